"""Gauss–Newton (= Fisher, for softmax cross-entropy) vector products of a whole network, matrix-free.

For the mean loss L(w) = (1/N) Σ_i ℓ(f_w(x_i), y_i) with logits f_w(x) ∈ R^K and per-sample Jacobians
J_i = ∂f_w(x_i)/∂w ∈ R^{K×p}, the generalised Gauss–Newton matrix is

    G = (1/N) Σ_i J_iᵀ H_i J_i,     H_i = ∂²ℓ/∂f² at f_w(x_i),

with H_i = diag(p_i) − p_i p_iᵀ (p_i = softmax f_w(x_i)) for ``loss="ce"`` — then G is the true Fisher — and
H_i = I for ``loss="mse"``, ℓ = ½‖f − onehot(y)‖² (then L is quadratic for a linear model and G is its exact
Hessian). ``G v`` is computed per batch as a JVP (J v), a multiplication by H, and a VJP (Jᵀ ·), through
``torch.func`` on the batched forward in eval mode (BatchNorm running statistics, samples independent).
Neither G nor J is ever formed; memory is that of one batch's forward/backward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from scrubnet.curvature.attention import jvp_safe_attention
from scrubnet.curvature.fallbacks import jvp_with_pullback, probe_paths
from scrubnet.curvature.params import flatten, trainable_params, unflatten
from scrubnet.models import eval_mode
from scrubnet.models.call import Inputs, call_functional, call_model
from scrubnet.models.loss import LossSpec, as_loss


def _check_loss(loss: str | LossSpec) -> LossSpec:
    return as_loss(loss)


def per_sample_loss(logits: Tensor, y: Tensor, loss: str | LossSpec) -> Tensor:
    """ℓ(f, y) per sample (N,): cross-entropy, or ½‖f − onehot(y)‖² for ``loss="mse"``; a
    :class:`~scrubnet.models.loss.LossSpec` adds label smoothing or the MSE target scale."""
    return as_loss(loss).per_sample(logits, y)


def output_hessian_product(logits: Tensor, u: Tensor, loss: str | LossSpec) -> Tensor:
    """H(f) u per sample, for logits and u of shape (B, K): (diag p − p pᵀ) u for CE, u for MSE (label smoothing
    and the target scale leave H unchanged)."""
    if as_loss(loss).kind == "ce":
        p = torch.softmax(logits, dim=-1)
        return p * u - p * (p * u).sum(-1, keepdim=True)
    return u


class GGNOperator:
    """The linear map v ↦ (G + damping·I) v on flat parameter vectors (length p = trainable parameters).

    model: evaluated in eval mode at its current weights (captured at construction).
    x:     inputs (N, ...); ``y`` is not needed (H depends only on the logits).
    loss:  "ce" (G = true Fisher) or "mse" (H = I), or a LossSpec (the same G).
    batch_size: samples per JVP/VJP pass; memory is one batch's forward + backward.
    ``calls`` counts the products computed (each costs about two forward+backward passes over x).
    """

    def __init__(self, model: nn.Module, x: Inputs, *, loss: str | LossSpec = "ce", batch_size: int = 256,
                 damping: float = 0.0):
        _check_loss(loss)
        if len(x) == 0:
            raise ValueError("cannot build a Gauss–Newton operator on an empty data set")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.model, self.x, self.loss = model, x, loss
        self.batch_size, self.damping = batch_size, float(damping)
        self.params = trainable_params(model)
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
        self.paths = probe_paths(model, x)   # forward-mode J v or the double-VJP; fused kernels or not
        self.calls = 0

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.params.values())

    def __call__(self, v: Tensor) -> Tensor:
        return self.matvec(v)

    def matvec(self, v: Tensor) -> Tensor:
        """(G + damping·I) v for a flat vector v (p,)."""
        if v.ndim != 1 or v.numel() != self.num_params:
            raise ValueError(f"expected a flat vector of {self.num_params} entries, got shape {tuple(v.shape)}")
        tangent = unflatten(v.to(next(iter(self.params.values())).dtype), self.params)
        out = {k: torch.zeros_like(t) for k, t in self.params.items()}
        n = len(self.x)
        with eval_mode(self.model), jvp_safe_attention(), self.paths.context():
            for i in range(0, n, self.batch_size):
                xb = self.x[i:i + self.batch_size]

                def f(p):
                    return call_functional(self.model, (p, self.buffers), xb)

                logits, jv, pull = jvp_with_pullback(f, self.params, tangent, self.paths)
                hjv = output_hessian_product(logits.detach(), jv, self.loss)
                (g,) = pull(hjv)
                for k in out:
                    out[k] += g[k].detach()
        self.calls += 1
        res = flatten(out) / n
        if self.damping:
            res = res + self.damping * v.to(res.dtype)
        return res.to(v.dtype)


def ggn_vector_product(model: nn.Module, x: Inputs, v, *, loss: str | LossSpec = "ce", batch_size: int = 256):
    """G v for the mean loss over ``x`` (see module docstring), without forming G.

    ``v`` is a flat vector (p,) or a dict ``{name: tensor}`` over the trainable parameters; the result has
    the same form.
    """
    op = GGNOperator(model, x, loss=loss, batch_size=batch_size)
    if isinstance(v, dict):
        missing = set(op.params) - set(v)
        if missing:
            raise ValueError(f"v lacks parameters: {', '.join(sorted(missing))}")
        flat = flatten({k: v[k] for k in op.params})
        return {k: t.clone() for k, t in unflatten(op.matvec(flat), op.params).items()}
    return op.matvec(v)


def mean_loss_and_grad(model: nn.Module, x: Inputs, y: Tensor, *, loss: str | LossSpec = "ce",
                       batch_size: int = 256) -> tuple[float, Tensor]:
    """(L, ∇L) for L = (1/N) Σ_i ℓ(f(x_i), y_i) in eval mode, streamed over batches; ∇L flat (p,)."""
    loss = _check_loss(loss)
    if len(x) == 0:
        raise ValueError("cannot compute a loss on an empty data set")
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    acc = [torch.zeros_like(p) for p in params]
    with eval_mode(model), torch.enable_grad(), probe_paths(model, x).context():
        for i in range(0, len(x), batch_size):
            lb = per_sample_loss(call_model(model, x[i:i + batch_size]), y[i:i + batch_size], loss).sum()
            grads = torch.autograd.grad(lb, params)
            total += float(lb.detach())
            for a, g in zip(acc, grads):
                a += g.detach()
    n = len(x)
    return total / n, torch.cat([a.reshape(-1) for a in acc]) / n
