"""Every input that used to pass silently now fails clearly: one `error:` line, exit code 2, nothing written
or changed."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from scrubnet.checkpoint import sidecar_path, state_sha256
from scrubnet.cli import app
from scrubnet.data.files import load_image_folder
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.methods import get_method
from scrubnet.models import build_model
from tests.conftest import protocol_ctx
from tests.cli.test_cli import TINY_TOML

runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def assert_refused(code, out, needle):
    assert code == 2, out
    assert out.startswith("error:") and needle in out, out


def files_under(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "tiny.toml").write_text(TINY_TOML)
    code, out = invoke("train", "--config", d / "tiny.toml", "--out", d / "model")
    assert code == 0, out
    return d


@pytest.fixture
def scratch(trained, tmp_path):
    """A copy of the trained checkpoints, and a snapshot to compare after a refused command."""
    shutil.copytree(trained / "model", tmp_path / "model")
    shutil.copy(trained / "tiny.toml", tmp_path / "tiny.toml")
    return tmp_path


def test_train_writes_forget_ids(trained):
    meta = json.loads((trained / "model" / "retrain.safetensors.json").read_text())
    text = (trained / "model" / "forget_ids.txt").read_text()
    ids = [int(t) for line in text.splitlines() if not line.startswith("#") for t in line.split()]
    assert ids == meta["forget_ids"] and len(ids) == 5


@pytest.mark.parametrize("text", ["[3.5]", "[true]", '["7"]', "[1e400]"])
def test_json_ids_that_are_not_integers(scratch, text):
    ids = scratch / "ids.json"
    ids.write_text(text)
    before = files_under(scratch)
    out = scratch / "scrubbed.safetensors"
    code, msg = invoke("forget", "--checkpoint", scratch / "model" / "original.safetensors", "--forget-ids", ids,
                       "--method", "finetune", "--out", out)
    assert_refused(code, msg, "is not an integer sample id")
    assert files_under(scratch) == before


def _poison(path):
    """Put a NaN into one weight of checkpoint ``path`` (sidecar hash updated, so only the value is wrong)."""
    state = load_file(str(path))
    k = next(k for k, v in state.items() if v.is_floating_point())
    state[k] = state[k].clone()
    state[k].view(-1)[0] = float("nan")
    save_file(state, str(path))
    meta = json.loads(sidecar_path(path).read_text())
    meta["sha256"] = state_sha256(path.read_bytes())
    sidecar_path(path).write_text(json.dumps(meta))


def test_non_finite_checkpoint_is_refused(scratch):
    _poison(scratch / "model" / "original.safetensors")
    ids = scratch / "ids.txt"
    ids.write_text("1 2")
    before = files_under(scratch)
    for method in ("finetune", "fisher", "newton"):
        code, msg = invoke("forget", "--checkpoint", scratch / "model" / "original.safetensors", "--forget-ids", ids,
                           "--method", method, "--out", scratch / "s.safetensors")
        assert_refused(code, msg, "non-finite weights")
    code, msg = invoke("evaluate", "--checkpoint", scratch / "model" / "retrain.safetensors", "--reference",
                       scratch / "model" / "original.safetensors", "--json", scratch / "ev.json")
    assert_refused(code, msg, "non-finite weights")
    assert files_under(scratch) == before


def test_non_finite_result_is_not_written(scratch):
    ids = scratch / "ids.txt"
    ids.write_text("1 2")
    before = files_under(scratch)
    code, msg = invoke("forget", "--checkpoint", scratch / "model" / "original.safetensors", "--forget-ids", ids,
                       "--method", "finetune", "--option", "lr=1e30", "--option", "epochs=3",
                       "--out", scratch / "s.safetensors")
    # the retain guard puts back the last good weights at each blow-up and, every step undone, fails the scrub
    assert_refused(code, msg, "the retain guard undid every step")
    assert files_under(scratch) == before


@pytest.mark.parametrize("method", ["finetune", "fisher", "newton"])
def test_non_finite_data_is_refused_on_entry(method):
    torch.manual_seed(0)
    model = build_model("mlp", (40,), 3, seed=0, hidden=8)
    x, y = torch.randn(30, 40), torch.randint(0, 3, (30,))
    x[4, 7] = float("nan")
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in model.named_parameters()}, num_classes=3)
    with pytest.raises(ValueError, match="non-finite"):
        get_method(method)(model, (x[5:], y[5:]), (x[:5], y[:5]), ctx)
    x[4, 7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        get_method(method)(model, (x[:5], y[:5]), (x[5:], y[5:]), ctx)


@pytest.mark.parametrize("toml,needle", [
    ("seeds = 3", "configuration key seeds: expected a list of integers"),
    ('[train]\nlr = "fast"', "configuration key train.lr: expected a finite number > 0, got 'fast'"),
    ("[train]\nbatch_size = 0", "configuration key train.batch_size: expected an integer >= 1, got 0"),
    ("[train]\nlr = nan", "configuration key train.lr: expected a finite number > 0, got nan"),
    ("[train]\nmax_epochs = -1", "configuration key train.max_epochs: expected an integer >= 1, got -1"),
    ("relearn_max_epochs = -1", "configuration key relearn_max_epochs: expected an integer >= 1, got -1"),
    ("seeds = [1, 1]", "configuration key seeds: duplicated seeds"),
    ('[data]\ntask_classes = "0-4"', "configuration key data.task_classes: expected a list of integers"),
    ("[data]\nn_train_per_class = 2.5", "configuration key data.n_train_per_class: expected an integer"),
])
def test_toml_values_of_the_wrong_type_or_range(tmp_path, toml, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml + "\n")
    out = tmp_path / "run"
    code, msg = invoke("run", "--config", cfg, "--out", out, "--quiet")
    assert_refused(code, msg, needle)
    assert "Traceback" not in msg and not out.exists()


def test_forget_out_equal_to_checkpoint_or_existing(scratch):
    ids = scratch / "ids.txt"
    ids.write_text("1 2")
    ck = scratch / "model" / "original.safetensors"
    before = files_under(scratch)
    code, msg = invoke("forget", "--checkpoint", ck, "--forget-ids", ids, "--method", "finetune", "--out", ck)
    assert_refused(code, msg, "is the input checkpoint")
    code, msg = invoke("forget", "--checkpoint", ck, "--forget-ids", ids, "--method", "finetune", "--out",
                       scratch / "model" / "retrain.safetensors")
    assert_refused(code, msg, "already exists")
    assert files_under(scratch) == before
    code, msg = invoke("forget", "--checkpoint", ck, "--forget-ids", ids, "--method", "finetune", "--option",
                       "epochs=1", "--out", scratch / "model" / "retrain.safetensors", "--overwrite")
    assert code == 0, msg


def test_forget_with_mlforget_points_to_the_ml_commands(scratch):
    ids = scratch / "ids.txt"
    ids.write_text("1 2")
    before = files_under(scratch)
    code, msg = invoke("forget", "--checkpoint", scratch / "model" / "original.safetensors", "--forget-ids", ids,
                       "--method", "mlforget", "--out", scratch / "m.safetensors")
    assert_refused(code, msg, "scrubnet mlforget")
    assert files_under(scratch) == before


def test_run_out_of_an_earlier_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    code, msg = invoke("run", "--out", out, "--methods", "original", "--seeds", "1", "--quiet")
    assert_refused(code, msg, "not empty")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "results.json"]
    assert (out / "results.json").read_text() == "{}"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_is_detected_before_computing(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, msg = invoke("run", "--out", ro / "run", "--methods", "original", "--seeds", "1", "--quiet")
        assert_refused(code, msg, "not writable")
    finally:
        ro.chmod(0o700)


def test_out_under_a_file_is_detected_before_computing(tmp_path, trained):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, msg = invoke("run", "--out", blocker / "run", "--methods", "original", "--seeds", "1", "--quiet")
    assert_refused(code, msg, "is not a directory")
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2")
    code, msg = invoke("forget", "--checkpoint", trained / "model" / "original.safetensors", "--forget-ids", ids,
                       "--method", "finetune", "--out", blocker / "s.safetensors")
    assert_refused(code, msg, "is not a directory")
    assert blocker.read_text() == "x"


def test_evaluate_refuses_models_of_other_data(scratch, tmp_path):
    other = tmp_path / "other"
    (tmp_path / "other.toml").write_text(TINY_TOML.replace("num_samples = 1500", "num_samples = 1400"))
    code, out = invoke("train", "--config", tmp_path / "other.toml", "--out", other)
    assert code == 0, out
    before = files_under(scratch)
    ev = scratch / "ev.json"
    code, msg = invoke("evaluate", "--checkpoint", scratch / "model" / "original.safetensors", "--reference",
                       other / "retrain.safetensors", "--json", ev)
    assert_refused(code, msg, "trained on other data")
    code, msg = invoke("evaluate", "--checkpoint", scratch / "model" / "original.safetensors", "--reference",
                       scratch / "model" / "retrain.safetensors", "--original", other / "original.safetensors",
                       "--json", ev)
    assert_refused(code, msg, "trained on other data")
    assert files_under(scratch) == before


def test_evaluate_reads_the_original_from_the_sidecar(scratch):
    ids = scratch / "ids.txt"
    ids.write_text("1 2 3")
    s = scratch / "s.safetensors"
    ck = scratch / "model" / "original.safetensors"
    assert invoke("forget", "--checkpoint", ck, "--forget-ids", ids, "--method", "finetune", "--option", "epochs=1",
                  "--out", s)[0] == 0
    results = {}
    for extra in ([], ["--original", ck]):
        j = scratch / f"ev{len(extra)}.json"
        code, msg = invoke("evaluate", "--checkpoint", s, "--reference", scratch / "model" / "retrain.safetensors",
                           "--json", j, *extra)
        assert code == 0, msg
        results[len(extra)] = json.loads(j.read_text())
    assert results[0]["relearn_epochs"] == results[2]["relearn_epochs"]
    (scratch / "moved").mkdir()
    shutil.move(str(ck), scratch / "moved" / "o.safetensors")
    code, msg = invoke("evaluate", "--checkpoint", s, "--reference", scratch / "model" / "retrain.safetensors")
    assert_refused(code, msg, "give it with --original")


def _image_folder(root, counts):
    from PIL import Image
    rng = np.random.default_rng(0)
    for name, n in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_empty_class_folder_keeps_the_labels(tmp_path):
    _image_folder(tmp_path / "full", {"a": 5, "b": 5, "c": 5})
    _image_folder(tmp_path / "hole", {"a": 5, "b": 0, "c": 5})
    _, y_full, _, _ = load_image_folder(tmp_path / "full", size=8)
    _, y_hole, _, _ = load_image_folder(tmp_path / "hole", size=8)
    assert sorted(set(y_full.tolist())) == [0, 1, 2]
    assert sorted(set(y_hole.tolist())) == [0, 2]  # c keeps label 2


def test_dataset_flag_keeps_the_toml_class_lists(tmp_path):
    _image_folder(tmp_path / "imgs", {f"k{i}": 6 for i in range(4)})
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\ntask_classes = [1, 2]\ncore_classes = [0]\nn_train_per_class = 2\nn_test_per_class = 1\n')
    from scrubnet.cli.run import _build_config
    built = _build_config(cfg, "imagefolder", tmp_path / "imgs", None, None, None, None, None, None, None)
    assert built.data.task_classes == [1, 2] and built.data.core_classes == [0]
    built = _build_config(None, "imagefolder", tmp_path / "imgs", None, None, None, None, None, None, None)
    assert built.data.core_classes == [] and built.data.task_classes == [0, 1, 2, 3, 4]


def test_config_round_trip_keeps_types():
    cfg = ExperimentConfig()
    assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match="data.forget_ids"):
        ExperimentConfig.from_dict({"data": {"forget_ids": [1.5]}})


def test_run_overwrite_replaces_only_the_earlier_runs_files(tmp_path, trained):
    out = tmp_path / "run"
    out.mkdir()
    for stale in ("results.json", "readouts.png", "sequential_loss_forget.png"):
        (out / stale).write_text("stale")
    (out / "notes.txt").write_text("mine")
    code, msg = invoke("run", "--config", trained / "tiny.toml", "--methods", "original,retrain", "--out", out,
                       "--quiet", "--overwrite")
    assert code == 0, msg
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "sequential_loss_forget.png").exists()
    assert json.loads((out / "results.json").read_text())["methods"].keys() == {"original", "retrain"}
