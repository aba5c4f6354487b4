"""`scrubnet references` then `scrubnet forget --references DIR`, end to end on a tiny own model: the reference
models are trained once, stored beside the weights with their cost, and calibrate the verdict; references of
other weights, or a directory without them, are one error line, exit 2, nothing written."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.models.user import build_user_model
from scrubnet.readouts.references import load_references

runner = CliRunner()

NET_PY = '''
from torch import nn


def make_net(width=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.GELU(), nn.Linear(width, 10))
'''

RECIPE = """[recipe]
loss = "cross_entropy"
lr = 0.05
momentum = 0.9
batch_size = 32
epochs = 3
"""


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("refs")
    (d / "net.py").write_text(NET_PY)
    xd, yd = load_digits(return_X_y=True)
    x = (xd[:120] / 16.0).astype(np.float32)
    y = yd[:120].astype(np.int64)
    np.savez(d / "data.npz", x_train=x, y_train=y, x_test=(xd[1000:1100] / 16.0).astype(np.float32),
             y_test=yd[1000:1100].astype(np.int64))
    net = build_user_model(f"{d / 'net.py'}:make_net")
    torch.manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    torch.save(net.state_dict(), d / "net.pt")
    (d / "recipe.toml").write_text(RECIPE)
    (d / "forget.txt").write_text(" ".join(map(str, range(10))) + "\n")
    return d


def _model(d, weights="net.pt"):
    return ["--model", f"{d / 'net.py'}:make_net", "--weights", str(d / weights), "--data", str(d / "data.npz")]


def test_references_then_forget_with_them_end_to_end(own, tmp_path):
    r = runner.invoke(app, ["references", *_model(own), "--recipe", str(own / "recipe.toml")])
    assert r.exit_code == 0, r.output
    refs_dir = own / "net.pt.references"  # beside the weights, by default
    assert "4 reference models" in r.output and "trained once in" in r.output
    index = json.loads((refs_dir / "references.json").read_text())
    assert index["models"] == 4 and index["n_train"] == 120 and index["seconds"] > 0
    refs = load_references(refs_dir, build_user_model(f"{own / 'net.py'}:make_net"))
    assert refs.members.shape == (4, 120) and (refs.members[0] ^ refs.members[1]).all()
    again = runner.invoke(app, ["references", *_model(own)])  # never overwritten silently
    assert again.exit_code == 2 and "already exists" in again.output

    out = tmp_path / "s.safetensors"
    r = runner.invoke(app, ["forget", *_model(own), "--recipe", str(own / "recipe.toml"), "--forget-ids",
                            str(own / "forget.txt"), "--method", "finetune", "--out", str(out),
                            "--warn-not-forgotten", "--references", str(refs_dir)])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "s.safetensors.json").read_text())
    v = meta["forgetting"]
    assert v["statistic"] == "calibrated" and v["references"]["models"] == 4, v
    assert v["references"]["seconds"] == pytest.approx(index["seconds"])
    assert "reference models: 4, trained once in" in r.output


def test_references_of_other_weights_or_a_missing_directory_are_refused(own, tmp_path):
    other = build_user_model(f"{own / 'net.py'}:make_net")
    torch.save(other.state_dict(), own / "other.pt")
    refs_dir = tmp_path / "refs"
    r = runner.invoke(app, ["references", *_model(own, "other.pt"), "--out", str(refs_dir), "--pairs", "1"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "s.safetensors"
    for d, needle in ((refs_dir, "other weights or data"), (tmp_path / "nothing", "holds no reference models")):
        r = runner.invoke(app, ["forget", *_model(own), "--forget-ids", str(own / "forget.txt"), "--method",
                                "finetune", "--out", str(out), "--references", str(d)])
        assert r.exit_code == 2 and needle in r.output and not out.exists(), r.output
