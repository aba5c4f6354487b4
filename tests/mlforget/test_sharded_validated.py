"""The sharded engine's validated schedule: every stage keeps its best epoch on a fixed validation set. Still
exact (a deletion equals a fresh validated run on D ∖ D_f bit for bit); never worse on the validation set than
the same trajectory's last epoch; a request without the validation set is refused before anything changes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scrubnet.mlforget.sharded import sharded_finetune


def _setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(180, 6, generator=g)
    y = (x[:, :3] + 0.8 * torch.randn(180, 3, generator=g)).argmax(1)
    return net, x[:120], y[:120], (x[120:], y[120:])


OPTS = dict(user_weights=["0.", "2."], epochs=6, lr=0.2, batch_size=16, seed=1)


def test_validated_deletion_is_exact_and_refused_without_the_validation_set():
    net, x, y, val = _setup()
    sm = sharded_finetune(net, x, y, shards=2, slices=2, validation=val, **OPTS)
    assert sm.config.validated
    sm.forget([3, 50, 77], x, y)
    keep = torch.tensor([i for i in range(120) if i not in (3, 50, 77)])
    fresh = sharded_finetune(net, x[keep], y[keep], ids=keep, shards=2, slices=2, validation=val, **OPTS)
    a, b = sm.state_dict(), fresh.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    before = {k: v.clone() for k, v in a.items()}
    sm.validation = None
    with pytest.raises(ValueError, match="validation"):
        sm.forget([5], x, y)
    assert 5 not in sm.forgotten.tolist()
    assert all(torch.equal(before[k], v) for k, v in sm.state_dict().items())


def test_the_kept_epoch_is_no_worse_on_validation_than_the_last():
    """One shard, one slice: the validated run and the plain run follow the same trajectory; the kept epoch's
    validation error is the minimum over it, so never above the last epoch's (a slow recount of both)."""
    net, x, y, (xv, yv) = _setup()
    plain = sharded_finetune(net, x, y, shards=1, slices=1, **OPTS)
    kept = sharded_finetune(net, x, y, shards=1, slices=1, validation=(xv, yv), **OPTS)
    err = {k: float((m(xv).argmax(1) != yv).float().mean()) for k, m in (("plain", plain), ("kept", kept))}
    assert err["kept"] <= err["plain"]
    assert kept._val_error() == pytest.approx(err["kept"])
