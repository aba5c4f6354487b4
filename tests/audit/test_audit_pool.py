"""The audit pool: tiny configurations, in-process engine vs Ray (one local Ray, 2 CPUs, for this module),
resume from the cache, seeds derived from ids, and the CLI's outputs."""
import json

import numpy as np
import pytest

from scrubnet.audit.engine import LocalEngine, make_engine
from scrubnet.audit.pool import derive
from scrubnet.audit.run import Audit, default_plan, run_audit
from scrubnet.experiments.config import ExperimentConfig

METHODS = ["original", "retrain", "finetune"]


def tiny_config() -> ExperimentConfig:
    return ExperimentConfig.from_dict({
        "data": {"n_train_per_class": 16, "n_test_per_class": 8, "core_per_class": 20, "forget_count": 4,
                 "num_samples": 1000},
        "train": {"pretrain_epochs": 2, "max_epochs": 25, "batch_size": 32},
        "model_options": {"hidden": 32}})


def _plan():
    return default_plan(METHODS, pool=4, eps_models=3)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit_local")
    return out, run_audit(tiny_config(), METHODS, out, plan=_plan(), engine=LocalEngine(), progress=False)


def _numbers(results):
    return {m: (d["ulira_game_balanced_accuracy"], d["ulira_game_balanced_accuracy_ci95"], d["ulira_game_auc"],
                d["ulira_retrain_out_balanced_accuracy"], d["retain_leakage"], d["klom_forget"],
                d["epsilon_forget_score"], d["epsilon_forget_score_ci95"], d["epsilon_score"],
                [p["epsilon"] for p in d["per_example"]]) for m, d in results["methods"].items()}


def test_outputs_and_layout(local_run):
    out, res = local_run
    for f in ("audit.json", "audit.md", "roc.png", "epsilon_hist.png"):
        assert (out / f).is_file()
    j = json.loads((out / "audit.json").read_text())
    assert set(j["methods"]) == set(METHODS)
    for d in j["methods"].values():
        for k in ("ulira_game_balanced_accuracy", "ulira_game_balanced_accuracy_ci95",
                  "ulira_retrain_out_balanced_accuracy", "klom_forget", "retain_leakage", "epsilon_forget_score",
                  "epsilon_u", "epsilon_r", "epsilon_score", "per_example"):
            assert k in d
        lo, hi = d["ulira_game_balanced_accuracy_ci95"]
        assert lo <= d["ulira_game_balanced_accuracy"] <= hi
        assert d["epsilon_u"] == d["epsilon_r"]
    # the original's leakage is its own change: 0; every trained pool model is accounted for
    assert j["methods"]["original"]["retain_leakage"] == 0.0
    fit = j["pool_fit"]
    assert fit["original"]["models"] == 4 and fit["retrain"]["models"] == 8
    assert all(0 <= d["rule_not_met"] <= d["models"] for d in fit.values())
    assert {r["a"] for r in j["comparisons"]["ulira_game_balanced_accuracy"]} == {"original", "retrain"}
    # the original model is one point per example for the ε-score: the cap, forget score 0
    assert j["methods"]["original"]["epsilon_forget_score"] == 0.0


def test_resume_reuses_cache_and_gives_same_numbers(local_run, tmp_path):
    out, res = local_run
    a = Audit(tiny_config(), METHODS, _plan(), out / "cache")
    assert all(a.cache.has(it["id"]) for it in a.train_items())
    # a second run in the same directory trains nothing and reproduces the numbers
    calls = []

    class Counting(LocalEngine):
        def map(self, fn, shared, payloads):
            calls.append(len(payloads))
            return super().map(fn, shared, payloads)

    again = run_audit(tiny_config(), METHODS, out, plan=_plan(), engine=Counting(), progress=False)
    assert sum(calls) == 0
    assert _numbers(again) == _numbers(res)


def test_seeds_depend_on_ids_only():
    assert derive(0, "original/3") == derive(0, "original/3") != derive(0, "original/4")
    a = Audit(tiny_config(), METHODS, _plan(), _tmp_cache())
    b = Audit(tiny_config(), METHODS, default_plan(METHODS, pool=6, eps_models=3), _tmp_cache())
    for s in range(4):  # a larger pool keeps the first splits and forget sets
        assert np.array_equal(a.data.halves[s], b.data.halves[s])
        assert np.array_equal(a.data.forget[(s, 0)], b.data.forget[(s, 0)])


def _tmp_cache():
    import tempfile
    from pathlib import Path
    return Path(tempfile.mkdtemp(prefix="scrubnet-audit-"))


def test_ray_engine_equals_in_process(local_run, tmp_path, ray_cluster):
    pytest.importorskip("ray")
    _, res = local_run
    eng = make_engine("ray", num_cpus=2, max_retries=1)
    try:
        got = run_audit(tiny_config(), METHODS, tmp_path / "ray", plan=_plan(), engine=eng, progress=False)
    finally:
        eng.close()
    assert got["config"]["audit"]["engine"] == "ray"
    assert _numbers(got) == _numbers(res)


def test_engine_errors():
    with pytest.raises(ValueError, match="--engine ray"):
        make_engine("local", address="127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("dask")


def test_cli_audit_bad_input(tmp_path):
    from typer.testing import CliRunner

    from scrubnet.cli import app
    r = CliRunner().invoke(app, ["audit", "--methods", "nosuch", "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "error" in r.output and not (tmp_path / "a").exists()
    r = CliRunner().invoke(app, ["audit", "--pool", "1", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and not (tmp_path / "b").exists()


def test_cli_audit_writes_outputs(tmp_path):
    from typer.testing import CliRunner

    from scrubnet.cli import app
    toml = tmp_path / "tiny.toml"
    toml.write_text('methods = ["original", "retrain", "finetune"]\n'
                    "[data]\nn_train_per_class = 16\nn_test_per_class = 8\ncore_per_class = 20\nforget_count = 4\n"
                    "num_samples = 1000\n[train]\npretrain_epochs = 2\nmax_epochs = 25\nbatch_size = 32\n"
                    "[model_options]\nhidden = 32\n")
    r = CliRunner().invoke(app, ["audit", "--config", str(toml), "--pool", "4", "--eps-models", "3", "--quiet",
                                 "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    j = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert list(j["methods"]) == ["original", "retrain", "finetune"]
    assert j["config"]["audit"]["plan"]["splits"] == 4

    # an earlier audit's results are replaced only with --overwrite (the cache is kept: nothing retrains)
    args = ["audit", "--config", str(toml), "--pool", "4", "--eps-models", "3", "--quiet", "--out", str(tmp_path / "a")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "--overwrite" in r.output, r.output
    (tmp_path / "a" / "roc.png").write_text("stale")
    r = CliRunner().invoke(app, args + ["--overwrite"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "a" / "roc.png").read_bytes()[:4] == b"\x89PNG"
    assert _numbers(json.loads((tmp_path / "a" / "audit.json").read_text())) == _numbers(j)


def test_cli_audit_user_method(tmp_path, monkeypatch):
    """--method module:Class registers a user's ForgettingMethod and audits it like a built-in."""
    from typer.testing import CliRunner

    import scrubnet.methods.base as base
    from scrubnet.cli import app
    base.available_methods()
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the registration ends with this test
    (tmp_path / "usermeth.py").write_text(
        "import copy\nfrom scrubnet.methods.base import ForgettingMethod, ScrubResult\n"
        "class Halve(ForgettingMethod):\n"
        "    def scrub(self, model, retain, forget, ctx):\n"
        "        m = copy.deepcopy(model)\n"
        "        for p in m.parameters():\n"
        "            p.data.mul_(0.5)\n"
        "        return ScrubResult(model=m)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "tiny.toml"
    toml.write_text("[data]\nn_train_per_class = 16\nn_test_per_class = 8\ncore_per_class = 20\nforget_count = 4\n"
                    "num_samples = 1000\n[train]\npretrain_epochs = 2\nmax_epochs = 25\nbatch_size = 32\n"
                    "[model_options]\nhidden = 32\n")
    r = CliRunner().invoke(app, ["audit", "--config", str(toml), "--methods", "original,retrain", "--method",
                                 "usermeth:Halve", "--pool", "4", "--eps-models", "3", "--quiet",
                                 "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    j = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert list(j["methods"]) == ["original", "retrain", "usermeth:Halve"]
    r = CliRunner().invoke(app, ["audit", "--method", "usermeth:Nope", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "not a ForgettingMethod" in r.output and not (tmp_path / "b").exists()



def test_damaged_cache_entries_are_named_and_recomputed(local_run, tmp_path, capfd):
    """A bit-flipped, a truncated and a 0x7f-filled cache file: each is named on stderr, recomputed, and the
    audit's numbers are those of the intact cache."""
    import shutil

    import corrupt
    out, res = local_run
    work = tmp_path / "audit"
    shutil.copytree(out, work)
    a = Audit(tiny_config(), METHODS, _plan(), work / "cache")
    damaged = {a.cache.path("original/1"): lambda p: corrupt.flip_exponent_bits(p, 2000),
               a.cache.path("retrain/0/0"): lambda p: corrupt.truncate(p, min(5000, p.stat().st_size // 2)),
               a.cache.path("scrub/finetune/0/0", a.options("finetune")): corrupt.fill_7f}
    for p, damage in damaged.items():  # (the tiny pool's logits files hold < 5000 bytes: cut to half)
        damage(p)
    capfd.readouterr()
    computed = []

    class Counting(LocalEngine):
        def map(self, fn, shared, payloads):
            for k, r in super().map(fn, shared, payloads):
                computed.extend(mid for mid, _, _ in (r if isinstance(r, list) else []))
                yield k, r

    again = run_audit(tiny_config(), METHODS, work, plan=_plan(), engine=Counting(), progress=False)
    err = capfd.readouterr().err
    for p, reason in zip(damaged, ["hash mismatch", "truncated", "hash mismatch"]):
        assert f"warning: audit cache entry {p}: {reason}" in err
    assert sorted(computed) == ["original/1", "retrain/0/0", "scrub/finetune/0/0"]
    assert _numbers(again) == _numbers(res)


def test_cli_audit_ranges_and_unwritable_out_refused_before_any_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import scrubnet.cli.audit as cli_audit
    from scrubnet.cli import app

    def must_not_run(*a, **k):
        raise AssertionError("the audit ran")
    monkeypatch.setattr(cli_audit, "run_audit", must_not_run)
    monkeypatch.setattr(cli_audit, "get_split", must_not_run)
    for args, needle in [(["--pool", "1000000"], "--pool must lie in [4, 512]"),
                         (["--pool", "2"], "--pool must lie in [4, 512]"),
                         (["--eps-models", "2"], "--eps-models must lie in [3, 512]"),
                         (["--eps-models", "100000"], "--eps-models must lie in [3, 512]")]:
        r = CliRunner().invoke(app, ["audit", *args, "--out", str(tmp_path / "a")])
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
        assert not (tmp_path / "a").exists()
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    r = CliRunner().invoke(app, ["audit", "--out", str(blocker / "audit")])
    assert r.exit_code == 2 and f"{blocker} is not a directory" in r.output, r.output
