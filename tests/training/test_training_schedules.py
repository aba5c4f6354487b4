"""Regularisation schedules of the SGD loop and TrainConfig: on exactly in the stated epochs [a, b)."""
from __future__ import annotations

import copy

import pytest
import torch

from scrubnet._config import ConfigValueError
from scrubnet.training import TrainConfig, finetune, in_window, sgd_loop
from scrubnet.models import build_model


def _setup():
    torch.manual_seed(0)
    x, y = torch.randn(24, 10), torch.randint(0, 3, (24,))
    return build_model("mlp", (10,), 3, seed=0, hidden=8), x, y


KW = dict(lr=0.1, momentum=0.0, batch_size=8)


def _weights(m):
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("window", [(2, 4), (0, 3), (3, None)])
def test_weight_decay_window_equals_piecewise_training(window):
    """Momentum 0: the scheduled run = separate runs with decay off / on / off, sharing the batch stream."""
    model, x, y = _setup()
    a, b = window
    sched = copy.deepcopy(model)
    sgd_loop(sched, x, y, max_epochs=6, generator=torch.Generator().manual_seed(1), weight_decay=0.5,
             weight_decay_epochs=window, **KW)
    g = torch.Generator().manual_seed(1)
    bounds = [0, a, 6 if b is None else b, 6]
    for lo, hi, on in zip(bounds, bounds[1:], (False, True, False)):
        if hi > lo:
            sgd_loop(model, x, y, max_epochs=hi - lo, generator=g, weight_decay=0.5 if on else 0.0, **KW)
    for p, q in zip(_weights(sched), _weights(model)):
        assert torch.equal(p, q)
    nodecay = _setup()[0]   # the decay did act: the run differs from one without it
    sgd_loop(nodecay, x, y, max_epochs=6, generator=torch.Generator().manual_seed(1), **KW)
    assert not all(torch.equal(p, q) for p, q in zip(_weights(sched), _weights(nodecay)))


def test_pull_window_switches_on_at_the_stated_epoch():
    model, x, y = _setup()
    w0 = {k: v.detach().clone() + 0.3 for k, v in model.named_parameters()}
    sched = copy.deepcopy(model)
    sgd_loop(sched, x, y, max_epochs=5, generator=torch.Generator().manual_seed(2), w0=w0, wd=0.4,
             wd_epochs=(3, None), **KW)
    g = torch.Generator().manual_seed(2)
    sgd_loop(model, x, y, max_epochs=3, generator=g, **KW)
    sgd_loop(model, x, y, max_epochs=2, generator=g, w0=w0, wd=0.4, **KW)
    for p, q in zip(_weights(sched), _weights(model)):
        assert torch.equal(p, q)


def test_augmentation_runs_only_in_its_window_and_leaves_batch_order():
    model, x, y = _setup()
    seen: list[int] = []
    epoch = {"now": -1}

    def on_epoch(e):
        epoch["now"] = e

    def aug(xb):
        seen.append(epoch["now"])
        return xb            # identity: the run must equal the unaugmented one (same batch stream)

    sched = copy.deepcopy(model)
    sgd_loop(sched, x, y, max_epochs=6, generator=torch.Generator().manual_seed(3), augment=aug,
             augment_epochs=(1, 4), on_epoch=on_epoch, **KW)
    assert sorted(set(seen)) == [1, 2, 3] and len(seen) == 3 * 3     # 3 batches per epoch
    sgd_loop(model, x, y, max_epochs=6, generator=torch.Generator().manual_seed(3), **KW)
    for p, q in zip(_weights(sched), _weights(model)):
        assert torch.equal(p, q)


def test_lr_decay_is_per_epoch():
    model, x, y = _setup()
    sched = copy.deepcopy(model)
    sgd_loop(sched, x, y, max_epochs=3, generator=torch.Generator().manual_seed(4), lr_decay=0.5,
             **{**KW, "lr": 0.2})
    g = torch.Generator().manual_seed(4)
    for e in range(3):
        sgd_loop(model, x, y, max_epochs=1, generator=g, **{**KW, "lr": 0.2 * 0.5 ** e})
    for p, q in zip(_weights(sched), _weights(model)):
        assert torch.equal(p, q)


def test_in_window():
    assert [in_window(e, (2, 4)) for e in range(6)] == [False, False, True, True, False, False]
    assert all(in_window(e, None) for e in range(5))
    assert [in_window(e, (3, None)) for e in range(5)] == [False, False, False, True, True]


def test_train_config_schedule_defaults_and_checks():
    cfg = TrainConfig()
    assert cfg.schedule("finetune") == {"wd_epochs": None, "augment_epochs": None}
    assert cfg.schedule("pretrain") == {"wd_epochs": None, "augment_epochs": None}
    cfg = TrainConfig(wd_until=10, pretrain_wd_from=5, augment="shift_noise", pretrain_augment_until=7)
    assert cfg.schedule("finetune") == {"wd_epochs": (0, 10), "augment_epochs": None}
    assert cfg.schedule("pretrain") == {"wd_epochs": (5, None), "augment_epochs": (0, 7)}
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="window"):
        TrainConfig(wd_from=4, wd_until=4)
    with pytest.raises(ValueError, match="augmentation"):
        TrainConfig(augment="mixup")
    with pytest.raises(ConfigValueError, match="wd_until"):
        TrainConfig.from_dict({"wd_until": 0})


def test_finetune_with_a_pull_window_differs_only_from_the_window_on():
    """finetune passes the window to the loop: a window that covers every epoch run = the default run."""
    model, x, y = _setup()
    base = TrainConfig(max_epochs=4, min_epochs=4, extra_epochs=0, batch_size=8)
    full, _ = finetune(model, x, y, TrainConfig(**{**base.to_dict(), "wd_until": 100}), seed=0)
    default, _ = finetune(model, x, y, base, seed=0)
    late, _ = finetune(model, x, y, TrainConfig(**{**base.to_dict(), "wd_from": 2}), seed=0)
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), default.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(late.parameters(), default.parameters()))
