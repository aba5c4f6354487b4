"""Diagonal Fisher information of a classifier, vectorised with ``torch.func`` and streamed over batches.

For a classifier with logits f_w(x) ∈ R^K and p(k|x) = softmax(f_w(x))_k, the **true Fisher** diagonal on a
set {x_1..x_N} is (labels drawn from the model's own predictive distribution, mean over samples)

    F_j = (1/N) Σ_i Σ_k p(k|x_i) · (∂ log p(k|x_i) / ∂w_j)²                      ("Eternal Sunshine")

and the **empirical Fisher** diagonal uses the dataset labels instead:

    F_j = (1/N) Σ_i (∂ log p(y_i|x_i) / ∂w_j)².

For softmax cross-entropy the true Fisher equals the Gauss–Newton matrix Jᵀ(diag p − p pᵀ)J, whose diagonal
is what :mod:`scrubnet.curvature.ggn` multiplies by without forming it.

Both are computed in **eval mode** (BatchNorm uses its running statistics, so samples do not interact and
per-sample gradients are well defined), streamed over batches into float64 accumulators, so memory does not
grow with N. Two exact vectorised paths:

* ``method="vmap"`` — the generic ``torch.func`` fallback of :mod:`scrubnet.curvature.kernels`: per batch of
  B samples, the K gradients √p_k·∇ log p_k of every sample come from one VJP vmapped over the K class
  cotangents, vmapped over samples (memory ≈ B·K·p); squared and summed over classes and samples. Works for
  any module.
* ``method="layerwise"`` (default via "auto") — one batched forward, K backward passes of
  Σ_i √p_k(x_i) log p_k(x_i) to the layer *outputs* only, and the squared per-sample gradients of the
  layers covered by the kernel registry (:mod:`scrubnet.curvature.kernels`: Linear, Conv1d/Conv2d, eval-mode
  BatchNorm) from (layer input, output gradient) in closed form ((g²)ᵀa² for Linear, unfold + bmm for
  convolutions, x̂·g for BatchNorm); parameters of any other module (or of a module called twice) go
  through the vmap path. ``benchmarks/fisher_diag.py`` measures it against vmap and the batch-size-1 loop
  (figures in the README's benchmark table).

:func:`fisher_diag_loop` is the slow, obviously-correct twin: batch size 1 and one ``autograd.grad`` per class
per sample, as in the authors' code. Tests and ``benchmarks/fisher_diag.py`` compare the two.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from scrubnet.curvature.kernels import LayerKernel, func_per_sample_grads, kernel_for
from scrubnet.curvature.params import trainable_params
from scrubnet.models import eval_mode

FISHER_KINDS = ("true", "empirical")

# default budget for the per-batch per-sample-gradient tensor (B·K·p numbers)
_DEFAULT_BUDGET_BYTES = 32 * 2**20




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


FISHER_METHODS = ("auto", "vmap", "layerwise")


def _vmap_batch_sums(model: nn.Module, params: dict[str, Tensor], names: list[str], buffers: dict[str, Tensor],
                     xb: Tensor, yb: Tensor | None, kind: str) -> dict[str, Tensor]:
    """Σ_i Σ_k p_k (∂ log p_k(x_i))² (true) or Σ_i (∂ log p_{y_i}(x_i))² (empirical) over the batch, for the
    parameters ``names`` (the others held fixed), by the generic ``torch.func`` fallback of
    :mod:`scrubnet.curvature.kernels` with cotangents diag(√p(x_i)) (true) or onehot(y_i) (empirical)."""
    with torch.no_grad():
        log_p = torch.log_softmax(functional_call(model, (params, buffers), (xb,)), dim=-1)
    if kind == "true":   # Σ_k (√p_k ∇log p_k)² = Σ_k p_k (∇log p_k)²
        cot = torch.diag_embed(log_p.exp().sqrt())                              # (B, K, K)
    else:
        cot = F.one_hot(yb, log_p.shape[-1]).to(log_p.dtype).unsqueeze(1)      # (B, 1, K)
    grads = func_per_sample_grads(model, params, names, buffers, xb, cot,
                                  output=lambda logits: torch.log_softmax(logits, dim=-1))
    return {k: _sq_sum0(t.reshape(-1, *t.shape[2:])) for k, t in grads.items()}


def _layerwise_plan(model: nn.Module, params: dict[str, Tensor], x1: Tensor
                    ) -> dict[str, tuple[nn.Module, str, LayerKernel]]:
    """Which trainable parameters the registered kernels cover: {param name: (module, "weight" | "bias",
    kernel)}.

    Covered: the parameters of a module that :func:`~scrubnet.curvature.kernels.kernel_for` supports, when
    the module is called exactly once per forward (checked on one sample ``x1``) and the parameter is not
    tied to another module. Everything else goes to the generic torch.func fallback. Assumes, as every
    ``nn.Module`` in the zoo does, that a module's parameters are only used by its own forward."""
    kernels = {mod: kernel_for(mod) for mod in model.modules()}
    calls: dict[nn.Module, int] = {}
    handles = []
    for mod, kernel in kernels.items():
        if kernel is not None:
            handles.append(mod.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1)))
    try:
        with torch.no_grad():
            model(x1)
    finally:
        for h in handles:
            h.remove()
    # a parameter object registered under two names (tied weights) is used by two modules: fallback
    owners: dict[int, int] = {}
    for _, t in model.named_parameters(remove_duplicate=False):
        owners[id(t)] = owners.get(id(t), 0) + 1
    plan = {}
    for prefix, mod in model.named_modules():
        if calls.get(mod, 0) != 1:
            continue
        for pname in ("weight", "bias"):
            full = f"{prefix}.{pname}" if prefix else pname
            tensor = getattr(mod, pname, None)
            if full in params and tensor is not None and owners.get(id(tensor), 0) == 1:
                plan[full] = (mod, pname, kernels[mod])
    return plan


def _sq_sum0(t: Tensor) -> Tensor:
    """Σ over dim 0 of t² (flattened so the reduction runs over one contiguous outer dimension)."""
    flat = t.reshape(t.shape[0], -1)
    return (flat * flat).sum(0).reshape(t.shape[1:])


def _layerwise_batch_sums(model: nn.Module, plan: dict[str, tuple[nn.Module, str, LayerKernel]], xb: Tensor,
                          yb: Tensor | None, kind: str) -> dict[str, Tensor]:
    """Squared per-sample gradient sums for the parameters in ``plan``: one batched forward, then one
    backward per class k of Σ_i √p_k(x_i)·log p_k(x_i) to the layer outputs (samples do not interact in eval
    mode, so the output gradient of sample i is that sample's own), and per-layer per-sample gradients from
    (input, output gradient) by the layer's closed form (outer product, unfold + bmm, x̂·g)."""
    modules = list({id(m): m for m, _, _ in plan.values()}.values())
    kernels = {m: k for m, _, k in plan.values()}
    inputs: dict[nn.Module, Tensor] = {}
    outputs: dict[nn.Module, Tensor] = {}

    def hook(m, i, o):
        inputs[m] = i[0].detach()
        outputs[m] = o

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        log_p = torch.log_softmax(model(xb), dim=-1)
    finally:
        for h in handles:
            h.remove()
    outs = [outputs[m] for m in modules]
    b, k = log_p.shape
    if kind == "true":  # cotangent k: √p_k(x_i) on column k of log p — all K backward passes in one batched call
        w = log_p.detach().exp().sqrt()                                        # (B, K)
        cot = w.T.unsqueeze(-1) * torch.eye(k, dtype=w.dtype, device=w.device).unsqueeze(1)  # [k,i,j]=w_ik δ_kj
    else:
        cot = torch.zeros(1, b, k, dtype=log_p.dtype, device=log_p.device)
        cot[0, torch.arange(b), yb] = 1.0
    grads = torch.autograd.grad(log_p, outs, grad_outputs=cot, is_grads_batched=True, allow_unused=True)
    acc: dict[str, Tensor] = {}
    for idx, m in enumerate(modules):
        g = grads[idx].detach() if grads[idx] is not None else \
            torch.zeros((cot.shape[0], *outs[idx].shape), dtype=outs[idx].dtype, device=outs[idx].device)
        sq = kernels[m].squared_sums(m, inputs[m], g)                          # g: (K, B, ...)
        for name, (mm, pname, _) in plan.items():
            if mm is m:
                acc[name] = sq[pname]
    return acc


def fisher_diag(model: nn.Module, x: Tensor, y: Tensor | None = None, *, kind: str = "true",
                batch_size: int | None = None, method: str = "auto",
                budget_bytes: int = _DEFAULT_BUDGET_BYTES) -> dict[str, Tensor]:
    """Diagonal Fisher ``{name: F}`` (F shaped like the parameter) of ``model`` on inputs ``x`` (N, ...).

    kind="true":      F_j = mean_i Σ_k p(k|x_i) (∂_j log p(k|x_i))²  (``y`` ignored).
    kind="empirical": F_j = mean_i (∂_j log p(y_i|x_i))²              (``y`` (N,) int64 required).

    method="vmap":      per-sample gradients by ``torch.func`` (vmap over samples of a VJP vmapped over the K
                        √p_k-weighted class cotangents); works for any module.
    method="layerwise": one batched forward and K backward passes to the layer outputs, per-sample gradients
                        of Linear / Conv1d / Conv2d / BatchNorm parameters in closed form; parameters of
                        other modules still go through vmap.
    method="auto":      "layerwise" (it falls back to vmap per parameter by itself).
    All are exact (same number as :func:`fisher_diag_loop` up to rounding).

    Only parameters with ``requires_grad`` are included. Evaluated in eval mode (the model's modes are
    restored). ``batch_size`` samples are processed at once (default: as many as keep the B·K·p per-sample
    gradient tensor under ``budget_bytes``). Returns tensors in the parameters' dtype.
    """
    _check_inputs(model, x, y, kind)
    if method not in FISHER_METHODS:
        raise ValueError(f"unknown Fisher method {method!r}; choose one of {', '.join(FISHER_METHODS)}")
    params = trainable_params(model)
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    p_count = sum(t.numel() for t in params.values())
    itemsize = next(iter(params.values())).element_size()
    acc = {k: torch.zeros(v.shape, dtype=torch.float64, device=v.device) for k, v in params.items()}
    with eval_mode(model), torch.enable_grad():
        plan = _layerwise_plan(model, params, x[:1]) if method != "vmap" else {}
        rest = [k for k in params if k not in plan]
        if batch_size is None:
            with torch.no_grad():
                probe = model(x[:1])
            classes = probe.shape[-1] if kind == "true" else 1
            if rest:  # vmap holds B·K·p per-sample gradients at once
                batch_size = auto_batch_size(p_count, classes, itemsize, budget_bytes)
            else:     # layerwise materialises B·K per-sample gradients of convolutions only
                p_conv = sum(params[n].numel() for n, (_, _, k) in plan.items() if k.kind == "conv")
                batch_size = max(1, min(256, budget_bytes // max(1, (classes * p_conv + p_count) * itemsize)))
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        n = len(x)
        for i in range(0, n, batch_size):
            xb = x[i:i + batch_size]
            yb = y[i:i + batch_size] if y is not None else None
            parts = []
            if plan:
                parts.append(_layerwise_batch_sums(model, plan, xb, yb, kind))
            if rest:
                parts.append(_vmap_batch_sums(model, params, rest, buffers, xb, yb, kind))
            for part in parts:
                for k, t in part.items():
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
    with eval_mode(model), torch.enable_grad():
        for i in range(len(x)):
            log_p = torch.log_softmax(model(x[i:i + 1]), dim=-1)[0]
            if kind == "true":
                probs = log_p.detach().exp()
                classes = range(log_p.shape[0])
            else:
                probs = torch.ones(1, dtype=log_p.dtype, device=log_p.device)
                classes = [int(y[i])]
            classes = list(classes)
            for j, k in enumerate(classes):
                grads = torch.autograd.grad(log_p[k], tensors, retain_graph=j < len(classes) - 1)
                w = float(probs[k]) if kind == "true" else 1.0
                for (name, _), g in zip(named, grads):
                    acc[name] += w * g.detach().to(torch.float64) ** 2
    return {k: (acc[k] / len(x)).to(p.dtype) for k, p in named}
