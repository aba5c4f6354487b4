"""The CLI end to end on a tiny configuration, and every bad input of the foundation issue."""
import json
import pickle

import pytest
from typer.testing import CliRunner

from scrubnet.cli import app

runner = CliRunner()

TINY_TOML = """
model = "mlp"
seeds = [0]
relearn_max_epochs = 5
[model_options]
hidden = 32
[data]
n_train_per_class = 20
n_test_per_class = 20
core_per_class = 40
forget_count = 5
num_samples = 1500
[train]
max_epochs = 15
pretrain_epochs = 2
batch_size = 32
"""


def train_tiny_checkpoint(d):
    """``scrubnet train`` of the tiny configuration into ``d / "model"``; returns ``d``."""
    cfg = d / "tiny.toml"
    cfg.write_text(TINY_TOML)
    r = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(d / "model")])
    assert r.exit_code == 0, r.output
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _ids(tmp_path, text, name="ids.txt"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("ids,needle", [("3 7 999", "999"), ("1 1", "duplicated"), ("", "empty"),
                                        (" ".join(str(i) for i in range(100)), "all 100")])
def test_forget_bad_ids_exit_nonzero_and_write_nothing(trained, tmp_path, ids, needle):
    out = tmp_path / "out" / "x.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                            "--forget-ids", str(_ids(tmp_path, ids)), "--method", "finetune", "--out", str(out)])
    assert r.exit_code != 0
    assert needle in r.output
    assert not out.exists() and not (tmp_path / "out").exists()


def test_forget_then_evaluate(trained, tmp_path):
    out = tmp_path / "scrubbed.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                            "--forget-ids", str(_ids(tmp_path, "0, 3\n5 # comment")), "--method", "finetune",
                            "--option", "epochs=2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "scrubbed.safetensors.json").read_text())
    assert meta["forget_ids"] == [0, 3, 5] and meta["method"] == "finetune"
    j = tmp_path / "ev.json"
    r = runner.invoke(app, ["evaluate", "--checkpoint", str(out), "--reference",
                            str(trained / "model" / "retrain.safetensors"), "--json", str(j)])
    assert r.exit_code == 0, r.output
    ev = json.loads(j.read_text())
    assert set(ev) >= {"error_forget", "mia_forget", "relearn_epochs", "activation_l1_forget"}
    # the table speaks to people: errors in %, flags as yes/no, the unit in its own column; JSON keeps fractions
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:4]] for ln in r.output.splitlines()
            if ln.count("│") >= 4}
    assert rows["error_forget"] == [f"{100 * ev['error_forget']:.1f}", "%"]
    assert rows["mia_degenerate"] == ["yes" if ev["mia_degenerate"] else "no", "yes/no"]
    assert rows["loss_forget"][1] == "nats" and 0 <= ev["error_forget"] <= 1


def test_forget_with_cg_capped_at_3_iterations_exits_2_and_writes_nothing(trained, tmp_path):
    out = tmp_path / "out" / "x.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                            "--forget-ids", str(_ids(tmp_path, "0 3 5")), "--method", "newton",
                            "--option", "max_iter=3", "--option", "tol=1e-12", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and "CG stopped after 3" in r.output
    assert not out.exists() and not (tmp_path / "out").exists()


def test_unknown_method_and_missing_or_corrupt_checkpoint(trained, tmp_path):
    ids = _ids(tmp_path, "1 2")
    out = tmp_path / "o.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(trained / "model" / "original.safetensors"),
                            "--forget-ids", str(ids), "--method", "frobnicate", "--out", str(out)])
    assert r.exit_code != 0 and "unknown method" in r.output and not out.exists()
    r = runner.invoke(app, ["forget", "--checkpoint", str(tmp_path / "missing.safetensors"), "--forget-ids",
                            str(ids), "--method", "finetune", "--out", str(out)])
    assert r.exit_code != 0 and "not found" in r.output and not out.exists()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    (tmp_path / "bad.safetensors.json").write_text((trained / "model" / "original.safetensors.json").read_text())
    r = runner.invoke(app, ["forget", "--checkpoint", str(bad), "--forget-ids", str(ids), "--method", "finetune",
                            "--out", str(out)])
    assert r.exit_code != 0 and "corrupt" in r.output and not out.exists()


def test_checkpoint_of_another_architecture(trained, tmp_path):
    from scrubnet.checkpoint import save_checkpoint
    from scrubnet.models import build_model
    other = tmp_path / "cnn.safetensors"
    save_checkpoint(other, build_model("cnn1d", (40,), 5), arch="cnn1d", in_shape=(40,), num_classes=5)
    r = runner.invoke(app, ["evaluate", "--checkpoint", str(trained / "model" / "original.safetensors"),
                            "--reference", str(other)])
    assert r.exit_code != 0 and "cnn1d" in r.output


def test_run_rejects_unknown_dataset_model_method(tmp_path):
    out = tmp_path / "run"
    for args, needle in ((["--dataset", "imagenet"], "unknown dataset"), (["--model", "vit"], "unknown model"),
                         (["--methods", "original,nope"], "unknown method")):
        r = runner.invoke(app, ["run", "--out", str(out), "--quiet", *args])
        assert r.exit_code != 0 and needle in r.output, r.output
        assert not out.exists()


def test_data_dir_in_wrong_format(tmp_path):
    d = tmp_path / "notcifar"
    d.mkdir()
    (d / "data_batch_1").write_bytes(pickle.dumps({"x": 1}))
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", "--dataset", "cifar10", "--data-dir", str(d), "--out", str(out), "--quiet"])
    assert r.exit_code != 0 and "test_batch" in r.output and not out.exists()
    (d / "test_batch").write_bytes(pickle.dumps({"x": 1}))
    (d / "data_batch_1").write_bytes(pickle.dumps(print))  # a pickle that would call code
    r = runner.invoke(app, ["run", "--dataset", "cifar10", "--data-dir", str(d), "--out", str(out), "--quiet"])
    assert r.exit_code != 0 and "refusing" in r.output and not out.exists()
    r = runner.invoke(app, ["run", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "nowhere"), "--out",
                            str(out), "--quiet"])
    assert r.exit_code != 0 and "not found" in r.output


def test_run_writes_results_report_and_figures(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", "--config", str(cfg), "--methods", "original,retrain,finetune", "--seeds", "2",
                            "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert list(res["methods"]) == ["original", "retrain", "finetune"]
    runs = res["methods"]["finetune"]["runs"]
    assert [x["seed"] for x in runs] == [0, 1]
    names = {"error_retain", "error_forget", "error_test", "loss_forget", "mia_forget", "relearn_epochs",
             "activation_l1_retain", "activation_l1_forget", "activation_l1_test"}
    assert names <= set(runs[0]["readouts"]) and names <= set(res["methods"]["finetune"]["summary"])
    vals = [x["readouts"]["loss_forget"] for x in runs]
    s = res["methods"]["finetune"]["summary"]["loss_forget"]
    assert s["mean"] == pytest.approx(sum(vals) / 2) and s["std"] == pytest.approx(abs(vals[0] - vals[1]) / 2)
    # retrain's distance to itself is zero
    assert res["methods"]["retrain"]["summary"]["activation_l1_forget"]["mean"] == 0.0
    for f in ("report.md", "readouts.png", "entropy.png"):
        assert (out / f).is_file()
    assert "(target)" in (out / "report.md").read_text()
    r = runner.invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and "scrubnet report" in r.output


@pytest.mark.parametrize("damage,reason", [("flip", "hash mismatch"), ("truncate", "truncated"),
                                           ("fill_7f", "hash mismatch")])
def test_damaged_weights_are_refused_naming_the_file(trained, tmp_path, damage, reason):
    import shutil

    import corrupt
    src = trained / "model"
    ck = tmp_path / "model"
    shutil.copytree(src, ck)
    w = ck / "original.safetensors"
    size = w.stat().st_size
    {"flip": lambda p: corrupt.flip_exponent_bits(p, 2000),
     "truncate": lambda p: corrupt.truncate(p, min(5000, size // 2)), "fill_7f": corrupt.fill_7f}[damage](w)
    out = tmp_path / "out.safetensors"
    r = runner.invoke(app, ["forget", "--checkpoint", str(w), "--forget-ids", str(_ids(tmp_path, "0 3")),
                            "--method", "finetune", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert f"checkpoint {w}: {reason}" in r.output and "Traceback" not in r.output
    assert not out.exists()
