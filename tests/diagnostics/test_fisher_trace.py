"""The Fisher-trace monitor against batch-size-1 loops of its definition (MLP, BatchNorm CNNs)."""
from __future__ import annotations

import copy

import pytest
import torch

from scrubnet.diagnostics.fisher_trace import (FisherTraceMonitor, fisher_trace, layer_of, probe_subset,
                                               sample_model_labels)
from scrubnet.models import build_model
from scrubnet.training import sgd_loop


def _bn_with_stats(model):
    """Non-trivial running statistics, so eval-mode BatchNorm is not the identity."""
    g = torch.Generator().manual_seed(5)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
            with torch.no_grad():
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=g))
    return model


MODELS = {
    "mlp": lambda: (build_model("mlp", (12,), 4, seed=0, hidden=16), torch.randn(7, 12)),
    "cnn1d": lambda: (_bn_with_stats(build_model("cnn1d", (20,), 5, seed=0, channels=4)), torch.randn(6, 20)),
    "cnn2d": lambda: (_bn_with_stats(build_model("cnn2d", (1, 8, 8), 3, seed=0, channels=3)),
                      torch.randn(5, 1, 8, 8)),
}


def _loop_trace(model, x, labels=None):
    """Batch size 1, one autograd.grad per (sample, class): {layer: trace}. labels None: exact expectation
    Σ_k p_k ‖∇ log p_k‖²; else ‖∇ log p_{labels[i]}(x_i)‖² (labels (M·S,), S per input in order)."""
    model.eval()
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    acc: dict[str, float] = {}
    reps = 1 if labels is None else len(labels) // len(x)
    count = 0
    for i in range(len(x)):
        log_p = torch.log_softmax(model(x[i:i + 1]), -1)[0]
        pairs = [(k, float(log_p[k].detach().exp())) for k in range(len(log_p))] if labels is None else \
            [(int(labels[i * reps + s]), 1.0) for s in range(reps)]
        for k, w in pairs:
            grads = torch.autograd.grad(log_p[k], [p for _, p in named], retain_graph=True)
            for (name, _), g in zip(named, grads):
                acc[layer_of(name)] = acc.get(layer_of(name), 0.0) + w * float(g.double().pow(2).sum())
        count += reps if labels is not None else 1
    return {k: v / count for k, v in acc.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_sampled_trace_equals_batch_one_loop(name):
    model, x = MODELS[name]()
    labels = sample_model_labels(model, x, torch.Generator().manual_seed(3), label_samples=2)
    got = fisher_trace(model, x, mode="sampled", generator=torch.Generator().manual_seed(3), label_samples=2)
    ref = _loop_trace(copy.deepcopy(model), x, labels)
    assert set(got.per_layer) == set(ref)
    for k in ref:
        assert got.per_layer[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-9), k
    assert got.total == pytest.approx(sum(ref.values()), rel=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_exact_trace_is_softmax_weighted_sum_of_per_class_gradients(name):
    model, x = MODELS[name]()
    got = fisher_trace(model, x, mode="exact")
    ref = _loop_trace(copy.deepcopy(model), x)
    for k in ref:
        assert got.per_layer[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-9), k
    assert got.total == pytest.approx(sum(ref.values()), rel=1e-5)


def test_sampled_labels_follow_the_model_and_average_to_the_exact_trace():
    model, x = MODELS["mlp"]()
    with torch.no_grad():
        model.head.weight.mul_(8.0)   # peaked predictions: the sampled and ground-truth-free labels differ
    probs = torch.softmax(model.eval()(x), -1)
    labels = sample_model_labels(model, x, torch.Generator().manual_seed(0), 4000).reshape(len(x), -1)
    freq = torch.stack([(labels == k).double().mean(1) for k in range(probs.shape[1])], 1)
    assert torch.allclose(freq, probs.double(), atol=0.03)
    many = fisher_trace(model, x, generator=torch.Generator().manual_seed(1), label_samples=1500).total
    exact = fisher_trace(model, x, mode="exact").total
    assert many == pytest.approx(exact, rel=0.05)


def test_monitor_on_sgd_loop_records_peak_and_leaves_training_unchanged():
    torch.manual_seed(0)
    x, y = torch.randn(40, 12), torch.randint(0, 4, (40,))
    plain = build_model("mlp", (12,), 4, seed=0, hidden=16)
    watched = copy.deepcopy(plain)
    kw = dict(lr=0.1, momentum=0.9, batch_size=8, max_epochs=4)
    sgd_loop(plain, x, y, generator=torch.Generator().manual_seed(1), **kw)
    mon = FisherTraceMonitor(watched, x[probe_subset(40, 10, seed=0)], seed=2)
    steps = FisherTraceMonitor(watched, x[:10], unit="step", every=3, mode="exact")
    sgd_loop(watched, x, y, generator=torch.Generator().manual_seed(1), on_epoch=mon.on_epoch,
             on_step=steps.on_step, **kw)
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)                       # monitoring draws from its own generator only
    assert mon.times == [0, 1, 2, 3, 4]
    assert steps.times == [3, 6, 9, 12, 15, 18]        # 5 batches × 4 epochs = 20 steps
    assert mon.peak == max(mon.totals) and mon.final == mon.totals[-1]
    assert mon.totals[mon.times.index(mon.peak_at)] == mon.peak
    # the final record is the trained model's trace (same labels: a fresh monitor with the same stream)
    fresh = FisherTraceMonitor(watched, x[probe_subset(40, 10, seed=0)], seed=2)
    for t in range(5):
        fresh.record(t)
    assert fresh.final == pytest.approx(mon.final, rel=1e-6)
    s = mon.summary()
    assert s["peak_at"] == mon.peak_at and len(s["per_layer"]["head"]) == 5
    assert sum(v[-1] for v in s["per_layer"].values()) == pytest.approx(s["final"], rel=1e-9)


def test_bad_input():
    model, x = MODELS["mlp"]()
    with pytest.raises(ValueError, match="mode"):
        fisher_trace(model, x, mode="empirical")
    with pytest.raises(ValueError, match="Generator"):
        fisher_trace(model, x)
    with pytest.raises(ValueError, match="every"):
        FisherTraceMonitor(model, x, every=0)
