"""`scrubnet tune` on the user's own model files, then `scrubnet forget --method auto --profile P`: the
profile file, what was tried and chosen, the scrub it runs, and the refusals (one error line, exit 2,
nothing written)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from scrubnet.checkpoint import read_meta
from scrubnet.cli import app
from scrubnet.tuning.profile import TunedProfile

runner = CliRunner()

NET_PY = '''
import torch
from torch import nn


def other_arch(model, data):
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def nan_weights(model, data):
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    return model


def make_net():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def train(model, data):
    """The user's training: re-initialised by the factory, SGD + momentum + weight decay, 20 epochs."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        for idx in torch.randperm(len(y), generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()
'''

RECIPE = """[recipe]
wd = 5e-4
lr = 0.1
momentum = 0.9
batch_size = 32
epochs = 20
"""


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    (d / "net.py").write_text(NET_PY)
    g = np.random.default_rng(0)
    y, yt = g.integers(0, 3, 300), g.integers(0, 3, 120)
    x = (g.normal(size=(300, 6)) + 1.5 * np.eye(6)[y]).astype(np.float32)
    xt = (g.normal(size=(120, 6)) + 1.5 * np.eye(6)[yt]).astype(np.float32)
    np.savez(d / "data.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    import importlib.util
    spec = importlib.util.spec_from_file_location("tune_net", d / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = mod.train(mod.make_net(), (torch.from_numpy(x), torch.from_numpy(y)))
    torch.save(net.state_dict(), d / "net.pt")
    (d / "recipe.toml").write_text(RECIPE)
    (d / "forget.txt").write_text("0 1 2 3 4 5\n")
    return d


def _tune(d, out, *extra):
    return runner.invoke(app, ["tune", "--model", f"{d / 'net.py'}:make_net", "--weights", str(d / "net.pt"),
                               "--data", str(d / "data.npz"), "--recipe", str(d / "recipe.toml"),
                               "--forget-ids", str(d / "forget.txt"), "--train", f"{d / 'net.py'}:train",
                               "--out", str(out), "--methods", "finetune,neggrad", "--budget", "2", *extra])


def _forget(d, out, *extra):
    return runner.invoke(app, ["forget", "--model", f"{d / 'net.py'}:make_net", "--weights", str(d / "net.pt"),
                               "--data", str(d / "data.npz"), "--recipe", str(d / "recipe.toml"),
                               "--forget-ids", str(d / "forget.txt"), "--out", str(out), *extra])


def test_tune_writes_a_profile_and_forget_auto_runs_its_choice(own, tmp_path):
    prof_path = tmp_path / "profile.json"
    r = _tune(own, prof_path)
    assert r.exit_code == 0, r.output
    prof = TunedProfile.load(prof_path)
    assert "chosen:" in r.output and r.output.count(" cost ") >= 4 and "retrainings" in r.output
    # three validation draws by successive halving: 4 candidates on the first, the best 2 on the others
    assert prof.validation["n"] == 6 and prof.validation["plan"] == [4, 2, 2] and len(prof.trials) == 8
    assert "ETA" in r.output and "closes = 1 −" in r.output
    assert json.loads(prof_path.read_text())["chosen"]["method"] == prof.method
    out = tmp_path / "scrubbed.safetensors"
    r = _forget(own, out, "--method", "auto", "--profile", str(prof_path), "--warn-not-forgotten")
    if r.exit_code == 0:
        meta = read_meta(out)
        assert meta["method"] == prof.method and meta["auto"]["method"] == prof.method
        assert meta["method_options"] == prof.options
        again = tmp_path / "direct.safetensors"
        opts = [a for k, v in prof.options.items() for a in ("--option", f"{k}={json.dumps(v)}")]
        r2 = _forget(own, again, "--method", prof.method, "--warn-not-forgotten", *opts)
        assert r2.exit_code == 0, r2.output
        a, b = load_file(str(out)), load_file(str(again))
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:   # an honest failure: one error line, nothing written
        assert r.exit_code == 2 and r.output.startswith("error:") and not out.exists()


def test_tune_and_auto_refusals(own, tmp_path):
    prof_path = tmp_path / "p.json"
    prof_path.write_text("{}")
    r = _tune(own, prof_path)
    assert r.exit_code == 2 and "already exists" in r.output
    r = _forget(own, tmp_path / "s.safetensors", "--method", "auto")
    assert r.exit_code == 2 and r.output.startswith("error:") and "--profile" in r.output
    r = _forget(own, tmp_path / "s.safetensors", "--method", "auto", "--profile", str(prof_path))
    assert r.exit_code == 2 and "version" in r.output and not (tmp_path / "s.safetensors").exists()
    r = runner.invoke(app, ["tune", "--model", f"{own / 'net.py'}:make_net", "--weights", str(own / "net.pt"),
                            "--data", str(own / "data.npz"), "--forget-ids", str(own / "forget.txt"),
                            "--train", f"{own / 'net.py'}:nope", "--out", str(tmp_path / "q.json")])
    assert r.exit_code == 2 and "--train" in r.output and "nope" in r.output and not (tmp_path / "q.json").exists()


@pytest.mark.parametrize("fn,words", [("other_arch", "another architecture"), ("nan_weights", "non-finite")])
def test_tune_refuses_a_training_that_returns_another_architecture_or_nan_weights(own, tmp_path, fn, words):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["tune", "--model", f"{own / 'net.py'}:make_net", "--weights", str(own / "net.pt"),
                            "--data", str(own / "data.npz"), "--forget-ids", str(own / "forget.txt"),
                            "--train", f"{own / 'net.py'}:{fn}", "--out", str(out), "--methods", "finetune",
                            "--budget", "1", "--draws", "1"])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and words in errors[0] and "--train" in errors[0]
    assert not out.exists() and not list(tmp_path.iterdir())       # nothing written, not even a temp file
