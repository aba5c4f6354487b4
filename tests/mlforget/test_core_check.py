"""Never worse than the pretrained point: a core fine-tuning that damages the network is dropped (the model is
linearised at the pretrained point, every sample deletable, and the command says so), a good core is kept, and
a µ search whose best held-out error is near chance refuses (one ``error:`` line, exit 2, nothing written)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.mlforget import store
from scrubnet.mlforget.finetune import accuracy, forgettable_finetune, near_chance

C, D, H = 4, 8, 32

MODEL_FILE = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, dead=False):
        super().__init__()
        self.feat, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.dead = dead

    def forward(self, x):
        return self.head(torch.relu(self.feat(x) - (1e3 if self.dead else 0.0)))


def net(dead=False):
    return MLP(dead)
'''


def task(n: int, seed: int, perm=(0, 1, 2, 3)):
    """Inputs (n, 8) float64 and labels from a fixed linear teacher, the classes renamed by ``perm``."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(D, C, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    x = torch.randn(n, D, generator=g).double()  # float32 values: the .npz reader keeps them exactly
    return x, torch.tensor(perm)[(x @ teacher).argmax(1)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(model file, weights, user data .npz, the pretrained network): pretrained on the teacher's classes, the
    user's task is the same teacher with the classes renamed (the pretrained features serve it)."""
    tmp = tmp_path_factory.mktemp("core")
    (tmp / "mlp.py").write_text(MODEL_FILE)
    import importlib.util
    spec = importlib.util.spec_from_file_location("core_check_mlp", tmp / "mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = mod.net().double()
    x, y = task(2000, 1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(5):
        for i in torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
    net = net.float().double().eval()  # what the command builds: the factory's float32 weights, cast
    torch.save(net.state_dict(), tmp / "w.pt")
    xu, yu = task(600, 2, perm=(2, 0, 3, 1))
    np.savez(tmp / "d.npz", x_train=xu.numpy(), y_train=yu.numpy())
    return tmp / "mlp.py", tmp / "w.pt", tmp / "d.npz", net, (xu, yu)


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def test_a_damaging_core_is_dropped_for_the_pretrained_point(pretrained, tmp_path):
    model_file, weights, npz, net, (x, y) = pretrained
    base = ["mlforget", "finetune", "--model", f"{model_file}:net", "--weights", weights, "--data", npz,
            "--user-weights", "layers:feat,head", "--core-ids", ",".join(map(str, range(24))), "--sigma", 0]
    # Adam at rate 30 on the 24 core samples wrecks the features: the core point is far worse
    code, out = cli(*base, "--core-lr", 30, "--mu", "auto", "--out", tmp_path / "bad")
    assert code == 0 and "core dropped" in out and "all deletable" in out, out
    st, static = store.load(tmp_path / "bad")
    assert static["core_ids"] == [] and "core_dropped" in static["finetune"]["user_weights"]
    check = static["finetune"]["user_weights"]["core_dropped"]
    assert check["core_error"] > check["pretrained_error"] + 0.03, check  # 200 held out: 0.18 vs 0.14
    # exactly the forgettable fine-tune at the pretrained point, at the µ its search (on the same held-out
    # samples as the core point's) chose
    ref = forgettable_finetune(net, x, y, C, user_weights=["feat", "head"], mu=st.config.mu, sigma=0.0)
    w, r = st.model.delta_flat(), ref.model.delta_flat()
    assert float((w - r).abs().max() / r.abs().max()) <= 1e-10
    xt, yt = task(1000, 3, perm=(2, 0, 3, 1))
    assert accuracy(st.model, xt, yt) == accuracy(ref.model, xt, yt) > 0.5
    # unchecked, the same core point is what the command would otherwise have served
    worse = forgettable_finetune(net, x, y, C, user_weights=["feat", "head"], mu=st.config.mu, sigma=0.0,
                                 core_ids=range(24), core_train={"lr": 30.0, "epochs": 40}, check_core=False)
    assert accuracy(worse.model, xt, yt) < accuracy(ref.model, xt, yt) - 0.05, accuracy(worse.model, xt, yt)
    # a sensible core rate: the core point is checked and kept
    code, out = cli(*base, "--core-lr", 1e-3, "--mu", 1e-3, "--out", tmp_path / "good")
    assert code == 0 and "core check: " in out and ": kept" in out and "24 never deletable" in out, out


def test_a_mu_search_near_chance_refuses(pretrained, tmp_path):
    model_file, weights, npz, _, (x, y) = pretrained
    # dead features (every ReLU off): the head alone sees constant inputs, every prediction is one class
    code, out = cli("mlforget", "finetune", "--model", f"{model_file}:net", "--model-option", "dead=true",
                    "--weights", weights, "--data", npz, "--user-weights", "layers:head", "--mu", "auto",
                    "--out", tmp_path / "ck")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "error:" in lines[0] and "near chance" in lines[0], out
    assert not (tmp_path / "ck").exists()
    # within the 95 % range of a majority predictor's error: c − 1.96·√(c(1−c)/n) (0.013 at 0.9 on 2000 samples,
    # 0.173 at 0.75 on 24)
    assert near_chance(0.888, 0.9, 2000) and not near_chance(0.886, 0.9, 2000)
    assert near_chance(0.58, 0.75, 24) and not near_chance(0.57, 0.75, 24)
