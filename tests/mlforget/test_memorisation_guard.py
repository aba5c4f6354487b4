"""The chance guard on a memorisation task (facts about the training people, TOFU-style): labels with no
structure to generalise, so every held-out answer is a guess. Declared ``--task memorisation`` the guard
scores the model that answers on its own training answers: a learned fine-tune passes (either engine, and
``auto`` picks the sharded one, saying why), a model at chance is still refused; the same data declared a
generalisation task is refused (its out-of-shard error is chance)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.mlforget import store

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, dead=False):
        super().__init__()
        self.feat, self.head = nn.Linear(32, 48), nn.Linear(48, 4)
        self.dead = dead

    def forward(self, x):
        h = torch.tanh(self.feat(x))
        return self.head(h * 0.0 if self.dead else h)


def net(dead=False):
    return Net(dead)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model file, weights, data .npz of 160 samples with random labels: nothing to generalise)."""
    tmp = tmp_path_factory.mktemp("memorise")
    (tmp / "net.py").write_text(MODEL_FILE)
    import importlib.util
    spec = importlib.util.spec_from_file_location("memorise_net", tmp / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    torch.save(mod.net().state_dict(), tmp / "w.pt")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(160, 32, generator=g)
    y = torch.randint(0, 4, (160,), generator=g)
    np.savez(tmp / "d.npz", x_train=x.numpy(), y_train=y.numpy())
    return tmp / "net.py", tmp / "w.pt", tmp / "d.npz"


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


SHARDED = ["--shards", 2, "--slices", 2, "--epochs", 40, "--lr", 0.03, "--batch-size", 16]


def _finetune(files, out, *extra, dead=False):
    model_file, weights, npz = files
    opt = ["--model-option", "dead=true"] if dead else []
    return cli("mlforget", "finetune", "--model", f"{model_file}:net", *opt, "--weights", weights, "--data", npz,
               "--user-weights", "layers:feat,head", *extra, "--out", out)


def _refused(code, out, path):
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("strategy auto=")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "chance" in lines[0], out
    assert not path.exists()
    return lines[0]


def test_memorisation_passes_when_learned_and_generalisation_is_refused(files, tmp_path):
    code, out = _finetune(files, tmp_path / "gen", "--strategy", "sharded", *SHARDED)
    assert "out-of-shard" in _refused(code, out, tmp_path / "gen")
    code, out = _finetune(files, tmp_path / "mem", "--strategy", "auto", "--task", "memorisation", *SHARDED)
    assert code == 0, out
    assert any(ln.startswith("strategy auto=sharded: ") and "memorisation" in ln for ln in out.splitlines()), out
    assert "training-answer error" in out
    st, static = store.load(tmp_path / "mem")
    check = store.requests(tmp_path / "mem")[0]["solver"]["chance_check"]
    assert static["finetune"]["task_kind"] == "memorisation" and check["task"] == "memorisation"
    assert check["held_out"] == 160 and check["chance"] == pytest.approx(0.6, abs=0.15)
    assert check["error"] < check["chance_interval"][0]
    # the guard's number is the aggregate's real error on its own samples (a slow recount)
    x = torch.as_tensor(np.load(files[2])["x_train"]).double()
    y = torch.as_tensor(np.load(files[2])["y_train"])
    assert check["error"] == pytest.approx(float((st.model(x).argmax(1) != y).float().mean()))
    # a deletion still works on the memorisation checkpoint
    code, out = cli("mlforget", "forget", tmp_path / "mem", "--ids", "4,9")
    assert code == 0 and "sharded engine" in out, out


@pytest.mark.parametrize("extra", [["--strategy", "sharded", *SHARDED], ["--strategy", "auto", *SHARDED],
                                   ["--strategy", "linearised", "--mu", "1e-3"]])
def test_memorisation_at_chance_is_still_refused(files, tmp_path, extra):
    """Dead features (the head sees a constant): nothing can be memorised → one error line, exit 2."""
    code, out = _finetune(files, tmp_path / "ck", "--task", "memorisation", *extra, dead=True)
    assert "training-answer error" in _refused(code, out, tmp_path / "ck")


def test_linearised_memorisation(files, tmp_path):
    """The linearised engine on the same task: a fixed µ passes when it learned its training answers; µ 'auto'
    (chosen on held-out samples) is refused before any work."""
    code, out = _finetune(files, tmp_path / "lin", "--strategy", "linearised", "--task", "memorisation",
                          "--mu", "1e-3")
    assert code == 0, out
    check = store.requests(tmp_path / "lin")[0]["solver"]["chance_check"]
    assert check["error"] < check["chance_interval"][0]
    code, out = _finetune(files, tmp_path / "auto", "--strategy", "linearised", "--task", "memorisation",
                          "--mu", "auto")
    assert code == 2 and out.strip().startswith("error:") and "fixed" in out and not (tmp_path / "auto").exists()


def test_shards_auto_is_refused_on_a_memorisation_task(files, tmp_path):
    """Choosing S reads held-out errors: refused before any work on a memorisation task."""
    code, out = _finetune(files, tmp_path / "ck", "--strategy", "sharded", "--task", "memorisation",
                          "--shards", "auto")
    assert code == 2 and out.strip().startswith("error:") and "--shards auto" in out
    assert not (tmp_path / "ck").exists()
