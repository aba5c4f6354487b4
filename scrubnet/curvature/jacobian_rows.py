"""Per-(sample, class) Jacobian rows of a network's logits, layer by layer (the engine of the NTK).

Notation: ``x`` holds N samples, the model has c outputs (logits) and p trainable parameters. J ∈ R^{Nc×p}
stacks the rows J[(i,k), :] = ∂f_k(x_i)/∂w, **sample-major** (row ``i*c + k``), in **eval mode**.

:class:`JacobianRows`: one forward pass with hooks on every layer covered by the kernel registry
(:mod:`scrubnet.curvature.kernels`: Linear, Conv1d/Conv2d, eval-mode BatchNorm) plus c backward passes to
the layer *outputs* give, per layer, its inputs ``a`` and the output-gradients ``g`` of every row; per-row
weight gradients are then ``Σ_s g_s a_sᵀ`` (the kernel's batched GEMM). Parameters the layer table does not
cover — other modules, and layers whose kernel the probe of :mod:`scrubnet.curvature.fallbacks` found not to
reproduce autograd (a hook that never fires, as on ``nn.MultiheadAttention``'s ``out_proj``; tied weights) —
go through the per-sample path (``vmap``, or a per-sample loop where vmap does not run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import AutodiffPaths, probe_paths
from scrubnet.curvature.kernels import LayerKernel, func_per_sample_grads, kernel_for
from scrubnet.curvature.params import trainable_params
from scrubnet.models import eval_mode
from scrubnet.models.call import Inputs, call_model

DEFAULT_BUDGET = 1 << 30  # 1 GiB

# --------------------------------------------------------------------------------------------------
# model plumbing
# --------------------------------------------------------------------------------------------------

def _main(x: Inputs) -> Tensor:
    """The main input tensor (of a ModelInputs, or x itself)."""
    return getattr(x, "main", x)


def _num_outputs(model: nn.Module, x: Inputs, paths: AutodiffPaths | None = None) -> int:
    with torch.no_grad(), eval_mode(model), (paths or AutodiffPaths()).context():
        out = call_model(model, x[:1])
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

    def __init__(self, model: nn.Module, x_probe: Inputs):
        self.model = model
        self.paths = probe_paths(model, x_probe)
        self.params = trainable_params(model)
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
        self.names = list(self.params)
        offsets, o = {}, 0
        for k, v in self.params.items():
            offsets[k] = (o, o + v.numel())
            o += v.numel()
        self.offsets = offsets
        self.p = o
        self.num_classes = _num_outputs(model, x_probe, self.paths)
        covered: set[str] = set()
        self.layers: list[_Layer] = []
        for mname, m in model.named_modules():
            kernel = kernel_for(m)
            own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
            if kernel is None or not own:
                continue
            full = {pn: (f"{mname}.{pn}" if mname else pn) for pn, _ in own}
            if set(full) - {"weight", "bias"} or any(v not in offsets or v in self.paths.unhooked
                                                     for v in full.values()):
                continue
            lay = _Layer(mname, m, kernel, weight=offsets.get(full.get("weight", "")),
                         bias=offsets.get(full.get("bias", "")))
            self.layers.append(lay)
            covered.update(full.values())
        self.generic_names = [k for k in self.names if k not in covered]
        self._probe(x_probe[:1])

    # ---- shapes ------------------------------------------------------------------------------
    def _probe(self, x1: Inputs) -> None:
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

    def capture(self, x: Inputs, need_grads: bool = True, layers: list[_Layer] | None = None
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
            with eval_mode(self.model), torch.enable_grad(), self.paths.context():
                if need_grads:
                    logits = call_model(self.model, x)
                else:   # with autograd on, as in a real capture (no-grad fast paths bypass the hooks)
                    call_model(self.model, x)
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

    def generic_rows(self, x: Inputs) -> list[tuple[tuple[int, int], Tensor]]:
        """Per-row gradients of the parameters outside covered layers (the kernels' torch.func fallback)."""
        if not self.generic_names:
            return []
        b, c = len(x), self.num_classes
        xm = _main(x)
        cot = torch.eye(c, dtype=xm.dtype if xm.is_floating_point() else self.params[self.names[0]].dtype,
                        device=xm.device).expand(b, c, c)
        with eval_mode(self.model), self.paths.context():
            jac = func_per_sample_grads(self.model, self.params, self.generic_names, self.buffers, x, cot,
                                        per_sample=self.paths.per_sample)
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

def activation_numel_per_sample(model: nn.Module, x1: Inputs) -> int:
    """Σ of the output sizes of every leaf module for one sample (what autograd keeps for a backward)."""
    total = [0]

    def hook(mod, inp, out):
        if isinstance(out, Tensor):
            total[0] += out[0].numel() if out.ndim else 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad(), eval_mode(model):
            call_model(model, x1[:1])
    finally:
        for h in handles:
            h.remove()
    return max(total[0], int(_main(x1)[:1].numel()))


def batch_for_budget(model: nn.Module, x: Inputs, budget: int, cap: int = 256) -> int:
    """Samples per forward+backward so that the autograd activations stay within ``budget`` bytes."""
    per = 3 * activation_numel_per_sample(model, x) * max(_main(x).element_size(), 4)
    return max(1, min(cap, int(budget // max(per, 1))))


def _micro_batch(engine: JacobianRows, itemsize: int, budget: int) -> int:
    return max(1, int(budget // max(engine.bytes_per_sample(itemsize), 1)))

