"""`scrubnet mlforget finetune` from the command line: every bad numeric option refused before any work (one
``error:`` line naming the option and its value, exit 2, nothing written), and a checkpoint that holds relative
paths: moved with its base model and data to another directory, it still takes requests and serves them."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.mlforget import store
from scrubnet.mlforget.ftstore import finetune_data, located_base
from tests.hf_models import probe_labels, tiny_bert, token_batch

pytest.importorskip("transformers")

N = 40


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project directory: the base model (hf directory) and the data, side by side."""
    tmp = tmp_path_factory.mktemp("proj")
    bert = tiny_bert(num_labels=3, seed=0)
    bert.save_pretrained(tmp / "bert")
    b = token_batch(N, length=8, seed=1)
    b["labels"] = probe_labels(bert, b)  # a task the features carry: the commands refuse a model at chance
    np.savez(tmp / "d.npz", x_train=b["input_ids"].numpy(), train_attention_mask=b["attention_mask"].numpy(),
             y_train=b["labels"].numpy())
    return tmp


@pytest.mark.parametrize("option, value, shown", [
    ("--mu", "inf", "--mu must be a finite number > 0 or 'auto', got inf"),
    ("--sigma", "inf", "--sigma must be a finite number ≥ 0, got inf"),
    ("--target-scale", "1e300", "--target-scale must be a finite number in (0, 1e+06], got 1e+300"),
    ("--target-scale", "nan", "--target-scale must be a finite number in (0, 1e+06], got nan"),
    ("--core-lr", "inf", "--core-lr must be a finite number > 0, got inf"),
    ("--core-ids", "3,5,3", "--core-ids names sample 3 more than once"),
])
def test_bad_option_refused_before_any_work(project, tmp_path, option, value, shown):
    # the model and data named do not exist: a refusal that reads them would name them instead
    out_dir = tmp_path / "ck"
    code, out = cli("mlforget", "finetune", "--model", f"hf:{tmp_path / 'nosuch'}", "--data", tmp_path / "no.npz",
                    "--out", out_dir, option, value)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and shown in lines[0], out
    assert not out_dir.exists() and not list(tmp_path.glob(".ck*"))


def test_moved_checkpoint_still_takes_and_serves_requests(project, tmp_path):
    src = tmp_path / "a"
    shutil.copytree(project, src)
    ck = src / "runs" / "ml-ft"
    code, out = cli("mlforget", "finetune", "--model", f"hf:{src / 'bert'}", "--data", src / "d.npz",
                    "--user-weights", "head", "--mu", "1e-2", "--sigma", 0, "--out", ck)
    assert code == 0, out
    rec = store.load(ck)[1]["finetune"]
    assert rec["data"] == "../../d.npz" and rec["base"]["weights"] == "../../bert/model.safetensors"
    assert rec["base"]["model"] == "hf:../../bert", rec["base"]
    code, out = cli("mlforget", "forget", "--checkpoint", ck, "--ids", "3,7")
    assert code == 0, out
    w_before = store.load(ck)[0].model.delta_flat()
    # a checkpoint moved alone (base model and data stay) finds them at the absolute paths it also records
    alone = tmp_path / "x" / "alone"
    shutil.copytree(ck, alone)
    code, out = cli("mlforget", "forget", "--checkpoint", alone, "--ids", "11")
    assert code == 0, out
    # the whole project moves; the old location is gone, so the absolute paths lead nowhere
    dst = tmp_path / "elsewhere" / "b"
    shutil.move(str(src), str(dst))
    assert not src.exists()
    moved = dst / "runs" / "ml-ft"
    assert torch.equal(store.load(moved)[0].model.delta_flat(), w_before)
    code, out = cli("mlforget", "show", moved)
    assert code == 0 and "hash chain: valid" in out, out
    from tests.serve.test_serve import SUBMIT, Server
    srv = Server(moved, tmp_path)
    try:
        code, sub = srv.call("POST", "/v1/requests", {"ids": [5, 6]}, token=SUBMIT, key="moved-1")
        assert code == 202, sub
        done = srv.wait(sub["id"])
        assert done["status"] == "applied", done
    finally:
        srv.stop()
    assert sorted(store.load(moved)[1]["forgotten_ids"]) == [3, 5, 6, 7]
    code, out = cli("mlforget", "forget", "--checkpoint", alone, "--ids", "12")   # its files are gone now
    assert code == 2 and "error:" in out and "not found" in out, out


def test_old_checkpoints_with_absolute_paths_still_read(project):
    """Before relative paths a record held absolute ones only (no ``absolute`` entry)."""
    old = {"base": {"model": f"hf:{project / 'bert'}", "weights": str(project / "bert" / "model.safetensors"),
                    "weights_sha256": None}, "data": str(project / "d.npz")}
    base = located_base(old, "/nonexistent/checkpoint")
    assert base["weights"] == str(project / "bert" / "model.safetensors") and base["model"] == old["base"]["model"]
    x, y = finetune_data({"finetune": {**old, "base": {**old["base"], "dtype": "float64"}},
                          "checkpoint_dir": "/nonexistent/checkpoint"})
    assert len(y) == N and x.main.shape == (N, 8)
