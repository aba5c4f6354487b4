"""The empirical NTK of a network's logits, without ever holding its Jacobian.

Notation: ``x`` holds N samples, the model has c outputs (logits) and p trainable parameters.
J ∈ R^{Nc×p} stacks the per-(sample, class) Jacobian rows J[(i,k), :] = ∂f_k(x_i)/∂w, **sample-major**
(row ``i*c + k``). The Gram (empirical NTK) is Θ = J Jᵀ ∈ R^{Nc×Nc}. Everything is evaluated with the
model in **eval mode** (BatchNorm uses its running statistics, so samples do not interact and per-sample
rows are well defined); the model's mode is restored afterwards.

What is here
* :class:`JacobianRows` — the engine: one forward pass with hooks on every layer covered by the kernel
  registry (:mod:`scrubnet.curvature.kernels`: Linear, Conv1d/Conv2d, eval-mode BatchNorm) plus c backward
  passes to the layer *outputs* give, per layer, its inputs ``a`` and the output-gradients ``g`` of every
  row; per-row weight gradients are then ``Σ_s g_s a_sᵀ`` (the kernel's batched GEMM). Parameters of any
  other module go through the kernels' torch.func fallback on just those parameters.
* :func:`ntk_gram` — Θ (or the cross-Gram J(x) J(x')ᵀ) under a memory budget, choosing per layer the
  cheaper of two exact contractions:
    explicit: Θ_l = G_l G_lᵀ with per-row gradients G_l (rows × numel);
    ghost:    Θ_l[(n,k),(m,k')] = Σ_{s,t} (g_{nks}·g_{mk't}) (ã_{ns}·ã_{mt}),   ã = [a, 1] (bias folded in),
  ghost wins for layers with few positions T (every Linear: T = 1; late conv layers). Every Jacobian row
  is computed once when the compact factors of x fit in the budget, and otherwise once per layer group or
  per held chunk ("NTK cost" and "NTK memory" in docs/decisions.md); the symmetric blocks are computed
  once. :func:`ntk_gram_flops` gives its FLOP floor.
* :func:`ntk_diag_blocks` — the N per-sample c×c blocks J_x diag(v) J_xᵀ (activation covariances).
* :func:`jacobian_vjp` (Jᵀa: one backward of Σ_i a_i·f(x_i)), :func:`jacobian_jvp` (J v, ``torch.func.jvp``),
  :func:`ntk_matvec` (Θu = J(Jᵀu)) and :func:`solve_gram` / :func:`solve_ntk_cg` (ridge solve by Cholesky
  with jitter, or by conjugate gradient on Θ-vector products when the Gram is too large to hold).
* :func:`dense_jacobian` — the obviously-correct twin for tests (``torch.func.jacrev`` of the whole batch).

Why this algorithm: on CPU a layerwise per-row-gradient / outer-product kernel beat ``vmap(jacrev)``
5.6–25× (ResNet-18, one thread); the c backward passes go to the layer outputs only (no weight gradients).
Measured figures (``benchmarks/ntk_scale.py``) are in the README and docs/decisions.md ("NTK cost").

Memory: ``memory_budget_bytes`` bounds the large buffers (3/5 for the held factors, 1/5 for the capture
of one micro-batch, 1/5 for the contraction temporaries); sizes are derived from it with a one-sample probe
of the layer shapes. The budget is a target for these buffers, not a hard cap on the process (autograd's
own activations for one micro-batch come on top).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.curvature.kernels import LayerKernel, func_per_sample_grads, kernel_for
from scrubnet.curvature.params import trainable_params, unflatten
from scrubnet.curvature.progress import current_progress
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
    """One module covered by a registered kernel: where its parameters sit in the flat vector and its
    contraction shape (from a one-sample probe)."""

    name: str
    module: nn.Module
    kernel: LayerKernel
    weight: tuple[int, int] | None = None     # [start, stop) in the flat parameter vector
    bias: tuple[int, int] | None = None
    d_in: int = 0                             # input features per position (× kernel size for conv)
    d_out: int = 0
    positions: int = 1                        # T: output positions per sample
    calls: int = 1                            # times the module runs per forward (weight sharing)
    input_numel: int = 0                      # per sample, as captured (not unfolded)
    output_numel: int = 0                     # per sample

    @property
    def kind(self) -> str:
        return self.kernel.kind

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in (s for s in (self.weight, self.bias) if s is not None))

    @property
    def factored(self) -> bool:
        return self.kernel.factored and self.calls == 1


class JacobianRows:
    """Per-(sample, class) Jacobian rows of a model's logits, layer by layer, in eval mode.

    ``capture(x)`` runs one forward pass and c backward passes and keeps, for every layer covered by a
    registered kernel (:mod:`scrubnet.curvature.kernels`), its input ``a`` (B, ...) and the
    output-gradients ``g`` (c, B, ...) of all B·c rows; from a capture, ``rows(cap, layer)`` gives the
    per-row gradients of that layer's parameters (the kernel's closed form). Parameters outside covered
    layers come from ``generic_rows`` (the kernels' torch.func fallback on just those parameters).
    """

    def __init__(self, model: nn.Module, x_probe: Tensor):
        self.model = model
        self.params = trainable_params(model)
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
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
            kernel = kernel_for(m)
            own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
            if kernel is None or not own:
                continue
            full = {pn: (f"{mname}.{pn}" if mname else pn) for pn, _ in own}
            if set(full) - {"weight", "bias"} or any(v not in offsets for v in full.values()):
                continue
            lay = _Layer(mname, m, kernel, weight=offsets.get(full.get("weight", "")),
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
            lay.d_in, lay.d_out, lay.positions = lay.kernel.shape(lay.module, tuple(ins[0].shape[1:]),
                                                                  tuple(outs[0][1:]))
            lay.input_numel = int(ins[0][0].numel())
            lay.output_numel = int(math.prod(outs[0][1:]))
            self.act_numel_per_sample += lay.calls * (lay.input_numel + lay.output_numel)

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

    def capture(self, x: Tensor, need_grads: bool = True, layers: list[_Layer] | None = None
                ) -> "JacobianRows.Capture":
        """Inputs and output gradients of ``layers`` (default: every covered layer). The c backward passes
        go only as deep as the earliest of them (autograd runs just the part of the graph that reaches
        the requested outputs)."""
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

        for lay in (self.layers if layers is None else layers):
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
    def rows_from(self, lay: _Layer, a: Tensor, g: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients [((start, stop), (B·c, numel))] of ``lay`` from one call's input a (B, ...) and
        output gradients g (c, B, ...), rows sample-major (the kernel's closed form)."""
        grads = lay.kernel.per_sample_grads(lay.module, a, g)          # {"weight"/"bias": (B, c, numel)}
        out = []
        for pname, sl in (("weight", lay.weight), ("bias", lay.bias)):
            if sl is not None:
                t = grads[pname]
                out.append((sl, t.reshape(t.shape[0] * t.shape[1], -1)))
        return out

    def rows(self, cap: "JacobianRows.Capture", lay: _Layer) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients of ``lay``'s parameters: [((start, stop), (B·c, numel))], summed over calls."""
        out: dict[tuple[int, int], Tensor] = {}
        for a, g in zip(cap.inputs[lay.name], cap.grads[lay.name]):
            for k, v in self.rows_from(lay, a, g):
                out[k] = out[k] + v if k in out else v
        return list(out.items())

    def ghost_factors(self, lay: _Layer, a: Tensor) -> Tensor:
        """ã (B, T, d_in[+1]) of a factored layer: input patches with a 1 appended for the bias (ã = 1 for a
        bias-only layer)."""
        pa = lay.kernel.patches(lay.module, a)
        if lay.weight is None:
            return torch.ones_like(pa[..., :1])
        if lay.bias is not None:
            pa = torch.cat([pa, torch.ones_like(pa[..., :1])], dim=-1)
        return pa

    def ghost_rows(self, lay: _Layer, g: Tensor) -> Tensor:
        """Output-gradient rows (B·c, T, d_out) of a factored layer from g (c, B, ...), sample-major."""
        go = lay.kernel.output_rows(lay.module, g)                      # (c, B, T, d_out)
        c, b = go.shape[0], go.shape[1]
        return go.transpose(0, 1).reshape(b * c, go.shape[2], go.shape[3])

    def generic_rows(self, x: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients of the parameters outside covered layers (the kernels' torch.func fallback)."""
        if not self.generic_names:
            return []
        b, c = len(x), self.num_classes
        cot = torch.eye(c, dtype=x.dtype if x.is_floating_point() else self.params[self.names[0]].dtype,
                        device=x.device).expand(b, c, c)
        with eval_mode(self.model):
            jac = func_per_sample_grads(self.model, self.params, self.generic_names, self.buffers, x, cot)
        return [(self.offsets[k], jac[k].reshape(b * c, -1)) for k in self.generic_names]

    def ghost_is_cheaper(self, lay: _Layer, rows_i: int, rows_j: int) -> bool:
        """Compare FLOPs of the two exact contractions for a (rows_i × rows_j) block of this layer."""
        explicit, ghost = self.contraction_flops(lay, rows_i, rows_j)
        return lay.factored and ghost < explicit

    def contraction_flops(self, lay: _Layer, rows_i: int, rows_j: int) -> tuple[float, float]:
        """(explicit, ghost) multiply-adds of this layer's (rows_i × rows_j) Gram block.

        explicit: per-row gradients R·T·d_in·d_out for both sides + the GEMM R_i·R_j·numel;
        ghost:    N_i·N_j·T²·(d_in + 1) (input patches) + R_i·R_j·T²·(d_out + 1) (output rows, product)."""
        c, t = self.num_classes, lay.positions
        n_i, n_j = max(rows_i // c, 1), max(rows_j // c, 1)
        explicit = float(rows_i) * rows_j * lay.numel + (rows_i + rows_j) * t * lay.numel
        if not lay.factored:
            return explicit, math.inf
        ghost = float(n_i) * n_j * t * t * (lay.d_in + 1) + float(rows_i) * rows_j * t * t * (lay.d_out + 1)
        return explicit, ghost


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
    out = torch.empty(g_i.shape[0], r_j, dtype=g_i.dtype, device=g_i.device)
    gj = g_j.reshape(r_j * t, -1)
    aj = a_j.reshape(n_j * t, -1)
    per_sample = c * t * r_j * t * g_i.element_size() * 2
    step = max(1, int(budget // max(per_sample, 1)))
    for s in range(0, n_i, step):
        e = min(n_i, s + step)
        ka = (a_i[s:e].reshape(-1, a_i.shape[-1]) @ aj.T).reshape(e - s, 1, t, n_j, 1, t)
        kg = (g_i[s * c:e * c].reshape(-1, g_i.shape[-1]) @ gj.T).reshape(e - s, c, t, n_j, c, t)
        out[s * c:e * c] = kg.mul_(ka).sum(dim=(2, 5)).reshape((e - s) * c, r_j)   # in place: no second temporary
    return out


@dataclass
class _Held:
    """Compact Jacobian factors of ``n`` consecutive samples (rows sample-major, c rows per sample).

    rows:  (n·c, width) per-row gradients of every parameter kept as rows (explicit layers, BN, fallback),
           side by side in one matrix (columns: ``_GramPlan.row_cols``), so that their Gram is one GEMM;
    raw:   {layer: (a (n, ...), g (c, n, ...))} the capture itself, for explicit layers whose rows are
           larger than their capture; per-row gradients are rebuilt per contraction block;
    ghost: {layer: (a (n, ...), g rows (n·c, T, d_out))} for layers contracted by the ghost rule: the input
           as captured, unfolded into patches ã (n, T, d_in[+1]) for one layer at a time when contracted."""

    n: int
    rows: Tensor | None = None
    raw: dict = field(default_factory=dict)
    ghost: dict = field(default_factory=dict)


class _GramPlan:
    """Per-layer contraction ("explicit" | "ghost") and storage ("rows" | "raw" | "ghost") for one Gram."""

    def __init__(self, engine: JacobianRows, n: int, m: int, method: str, itemsize: int, held_budget: int,
                 layers: list[_Layer] | None = None, generic: bool = True):
        c = engine.num_classes
        self.engine, self.c = engine, c
        self.layers = list(engine.layers if layers is None else layers)
        self.generic_names = list(engine.generic_names) if generic else []
        self.contraction: dict[str, str] = {}
        self.storage: dict[str, str] = {}
        for lay in self.layers:
            ghost = lay.factored and (method == "ghost" or (method == "auto" and
                                                             engine.ghost_is_cheaper(lay, n * c, m * c)))
            self.contraction[lay.name] = "ghost" if ghost else "explicit"
            self.storage[lay.name] = "ghost" if ghost else "rows"
        generic = c * sum(engine.params[k].numel() for k in self.generic_names)
        # explicit layers: keep the smaller of (rows, capture) until everything fits; switching a layer
        # to its capture costs a rebuild of its per-row gradients per block, ∝ T: cheapest T first
        candidates = sorted((lay for lay in self.layers
                             if self.storage[lay.name] == "rows" and lay.factored
                             and lay.input_numel + c * lay.output_numel < c * lay.numel),
                            key=lambda lay: lay.positions)
        for lay in candidates:
            if self.per_sample(generic) * itemsize * n <= held_budget:
                break
            self.storage[lay.name] = "raw"
        self.per_sample_bytes = self.per_sample(generic) * itemsize
        self.row_cols: dict[tuple[int, int], tuple[int, int]] = {}
        spans = [sl for lay in self.layers if self.storage[lay.name] == "rows"
                 for sl in (lay.weight, lay.bias) if sl is not None]
        spans += [engine.offsets[k] for k in self.generic_names]
        col = 0
        for lo, hi in spans:
            self.row_cols[(lo, hi)] = (col, col + hi - lo)
            col += hi - lo
        self.row_width = col

    def per_sample(self, generic: int) -> int:
        c, total = self.c, generic
        for lay in self.layers:
            kind = self.storage[lay.name]
            if kind == "rows":
                total += c * lay.numel
            elif kind == "raw":
                total += lay.input_numel + c * lay.output_numel
            else:
                total += lay.input_numel + c * lay.output_numel
        return total

    def capture_bytes_per_sample(self, itemsize: int) -> int:
        """Working memory of one sample in :meth:`hold`'s capture of this plan's layers: autograd's saved
        tensors, the hooked outputs' clones and the c output gradients of the hooked layers, the unfolded
        input and per-row gradients of the largest layer whose rows are built, the fallback rows."""
        eng, c = self.engine, self.c
        built = [lay for lay in self.layers if self.storage[lay.name] in ("rows", "raw")]
        hooked = sum(lay.calls * (lay.input_numel + lay.output_numel) for lay in self.layers)
        unf = max([lay.positions * lay.d_in for lay in built] or [0])
        rows = max([lay.numel for lay in self.layers if self.storage[lay.name] == "rows"] or [0])
        generic = c * sum(eng.params[k].numel() for k in self.generic_names)
        return itemsize * (2 * eng.all_outputs_per_sample + hooked + c * hooked + 2 * unf + 2 * c * rows + generic)

    def hold(self, x: Tensor, micro: int) -> _Held:
        """Capture every sample of ``x`` once (micro-batches) into preallocated compact factors."""
        eng, c, n = self.engine, self.c, len(x)
        held = _Held(n)
        if self.row_width:
            dtype = next(iter(eng.params.values())).dtype
            held.rows = torch.empty(n * c, self.row_width, dtype=dtype, device=x.device)
        report = current_progress()
        for s in range(0, n, micro):
            xb = x[s:s + micro]
            lo, hi = s, s + len(xb)
            if report is not None:
                report("NTK: Jacobian rows (samples)", s, n)
            cap = eng.capture(xb, layers=self.layers)
            for lay in self.layers:
                kind = self.storage[lay.name]
                if kind == "rows":
                    parts = eng.rows(cap, lay)
                elif kind == "raw":
                    a, g = cap.inputs[lay.name][0], cap.grads[lay.name][0]
                    if lay.name not in held.raw:
                        held.raw[lay.name] = (a.new_empty((n,) + tuple(a.shape[1:])),
                                              g.new_empty((c, n) + tuple(g.shape[2:])))
                    held.raw[lay.name][0][lo:hi] = a
                    held.raw[lay.name][1][:, lo:hi] = g
                    continue
                else:  # the input as captured (unfolded per contraction: 9× smaller for a 3×3 conv)
                    a = cap.inputs[lay.name][0]
                    g = eng.ghost_rows(lay, cap.grads[lay.name][0])
                    if lay.name not in held.ghost:
                        held.ghost[lay.name] = (a.new_empty((n,) + tuple(a.shape[1:])),
                                                g.new_empty((n * c,) + tuple(g.shape[1:])))
                    held.ghost[lay.name][0][lo:hi] = a
                    held.ghost[lay.name][1][lo * c:hi * c] = g
                    continue
                for sl, r in parts:
                    c0, c1 = self.row_cols[sl]
                    held.rows[lo * c:hi * c, c0:c1] = r
            del cap
            for sl, r in (eng.generic_rows(xb) if self.generic_names else []):
                c0, c1 = self.row_cols[sl]
                held.rows[lo * c:hi * c, c0:c1] = r
        if report is not None:
            report("NTK: Jacobian rows (samples)", n, n)
        return held

    def contract(self, hi: _Held, hj: _Held, out: Tensor, same: bool, budget: int) -> None:
        """out (hi.n·c × hj.n·c) += J_i J_jᵀ from compact factors. ``same``: hi is hj and ``out`` is square;
        only blocks on or above the diagonal are computed, each off-diagonal block is also added
        transposed below it."""
        eng, c = self.engine, self.c
        lay_by_name = {lay.name: lay for lay in eng.layers}

        def pairs(n_i: int, n_j: int, step: int):
            if same:  # at least 8 blocks per side: the blocks above the diagonal are ≈ 56 % of the square
                step = min(step, max(1, -(-n_i // 8)))
            for s in range(0, n_i, step):
                for t in range(s if same else 0, n_j, step):
                    yield s, min(n_i, s + step), t, min(n_j, t + step)

        def add(s, e, t, f, blk):
            out[s * c:e * c, t * c:f * c] += blk.to(out.dtype)
            if same and t != s:
                out[t * c:f * c, s * c:e * c] += blk.T.to(out.dtype)

        report = current_progress()
        steps = (hi.rows is not None) + len(hi.raw) + len(hi.ghost)
        done = 0

        def tick():
            nonlocal done
            done += 1
            if report is not None:
                report("NTK: Gram contraction (layers)", done, steps)

        # per-row gradients held side by side: one GEMM per block, symmetric blocks once
        if hi.rows is not None:
            for s, e, t, f in pairs(hi.n, hj.n, max(hi.n, hj.n)):
                add(s, e, t, f, hi.rows[s * c:e * c] @ hj.rows[t * c:f * c].T)
            tick()
        # captures: rebuild per-row gradients per block of samples sized to the budget
        for name, (a_i, g_i) in hi.raw.items():
            lay = lay_by_name[name]
            a_j, g_j = hj.raw[name]
            step = _raw_step(lay, c, a_i.element_size(), budget)
            cache: tuple[int, list] | None = None
            for s, e, t, f in pairs(hi.n, hj.n, step):
                if cache is None or cache[0] != s:
                    cache = (s, eng.rows_from(lay, a_i[s:e], g_i[:, s:e]))   # rows of block s, reused along t
                rows_j = cache[1] if same and t == s else eng.rows_from(lay, a_j[t:f], g_j[:, t:f])
                blk = None
                for (_, r_i), (_, r_j) in zip(cache[1], rows_j):   # weight, then bias
                    blk = r_i @ r_j.T if blk is None else blk.addmm_(r_i, r_j.T)
                add(s, e, t, f, blk)
            tick()
        # ghost rule: input patches unfolded for one layer at a time (transient), output rows as held
        for name, (x_i, g_i) in hi.ghost.items():
            x_j, g_j = hj.ghost[name]
            a_i = eng.ghost_factors(lay_by_name[name], x_i)
            a_j = a_i if hj is hi else eng.ghost_factors(lay_by_name[name], x_j)
            for s, e, t, f in pairs(hi.n, hj.n, max(hi.n, hj.n)):
                add(s, e, t, f, _ghost_block(a_i[s:e], g_i[s * c:e * c], a_j[t:f], g_j[t * c:f * c], c, budget))
            del a_i, a_j
            tick()


def _chunked_passes(k: int) -> float:
    """Capture passes over all samples of the snake schedule with ``k`` chunks: 1 + k(k−1)/2 chunk
    captures (:func:`_symmetric_gram`), in units of k chunks."""
    return (1.0 + k * (k - 1) / 2.0) / k


def _min_bytes_per_sample(engine: JacobianRows, lay: _Layer, n: int, method: str) -> int:
    """Elements one sample of ``lay`` needs when held as compactly as possible (rows or capture)."""
    c = engine.num_classes
    capture = lay.input_numel + c * lay.output_numel
    ghost = lay.factored and (method == "ghost" or (method == "auto" and engine.ghost_is_cheaper(lay, n * c, n * c)))
    if ghost:
        return capture
    return min(c * lay.numel, capture) if lay.factored else c * lay.numel


def _pass_flops(engine: JacobianRows, x1: Tensor, layers: list[_Layer], generic: bool) -> float:
    """FLOPs of capturing one sample for ``layers`` only (forward + c backward passes reaching them)."""
    with FlopCounterMode(display=False) as counter:
        engine.capture(x1, layers=layers)
        if generic:
            engine.generic_rows(x1)
    return float(counter.get_total_flops())


def _raw_step(lay: _Layer, c: int, itemsize: int, budget: int) -> int:
    """Samples per block when a held capture's per-row gradients are rebuilt (:meth:`_GramPlan.contract`)."""
    return max(1, int(budget // max(2 * c * lay.numel * itemsize, 1)))


def _schedule_flops(plan: _GramPlan, n: int, chunk: int, pass_flops: float, budget: int, itemsize: int) -> float:
    """FLOPs a schedule spends beyond the Gram contraction itself (the same in every schedule): captures
    (``pass_flops`` per sample captured), per-row gradients of "rows" layers built at each capture, and the
    rebuilds of "raw" layers' per-row gradients, counted by walking the block loops of
    :func:`_symmetric_gram` and :meth:`_GramPlan.contract`."""
    eng, c = plan.engine, plan.c
    sizes = [min(n, s + chunk) - s for s in range(0, n, chunk)]
    k = len(sizes)
    # snake: the held chunk h meets every chunk not done yet; the last one streamed is held next
    captured, done, h = sizes[0], {0}, 0
    pair_list: list[tuple[int, int]] = []
    while len(done) < k:
        todo = [j for j in range(k) if j not in done]
        for j in todo:
            pair_list.append((h, j))
            captured += sizes[j]
        h = todo[-1]
        done.add(h)
    total = pass_flops * captured
    for lay in plan.layers:
        per_sample = 2.0 * c * lay.positions * lay.numel      # per-row gradients of one sample
        kind = plan.storage[lay.name]
        if kind == "rows":
            total += per_sample * captured
        elif kind == "raw":
            step = _raw_step(lay, c, itemsize, budget)
            rebuilt = 0
            for m in sizes:                                     # diagonal blocks: i once, j per block above
                blocks = [min(m, s + step) - s for s in range(0, m, step)]
                rebuilt += m + sum(sum(blocks[b + 1:]) for b in range(len(blocks)))
            for i, j in pair_list:                              # off-diagonal: i once, j once per i-block
                rebuilt += sizes[i] + -(-sizes[i] // step) * sizes[j]
            total += per_sample * rebuilt
    return total


def _symmetric_schedule(engine: JacobianRows, x: Tensor, n: int, method: str, itemsize: int,
                        held_budget: int, contraction_budget: int | None = None) -> list[tuple[_GramPlan, int]]:
    """How to contract a symmetric Gram whose factors do not fit: [(plan of a layer group, chunk size)].

    Two ways; the one with fewer FLOPs beyond the contraction itself wins (:func:`_schedule_flops`:
    captures, per-row gradients built and rebuilt; "NTK memory" in docs/decisions.md):
    * all layers at once, the samples in chunks: a chunk pair needs both chunks held, so chunks are half
      of what fits, and the snake order of :func:`_symmetric_gram` captures 1 + k(k−1)/2 chunks;
    * layer groups, packed from the output side so that each group's factors of **all** samples fit (a
      group too large alone is chunked as above): one capture pass per group, and the c backward passes
      of a group stop at its earliest layer, so groups near the output cost little more than a forward.
    Θ is the sum of the groups' Grams (each parameter belongs to exactly one group)."""
    c = engine.num_classes
    x1 = x[:1]
    budget = held_budget // 3 if contraction_budget is None else contraction_budget
    generic_elems = c * sum(engine.params[k].numel() for k in engine.generic_names)

    def option(layers, generic):
        plan = _GramPlan(engine, n, n, method, itemsize, held_budget, layers=layers, generic=generic)
        fit = int(held_budget // max(plan.per_sample_bytes, 1))
        chunk = n if fit >= n else max(1, fit // 2)
        cost = _schedule_flops(plan, n, chunk, _pass_flops(engine, x1, layers, generic), budget, itemsize)
        return plan, chunk, cost

    plan, chunk, whole_cost = option(engine.layers, True)
    whole = [(plan, chunk)]
    # groups from the output side (modules register roughly in forward order)
    capacity = held_budget // (itemsize * n)
    groups: list[list[_Layer]] = []
    current: list[_Layer] = []
    used = generic_elems  # the fallback parameters' rows travel with the first group built (the last layers)
    for lay in reversed(engine.layers):
        need = _min_bytes_per_sample(engine, lay, n, method)
        if current and used + need > capacity:
            groups.append(current)
            current, used = [], 0
        current.append(lay)
        used += need
    if current:
        groups.append(current)
    if len(groups) <= 1:
        return whole
    grouped, grouped_cost = [], 0.0
    for g, layers in enumerate(groups):
        plan, chunk, cost = option([lay for lay in engine.layers if lay in layers], g == 0)   # forward order
        grouped.append((plan, chunk))
        grouped_cost += cost
    return grouped if grouped_cost < whole_cost else whole


def ntk_gram_schedule(model: nn.Module, x1: Tensor, n: int, *, memory_budget_bytes: int = DEFAULT_BUDGET,
                      method: str = "auto") -> dict:
    """How :func:`ntk_gram` will contract the symmetric Gram of ``n`` samples like ``x1`` within the budget,
    without running it: {"schedule": "held" (every factor at once) | "layer groups" | "chunks",
    "groups": number of layer groups, "chunks": [chunks per group], "extra_flops": FLOPs of captures and
    per-row-gradient (re)builds beyond the single pass that :func:`ntk_gram_flops` counts (≥ 0)}."""
    engine = JacobianRows(model, x1[:1])
    c = engine.num_classes
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    held_budget, contraction_budget = 3 * memory_budget_bytes // 5, memory_budget_bytes // 5
    plan = _GramPlan(engine, n, n, method, isz, held_budget)
    if int(held_budget // max(plan.per_sample_bytes, 1)) >= n:
        return {"schedule": "held", "groups": 1, "chunks": [1], "extra_flops": 0.0}
    sched = _symmetric_schedule(engine, x1[:1], n, method, isz, held_budget, contraction_budget)
    cost = sum(_schedule_flops(p, n, chunk, _pass_flops(engine, x1[:1], p.layers, bool(p.generic_names)),
                               contraction_budget, isz) for p, chunk in sched)
    once = n * _pass_flops(engine, x1[:1], engine.layers, True) + sum(
        2.0 * c * n * lay.positions * lay.numel for lay in engine.layers if plan.contraction[lay.name] == "explicit")
    return {"schedule": "layer groups" if len(sched) > 1 else "chunks", "groups": len(sched),
            "chunks": [-(-n // chunk) for _, chunk in sched], "extra_flops": max(0.0, cost - once)}


def _symmetric_gram(plan: _GramPlan, x: Tensor, theta: Tensor, chunk: int, micro: int, budget: int) -> None:
    """theta (N·c × N·c) += J Jᵀ over ``plan``'s layers, the samples in chunks of ``chunk``.

    Snake order: a held chunk is contracted with itself and with every chunk it has not met yet, each
    captured ("streamed") in turn; the last one streamed becomes the next held chunk, so it is not captured
    again. k chunks cost 1 + k(k−1)/2 chunk captures instead of k(k+1)/2, with two chunks in memory."""
    n, c = len(x), plan.c
    bounds = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    done = [False] * len(bounds)
    h = 0
    report, pairs_total, pairs_done = current_progress(), len(bounds) * (len(bounds) + 1) // 2, 0
    held = plan.hold(x[bounds[0][0]:bounds[0][1]], micro)
    while True:
        a0, a1 = bounds[h]
        plan.contract(held, held, theta[a0 * c:a1 * c, a0 * c:a1 * c], True, budget)
        done[h] = True
        pairs_done += 1
        if report is not None:
            report(f"NTK: chunk pairs ({len(plan.layers)} layers)", pairs_done, pairs_total)
        todo = [j for j in range(len(bounds)) if not done[j]]
        if not todo:
            return
        nxt = None
        for j in todo:
            b0, b1 = bounds[j]
            streamed = plan.hold(x[b0:b1], micro)
            plan.contract(held, streamed, theta[a0 * c:a1 * c, b0 * c:b1 * c], False, budget)
            theta[b0 * c:b1 * c, a0 * c:a1 * c] = theta[a0 * c:a1 * c, b0 * c:b1 * c].T
            pairs_done += 1
            if report is not None:
                report(f"NTK: chunk pairs ({len(plan.layers)} layers)", pairs_done, pairs_total)
            if j == todo[-1]:
                nxt = streamed
            del streamed  # before the next chunk is captured
        del held
        held, h = nxt, todo[-1]
        del nxt


def ntk_gram(model: nn.Module, x: Tensor, x2: Tensor | None = None, *,
             memory_budget_bytes: int = DEFAULT_BUDGET, method: str = "auto",
             out_dtype: torch.dtype = torch.float64) -> Tensor:
    """Empirical NTK Gram Θ = J(x) J(x2)ᵀ of the logits (eval mode), sample-major rows, never holding J.

    Shapes: x (N, ...), x2 (M, ...) (default x) → Θ (N·c, M·c) in ``out_dtype``, on x's device.
    ``method``: "auto" (per layer the cheaper of explicit/ghost, :meth:`JacobianRows.contraction_flops`),
    "explicit" or "ghost" (ghost where the kernel is factored).

    Algorithm ("NTK cost" in docs/decisions.md): the samples of x are captured (one forward + c backward
    passes to the layer outputs) **once** per held chunk into compact factors — per layer the smaller of
    its per-row gradients and its capture (input, output gradients), the ghost factors for ghost layers —
    sized so that, when it fits in 3/5 of the budget, the whole of x is one chunk and every Jacobian row is
    computed exactly once. The Gram is then contracted layer by layer in blocks from the held factors;
    symmetric blocks are computed once and mirrored. When the factors of x do not fit
    (:func:`_symmetric_schedule`, the cheaper of the two in FLOPs spent outside the contraction):
    either the layers are split into groups whose factors of all samples fit, each group captured in its
    own pass whose backward stops at the group's earliest layer, and Θ is the sum of the groups' Grams; or
    the samples are split into chunks held two at a time in a snake order (the last chunk streamed is the
    next held, 1 + k(k−1)/2 chunk captures for k chunks). For a cross-Gram (x2 given) the samples of x2
    are streamed in micro-batches against held chunks of x.
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
    held_budget = 3 * memory_budget_bytes // 5
    plan = _GramPlan(engine, n, m, method, isz, held_budget)
    contraction_budget = memory_budget_bytes // 5
    theta = torch.zeros(n * c, m * c, dtype=out_dtype, device=x.device)
    chunk_i = max(1, min(n, int(held_budget // max(plan.per_sample_bytes, 1))))
    if symmetric and chunk_i < n:
        for group_plan, chunk in _symmetric_schedule(engine, x, n, method, isz, held_budget, contraction_budget):
            # micro-batches sized to what this plan's capture holds (≥ the all-layer rule's)
            group_micro = max(micro, int(memory_budget_bytes // 5 // max(group_plan.capture_bytes_per_sample(isz), 1)))
            _symmetric_gram(group_plan, x, theta, chunk, group_micro, contraction_budget)
        return theta
    for i0 in range(0, n, chunk_i):
        i1 = min(n, i0 + chunk_i)
        held = plan.hold(x[i0:i1], micro)
        ri0, ri1 = i0 * c, i1 * c
        j_start = 0
        if symmetric:
            plan.contract(held, held, theta[ri0:ri1, ri0:ri1], True, contraction_budget)
            j_start = i1
        for s in range(j_start, m, micro):
            xb = x2[s:min(m, s + micro)]
            rj0, rj1 = s * c, (s + len(xb)) * c
            streamed = plan.hold(xb, micro)
            plan.contract(held, streamed, theta[ri0:ri1, rj0:rj1], False, contraction_budget)
            del streamed  # before the next block is captured
        del held
    return theta


def ntk_gram_flops(model: nn.Module, x: Tensor, n: int | None = None) -> dict[str, float]:
    """FLOP floor (FLOP = 2 multiply-adds) of the exact Gram over ``n`` samples like ``x`` (default len(x)).

    ``jacobian_pass``: one forward and c backward passes to the layer outputs per sample (counted with
    ``torch.utils.flop_counter`` on one sample: matmuls and convolutions), i.e. every Jacobian row once;
    ``gram``: Σ over layers of the cheaper of the explicit and ghost contractions of the symmetric Gram
    (half of the off-diagonal blocks), per-row gradients included for explicit layers;
    ``total`` = their sum. Returns FLOPs (floats)."""
    n = len(x) if n is None else int(n)
    engine = JacobianRows(model, x[:1])
    c = engine.num_classes
    with FlopCounterMode(display=False) as counter:
        engine.capture(x[:1])
    per_sample = float(counter.get_total_flops())
    r = n * c
    gram = 0.0
    for lay in engine.layers:
        explicit, ghost = engine.contraction_flops(lay, r, r)
        # symmetric: R(R+1)/2 row pairs instead of R²; the per-row gradients are computed once
        explicit = 0.5 * float(r) * (r + 1) * lay.numel + r * lay.positions * lay.numel
        if ghost != math.inf:
            ghost = 0.5 * ghost
        gram += 2.0 * min(explicit, ghost)
    generic = sum(engine.params[k].numel() for k in engine.generic_names)
    gram += 2.0 * 0.5 * float(r) * (r + 1) * generic
    return {"jacobian_pass": per_sample * n, "gram": gram, "total": per_sample * n + gram}


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
    out = torch.zeros(len(x), c, c, dtype=out_dtype, device=x.device)
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

def jacobian_vjp(model: nn.Module, x: Tensor, a: Tensor, *, batch_size: int = 256) -> Tensor:
    """Jᵀa = ∇_w Σ_i a_i·f(x_i) (eval mode): a (N, c) → flat (p,), one backward per micro-batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    if a.shape[0] != len(x):
        raise ValueError(f"a has {a.shape[0]} rows, x has {len(x)} samples")
    with eval_mode(model), torch.enable_grad():
        for s in range(0, len(x), batch_size):
            f = model(x[s:s + batch_size])
            gs = torch.autograd.grad((f * a[s:s + batch_size].to(f.dtype)).sum(), params, allow_unused=True)
            out += torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.reshape(-1)
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
    a = theta.to(torch.float64) + ridge * torch.eye(theta.shape[0], dtype=torch.float64, device=theta.device)
    return cholesky_solve_jitter(a, rhs.to(device=theta.device, dtype=torch.float64))


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
