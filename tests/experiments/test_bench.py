"""The standard metrics as readouts of `scrubnet run` and of the audit, and `scrubnet bench`: tuning, resuming,
CIFAR-10 python batches, and the audit accepting the field's methods."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.data.files import write_cifar_batch
from scrubnet.experiments import bench as B
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.runner import run_experiment
from scrubnet.readouts.standard import metrics_from_logits, standard_metrics

runner = CliRunner()
FIELD = ["neggrad-plus", "ga", "l1-sparse", "salun", "scrub", "ssd", "bad-teacher", "unsir", "boundary-shrink"]


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setenv("SCRUBNET_TINY", "1")


def test_standard_metrics_are_run_readouts(tiny, tmp_path):
    cfg = ExperimentConfig.from_dict({"methods": ["original", "retrain", "finetune"]})
    res = run_experiment(cfg, tmp_path, progress=False)
    for m, d in res["methods"].items():
        r = d["runs"][0]["readouts"]
        # UA is the error on D_f, RA / TA the accuracies: the same numbers as the papers' readouts
        assert r["ua"] == pytest.approx(r["error_forget"], abs=1e-6)
        assert r["ra"] == pytest.approx(1 - r["error_retain"], abs=1e-6)
        assert r["ta"] == pytest.approx(1 - r["error_test"], abs=1e-6)
        assert 0 <= r["mia_efficacy"] <= 1
    ret, orig = (res["methods"][m]["runs"][0]["readouts"] for m in ("retrain", "original"))
    assert ret["avg_gap"] == 0.0
    gaps = [abs(orig[k] - ret[k]) for k in ("ua", "ra", "ta", "mia_efficacy")]
    assert orig["avg_gap"] == pytest.approx(np.mean(gaps))
    report = (tmp_path / "report.md").read_text()
    assert "## Standard metrics" in report
    measured = report.split("## What each method measured")[-1] if "## What each" in report else ""
    assert "`ua`" not in measured and "`avg_gap`" not in measured  # not mixed into the papers' readouts


def test_metrics_from_logits_match_the_model_path():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    sets = [(torch.randn(n, 4), torch.randint(0, 3, (n,))) for n in (40, 10, 30)]
    direct = standard_metrics(model, *sets, seed=3)
    with torch.no_grad():
        from_logits = metrics_from_logits(*[(model(x).numpy(), y.numpy()) for x, y in sets], seed=3)
    assert direct.as_dict() == pytest.approx(from_logits.as_dict())


def _job(value, gap, ok=True):
    return {"options": {"lr": value}, "metrics": {"avg_gap": gap}, "ok": ok}


def test_choose_takes_the_smallest_validation_gap():
    t = B.choose([_job(0.1, 0.3), _job(0.01, 0.05), _job(0.001, 0.2)])
    assert (t["option"], t["chosen"], t["grid"], t["trials"]) == ("lr", 0.01, [0.1, 0.01, 0.001], 3)
    assert not t["on_edge"] and B.choose([_job(0.1, 0.3), _job(0.01, 0.5)])["on_edge"]
    # a failed run is chosen only when every value failed; ties go to the first value
    assert B.choose([_job(0.1, 0.3), _job(0.01, 0.05, ok=False)])["chosen"] == 0.1
    assert B.choose([_job(0.1, 0.2, ok=False), _job(0.01, 0.1, ok=False)])["chosen"] == 0.01
    assert B.choose([_job(0.1, 0.2), _job(0.01, 0.2)])["chosen"] == 0.1


def test_bench_tunes_on_the_validation_split_and_widens_an_edge(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(B, "TINY_TUNED", ("finetune",))
    monkeypatch.setattr(B, "TUNE_GRIDS", {"finetune": ("lr", [1e-4, 0.3], "log")})
    cfg = ExperimentConfig.from_dict({"methods": ["finetune"]})
    res = B.run_bench(cfg, tmp_path, settings=["random-10"], progress=False, forget_sets=2)
    t = res["tuning"]["random-10"]["finetune"]
    assert t["grid"][:2] == [1e-4, 0.3] and len(t["avg_gap"]) == 3 == t["trials"]
    # the third trial: one step beyond the better edge (log-even), or the midpoint if both were equal
    assert t["grid"][2] == pytest.approx(3e-8 if t["avg_gap"][0] <= t["avg_gap"][1] else 900.0, rel=1e-2)
    # a value whose scrub raises (lr 900 makes the weights non-finite) is recorded, never chosen
    gaps = [np.inf if g is None else g for g in t["avg_gap"]]
    assert t["chosen"] == t["grid"][int(np.argmin(gaps))]
    assert all(not t["ok"][i] for i in range(3) if gaps[i] == np.inf)
    # the recorded gaps are those of the validation split (a block no forget set uses, its own seed and retrain)
    vcfg = B.setting_config(cfg, "random-10", "validation")
    tests = [set(B.setting_config(cfg, "random-10", "test", f).data.forget_ids) for f in (0, 1)]
    assert set(vcfg.data.forget_ids).isdisjoint(tests[0] | tests[1]) and tests[0].isdisjoint(tests[1])
    again = B.run_job(vcfg, {"setting": "random-10", "role": "tune", "forget_set": -1, "seed": B.VALIDATION_SEED,
                             "method": "finetune", "options": {"lr": 0.3}})
    assert again["metrics"]["avg_gap"] == pytest.approx(t["avg_gap"][1])
    summ = res["summary"]["random-10"]
    rows = {r["method"]: r for r in summ["rows"]}
    assert rows["finetune"]["options"] == {"lr": t["chosen"]} and rows["finetune"]["tuned"]
    assert rows["retrain"]["avg_gap"]["mean"] == 0.0 and rows["finetune"]["avg_gap"]["n"] == 2
    assert summ["best"] == summ["closest"] == "finetune" and summ["ties"] == [["finetune"]]  # anchors not candidates
    md = (tmp_path / "bench.md").read_text()
    assert "95 %" in md and "tie group" in md and (tmp_path / "bench.png").is_file()


def test_bench_resumes_after_a_kill(tiny, tmp_path, monkeypatch):
    cfg = ExperimentConfig.from_dict({"methods": ["finetune", "salun"]})
    real, calls = B.run_job, []

    def dies_after_three(c, job):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the bench is killed during its fourth job
        calls.append(job)
        return real(c, job)

    monkeypatch.setattr(B, "run_job", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        B.run_bench(cfg, tmp_path, settings=["random-1"], progress=False, forget_sets=1)
    assert len(list((tmp_path / "jobs").glob("*.json"))) == 3
    monkeypatch.setattr(B, "run_job", real)
    res = B.run_bench(cfg, tmp_path, settings=["random-1"], progress=False, forget_sets=1)
    total = 3 + 4  # salun's three validation trials, then original, retrain, finetune, salun on seed 0
    assert res["jobs"] == {"reused": 3, "run": total - 3}
    res2 = B.run_bench(cfg, tmp_path, settings=["random-1"], progress=False, forget_sets=1)
    assert res2["jobs"] == {"reused": total, "run": 0}
    assert res2["summary"] == res["summary"]


def test_bench_on_ray_equals_in_process(tiny, tmp_path, ray_cluster):
    pytest.importorskip("ray")
    from scrubnet.audit.engine import make_engine

    cfg = ExperimentConfig.from_dict({"methods": ["finetune"]})
    local = B.run_bench(cfg, tmp_path / "local", settings=["random-1"], tune=False, progress=False, forget_sets=1)
    eng = make_engine("ray", num_cpus=2, max_retries=1)
    try:
        ray = B.run_bench(cfg, tmp_path / "ray", settings=["random-1"], tune=False, engine=eng, progress=False,
                          forget_sets=1)
    finally:
        eng.close()
    assert ray["engine"] == "ray" and ray["jobs"] == {"run": 3, "reused": 0}
    strip = [{k: v for k, v in r.items() if k != "time_s"} for r in local["runs"]]
    assert [{k: v for k, v in r.items() if k != "time_s"} for r in ray["runs"]] == strip


def _cifar_dir(root, per_batch=20):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        write_cifar_batch(d / f"data_batch_{i}", rng.integers(0, 256, (per_batch, 3072)), np.arange(per_batch) % 10)
    write_cifar_batch(d / "test_batch", rng.integers(0, 256, (per_batch, 3072)), np.arange(per_batch) % 10)
    return root


def test_bench_on_cifar10_python_batches(tiny, tmp_path):
    data = _cifar_dir(tmp_path / "cifar")
    cfg = tmp_path / "small.toml"
    # ResNet-18 at 1/16 of its width (4 to 32 channels): the architecture of the bench, seconds on a CPU
    cfg.write_text("[data]\nn_train_per_class = 4\nn_test_per_class = 2\n[train]\nmax_epochs = 2\n"
                   "min_epochs = 1\nbatch_size = 20\n[model_options]\nwidth = 0.0625\n")
    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", "--dataset", "cifar10", "--data-dir", str(data), "--config", str(cfg),
                            "--methods", "finetune", "--settings", "class", "--forget-sets", "1", "--out", str(out),
                            "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "bench.json").read_text())
    assert res["config"]["model"] == "resnet18" and res["config"]["data"]["dataset"] == "cifar10"
    assert res["config"]["data"]["task_classes"] == list(range(10))
    assert res["settings"]["class"]["n_forget"] == 4 and res["settings"]["class"]["n_test"] == 20
    assert [r["method"] for r in res["summary"]["class"]["rows"]][0] == "retrain"
    assert {r["method"] for r in res["summary"]["class"]["rows"]} == {"original", "retrain", "finetune"}


def test_audit_plans_every_field_method(tiny, tmp_path):
    from scrubnet.audit.run import Audit, default_plan
    from scrubnet.experiments.runner import get_split, resolve_methods
    from scrubnet.methods.base import method_class

    cfg = ExperimentConfig.from_dict({"methods": ["original", "retrain"] + FIELD})
    chosen = [m for m in resolve_methods(cfg, get_split(cfg)) if not method_class(m).class_only]  # as the CLI
    audit = Audit(cfg, chosen, default_plan(chosen), tmp_path)
    planned = {r["method"] for g in audit.scrub_runs() for r in g["runs"]}
    # the class-only methods need a whole forgotten class; the pool's forget sets are per-example subsets
    assert planned == set(FIELD) - {"unsir", "boundary-shrink"}


def test_audit_runs_field_methods_with_standard_metrics(tiny, tmp_path):
    out = tmp_path / "audit"
    r = runner.invoke(app, ["audit", "--methods", "original,retrain,ssd,salun", "--pool", "4", "--eps-models", "3",
                            "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "audit.json").read_text())
    for m in ("original", "ssd", "salun"):
        s = res["methods"][m]["standard"]
        assert 0 <= s["ua"] <= 1 and 0 <= s["avg_gap"] <= 1 and s["pairs"] >= 4
    assert res["methods"]["retrain"]["standard"]["avg_gap"] == 0.0
    assert res["methods"]["original"]["standard"]["avg_gap"] > 0
    assert "Standard metrics" in (out / "audit.md").read_text()
