"""Diagonal Fisher information of a classifier, vectorised with ``torch.func`` and streamed over batches.

For a classifier with logits f_w(x) ∈ R^K and p(k|x) = softmax(f_w(x))_k, the **true Fisher** diagonal on a
set {x_1..x_N} is (labels drawn from the model's own predictive distribution, mean over samples)

    F_j = (1/N) Σ_i Σ_k p(k|x_i) · (∂ log p(k|x_i) / ∂w_j)²                      (spec fisher-forgetting §A5)

and the **empirical Fisher** diagonal uses the dataset labels instead:

    F_j = (1/N) Σ_i (∂ log p(y_i|x_i) / ∂w_j)².

For softmax cross-entropy the true Fisher equals the Gauss–Newton matrix Jᵀ(diag p − p pᵀ)J, whose diagonal
is what :mod:`scrubnet.curvature.ggn` multiplies by without forming it.

Both are computed in **eval mode** (BatchNorm uses its running statistics, so samples do not interact and
per-sample gradients are well defined) with ``functional_call`` + ``vmap``: per batch of B samples, the K
gradients √p_k·∇ log p_k of every sample are produced by one vmapped VJP (memory ≈ B·K·p numbers), squared,
summed over classes and samples, and added to float64 accumulators; memory therefore does not grow with N.

:func:`fisher_diag_loop` is the slow, obviously-correct twin: batch size 1 and one ``autograd.grad`` per class
per sample, as in the authors' code. Tests and ``benchmarks/fisher_diag.py`` compare the two.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from scrubnet.curvature.params import trainable_params

FISHER_KINDS = ("true", "empirical")

# default budget for the per-batch per-sample-gradient tensor (B·K·p numbers)
_DEFAULT_BUDGET_BYTES = 32 * 2**20


class _EvalMode:
    """Context manager: put a module in eval mode and restore its previous train/eval flags afterwards."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        return self.model

    def __exit__(self, *exc):
        for m, flag in self.flags:
            m.training = flag
        return False


def eval_mode(model: nn.Module) -> _EvalMode:
    """``with eval_mode(model): ...`` runs the block with every submodule in eval mode, then restores them."""
    return _EvalMode(model)


def _check_inputs(model: nn.Module, x: Tensor, y: Tensor | None, kind: str) -> None:
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {', '.join(FISHER_KINDS)}")
    if not isinstance(x, Tensor) or x.ndim < 1:
        raise ValueError("x must be a tensor with a leading sample dimension")
    if len(x) == 0:
        raise ValueError("cannot compute a Fisher on an empty data set")
    if kind == "empirical":
        if y is None:
            raise ValueError("the empirical Fisher needs the labels y")
        if len(y) != len(x):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
    if not trainable_params(model):
        raise ValueError("model has no trainable parameters")


def auto_batch_size(num_params: int, num_classes: int, itemsize: int = 4,
                    budget_bytes: int = _DEFAULT_BUDGET_BYTES) -> int:
    """Largest batch B with B·K·p·itemsize ≤ budget (≥ 1): bounds the per-batch gradient tensor."""
    per_sample = max(1, num_params * max(1, num_classes) * itemsize)
    return max(1, min(64, budget_bytes // per_sample))


def fisher_diag(model: nn.Module, x: Tensor, y: Tensor | None = None, *, kind: str = "true",
                batch_size: int | None = None, budget_bytes: int = _DEFAULT_BUDGET_BYTES) -> dict[str, Tensor]:
    """Diagonal Fisher ``{name: F}`` (F shaped like the parameter) of ``model`` on inputs ``x`` (N, ...).

    kind="true":      F_j = mean_i Σ_k p(k|x_i) (∂_j log p(k|x_i))²  (``y`` ignored).
    kind="empirical": F_j = mean_i (∂_j log p(y_i|x_i))²              (``y`` (N,) int64 required).

    Only parameters with ``requires_grad`` are included. Evaluated in eval mode (the model's modes are
    restored). ``batch_size`` samples are processed at once (default: as many as keep the B·K·p per-sample
    gradient tensor under ``budget_bytes``). Returns tensors in the parameters' dtype.
    """
    _check_inputs(model, x, y, kind)
    params = trainable_params(model)
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    p_count = sum(t.numel() for t in params.values())
    itemsize = next(iter(params.values())).element_size()
    acc = {k: torch.zeros(v.shape, dtype=torch.float64, device=v.device) for k, v in params.items()}

    def logits_one(p, xi):
        return functional_call(model, (p, buffers), (xi.unsqueeze(0),)).squeeze(0)

    if kind == "true":
        def per_sample(p, xi):
            def log_probs(q):
                return torch.log_softmax(logits_one(q, xi), dim=-1)
            lp, pull = vjp(log_probs, p)
            weights = lp.detach().exp().sqrt()            # √p_k: Σ_k (√p_k ∇log p_k)² = Σ_k p_k (∇log p_k)²
            (g,) = vmap(pull)(torch.diag(weights))         # {name: (K, *shape)}
            return {k: (t * t).sum(0) for k, t in g.items()}

        def batch_sum(xb, yb):
            out = vmap(per_sample, in_dims=(None, 0))(params, xb)
            return {k: t.sum(0) for k, t in out.items()}
    else:
        def nll_one(p, xi, yi):
            return F.cross_entropy(logits_one(p, xi).unsqueeze(0), yi.unsqueeze(0))

        per_sample_grad = vmap(grad(nll_one), in_dims=(None, 0, 0))

        def batch_sum(xb, yb):
            g = per_sample_grad(params, xb, yb)
            return {k: (t * t).sum(0) for k, t in g.items()}

    with eval_mode(model):
        if batch_size is None:
            with torch.no_grad():
                probe = model(x[:1])
            batch_size = auto_batch_size(p_count, probe.shape[-1] if kind == "true" else 1, itemsize,
                                         budget_bytes)
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        n = len(x)
        for i in range(0, n, batch_size):
            xb = x[i:i + batch_size]
            yb = y[i:i + batch_size] if y is not None else torch.zeros(len(xb), dtype=torch.long)
            for k, t in batch_sum(xb, yb).items():
                acc[k] += t.detach().to(torch.float64)
    return {k: (acc[k] / n).to(params[k].dtype) for k in params}


def fisher_diag_loop(model: nn.Module, x: Tensor, y: Tensor | None = None, *, kind: str = "true"
                     ) -> dict[str, Tensor]:
    """Slow reference for :func:`fisher_diag`: batch size 1, one backward pass per class per sample.

    Same definition and return format as :func:`fisher_diag` (the authors' protocol; used by tests and the
    benchmark only).
    """
    _check_inputs(model, x, y, kind)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    acc = {k: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for k, p in named}
    tensors = [p for _, p in named]
    with eval_mode(model):
        for i in range(len(x)):
            log_p = torch.log_softmax(model(x[i:i + 1]), dim=-1)[0]
            if kind == "true":
                probs = log_p.detach().exp()
                classes = range(log_p.shape[0])
            else:
                probs = torch.ones(1, dtype=log_p.dtype)
                classes = [int(y[i])]
            classes = list(classes)
            for j, k in enumerate(classes):
                grads = torch.autograd.grad(log_p[k], tensors, retain_graph=j < len(classes) - 1)
                w = float(probs[k]) if kind == "true" else 1.0
                for (name, _), g in zip(named, grads):
                    acc[name] += w * g.detach().to(torch.float64) ** 2
    return {k: (acc[k] / len(x)).to(p.dtype) for k, p in named}
