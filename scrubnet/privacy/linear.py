"""The linear softmax classifier on frozen features, with per-sample gradients in closed form.

Model: logits = X W with features X (n, D) and weights W (D, C), no bias (the features are L2-normalised,
see :func:`normalise_features`). Loss of sample i: ℓ_i(W) = −log softmax(x_iᵀW)_{y_i} (nats). Totals are
*sums* over samples, as in the mixed-privacy algorithms.

Per-sample gradient (D, C):  g_i = x_i (p_i − e_{y_i})ᵀ,  with p_i = softmax(x_iᵀW).
It is a rank-one matrix, so ‖g_i‖_F = ‖x_i‖·‖p_i − e_{y_i}‖ ≤ √2·‖x_i‖, any weighted sum is
Σ_i s_i g_i = Xᵀ diag(s) (P − Y), and the projection onto the span of orthonormal U (D, k) has norm
‖Uᵀ g_i‖_F = ‖Uᵀ x_i‖·‖p_i − e_{y_i}‖. Nothing here materialises the (n, D, C) tensor except
:func:`per_sample_gradients`, which exists for tests and small n.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def normalise_features(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows of ``x`` (n, D) scaled to unit L2 norm (rows of zeros stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(eps)


def residuals(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """P − Y (n, C): softmax probabilities minus one-hot labels; row i is ∂ℓ_i/∂logits_i."""
    p = torch.softmax(x @ w, dim=1)
    return p - F.one_hot(y, w.shape[1]).to(p.dtype)


def per_sample_gradients(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """The (n, D, C) tensor of g_i = x_i (p_i − e_{y_i})ᵀ (for tests and small n)."""
    return x[:, :, None] * residuals(x, y, w)[:, None, :]


def per_sample_grad_norms(x: Tensor, y: Tensor, w: Tensor, r: Tensor | None = None) -> Tensor:
    """‖g_i‖_F = ‖x_i‖·‖p_i − e_{y_i}‖, shape (n,); ``r`` = precomputed residuals."""
    if r is None:
        r = residuals(x, y, w)
    return x.norm(dim=1) * r.norm(dim=1)


def weighted_gradient_sum(x: Tensor, r: Tensor, weights: Tensor | None = None) -> Tensor:
    """Σ_i s_i g_i = Xᵀ diag(s) R, shape (D, C); ``weights`` s (n,) default 1."""
    return x.T @ (r if weights is None else r * weights[:, None])


def loss_per_sample(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """ℓ_i(W) in nats, shape (n,)."""
    return F.cross_entropy(x @ w, y, reduction="none")


def error_rate(x: Tensor, y: Tensor, w: Tensor) -> float:
    """Fraction of samples whose arg-max logit is not the label."""
    return float(((x @ w).argmax(1) != y).double().mean()) if len(y) else float("nan")


def objective(x: Tensor, y: Tensor, w: Tensor, wd: float, center: Tensor | None = None) -> float:
    """Σ_i ℓ_i(W) + (wd/2)‖W − center‖² (center 0 by default)."""
    d = w if center is None else w - center
    return float(loss_per_sample(x, y, w).sum() + 0.5 * wd * (d * d).sum())


def fit_full_batch(x: Tensor, y: Tensor, num_classes: int, *, wd: float, iters: int, lrs, init: Tensor | None = None
                   ) -> tuple[Tensor, float]:
    """Non-private fit: ``iters`` steps of full-batch gradient descent on Σ_i ℓ_i + (wd/2)‖W‖², from ``init``
    (default 0), once per learning rate in ``lrs``; keeps the run with the lowest final objective.

    Learning rates are per *mean* loss: the step is W ← W − (lr/n)·∇(Σ ℓ_i + (wd/2)‖W‖²), so one value works
    for 25 or 25 000 samples. Returns (W, the chosen lr). Deterministic (no randomness).
    """
    n = len(y)
    start = torch.zeros(x.shape[1], num_classes, dtype=x.dtype) if init is None else init.clone()
    best: tuple[float, Tensor, float] | None = None
    for lr in lrs:
        w = start.clone()
        for _ in range(iters):
            g = weighted_gradient_sum(x, residuals(x, y, w)) + wd * w
            w = w - (lr / n) * g
        obj = objective(x, y, w, wd)
        if torch.isfinite(w).all() and (best is None or obj < best[0]):
            best = (obj, w, float(lr))
    if best is None:
        raise ValueError("every learning rate diverged in the full-batch fit")
    return best[1], best[2]
