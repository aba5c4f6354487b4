"""Weight norm, effective learning rate and trajectory PCA against direct computations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from scrubnet.diagnostics.readiness import fisher_readiness, linearization_gap
from scrubnet.diagnostics.trajectory import WeightNormLog, flat_weights, trajectory_pca, weight_sq_norm
from scrubnet.models import build_model
from scrubnet.training import sgd_loop


def test_weight_norm_and_effective_lr_per_epoch():
    model = build_model("mlp", (6,), 3, seed=0, hidden=5)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    log = WeightNormLog(model, lr_at=lambda e: 0.1 * 0.5 ** e, snapshot_every=2)
    sgd_loop(model, x, y, lr=0.1, momentum=0.9, batch_size=4, max_epochs=3, generator=torch.Generator().manual_seed(0),
             lr_decay=0.5, on_epoch=log.on_epoch)
    direct = sum(float((p.detach().double() ** 2).sum()) for p in model.parameters())
    assert log.epochs == [0, 1, 2, 3] and log.sq_norms[-1] == pytest.approx(direct, rel=1e-12)
    assert log.effective_lr[-1] == pytest.approx(0.1 * 0.5 ** 3 / direct, rel=1e-12)
    assert log.snapshot_epochs == [0, 2] and log.snapshots[0].shape == flat_weights(model).shape
    assert weight_sq_norm(model) == pytest.approx(float(flat_weights(model).pow(2).sum()), rel=1e-12)


def test_trajectory_pca_matches_numpy_svd():
    g = torch.Generator().manual_seed(0)
    paths = {"a": torch.randn(5, 7, generator=g, dtype=torch.float64),
             "b": torch.randn(3, 7, generator=g, dtype=torch.float64) + 2.0}
    proj, ratio = trajectory_pca(paths)
    m = np.concatenate([paths["a"].numpy(), paths["b"].numpy()])
    c = m - m.mean(0)
    u, s, vt = np.linalg.svd(c, full_matrices=False)
    ref = c @ vt[:2].T
    got = np.concatenate([proj["a"].numpy(), proj["b"].numpy()])
    for j in range(2):   # principal directions are defined up to sign
        assert np.allclose(got[:, j], ref[:, j]) or np.allclose(got[:, j], -ref[:, j])
    assert np.allclose(ratio.numpy(), (s[:2] ** 2) / (s ** 2).sum())
    line = {"r": torch.outer(torch.arange(4.0, dtype=torch.float64), torch.ones(7, dtype=torch.float64))}
    p, r = trajectory_pca(line)
    assert float(r[0]) == pytest.approx(1.0) and torch.allclose(p["r"][:, 1], torch.zeros(4, dtype=torch.float64),
                                                                atol=1e-10)


def test_fisher_readiness():
    t = list(range(8))
    rise_fall = [1, 3, 6, 5, 4, 3, 2.5, 2]
    r = fisher_readiness(t, rise_fall)
    assert (r["peak"], r["peak_at"], r["final"]) == (6, 2, 2) and r["ready"]
    still_rising = [1, 2, 3, 4, 5, 6, 7, 8]
    assert not fisher_readiness(t, still_rising)["ready"]
    just_past = [1, 2, 3, 4, 5, 9, 4, 3]    # peak 2 evaluations before the end: not past by patience 3
    assert not fisher_readiness(t, just_past)["past_peak"]
    flat_after = [1, 5, 4.9, 4.9, 4.8, 4.8, 4.8, 4.8]
    assert fisher_readiness(t, flat_after)["past_peak"] and not fisher_readiness(t, flat_after)["decayed"]


def test_linearization_gap_is_zero_for_a_linear_model_and_grows_with_the_step():
    x = torch.randn(20, 6)
    lin_a = build_model("mlp", (6,), 3, seed=0, depth=0)     # Flatten + Linear: exactly linear in w
    lin_b = build_model("mlp", (6,), 3, seed=1, depth=0)
    r = linearization_gap(lin_a, lin_b, x)
    assert r["relative_gap"] < 1e-5 and r["agreement"] == 1.0
    a = build_model("mlp", (6,), 3, seed=0, hidden=8)
    gaps = []
    for scale in (1e-3, 1e-1):
        b = build_model("mlp", (6,), 3, seed=0, hidden=8)
        with torch.no_grad():
            for p, d in zip(b.parameters(), build_model("mlp", (6,), 3, seed=2, hidden=8).parameters()):
                p.add_(scale * d)
        gaps.append(linearization_gap(a, b, x)["relative_gap"])
    assert gaps[0] < gaps[1]
    # direct check of the definition on the larger step: f_lin = f_a + J (w_b − w_a) by finite differences
    eps = 1e-4
    mid = build_model("mlp", (6,), 3, seed=0, hidden=8).double()
    ad, bd = a.double(), b.double()
    with torch.no_grad():
        for p, pa, pb in zip(mid.parameters(), ad.parameters(), bd.parameters()):
            p.copy_(pa + eps * (pb - pa))
        f_lin = ad(x.double()) + (mid(x.double()) - ad(x.double())) / eps
        fb, fa = bd(x.double()), ad(x.double())
    ref = float((f_lin - fb).norm() / (fb - fa).norm())
    assert gaps[1] == pytest.approx(ref, rel=1e-3)


def test_linearization_gap_with_the_anchors_batchnorm_statistics():
    """Only the BatchNorm buffers differ: the weight-space gap is 0, the own-statistics gap is not."""
    x = torch.randn(12, 20)
    a = build_model("cnn1d", (20,), 3, seed=0, channels=4).eval()
    b = build_model("cnn1d", (20,), 3, seed=0, channels=4)
    b.train()
    with torch.no_grad():
        b(3 * torch.randn(32, 20) + 1)   # moves the running statistics only
    b.eval()
    own = linearization_gap(a, b, x)
    same = linearization_gap(a, b, x, anchor_statistics=True)
    assert own["move"] > 0.01 and own["relative_gap"] == pytest.approx(1.0, abs=1e-5)   # f_lin = f_a exactly
    assert same["move"] == 0.0
