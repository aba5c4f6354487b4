"""The vmapped trainer gives the weights of the one-model-at-a-time loop (scrubnet.training)."""
import pytest
import torch
from torch import nn

from scrubnet.models import build_model
from scrubnet.training import TrainConfig, finetune, finetune_start, retrain
from scrubnet.training.pool import finetune_many, retrain_many


def _data(n, d=12, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, :c].argmax(1) + (torch.rand(n, generator=g) < 0.1).long()) % c
    return x, y


def _close(a: nn.Module, b: nn.Module, tol=1e-4):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(p, q, atol=tol, rtol=tol), n


@pytest.mark.parametrize("arch,opts", [("mlp", {"hidden": 16}), ("cnn1d", {"channels": 4})])
def test_finetune_many_equals_the_loop(arch, opts):
    cfg = TrainConfig(lr=0.05, wd=0.03, batch_size=16, extra_epochs=2, max_epochs=40)
    net = build_model(arch, (12,), 4, seed=0, **opts)
    starts = [finetune_start(net, 3, seed=s) for s in range(3)]
    data = [_data(40 + 8 * (k == 2), seed=k) for k in range(3)]   # two sizes → two stacks
    got = finetune_many(starts, [d[0] for d in data], [d[1] for d in data], cfg, [5, 6, 7])
    for k in range(3):
        ref, h = finetune(starts[k], *data[k], cfg, [5, 6, 7][k])
        model, hv = got[k]
        assert (hv.epochs, hv.zero_error_epoch) == (h.epochs, h.zero_error_epoch)
        assert abs(hv.final_loss - h.final_loss) < 1e-4
        _close(model, ref)
    # the stopping rule fires per model at different epochs in this set-up
    assert len({h.epochs for _, h in got}) > 1 or all(h.zero_error_epoch is None for _, h in got)


@pytest.mark.parametrize("mode", ["remove", "replace"])
def test_retrain_many_equals_the_loop(mode):
    cfg = TrainConfig(lr=0.05, wd=0.03, batch_size=16, extra_epochs=2, max_epochs=30)
    start = finetune_start(build_model("mlp", (12,), 4, seed=1, hidden=16), 3, seed=1)
    x, y = _data(48, seed=3)
    train_idxs = [torch.arange(0, 40), torch.arange(8, 48)]
    forget = [torch.tensor([0, 3, 5]), torch.tensor([1, 2])]
    got = retrain_many([start, start], x, y, forget, cfg, [1, 2], mode=mode, train_idxs=train_idxs)
    for k in range(2):
        ref, _ = retrain(start, x[train_idxs[k]], y[train_idxs[k]], forget[k], cfg, [1, 2][k], mode=mode)
        _close(got[k][0], ref)


def test_refuses_unfrozen_batchnorm_and_dropout():
    x, y = _data(16)
    bn = finetune_start(build_model("cnn1d", (12,), 4, seed=0, channels=4), 3, seed=0)
    with pytest.raises(ValueError, match="frozen BatchNorm"):
        finetune_many([bn], [x], [y], TrainConfig(freeze_bn=False), [0])
    drop = nn.Sequential(nn.Linear(12, 8), nn.Dropout(0.1), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="Dropout"):
        finetune_many([drop], [x], [y], TrainConfig(), [0])
    with pytest.raises(ValueError, match="one architecture"):
        finetune_many([bn, finetune_start(build_model("mlp", (12,), 4, seed=0, hidden=8), 3, seed=0)], [x, x],
                      [y, y], TrainConfig(), [0, 1])


def test_sustained_rule_vmapped_equals_the_loop_and_ends_at_zero_error():
    """The audit pool's stopping rule (the protocol as stated): a model stopped by the rule is at zero training
    error; the first-zero rule of `scrubnet run` can stop above it (seed 6 here)."""
    cfg = TrainConfig(lr=0.05, wd=0.03, batch_size=8, extra_epochs=2, max_epochs=60)
    net = build_model("mlp", (12,), 4, seed=0, hidden=16)
    seeds = [5, 6, 7]
    starts = [finetune_start(net, 3, seed=k) for k in seeds]
    data = [_data(40, seed=k) for k in seeds]
    got = finetune_many(starts, [d[0] for d in data], [d[1] for d in data], cfg, seeds, sustained=True)
    for k in range(3):
        ref, h = finetune(starts[k], *data[k], cfg, seeds[k], sustained=True)
        model, hv = got[k]
        assert (hv.epochs, hv.zero_error_epoch) == (h.epochs, h.zero_error_epoch)
        _close(model, ref)
        assert h.epochs < cfg.max_epochs and h.final_error == 0.0
    _, first = finetune(starts[1], *data[1], cfg, seeds[1])
    assert first.final_error > 0 and got[1][1].epochs > first.epochs
