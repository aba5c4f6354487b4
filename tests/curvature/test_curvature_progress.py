"""Long passes report their progress to an installed reporter (the CLI's bar with an ETA): the Fisher
batches, the NTK capture/contraction/chunk pairs, CG iterations and training epochs; values do not change."""
from __future__ import annotations

from collections import defaultdict

import torch

from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.ntk import ntk_gram
from scrubnet.curvature.progress import progress_reporter
from scrubnet.curvature.solvers import conjugate_gradient
from scrubnet.models.zoo import build_model
from scrubnet.training import sgd_loop


def _record():
    calls = defaultdict(list)
    return calls, lambda what, done, total: calls[what].append((done, total))


def _model_and_data(n=6):
    model = build_model("resnet18", (3, 6, 6), 3, seed=1, width=0.05).double().eval()
    x = torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return model, x


def test_ntk_gram_reports_and_gives_the_same_gram():
    model, x = _model_and_data()
    plain = ntk_gram(model, x, memory_budget_bytes=60_000)
    calls, rep = _record()
    with progress_reporter(rep):
        got = ntk_gram(model, x, memory_budget_bytes=60_000)
    assert torch.equal(got, plain)
    assert calls["NTK: Jacobian rows (samples)"][-1][0] == calls["NTK: Jacobian rows (samples)"][-1][1]
    layers = calls["NTK: Gram contraction (layers)"]
    assert layers and all(d <= t for d, t in layers) and layers[-1][0] == layers[-1][1]
    pairs = [k for k in calls if k.startswith("NTK: chunk pairs")]
    assert pairs, "a budget this small contracts in chunks or layer groups"
    for k in pairs:
        done = [d for d, _ in calls[k]]
        assert done == sorted(done) or min(done) == 1   # one bar per group, restarting per group
        assert calls[k][-1][0] == calls[k][-1][1]
    # with no reporter installed nothing is recorded and nothing fails
    assert torch.equal(ntk_gram(model, x, memory_budget_bytes=60_000), plain)


def test_cg_reports_each_iteration_against_its_cap():
    a = torch.randn(20, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = a @ a.T + 20 * torch.eye(20, dtype=torch.float64)
    b = torch.ones(20, dtype=torch.float64)
    calls, rep = _record()
    with progress_reporter(rep):
        x, info = conjugate_gradient(lambda v: a @ v, b, tol=1e-12, max_iter=50)
    seen = calls["CG iterations (cap 50)"]
    assert [d for d, _ in seen] == list(range(len(seen))) and {t for _, t in seen} == {50}
    assert len(seen) == info.iterations
    assert torch.allclose(a @ x, b, atol=1e-9)


def test_training_reports_epochs_against_the_cap():
    model = build_model("mlp", (5,), 3, seed=0, hidden=8)
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(16) % 3
    calls, rep = _record()
    with progress_reporter(rep):
        epochs, _ = sgd_loop(model, x, y, lr=0.1, momentum=0.0, batch_size=8, max_epochs=4,
                             generator=torch.Generator().manual_seed(1))
    assert epochs == 4
    assert calls["training epochs (cap 4)"] == [(e, 4) for e in range(5)]


def test_fisher_reports_batches():
    model, x = _model_and_data(8)
    calls, rep = _record()
    with progress_reporter(rep):
        fisher_diag(model, x, budget_bytes=200_000)
    assert calls and all(v[-1][0] == v[-1][1] for v in calls.values())
