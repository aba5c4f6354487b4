"""The pre-flight's choice of S from the learning curve (:func:`choose_shards`): the largest S whose
shard-sized ordinary fine-tune is within the tolerance of the whole data's, each error recomputed the slow way."""
from __future__ import annotations

import torch
from torch import nn

from scrubnet.mlforget.chance import held_out_split
from scrubnet.mlforget.finetune import accuracy, ordinary_finetune
from scrubnet.mlforget.preflight import choose_shards

BUDGET = {"epochs": 6, "lr": 0.05, "batch_size": 32}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _task(n, noise):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :3] + noise * torch.randn(n, 3, generator=g)).argmax(1)
    return x, y


def test_choice_follows_the_learning_curve_and_each_error_is_recomputed():
    net, (x, y) = _net(), _task(400, 0.3)
    got = choose_shards(net, x, y, 3, user_weights=["0.", "2."], tolerance=0.05, budget=BUDGET,
                        candidates=(4, 2, 1), seed=2)
    errors = {int(k): v for k, v in got["errors"].items()}
    assert set(errors) == {1, 2, 4} and got["held_out"] == 200
    assert got["shards"] == max(S for S, e in errors.items() if e <= errors[1] + 0.05)
    assert got["reason"].startswith(f"shards {got['shards']}: ")
    # the slow twin of one point of the curve: the same split, the first ⌈|fit|/S⌉ of the seeded permutation
    fit, val = held_out_split(400, 2)
    perm = fit[torch.randperm(len(fit), generator=torch.Generator().manual_seed(7919 * 2 + 31))]
    part = torch.sort(perm[:100]).values
    twin = ordinary_finetune(net, x[part], y[part], user_weights=["0.", "2."], seed=2, **BUDGET)
    assert abs((1 - accuracy(twin, x[val], y[val])) - errors[2]) < 1e-12
    # a zero tolerance can only keep an S whose error is no worse than the whole data's
    strict = choose_shards(net, x, y, 3, user_weights=["0.", "2."], tolerance=0.0, budget=BUDGET,
                           candidates=(4, 2, 1), seed=2)
    assert strict["errors"] == got["errors"]  # the same curve (seeded)
    assert strict["shards"] == max(S for S, e in errors.items() if e <= errors[1])


def test_cli_shards_auto_records_its_choice(tmp_path):
    """``mlforget finetune --strategy sharded --shards auto``: the one-line reason printed, the choice recorded
    in the checkpoint, and the model built with it."""
    import numpy as np
    from typer.testing import CliRunner

    from scrubnet.cli import app
    from scrubnet.mlforget import store
    (tmp_path / "net.py").write_text("import torch\nfrom torch import nn\n\n\ndef net():\n    torch.manual_seed(0)\n"
                                     "    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))\n")
    torch.save(_net().state_dict(), tmp_path / "w.pt")
    x, y = _task(300, 0.3)
    np.savez(tmp_path / "d.npz", x_train=x.numpy(), y_train=y.numpy())
    res = CliRunner().invoke(app, ["mlforget", "finetune", "--model", f"{tmp_path / 'net.py'}:net", "--weights",
                                   str(tmp_path / "w.pt"), "--data", str(tmp_path / "d.npz"), "--user-weights",
                                   "layers:0.,2.", "--strategy", "sharded", "--shards", "auto", "--slices", "2",
                                   "--epochs", "6", "--lr", "0.05", "--tolerance", "0.05",
                                   "--out", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("shards "))
    _, static = store.load(tmp_path / "ck")
    choice = static["finetune"]["shard_choice"]
    assert line == choice["reason"] and static["finetune"]["sharded"]["shards"] == max(2, choice["shards"])


def test_no_curve_at_chance_keeps_one_shard_and_says_so():
    """Features that carry nothing (the head sees zeros): even the whole fit split is at chance → S = 1."""
    net, (x, y) = _net(), _task(300, 0.3)
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.zero_()
    got = choose_shards(net, x, y, 3, user_weights=["2."], budget=BUDGET, candidates=(4, 2, 1), seed=0)
    assert got["shards"] == 1 and "at chance" in got["reason"]
