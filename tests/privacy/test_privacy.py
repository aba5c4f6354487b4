"""AdaMix / NoisyGD: accounting against the reference table and a maintained accountant, closed-form
per-sample gradients against torch.func, the per-step sensitivity bound, per-instance privacy."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scrubnet.privacy.accounting import Accounting, delta_of_epsilon, epsilon_of_mu, max_steps, mu_of_epsilon
from scrubnet.privacy.linear import (fit_full_batch, normalise_features, per_sample_grad_norms, per_sample_gradients,
                                     residuals, weighted_gradient_sum)
from scrubnet.privacy.noisygd import preset, private_release, public_subspace, train_private


def test_max_steps_reproduces_the_reference_table():
    assert [max_steps(e, 1e-5, 20.0) for e in (0.5, 1, 2, 3, 4, 8)] == [8, 28, 100, 206, 342, 1110]
    assert [round(mu_of_epsilon(e, 1e-5), 4) for e in (0.5, 1, 2, 3, 4, 8)] == \
        [0.1422, 0.2681, 0.5016, 0.7191, 0.9249, 1.6660]


def test_max_steps_is_the_largest_within_budget():
    for eps in (0.7, 2.5):
        t = max_steps(eps, 1e-6, 7.0)
        assert delta_of_epsilon(eps, math.sqrt(t) / 7.0) <= 1e-6 < delta_of_epsilon(eps, math.sqrt(t + 1) / 7.0)


def test_epsilon_of_mu_agrees_with_the_pld_accountant():
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    for steps in (28, 206, 1110):
        acc = PLDAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(20.0), steps)
        ref = acc.get_epsilon(1e-5)
        ours = epsilon_of_mu(math.sqrt(steps) / 20.0, 1e-5)
        assert abs(ours - ref) / ref < 0.01, (steps, ours, ref)


def test_epsilon_of_mu_inverts_delta_and_is_vectorised():
    mus = np.array([0.0, 0.1, 0.5, 2.0])
    eps = epsilon_of_mu(mus, 1e-5)
    assert eps[0] == 0.0 and np.all(np.diff(eps) > 0)
    assert np.allclose(delta_of_epsilon(eps[1:], mus[1:]), 1e-5, rtol=1e-6)
    with pytest.raises(ValueError):
        max_steps(-1.0, 1e-5, 20.0)


def _toy(n=30, d=6, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = normalise_features(torch.randn(n, d, generator=g, dtype=torch.float64))
    y = torch.randint(c, (n,), generator=g)
    w = torch.randn(d, c, generator=g, dtype=torch.float64)
    return x, y, w


def test_closed_form_per_sample_gradients_equal_torch_func():
    from torch.func import grad, vmap

    x, y, w = _toy()

    def loss(w_, xi, yi):
        return F.cross_entropy((xi @ w_)[None], yi[None])

    ref = vmap(grad(loss), in_dims=(None, 0, 0))(w, x, y)
    ours = per_sample_gradients(x, y, w)
    assert torch.allclose(ours, ref, atol=1e-12)
    assert torch.allclose(per_sample_grad_norms(x, y, w), ref.flatten(1).norm(dim=1), atol=1e-12)
    assert torch.allclose(weighted_gradient_sum(x, residuals(x, y, w)), ref.sum(0), atol=1e-12)


@pytest.mark.parametrize("dim", [None, 2, 5])
def test_one_private_sample_moves_the_release_by_at_most_tau(dim):
    x, y, w = _toy(n=40, d=8, c=3)
    xp, yp, _ = _toy(n=10, d=8, c=3, seed=1)
    basis = public_subspace(xp, residuals(xp, yp, w), dim) if dim else None
    for tau in (0.05, 0.3, 10.0):
        s, _, c = private_release(x, y, w, tau, basis)
        for i in range(5):   # remove sample i
            keep = torch.arange(len(y)) != i
            s2, _, _ = private_release(x[keep], y[keep], w, tau, basis)
            diff = float((s - s2).norm())
            assert diff <= tau * (1 + 1e-9)
            assert diff == pytest.approx(tau * math.sqrt(float(c[i])), rel=1e-9, abs=1e-12)  # pDP share
        z = 50.0 * torch.randn(1, 8, dtype=torch.float64)   # add an outlier of huge norm
        s3, _, _ = private_release(torch.cat([x, z]), torch.cat([y, y[:1]]), w, tau, basis)
        assert float((s3 - s).norm()) <= tau * (1 + 1e-9)


def test_public_subspace_is_orthonormal_and_spans_the_public_gradient():
    x, y, w = _toy(n=20, d=8, c=3)
    u = public_subspace(x, residuals(x, y, w), 5)
    assert torch.allclose(u.T @ u, torch.eye(5, dtype=u.dtype), atol=1e-12)
    g = weighted_gradient_sum(x, residuals(x, y, w))   # rank ≤ C − 1 = 2 ≤ 5: reconstructed exactly
    assert torch.allclose(u @ (u.T @ g), g, atol=1e-10)


def _task(seed=0, n=200, d=10, c=3):
    g = torch.Generator().manual_seed(seed)
    means = 3.0 * torch.randn(c, d, generator=g, dtype=torch.float64)
    y = torch.arange(n) % c
    x = normalise_features(means[y] + torch.randn(n, d, generator=g, dtype=torch.float64))
    return x, y


def test_train_private_accounting_pdp_and_determinism():
    x, y = _task()
    xp, yp = x[:9], y[:9]
    xq, yq = x[9:], y[9:]
    w_pub, _ = fit_full_batch(xp, yp, 3, wd=1e-2, iters=50, lrs=(1.0,))
    cfg = preset("adamix", lr=2.0, subspace_dim=4)
    a = train_private(xq, yq, xp, yp, 3, cfg, epsilon=1.0, delta=1e-5, seed=3, public_init=w_pub)
    b = train_private(xq, yq, xp, yp, 3, cfg, epsilon=1.0, delta=1e-5, seed=3, public_init=w_pub)
    assert torch.equal(a.weights, b.weights)
    acc = a.accounting
    assert acc.steps == 28 and acc.mu == pytest.approx(math.sqrt(28) / 20) and acc.epsilon <= 1.0
    assert len(acc.clip_thresholds) == 28
    # the adaptive threshold is the 90th percentile of the public norms at the initialisation
    assert acc.clip_thresholds[0] == pytest.approx(float(torch.quantile(per_sample_grad_norms(xp, yp, w_pub), 0.9)))
    # per-instance privacy never exceeds the run's guarantee
    assert a.pdp_mu.shape == (len(yq),) and np.all(a.pdp_mu <= acc.mu + 1e-12)
    assert np.all(a.pdp_epsilon <= acc.epsilon + 1e-9)
    assert a.recon_error_public < a.recon_error_random
    c = train_private(xq, yq, xp, yp, 3, cfg, epsilon=1.0, delta=1e-5, seed=4, public_init=w_pub)
    assert not torch.equal(a.weights, c.weights)
    assert Accounting.from_dict(acc.to_dict()) == acc


def test_noisygd_at_huge_epsilon_approaches_the_non_private_fit():
    x, y = _task(n=300)
    xt, yt = _task(seed=9, n=300)
    cfg = preset("noisygd", lr=1.0, sigma=1e-6, clip_threshold=10.0)
    run = train_private(x[3:], y[3:], x[:3], y[:3], 3, cfg, epsilon=1.0, delta=1e-5, seed=0, steps=300)
    ref, _ = fit_full_batch(x, y, 3, wd=1e-2, iters=300, lrs=(1.0,))
    assert torch.allclose(run.weights, ref, atol=1e-4)
    assert run.pdp_mu.shape == (300,)
