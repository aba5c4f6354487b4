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
  Σ_i √p_k(x_i) log p_k(x_i) to the layer *outputs* only (all K in one batched backward on Linear/BatchNorm
  nets and on nets small enough for the budget to hold K output gradients of ≥ 64 samples, one plain
  backward per column otherwise: :func:`batched_columns`), and the squared per-sample gradients of the
  layers covered by the kernel registry (:mod:`scrubnet.curvature.kernels`: Linear, Conv1d/Conv2d, eval-mode
  BatchNorm) from (layer input, output gradient) in closed form ((g²)ᵀa² for Linear, unfold + bmm for
  convolutions, x̂·g for BatchNorm); parameters of any other module (or of a module called twice) go
  through the vmap path. ``benchmarks/fisher_diag.py`` measures it against vmap and the batch-size-1 loop
  (figures in the README's benchmark table).

:func:`fisher_diag_loop` is the slow, obviously-correct twin: batch size 1 and one ``autograd.grad`` per class
per sample, as in the authors' code. Tests and ``benchmarks/fisher_diag.py`` compare the two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import probe_paths
from scrubnet.curvature.kernels import LayerKernel, func_per_sample_grads, kernel_for
from scrubnet.curvature.progress import ProgressFn, current_progress
from scrubnet.curvature.params import trainable_params
from scrubnet.models import eval_mode
from scrubnet.models.call import Inputs, ModelInputs, call_functional, call_model
from scrubnet.models.flops import NONGEMM_FLOP_EQUIV, counting_work

FISHER_KINDS = ("true", "mc", "empirical")

# default working-memory budget of one Fisher computation (activations, output gradients, per-layer temporaries)
DEFAULT_BUDGET_BYTES = 1 << 30
_DEFAULT_BUDGET_BYTES = 32 * 2**20   # the vmap path's per-batch B·K·p tensor (auto_batch_size)




def _check_inputs(model: nn.Module, x: Inputs, y: Tensor | None, kind: str) -> None:
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {', '.join(FISHER_KINDS)}")
    if not isinstance(x, (Tensor, ModelInputs)) or len(x.shape) < 1:
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
                     xb: Inputs, yb: Tensor | None, kind: str, per_sample: str = "vmap") -> dict[str, Tensor]:
    """Σ_i Σ_k p_k (∂ log p_k(x_i))² (true) or Σ_i (∂ log p_{y_i}(x_i))² (empirical) over the batch, for the
    parameters ``names`` (the others held fixed), by the generic ``torch.func`` fallback of
    :mod:`scrubnet.curvature.kernels` with cotangents diag(√p(x_i)) (true) or onehot(y_i) (empirical)."""
    with torch.no_grad():
        log_p = torch.log_softmax(call_functional(model, (params, buffers), xb), dim=-1)
    if kind == "true":   # Σ_k (√p_k ∇log p_k)² = Σ_k p_k (∇log p_k)²
        cot = torch.diag_embed(log_p.exp().sqrt())                              # (B, K, K)
    else:
        cot = F.one_hot(yb, log_p.shape[-1]).to(log_p.dtype).unsqueeze(1)      # (B, 1, K)
    grads = func_per_sample_grads(model, params, names, buffers, xb, cot,
                                  output=lambda logits: torch.log_softmax(logits, dim=-1), per_sample=per_sample)
    return {k: _sq_sum0(t.reshape(-1, *t.shape[2:])) for k, t in grads.items()}


def _layerwise_plan(model: nn.Module, params: dict[str, Tensor], x1: Inputs, unhooked: tuple[str, ...] = ()
                    ) -> dict[str, tuple[nn.Module, str, LayerKernel]]:
    """Which trainable parameters the registered kernels cover: {param name: (module, "weight" | "bias",
    kernel)}.

    Covered: the parameters of a module that :func:`~scrubnet.curvature.kernels.kernel_for` supports, when
    the module is called exactly once per forward (checked on one sample ``x1``) and the parameter is not
    tied to another module nor ``unhooked`` (the probe of :mod:`scrubnet.curvature.fallbacks` found its
    kernel gradient unequal to autograd's: used functionally or outside its module). Everything else goes
    to the generic per-sample path."""
    kernels = {mod: kernel_for(mod) for mod in model.modules()}
    calls: dict[nn.Module, int] = {}
    handles = []
    for mod, kernel in kernels.items():
        if kernel is not None:
            handles.append(mod.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1)))
    try:
        with torch.enable_grad():   # as in the real pass (no-grad fast paths bypass the hooks)
            call_model(model, x1)
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
            if full in params and tensor is not None and owners.get(id(tensor), 0) == 1 and full not in unhooked:
                plan[full] = (mod, pname, kernels[mod])
    return plan


def _sq_sum0(t: Tensor) -> Tensor:
    """Σ over dim 0 of t² (flattened so the reduction runs over one contiguous outer dimension)."""
    flat = t.reshape(t.shape[0], -1)
    return (flat * flat).sum(0).reshape(t.shape[1:])


def _layerwise_batch_sums(model: nn.Module, plan: dict[str, tuple[nn.Module, str, LayerKernel]], xb: Tensor,
                          yb: Tensor | None, kind: str, class_chunk: int, layer_budget_bytes: int
                          ) -> dict[str, Tensor]:
    """Squared per-sample gradient sums for the parameters in ``plan``: one batched forward, then backward
    passes of the columns of the output-Hessian square root to the layer outputs (samples do not interact
    in eval mode, so the output gradient of sample i is that sample's own), ``class_chunk`` columns per
    batched backward, and per-layer squared per-sample gradients from (input, output gradient) by the
    layer's closed form ((g²)ᵀa², unfold + bmm, x̂·g), chunked over samples so that no layer's temporary
    exceeds ``layer_budget_bytes``. Never more than one chunk of columns of one layer's per-sample
    gradients exists at a time.

    Columns: true   — √p_k(x_i)·e_k on log p(x_i), k = 1..K (backprop through log-softmax gives
                      √p_k (e_k − p), the k-th column of (diag p − p pᵀ)^{1/2}; Σ_k of the squares is the
                      true Fisher);
             empirical — one column e_{y_i} (the Monte-Carlo Fisher passes its drawn labels ŷ_i here)."""
    modules = list({id(m): m for m, _, _ in plan.values()}.values())
    kernels = {m: k for m, _, k in plan.values()}
    inputs: dict[nn.Module, Tensor] = {}
    outputs: dict[nn.Module, Tensor] = {}

    def hook(m, i, o):
        inputs[m] = i[0].detach()
        outputs[m] = o

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        log_p = torch.log_softmax(call_model(model, xb), dim=-1)
    finally:
        for h in handles:
            h.remove()
    outs = [outputs[m] for m in modules]
    b, k = log_p.shape
    if kind == "true":  # cotangent k: √p_k(x_i) on column k of log p
        w = log_p.detach().exp().sqrt()                                        # (B, K)
        eye = torch.eye(k, dtype=w.dtype, device=w.device)
        chunks = [w.T[s:s + class_chunk].unsqueeze(-1) * eye[s:s + class_chunk].unsqueeze(1)  # [k,i,j]=w_ik δ_kj
                  for s in range(0, k, class_chunk)]
    else:
        cot = torch.zeros(1, b, k, dtype=log_p.dtype, device=log_p.device)
        cot[0, torch.arange(b, device=log_p.device), yb.to(log_p.device)] = 1.0
        chunks = [cot]
    acc: dict[str, Tensor] = {}

    def add(name_sq: dict[str, Tensor], m: nn.Module) -> None:
        for name, (mm, pname, _) in plan.items():
            if mm is m:
                acc[name] = name_sq[pname] if name not in acc else acc[name] + name_sq[pname]

    columns = sum(c.shape[0] for c in chunks)
    # factored layers with few positions: accumulate the per-sample position Gram over the columns, then one
    # GEMM ((T+1)/2 < K: cheaper than K per-sample gradients per sample; "Fisher at scale" in decisions.md)
    ghost = {m for m in modules if kernels[m].factored and inputs[m].ndim > 2
             and (_positions(kernels[m], m, inputs[m], outs[modules.index(m)]) + 1) / 2 < columns}
    pos_gram: dict[nn.Module, Tensor] = {}
    for c_idx, cot in enumerate(chunks):
        last = c_idx == len(chunks) - 1
        if cot.shape[0] == 1:   # one column: a plain backward (faster than a batched one on CPU)
            grads = [None if g is None else g.unsqueeze(0) for g in
                     torch.autograd.grad(log_p, outs, grad_outputs=cot[0], allow_unused=True, retain_graph=not last)]
        else:
            grads = torch.autograd.grad(log_p, outs, grad_outputs=cot, is_grads_batched=True, allow_unused=True,
                                        retain_graph=not last)
        for idx, m in enumerate(modules):
            if grads[idx] is None:
                continue
            g = grads[idx].detach()                                            # (K', B, ...)
            if m in ghost:
                mg = kernels[m].position_gram(m, g)
                pos_gram[m] = mg if m not in pos_gram else pos_gram[m] + mg
            else:
                add(kernels[m].squared_sums(m, inputs[m], g, max_bytes=layer_budget_bytes), m)
        del grads
    for m, mg in pos_gram.items():
        add(kernels[m].squared_sums_from_position_gram(m, inputs[m], mg, max_bytes=layer_budget_bytes), m)
    for name, (m, pname, _) in plan.items():   # no gradient reached the layer: zero
        if name not in acc:
            acc[name] = torch.zeros_like(getattr(m, pname), dtype=log_p.dtype)
    return acc


def _positions(kernel: LayerKernel, module: nn.Module, a: Tensor, out: Tensor) -> int:
    """T, the output positions per sample of a factored layer."""
    return kernel.shape(module, tuple(a.shape[1:]), tuple(out.shape[1:]))[2]


@dataclass
class FisherPlan:
    """How :func:`fisher_diag` will run, and what it costs (the cost model's Fisher entry).

    batch:        samples per forward; class_chunk: output-Hessian columns per batched backward;
    passes:       backward passes per sample (K for the true Fisher, 1 for "mc" and "empirical");
    flops:        total FLOPs (FLOP = 2 multiply-adds) over n samples: forward + backward-to-layer-outputs
                  per column (≈ the forward's FLOPs each) + per-layer squared per-sample gradients;
    peak_bytes:   working memory above the model and the data (autograd activations of one batch, the
                  captured output gradients of one column chunk, one layer's per-sample temporaries, the
                  float64 accumulators);
    layer_budget: bytes allowed to one layer's per-sample temporaries;
    activation_elements: n·(columns + 1)·Σ leaf activations per sample: the memory-bound elementwise work
                  (BatchNorm, ReLU, additions forward and backward) that FLOPs do not count;
    fallback:     parameters that go through the torch.func fallback (memory ≈ B·K·p of them)."""

    batch: int
    class_chunk: int
    passes: int
    flops: float
    peak_bytes: int
    layer_budget: int
    fallback: list[str] = field(default_factory=list)
    activation_elements: float = 0.0   # Σ over backward passes of the activations they touch (elementwise work)


def _layer_stats(model: nn.Module, plan: dict, x1: Tensor, cols: int
                 ) -> tuple[int, int, int, int, int, float, float, int]:
    """One-sample probe: (Σ leaf outputs, Σ captured outputs, largest leaf output, largest per-sample layer
    temporary per column of a backward (per-sample gradients: grows with the columns per backward), largest
    per-sample position-Gram temporary (once per batch, whatever the columns per backward), forward FLOPs,
    squared-gradient FLOPs over all ``cols`` columns, position-Gram numbers)."""
    leaf_total, leaf_max = [0], [0]
    captured: dict[nn.Module, tuple[tuple, tuple]] = {}
    modules = {m for m, _, _ in plan.values()}

    def leaf_hook(mod, inp, out):
        if isinstance(out, Tensor):
            n = out[0].numel() if out.ndim else 1
            leaf_total[0] += n
            leaf_max[0] = max(leaf_max[0], n)
        if mod in modules:
            captured[mod] = (tuple(inp[0].shape[1:]), tuple(out.shape[1:]))

    handles = [m.register_forward_hook(leaf_hook) for m in model.modules()
               if not list(m.children()) or m in modules]
    try:
        # counted as the cost model counts (the transformer fast path off, non-GEMM elements at equivalents)
        with torch.no_grad(), counting_work() as counted:
            call_model(model, x1[:1])
    finally:
        for h in handles:
            h.remove()
    gemm, elements = counted()
    fwd = gemm + NONGEMM_FLOP_EQUIV * elements
    cap_total, per_layer, per_gram, sq_flops, ghost_numel = 0, 0, 0, 0.0, 0
    for mod, (ins, outs) in captured.items():
        out_numel = int(math.prod(outs))
        cap_total += out_numel
        kern = kernel_for(mod)
        numel = sum(t.numel() for t in (getattr(mod, "weight", None), getattr(mod, "bias", None)) if t is not None)
        if kern.factored:
            d_in, d_out, t = kern.shape(mod, ins, outs)
            if len(ins) > 1 and (t + 1) / 2 < cols:   # position Gram (as _layerwise_batch_sums decides)
                pairs = t * (t + 1) / 2
                ghost_numel += d_out * t * t
                per_gram = max(per_gram, int(pairs * (d_in + d_out) * 2))
                sq_flops += cols * 2.0 * t * t * d_out + 2.0 * pairs * (d_in * d_out + d_in)
            elif kern.kind == "linear" and len(ins) == 1:   # (Σ_k g²)ᵀ a²: no per-sample gradients
                per_layer = max(per_layer, 2 * d_in + 2 * d_out)
                sq_flops += 2.0 * d_in * d_out + 2.0 * cols * d_out
            else:                                          # per-sample gradients per column, squared
                per_layer = max(per_layer, t * d_in + numel + t * d_out)
                sq_flops += cols * (2.0 * t * d_in * d_out + 2.0 * numel)
        else:
            per_layer = max(per_layer, 2 * int(math.prod(ins)) + 2 * numel)
            sq_flops += cols * 4.0 * out_numel
    return leaf_total[0], cap_total, leaf_max[0], per_layer, per_gram, fwd, sq_flops, ghost_numel


# the batched-columns path needs the budget to hold the output gradients of every column for this many samples
# (or all of them): below it the batch is too small to amortise the K-fold larger working set
BATCHED_MIN_BATCH = 64


def batched_columns(max_batch: int, n: int, batch_size: int | None = None) -> bool:
    """The rule of :func:`plan_fisher` for nets with convolutions: back-propagate all K columns in one batched
    backward when the budget fits ``max_batch`` samples with every column's output gradients alive and that is
    at least min(BATCHED_MIN_BATCH, n) (and a given ``batch_size`` fits too); else one column per backward."""
    if max_batch < min(BATCHED_MIN_BATCH, n):
        return False
    return batch_size is None or batch_size <= max_batch


def plan_fisher(model: nn.Module, x1: Inputs, n: int, *, kind: str = "true", method: str = "auto",
                budget_bytes: int = DEFAULT_BUDGET_BYTES, batch_size: int | None = None) -> FisherPlan:
    """The batch size, class chunk, FLOPs and working memory of :func:`fisher_diag` on ``n`` samples shaped
    like ``x1`` (one sample is run through the model as a probe). The working set
    B·(3·Σ activations + K'·Σ captured output gradients + 2·largest activation·K') + one layer's temporaries
    (≤ budget/4) + float64 accumulators (8·p) is kept within ``budget_bytes`` by choosing K' (K when
    :func:`batched_columns` says so for the batch that K would leave, else 1), then B."""
    params = trainable_params(model)
    p_count = sum(t.numel() for t in params.values())
    isz = next(iter(params.values())).element_size()
    paths = probe_paths(model, x1)
    with eval_mode(model), paths.context():
        plan = _layerwise_plan(model, params, x1[:1], paths.unhooked) if method != "vmap" else {}
        rest = [k for k in params if k not in plan]
        with torch.no_grad():
            classes = int(call_model(model, x1[:1]).shape[-1])
        cols = classes if kind == "true" else 1
        leaf_total, cap_total, leaf_max, per_layer, per_gram, fwd, sq, ghost_numel = _layer_stats(
            model, plan, x1[:1], cols)
    p_rest = sum(params[k].numel() for k in rest)
    acc_bytes = 8 * p_count
    layer_budget = max(1, budget_bytes // 4)
    work = max(1, budget_bytes - layer_budget - acc_bytes)

    def per_sample(kc: int) -> int:
        return isz * (3 * leaf_total + kc * (cap_total + 2 * leaf_max) + ghost_numel + cols * p_rest)

    # Linear/BN-only nets keep the earlier releases' single batched backward over all columns and their batch
    # (B·p ≤ 8 Mi terms per float32 partial sum) within the budget: the default experiment's Fisher stays
    # bit-identical. Other nets: all columns in one batched backward when the budget holds the output
    # gradients of every column for a large enough batch (≥ BATCHED_MIN_BATCH samples, or all n): small nets,
    # where one plain backward per column is dominated by per-call overhead and small GEMMs; otherwise one
    # column per plain backward (on a large net faster on CPU than a batched one, and the output gradients of
    # one column only are alive). "Fisher at scale" in docs/decisions/index.md.
    linear_only = not rest and all(k.kind in ("linear", "bn") for _, _, k in plan.values())
    kc = cols if linear_only or batched_columns(work // per_sample(cols), n, batch_size) else 1
    if batch_size is None:
        batch_size = work // per_sample(kc)
        if linear_only:
            batch_size = min(batch_size, max(1, min(256, (32 * 2**20) // max(1, p_count * isz))))
        batch_size = max(1, min(256, batch_size, n))
    batch_size = int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    per_layer_bytes = min(layer_budget, isz * batch_size * max(per_layer * kc, per_gram))
    peak = batch_size * per_sample(kc) + per_layer_bytes + acc_bytes
    # FLOPs per sample: forward, one backward to the layer inputs per column (≈ a forward each), squared
    # per-sample gradients per column; the fallback: a VJP (≈ 3 forwards) per column
    flops = n * (fwd * (2 if kind == "mc" else 1) + cols * fwd + sq + (3.0 * cols * fwd if rest else 0.0))
    return FisherPlan(batch=batch_size, class_chunk=kc, passes=cols, flops=flops, peak_bytes=int(peak),
                      layer_budget=layer_budget, fallback=rest,
                      activation_elements=float(n) * (cols + 1) * leaf_total)


def fisher_diag(model: nn.Module, x: Inputs, y: Tensor | None = None, *, kind: str = "true",
                batch_size: int | None = None, method: str = "auto",
                budget_bytes: int = DEFAULT_BUDGET_BYTES, seed: int = 0,
                progress: ProgressFn | None = None) -> dict[str, Tensor]:
    """Diagonal Fisher ``{name: F}`` (F shaped like the parameter) of ``model`` on inputs ``x`` (N, ...).

    kind="true":      F_j = mean_i Σ_k p(k|x_i) (∂_j log p(k|x_i))²  (``y`` ignored).
    kind="mc":        F_j = mean_i (∂_j log p(ŷ_i|x_i))², ŷ_i ~ p(·|x_i) drawn with ``seed``: an unbiased
                      Monte-Carlo estimate of the true Fisher with one backward pass instead of K (variance
                      per sample Σ_k p_k g_k⁴ − (Σ_k p_k g_k²)², g_k = ∂_j log p(k|x_i); see the module
                      docstring).
    kind="empirical": F_j = mean_i (∂_j log p(y_i|x_i))²              (``y`` (N,) int64 required).

    method="vmap":      per-sample gradients by ``torch.func`` (vmap over samples of a VJP vmapped over the K
                        √p_k-weighted class cotangents); works for any module.
    method="layerwise": one batched forward and backward passes of the output-Hessian square-root columns
                        to the layer outputs, squared per-sample gradients of Linear / Conv1d / Conv2d /
                        BatchNorm parameters in closed form, layer by layer; parameters of other modules
                        still go through vmap.
    method="auto":      "layerwise" (it falls back to vmap per parameter by itself).
    All are exact (same number as :func:`fisher_diag_loop` up to rounding; "mc" is exact for its draws).

    Only parameters with ``requires_grad`` are included. Evaluated in eval mode (the model's modes are
    restored). Memory: the batch size and the columns per backward are chosen by :func:`plan_fisher` so the
    working set stays within ``budget_bytes`` (``batch_size`` overrides the batch). ``progress(what, done, total)``
    is called after every batch. Returns tensors in the parameters' dtype.
    """
    _check_inputs(model, x, y, kind)
    if method not in FISHER_METHODS:
        raise ValueError(f"unknown Fisher method {method!r}; choose one of {', '.join(FISHER_METHODS)}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    params = trainable_params(model)
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    acc = {k: torch.zeros(v.shape, dtype=torch.float64, device=v.device) for k, v in params.items()}
    n = len(x)
    fplan = plan_fisher(model, x[:1], n, kind=kind, method=method, budget_bytes=budget_bytes,
                        batch_size=batch_size)
    batch_size = fplan.batch
    generator = torch.Generator(device=x.device).manual_seed(int(seed)) if kind == "mc" else None
    report = progress or current_progress()
    paths = probe_paths(model, x)
    with eval_mode(model), torch.enable_grad(), paths.context():
        plan = _layerwise_plan(model, params, x[:1], paths.unhooked) if method != "vmap" else {}
        rest = [k for k in params if k not in plan]
        for i in range(0, n, batch_size):
            xb = x[i:i + batch_size]
            yb = y[i:i + batch_size] if y is not None else None
            parts = []
            if kind == "mc":  # the draw is shared by both paths: one label per sample
                with torch.no_grad():
                    probs = torch.softmax(call_model(model, xb), dim=-1).to(torch.float64)
                yb = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            sum_kind = "empirical" if kind == "mc" else kind
            if plan:
                parts.append(_layerwise_batch_sums(model, plan, xb, yb, sum_kind, fplan.class_chunk,
                                                   fplan.layer_budget))
            if rest:
                parts.append(_vmap_batch_sums(model, params, rest, buffers, xb, yb, sum_kind, paths.per_sample))
            for part in parts:
                for k, t in part.items():
                    acc[k] += t.detach().to(torch.float64)
            if report is not None:
                report("Fisher diagonal", min(n, i + batch_size), n)
    return {k: (acc[k] / n).to(params[k].dtype) for k in params}


def fisher_diag_loop(model: nn.Module, x: Inputs, y: Tensor | None = None, *, kind: str = "true"
                     ) -> dict[str, Tensor]:
    """Slow reference for :func:`fisher_diag`: batch size 1, one backward pass per class per sample.

    Same definition and return format as :func:`fisher_diag` (the authors' protocol; used by tests and the
    benchmark only).
    """
    _check_inputs(model, x, y, kind)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    acc = {k: torch.zeros(p.shape, dtype=torch.float64, device=p.device) for k, p in named}
    tensors = [p for _, p in named]
    with eval_mode(model), torch.enable_grad(), probe_paths(model, x).context():
        for i in range(len(x)):
            log_p = torch.log_softmax(call_model(model, x[i:i + 1]), dim=-1)[0]
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
