"""The empirical NTK of a network's logits, without ever holding its Jacobian.

Notation: ``x`` holds N samples, the model has c outputs (logits) and p trainable parameters.
J ∈ R^{Nc×p} stacks the per-(sample, class) Jacobian rows J[(i,k), :] = ∂f_k(x_i)/∂w, **sample-major**
(row ``i*c + k``). The Gram (empirical NTK) is Θ = J Jᵀ ∈ R^{Nc×Nc}. Everything is evaluated with the
model in **eval mode** (BatchNorm uses its running statistics, so samples do not interact and per-sample
rows are well defined); the model's mode is restored afterwards.

What is here
* :class:`JacobianRows` — the engine: one forward pass with hooks on every ``Linear``/``Conv1d``/``Conv2d``/
  ``BatchNorm`` layer plus c batched backward passes give, per layer, its inputs ``a`` and the
  output-gradients ``g`` of every row; per-row weight gradients are then ``Σ_s g_s a_sᵀ`` (a batched GEMM).
  Parameters of any other module fall back to ``torch.func.vmap(jacrev)`` on just those parameters.
* :func:`ntk_gram` — Θ (or the cross-Gram J(x) J(x')ᵀ) block by block under a memory budget, choosing per
  layer the cheaper of two exact contractions (compute.md §2 "layerwise outer products"):
    explicit: Θ_l = G_l G_lᵀ with per-row gradients G_l (rows × numel);
    ghost:    Θ_l[(n,k),(m,k')] = Σ_{s,t} (g_{nks}·g_{mk't}) (ã_{ns}·ã_{mt}),   ã = [a, 1] (bias folded in),
  ghost wins for layers with few positions T (every Linear: T = 1; late conv layers).
* :func:`ntk_diag_blocks` — the N per-sample c×c blocks J_x diag(v) J_xᵀ (activation covariances).
* :func:`jacobian_vjp` (Jᵀa: one backward of Σ_i a_i·f(x_i)), :func:`jacobian_jvp` (J v, ``torch.func.jvp``),
  :func:`ntk_matvec` (Θu = J(Jᵀu)) and :func:`solve_ntk` (ridge solve by Cholesky with jitter, or by
  conjugate gradient on Θ-vector products when the Gram is too large to hold).
* :func:`dense_jacobian` — the obviously-correct twin for tests (``torch.func.jacrev`` of the whole batch).

Why this algorithm (compute.md §2, §12): on CPU a layerwise per-row-gradient / outer-product kernel beat
``vmap(jacrev)`` 5.6–25×; here the c backward passes go to the layer *outputs* only (no weight gradients), and
per-row weight gradients are a batched GEMM of (output-gradient, unfolded input). Measured with
``benchmarks/ntk_scale.py`` (CIFAR ResNet-18, 32×32, c = 5, one thread on the shared 2-core box, so
absolute times vary ×2 with the load of other jobs):

* width 0.4 (p = 1.79 M), N = 500, budget 1.46 GiB: scrub 731 s (Gram 722 s), one pass of every Jacobian
  row 60 s (ratio 12.2), peak RSS 1.39 GiB; the dense Jacobian would be 16.7 GiB. (An earlier run with a
  0.98 GiB budget and a looser memory split: scrub 477 s, pass 66 s, ratio 7.3, peak 2.03 GiB.)
* width 1.0 (p = 11.2 M), N = 500, budget 4.88 GiB: scrub 1854 s (Gram 1819 s), Jacobian pass 129 s
  (ratio 14.4), peak RSS 3.15 GiB; the dense Jacobian would be 104 GiB. At N = 100: scrub 80 s, pass 29 s
  (ratio 2.8), peak RSS 3.08 GiB.

Where the time goes (profile, width 0.4, N = 150, 0.45 GiB budget, 93 s): the c backward passes 28 s
(the rows of later chunks are recomputed once per held chunk of rows, and small micro-batches run
below full CPU efficiency), the explicit contraction G_I G_Jᵀ 27 s (R²·p_explicit multiply-adds),
per-row gradient GEMMs 13 s, ghost blocks 6 s, convolutions and unfolding 9 s. A larger budget (fewer
held chunks) or a GPU shrinks the first; the second is the price of an exact Gram.

Memory: ``memory_budget_bytes`` bounds the large buffers (the held block of rows, the captured layer
inputs/output-gradients of one micro-batch, the contraction temporaries); chunk sizes are derived from
it with a one-sample probe of the layer shapes. The budget is a target for these buffers, not a hard cap
on the process (autograd's own activations for one micro-batch come on top).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap

from scrubnet.curvature.params import trainable_params, unflatten
from scrubnet.curvature.solvers import SolveInfo, cholesky_solve_jitter, conjugate_gradient
from scrubnet.models import eval_mode

DEFAULT_BUDGET = 1 << 30  # 1 GiB


# --------------------------------------------------------------------------------------------------
# model plumbing
# --------------------------------------------------------------------------------------------------



def _num_outputs(model: nn.Module, x: Tensor) -> int:
    with torch.no_grad(), eval_mode(model):
        out = model(x[:1])
    if out.ndim != 2:
        raise ValueError(f"expected logits of shape (batch, c), got {tuple(out.shape)}")
    return int(out.shape[1])


@dataclass
class _Layer:
    """One supported module: where its parameters sit in the flat vector, and its contraction shape."""

    name: str
    module: nn.Module
    kind: str                                 # "linear" | "conv" | "bn"
    weight: tuple[int, int] | None = None     # [start, stop) in the flat parameter vector
    bias: tuple[int, int] | None = None
    d_in: int = 0                             # input features per position (× kernel size for conv)
    d_out: int = 0
    positions: int = 1                        # T: output positions per sample (probe)
    calls: int = 1                            # times the module runs per forward (weight sharing)

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in (s for s in (self.weight, self.bias) if s is not None))


def _supported(m: nn.Module) -> str | None:
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
            return None
        return "conv"
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if not m.track_running_stats or m.running_mean is None:
            return None
        return "bn"
    return None


class JacobianRows:
    """Per-(sample, class) Jacobian rows of a model's logits, layer by layer, in eval mode.

    ``capture(x)`` runs one forward pass and c backward passes and keeps, for every supported layer,
    its input ``a`` (B, ...) and the output-gradients ``g`` (c, B, ...) of all B·c rows; from a capture,
    ``rows(cap, layer)`` gives the per-row gradients of that layer's parameters and ``ghost(cap, layer)``
    the factors (ã, g) of the ghost contraction. Parameters outside supported layers come from
    ``generic_rows`` (vmap(jacrev) over just those parameters).
    """

    def __init__(self, model: nn.Module, x_probe: Tensor):
        self.model = model
        self.params = trainable_params(model)
        self.names = list(self.params)
        offsets, o = {}, 0
        for k, v in self.params.items():
            offsets[k] = (o, o + v.numel())
            o += v.numel()
        self.offsets = offsets
        self.p = o
        self.num_classes = _num_outputs(model, x_probe)
        covered: set[str] = set()
        self.layers: list[_Layer] = []
        for mname, m in model.named_modules():
            kind = _supported(m)
            own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
            if kind is None or not own:
                continue
            full = {pn: (f"{mname}.{pn}" if mname else pn) for pn, _ in own}
            if set(full) - {"weight", "bias"} or any(v not in offsets for v in full.values()):
                continue
            lay = _Layer(mname, m, kind, weight=offsets.get(full.get("weight", "")),
                         bias=offsets.get(full.get("bias", "")))
            self.layers.append(lay)
            covered.update(full.values())
        self.generic_names = [k for k in self.names if k not in covered]
        self._probe(x_probe[:1])

    # ---- shapes ------------------------------------------------------------------------------
    def _probe(self, x1: Tensor) -> None:
        self.all_outputs_per_sample = activation_numel_per_sample(self.model, x1)
        cap = self.capture(x1, need_grads=False)
        self.act_numel_per_sample = 0
        for lay in self.layers:
            ins, outs = cap.inputs[lay.name], cap.outputs_shape[lay.name]
            lay.calls = len(ins)
            a, out_shape = ins[0], outs[0]
            if lay.kind == "linear":
                lay.d_in, lay.d_out = lay.module.in_features, lay.module.out_features
                lay.positions = int(a[0].numel() // lay.d_in)
            elif lay.kind == "conv":
                m = lay.module
                lay.d_in = m.in_channels * int(math.prod(m.kernel_size))
                lay.d_out = m.out_channels
                lay.positions = int(math.prod(out_shape[2:]))
            else:
                lay.d_in = lay.d_out = lay.module.num_features
                lay.positions = int(math.prod(out_shape[2:])) if len(out_shape) > 2 else 1
            self.act_numel_per_sample += lay.calls * (a[0].numel() + int(math.prod(out_shape[1:])))

    def bytes_per_sample(self, itemsize: int) -> int:
        """Rough working memory of one sample in a capture: inputs, c output-gradients, unfolded input."""
        c = self.num_classes
        unf = max([lay.positions * lay.d_in for lay in self.layers] or [0])
        per_row_grad = max([lay.numel for lay in self.layers] or [0])
        graph = 2 * self.all_outputs_per_sample + self.act_numel_per_sample  # saved tensors + hook clones
        return itemsize * (graph + c * self.act_numel_per_sample + 2 * unf + 2 * c * per_row_grad
                           + c * sum(self.params[k].numel() for k in self.generic_names))

    # ---- capture -----------------------------------------------------------------------------
    @dataclass
    class Capture:
        batch: int
        inputs: dict = field(default_factory=dict)          # name -> [input tensor per call]
        grads: dict = field(default_factory=dict)           # name -> [g (c, B, ...) per call]
        outputs_shape: dict = field(default_factory=dict)

    def capture(self, x: Tensor, need_grads: bool = True) -> "JacobianRows.Capture":
        cap = JacobianRows.Capture(batch=len(x))
        outs: list[Tensor] = []
        owners: list[str] = []
        handles = []

        def make_hook(name):
            def hook(mod, inp, out):
                cap.inputs.setdefault(name, []).append(inp[0].detach())
                cap.outputs_shape.setdefault(name, []).append(tuple(out.shape))
                if need_grads:
                    outs.append(out)
                    owners.append(name)
                    return out.clone()  # later in-place ops must not touch the tensor we differentiate at
                return None
            return hook

        for lay in self.layers:
            handles.append(lay.module.register_forward_hook(make_hook(lay.name)))
        try:
            with eval_mode(self.model), torch.enable_grad():
                if need_grads:
                    logits = self.model(x)
                else:
                    with torch.no_grad():
                        self.model(x)
                    return cap
        finally:
            for h in handles:
                h.remove()
        c = logits.shape[1]
        if not outs:
            return cap
        per_class = []
        for k in range(c):
            gk = torch.autograd.grad(logits[:, k].sum(), outs, retain_graph=k < c - 1, allow_unused=True)
            per_class.append([torch.zeros_like(o) if g is None else g.detach() for g, o in zip(gk, outs)])
        for j, name in enumerate(owners):
            cap.grads.setdefault(name, []).append(torch.stack([per_class[k][j] for k in range(c)]))
        return cap

    # ---- per-layer factors -------------------------------------------------------------------
    def _a_g(self, lay: _Layer, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(a (B, T, d_in), g (B, c, T, d_out)) for Linear/Conv; positions along T."""
        c, b = g.shape[0], g.shape[1]
        if lay.kind == "linear":
            a2 = a.reshape(b, -1, lay.d_in)
            g2 = g.reshape(c, b, -1, lay.d_out).permute(1, 0, 2, 3)
            return a2, g2
        m = lay.module
        if isinstance(m, nn.Conv1d):
            a4 = a.unsqueeze(2)
            ks, st, pd, dl = (1, m.kernel_size[0]), (1, m.stride[0]), (0, m.padding[0]), (1, m.dilation[0])
        else:
            a4, ks, st, pd, dl = a, m.kernel_size, m.stride, m.padding, m.dilation
        unf = F.unfold(a4, ks, dilation=dl, padding=pd, stride=st)              # (B, d_in, T)
        g2 = g.reshape(c, b, lay.d_out, -1).permute(1, 0, 3, 2)               # (B, c, T, d_out)
        return unf.transpose(1, 2), g2

    def rows(self, cap: "JacobianRows.Capture", lay: _Layer) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients of ``lay``'s parameters: [((start, stop), (B·c, numel))], rows sample-major."""
        out: dict[tuple[int, int], Tensor] = {}
        for a, g in zip(cap.inputs[lay.name], cap.grads[lay.name]):
            c, b = g.shape[0], g.shape[1]
            if lay.kind == "bn":
                m = lay.module
                shape = [1, -1] + [1] * (a.ndim - 2)
                xhat = (a - m.running_mean.view(shape)) / torch.sqrt(m.running_var.view(shape) + m.eps)
                gs = g.reshape(c, b, lay.d_out, -1)
                parts = {}
                if lay.weight is not None:
                    parts[lay.weight] = (gs * xhat.reshape(1, b, lay.d_out, -1)).sum(-1)
                if lay.bias is not None:
                    parts[lay.bias] = gs.sum(-1)
                parts = {k: v.permute(1, 0, 2).reshape(b * c, -1) for k, v in parts.items()}
            else:
                a2, g2 = self._a_g(lay, a, g)                                   # (B,T,din), (B,c,T,dout)
                parts = {}
                if lay.weight is not None:
                    gt = g2.permute(0, 1, 3, 2).reshape(b, c * lay.d_out, -1)  # (B, c·dout, T)
                    parts[lay.weight] = torch.bmm(gt, a2).reshape(b * c, -1)
                if lay.bias is not None:
                    parts[lay.bias] = g2.sum(2).reshape(b * c, -1)
            for k, v in parts.items():
                out[k] = out[k] + v if k in out else v
        return list(out.items())

    def ghost(self, cap: "JacobianRows.Capture", lay: _Layer) -> tuple[Tensor, Tensor]:
        """Ghost factors of a Linear/Conv layer with one call: ã (B, T, d_in[+1]) and g (B·c, T, d_out)."""
        a2, g2 = self._a_g(lay, cap.inputs[lay.name][0], cap.grads[lay.name][0])
        if lay.bias is not None:
            a2 = torch.cat([a2, torch.ones_like(a2[..., :1])], dim=-1)
        b, c = g2.shape[0], g2.shape[1]
        if lay.weight is None:  # bias only: ã = 1
            a2 = torch.ones_like(a2[..., :1])
        return a2, g2.reshape(b * c, g2.shape[2], g2.shape[3])

    def generic_rows(self, x: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients of the parameters outside supported layers (vmap(jacrev) on them only)."""
        if not self.generic_names:
            return []
        fixed = {k: v for k, v in self.params.items() if k not in self.generic_names}
        buffers = dict(self.model.named_buffers())
        free = {k: self.params[k] for k in self.generic_names}

        def f_single(pfree, xi):
            return functional_call(self.model, ({**fixed, **pfree}, buffers), (xi.unsqueeze(0),)).squeeze(0)

        with eval_mode(self.model):
            jac = vmap(jacrev(f_single), in_dims=(None, 0))(free, x)   # name -> (B, c, *shape)
        b, c = len(x), self.num_classes
        return [(self.offsets[k], jac[k].reshape(b * c, -1)) for k in self.generic_names]

    def all_rows(self, x: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
        """Every parameter's per-row gradients for the micro-batch ``x`` (list of (slice, (B·c, numel)))."""
        cap = self.capture(x)
        out = []
        for lay in self.layers:
            out += self.rows(cap, lay)
        return out + self.generic_rows(x)

    def ghost_is_cheaper(self, lay: _Layer, rows_i: int, rows_j: int) -> bool:
        """Compare FLOPs of the two exact contractions for a (rows_i × rows_j) block of this layer."""
        if lay.kind == "bn" or lay.calls != 1:
            return False
        c, t = self.num_classes, lay.positions
        n_i, n_j = max(rows_i // c, 1), max(rows_j // c, 1)
        explicit = rows_i * rows_j * lay.numel + (rows_i + rows_j) * t * lay.numel
        ghost = n_i * n_j * t * t * (lay.d_in + 1) + rows_i * rows_j * t * t * (lay.d_out + 1)
        return ghost < explicit


# --------------------------------------------------------------------------------------------------
# Gram
# --------------------------------------------------------------------------------------------------

def activation_numel_per_sample(model: nn.Module, x1: Tensor) -> int:
    """Σ of the output sizes of every leaf module for one sample (what autograd keeps for a backward)."""
    total = [0]

    def hook(mod, inp, out):
        if isinstance(out, Tensor):
            total[0] += out[0].numel() if out.ndim else 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad(), eval_mode(model):
            model(x1[:1])
    finally:
        for h in handles:
            h.remove()
    return max(total[0], int(x1[:1].numel()))


def batch_for_budget(model: nn.Module, x: Tensor, budget: int, cap: int = 256) -> int:
    """Samples per forward+backward so that the autograd activations stay within ``budget`` bytes."""
    per = 3 * activation_numel_per_sample(model, x) * max(x.element_size(), 4)
    return max(1, min(cap, int(budget // max(per, 1))))


def _micro_batch(engine: JacobianRows, itemsize: int, budget: int) -> int:
    return max(1, int(budget // max(engine.bytes_per_sample(itemsize), 1)))


def _ghost_block(a_i: Tensor, g_i: Tensor, a_j: Tensor, g_j: Tensor, c: int, budget: int) -> Tensor:
    """Σ_{s,t} (g_{ns}·g_{mt})(ã_{ns}·ã_{mt}) for rows (n,k) × (m,k'): returns (R_i × R_j).

    a_i (N_i, T, d), g_i (N_i·c, T, e); the (R_i·T × R_j·T) temporary is chunked over rows of i."""
    n_i, t, _ = a_i.shape
    n_j = a_j.shape[0]
    r_j = g_j.shape[0]
    out = torch.empty(g_i.shape[0], r_j, dtype=g_i.dtype)
    gj = g_j.reshape(r_j * t, -1)
    aj = a_j.reshape(n_j * t, -1)
    per_sample = c * t * r_j * t * g_i.element_size() * 2
    step = max(1, int(budget // max(per_sample, 1)))
    for s in range(0, n_i, step):
        e = min(n_i, s + step)
        ka = (a_i[s:e].reshape(-1, a_i.shape[-1]) @ aj.T).reshape(e - s, 1, t, n_j, 1, t)
        kg = (g_i[s * c:e * c].reshape(-1, g_i.shape[-1]) @ gj.T).reshape(e - s, c, t, n_j, c, t)
        out[s * c:e * c] = (kg * ka).sum(dim=(2, 5)).reshape((e - s) * c, r_j)
    return out


def ntk_gram(model: nn.Module, x: Tensor, x2: Tensor | None = None, *,
             memory_budget_bytes: int = DEFAULT_BUDGET, method: str = "auto",
             out_dtype: torch.dtype = torch.float64) -> Tensor:
    """Empirical NTK Gram Θ = J(x) J(x2)ᵀ of the logits (eval mode), sample-major rows, never holding J.

    Shapes: x (N, ...), x2 (M, ...) (default x) → Θ (N·c, M·c) in ``out_dtype``.
    ``method``: "auto" (per layer the cheaper of explicit/ghost), "explicit" or "ghost" (ghost where
    possible). Algorithm: rows of x are split into *held* chunks I (per-row gradients of explicit layers
    and ghost factors of the others kept, ≤ half the budget); for every chunk I, the micro-batches J of
    x2 (J ≥ I when symmetric) are recomputed and contracted layer by layer, then discarded. With the
    whole of x held (the usual case for small models) every row is computed exactly once.
    """
    if method not in ("auto", "explicit", "ghost"):
        raise ValueError(f"method must be 'auto', 'explicit' or 'ghost', got {method!r}")
    if memory_budget_bytes <= 0:
        raise ValueError("memory_budget_bytes must be positive")
    if len(x) == 0:
        raise ValueError("ntk_gram needs at least one sample")
    symmetric = x2 is None
    x2 = x if symmetric else x2
    engine = JacobianRows(model, x)
    c = engine.num_classes
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    n, m = len(x), len(x2)
    micro = _micro_batch(engine, isz, memory_budget_bytes // 5)
    full_rows_i = n * c

    def use_ghost(lay, rows_i, rows_j):
        if method == "explicit" or lay.kind == "bn" or lay.calls != 1:
            return False
        if method == "ghost":
            return True
        return engine.ghost_is_cheaper(lay, rows_i, rows_j)

    # held bytes per sample of chunk I
    ghost_sel = {lay.name: use_ghost(lay, full_rows_i, m * c) for lay in engine.layers}
    held_per_sample = 0
    for lay in engine.layers:
        if ghost_sel[lay.name]:
            held_per_sample += lay.positions * (lay.d_in + 1) + c * lay.positions * lay.d_out
        else:
            held_per_sample += c * lay.numel
    held_per_sample += c * sum(engine.params[k].numel() for k in engine.generic_names)
    held_per_sample *= isz
    chunk_i = max(1, min(n, int((2 * memory_budget_bytes // 5) // max(held_per_sample, 1))))
    theta = torch.zeros(n * c, m * c, dtype=out_dtype)
    contraction_budget = memory_budget_bytes // 5

    for i0 in range(0, n, chunk_i):
        i1 = min(n, i0 + chunk_i)
        # ---- hold chunk I (preallocated, filled in place: no concatenation copies) ----
        rows_i: dict[tuple[int, int], Tensor] = {}
        ghost_i: dict[str, tuple[Tensor, Tensor]] = {}
        for s in range(i0, i1, micro):
            xb = x[s:min(i1, s + micro)]
            lo, hi = (s - i0), (s - i0) + len(xb)
            cap = engine.capture(xb)
            for lay in engine.layers:
                if ghost_sel[lay.name]:
                    a, g = engine.ghost(cap, lay)
                    if lay.name not in ghost_i:
                        ghost_i[lay.name] = (a.new_empty((i1 - i0,) + tuple(a.shape[1:])),
                                             g.new_empty(((i1 - i0) * c,) + tuple(g.shape[1:])))
                    ghost_i[lay.name][0][lo:hi] = a
                    ghost_i[lay.name][1][lo * c:hi * c] = g
                else:
                    for sl, r in engine.rows(cap, lay):
                        if sl not in rows_i:
                            rows_i[sl] = r.new_empty(((i1 - i0) * c, r.shape[1]))
                        rows_i[sl][lo * c:hi * c] = r
            del cap
            for sl, r in engine.generic_rows(xb):
                if sl not in rows_i:
                    rows_i[sl] = r.new_empty(((i1 - i0) * c, r.shape[1]))
                rows_i[sl][lo * c:hi * c] = r
        ri0, ri1 = i0 * c, i1 * c
        # ---- diagonal block from the held chunk ----
        j_start = 0
        if symmetric:
            blk = torch.zeros(ri1 - ri0, ri1 - ri0, dtype=out_dtype)
            for sl, r in rows_i.items():
                blk += (r @ r.T).to(out_dtype)
            for name, (a, g) in ghost_i.items():
                blk += _ghost_block(a, g, a, g, c, contraction_budget).to(out_dtype)
            theta[ri0:ri1, ri0:ri1] = 0.5 * (blk + blk.T)
            j_start = i1
        # ---- stream the other rows ----
        for s in range(j_start, m, micro):
            xb = x2[s:min(m, s + micro)]
            rj0, rj1 = s * c, (s + len(xb)) * c
            cap = engine.capture(xb)
            blk = torch.zeros(ri1 - ri0, rj1 - rj0, dtype=out_dtype)
            for lay in engine.layers:
                if lay.name in ghost_i:
                    a_j, g_j = engine.ghost(cap, lay)
                    a_i, g_i = ghost_i[lay.name]
                    blk += _ghost_block(a_i, g_i, a_j, g_j, c, contraction_budget).to(out_dtype)
                else:
                    for sl, r in engine.rows(cap, lay):
                        blk += (rows_i[sl] @ r.T).to(out_dtype)
            for sl, r in engine.generic_rows(xb):
                blk += (rows_i[sl] @ r.T).to(out_dtype)
            del cap
            theta[ri0:ri1, rj0:rj1] = blk
            if symmetric:
                theta[rj0:rj1, ri0:ri1] = blk.T
    return theta


def ntk_diag_blocks(model: nn.Module, x: Tensor, param_weights: Tensor | None = None, *,
                    memory_budget_bytes: int = DEFAULT_BUDGET, out_dtype: torch.dtype = torch.float64) -> Tensor:
    """Per-sample blocks Σ_x = J_x diag(v) J_xᵀ (c×c) for every sample: returns (N, c, c).

    ``param_weights`` v is a flat (p,) vector (e.g. the variance of Gaussian weight noise), default 1
    (then each block is the diagonal block of Θ). One pass over x; per-row gradients of one layer of one
    micro-batch at a time.
    """
    engine = JacobianRows(model, x)
    c = engine.num_classes
    if param_weights is not None and param_weights.numel() != engine.p:
        raise ValueError(f"param_weights has {param_weights.numel()} entries, model has {engine.p} parameters")
    out = torch.zeros(len(x), c, c, dtype=out_dtype)
    for sl, (lo, hi), r in _rows_stream(engine, x, memory_budget_bytes):
        b = sl.stop - sl.start
        r3 = r.reshape(b, c, -1)
        if param_weights is None:
            out[sl] += torch.bmm(r3, r3.transpose(1, 2)).to(out_dtype)
        else:
            w = param_weights[lo:hi].to(r.dtype)
            out[sl] += torch.bmm(r3 * w, r3.transpose(1, 2)).to(out_dtype)
    return out


def _rows_stream(engine: JacobianRows, x: Tensor, budget: int):
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    micro = _micro_batch(engine, isz, budget // 2)
    for s in range(0, len(x), micro):
        xb = x[s:s + micro]
        sl = slice(s, s + len(xb))
        cap = engine.capture(xb)
        for lay in engine.layers:
            for ps, r in engine.rows(cap, lay):
                yield sl, ps, r
        del cap
        for ps, r in engine.generic_rows(xb):
            yield sl, ps, r


def iter_jacobian_rows(model: nn.Module, x: Tensor, *, memory_budget_bytes: int = DEFAULT_BUDGET
                       ) -> Iterator[tuple[slice, tuple[int, int], Tensor]]:
    """Yield (sample slice, (start, stop) in the flat parameters, per-row gradients (B·c, stop − start)):
    every Jacobian row computed exactly once, one micro-batch and one layer at a time (the floor cost of
    any exact method that needs the Gram)."""
    engine = JacobianRows(model, x)
    yield from _rows_stream(engine, x, memory_budget_bytes)


# --------------------------------------------------------------------------------------------------
# products
# --------------------------------------------------------------------------------------------------

def _chunk_size(model: nn.Module, x: Tensor, budget: int) -> int:
    per = max(1, x[:1].numel()) * 64 * max(x.element_size(), 4)  # activations dominate; cheap heuristic
    acts = sum(p.numel() for p in model.parameters()) // 8
    return max(1, min(len(x), int(budget // max(per + acts, 1))))


def jacobian_vjp(model: nn.Module, x: Tensor, a: Tensor, *, batch_size: int = 256) -> Tensor:
    """Jᵀa = ∇_w Σ_i a_i·f(x_i) (eval mode): a (N, c) → flat (p,), one backward per micro-batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    if a.shape[0] != len(x):
        raise ValueError(f"a has {a.shape[0]} rows, x has {len(x)} samples")
    with eval_mode(model), torch.enable_grad():
        for s in range(0, len(x), batch_size):
            f = model(x[s:s + batch_size])
            gs = torch.autograd.grad((f * a[s:s + batch_size].to(f.dtype)).sum(), params, allow_unused=True)
            out += torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.reshape(-1)
                              for g, p in zip(gs, params)])
    return out


def jacobian_jvp(model: nn.Module, x: Tensor, v: Tensor, *, batch_size: int = 256) -> Tensor:
    """J v (eval mode) by forward-mode AD (``torch.func.jvp``): flat v (p,) → (N, c)."""

    params = trainable_params(model)
    tangent = unflatten(v.to(next(iter(params.values())).dtype), params)
    buffers = dict(model.named_buffers())
    outs = []
    with eval_mode(model):
        for s in range(0, len(x), batch_size):
            xb = x[s:s + batch_size]
            _, jv = jvp(lambda p: functional_call(model, (p, buffers), (xb,)), (params,), (tangent,))
            outs.append(jv.detach())
    return torch.cat(outs)


def ntk_matvec(model: nn.Module, x: Tensor, u: Tensor, *, batch_size: int = 256) -> Tensor:
    """Θu = J(Jᵀu) without Θ: u (N, c) → (N, c)."""
    return jacobian_jvp(model, x, jacobian_vjp(model, x, u, batch_size=batch_size), batch_size=batch_size)


def dense_jacobian(model: nn.Module, x: Tensor) -> Tensor:
    """The full J (N·c × p), sample-major rows, by ``torch.func.jacrev`` of the whole batch (tests only)."""
    params = trainable_params(model)
    buffers = dict(model.named_buffers())
    with eval_mode(model):
        jac = jacrev(lambda p: functional_call(model, (p, buffers), (x,)).reshape(-1))(params)
    return torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], dim=1)


# --------------------------------------------------------------------------------------------------
# ridge solves
# --------------------------------------------------------------------------------------------------

def solve_gram(theta: Tensor, rhs: Tensor, ridge: float) -> tuple[Tensor, SolveInfo]:
    """(Θ + ridge·I)⁻¹ rhs by float64 Cholesky, with jitter escalation on failure (reported in info)."""
    if ridge < 0:
        raise ValueError("ridge must be non-negative")
    a = theta.to(torch.float64) + ridge * torch.eye(theta.shape[0], dtype=torch.float64)
    return cholesky_solve_jitter(a, rhs.to(torch.float64))


def solve_ntk_cg(model: nn.Module, x: Tensor, rhs: Tensor, ridge: float, *, tol: float = 1e-8,
                 max_iter: int = 1000, batch_size: int = 256) -> tuple[Tensor, SolveInfo]:
    """(Θ + ridge·I)⁻¹ rhs by conjugate gradient on Θ-vector products (Θ never formed).

    rhs (N, c) → (N, c). Each iteration is one VJP and one JVP over x."""
    if ridge <= 0:
        raise ValueError("the CG path needs a positive ridge")

    def matvec(u):
        return ntk_matvec(model, x, u, batch_size=batch_size).to(u.dtype) + ridge * u
    return conjugate_gradient(matvec, rhs.to(torch.float64), tol=tol, max_iter=max_iter)


def gram_bytes(n_rows: int) -> int:
    """Bytes of a float64 Gram with ``n_rows`` rows (for choosing Cholesky vs CG)."""
    return 8 * n_rows * n_rows
