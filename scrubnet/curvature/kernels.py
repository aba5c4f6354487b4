"""Per-layer curvature kernels: one registry of the closed forms that the Fisher diagonal, the NTK Gram and
K-FAC share ("Curvature kernels" in docs/decisions/index.md).

Every consumer runs one forward pass with hooks that keep each layer's input ``a`` (B, ...) and then
back-propagates K cotangents to the layer *outputs* only, giving ``g`` (K, B, ...) — the gradient of K
per-sample-separable scalars with respect to that layer's output (eval mode: BatchNorm uses its running
statistics, so sample i's output gradient is its own). From (a, g) a kernel returns, in closed form:

* :meth:`LayerKernel.per_sample_grads` — {"weight" | "bias": (B, K, numel)}: the per-sample gradients
  ∂s_k(x_i)/∂θ of the layer's own parameters (NTK rows, per-sample Fisher terms);
* :meth:`LayerKernel.squared_sums` — {"weight" | "bias": param-shaped}: Σ_k Σ_i (∂s_k(x_i)/∂θ)² (the Fisher
  diagonal), without materialising per-sample gradients where a cheaper form exists (Linear: (Σ_k g_k²)ᵀ a²);
* for *factored* kernels (Linear, Conv1d/Conv2d: θ acts on input patches), :meth:`LayerKernel.patches`
  (B, T, d_in) and :meth:`LayerKernel.output_rows` (K, B, T, d_out), with T positions per sample, so that
  the per-sample weight gradient is Σ_t g_t a_tᵀ — the factors of the ghost NTK contraction and of K-FAC.

Registered kernels (:func:`register_kernel`): ``nn.Linear`` (any leading dims: positions = all but the
last), ``nn.Conv1d``/``nn.Conv2d`` (groups = 1, numeric zero padding; a Conv1d is unfolded as a Conv2d of
height 1 by the one helper :func:`unfold_patches`) and BatchNorm with running statistics (eval mode:
y = γ·x̂ + β with x̂ from the running mean/variance). :func:`kernel_for` is the one place that decides
whether a module is covered; anything else goes to the generic ``torch.func`` fallback
:func:`func_per_sample_grads` (vmap over samples of VJPs vmapped over the K cotangents), exact for any
module, slower.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vjp, vmap

from scrubnet.models.call import Inputs, call_functional


class LayerKernel:
    """Closed forms for one layer type (see the module docstring); subclasses register themselves."""

    kind = "generic"
    factored = False   # True: the weight acts on input patches (patches/output_rows defined)

    def supports(self, module: nn.Module) -> bool:
        return True

    # ---- factored layers ---------------------------------------------------------------------
    def patches(self, module: nn.Module, a: Tensor) -> Tensor:
        """Layer input as patches (B, T, d_in)."""
        raise NotImplementedError(f"{type(self).__name__} is not a factored kernel")

    def output_rows(self, module: nn.Module, g: Tensor) -> Tensor:
        """Output gradients g (K, B, ...) as rows (K, B, T, d_out)."""
        raise NotImplementedError(f"{type(self).__name__} is not a factored kernel")

    def shape(self, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
              ) -> tuple[int, int, int]:
        """(d_in, d_out, T) for one sample with input shape ``in_shape`` and output shape ``out_shape``
        (both without the batch dimension)."""
        raise NotImplementedError

    # ---- every layer -------------------------------------------------------------------------
    def per_sample_grads(self, module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
        """{"weight"/"bias": (B, K, numel)} per-sample gradients from input a (B, ...), g (K, B, ...)."""
        k, b = g.shape[0], g.shape[1]
        pa = self.patches(module, a)                                   # (B, T, d_in)
        go = self.output_rows(module, g)                               # (K, B, T, d_out)
        d_out, t = go.shape[-1], go.shape[-2]
        out = {}
        if getattr(module, "weight", None) is not None:
            gt = go.permute(1, 0, 3, 2).reshape(b, k * d_out, t)       # (B, K·d_out, T)
            out["weight"] = torch.bmm(gt, pa).reshape(b, k, -1)        # Σ_t g_t a_tᵀ per (sample, k)
        if getattr(module, "bias", None) is not None:
            out["bias"] = go.sum(2).permute(1, 0, 2)                   # (B, K, d_out)
        return out

    def squared_sums(self, module: nn.Module, a: Tensor, g: Tensor, max_bytes: int | None = None
                     ) -> dict[str, Tensor]:
        """{"weight"/"bias": param-shaped} Σ_k Σ_i (per-sample gradient)².

        ``max_bytes`` bounds the per-sample temporaries (unfolded patches, output rows, per-sample gradients
        of one sample chunk): the samples are processed in chunks that fit (at least one sample)."""
        b, k = a.shape[0], g.shape[0]
        step = b
        if max_bytes is not None and b > 1:
            numel = sum(t.numel() for t in (getattr(module, "weight", None), getattr(module, "bias", None))
                        if t is not None)
            per_sample = a.element_size() * (k * numel + 2 * a[0].numel() * self.unfold_factor(module)
                                             + 2 * g[0, 0].numel() * k)
            step = max(1, min(b, int(max_bytes // max(per_sample, 1))))
        out: dict[str, Tensor] = {}
        for s in range(0, b, step):
            for name, rows in self.per_sample_grads(module, a[s:s + step], g[:, s:s + step]).items():
                flat = rows.reshape(-1, rows.shape[-1])
                sq = (flat * flat).sum(0).reshape(getattr(module, name).shape)
                out[name] = sq if name not in out else out[name] + sq
        return out

    def position_gram(self, module: nn.Module, g: Tensor) -> Tensor:
        """M (B, d_out, T, T) = Σ_k go_k go_kᵀ per sample and output channel, from g (K, B, ...) of a factored
        layer (go = output rows): accumulated over the output-Hessian columns, it gives the squared sums of
        every column at once (:meth:`squared_sums_from_position_gram`)."""
        go = self.output_rows(module, g)                                # (K, B, T, d_out)
        gt = go.permute(1, 3, 0, 2)                                     # (B, d_out, K, T)
        return torch.matmul(gt.transpose(-1, -2), gt)                   # (B, d_out, T, T)

    def squared_sums_from_position_gram(self, module: nn.Module, a: Tensor, m: Tensor,
                                        max_bytes: int | None = None) -> dict[str, Tensor]:
        """{"weight"/"bias"} Σ_i Σ_k (Σ_t g_kot a_tj)² = Σ_i Σ_{t,t'} M_i[o,t,t'] a_it·j a_it'·j from the
        position Gram M (B, d_out, T, T) and the layer input a: the pairs t ≤ t' (off-diagonal ones twice)
        as one GEMM over samples and pairs (d_out × B·P)(B·P × d_in); chunked over samples to ``max_bytes``."""
        pa = self.patches(module, a)                                    # (B, T, d_in)
        b, t, d_in = pa.shape
        d_out = m.shape[1]
        iu = torch.triu_indices(t, t, device=a.device)
        pair_w = torch.where(iu[0] == iu[1], 1.0, 2.0).to(m.dtype)      # (P,)
        per_sample = a.element_size() * iu.shape[1] * (d_in + d_out) * 2
        step = b if max_bytes is None else max(1, min(b, int(max_bytes // max(per_sample, 1))))
        out: dict[str, Tensor] = {}
        if getattr(module, "weight", None) is not None:
            w = torch.zeros(d_out, d_in, dtype=m.dtype, device=m.device)
            for s in range(0, b, step):
                mu = (m[s:s + step][:, :, iu[0], iu[1]] * pair_w)       # (b', d_out, P)
                au = pa[s:s + step][:, iu[0]] * pa[s:s + step][:, iu[1]]  # (b', P, d_in)
                w.addmm_(mu.permute(1, 0, 2).reshape(d_out, -1), au.reshape(-1, d_in))
            out["weight"] = w.reshape(module.weight.shape).clamp_(min=0)
        if getattr(module, "bias", None) is not None:
            out["bias"] = m.sum(dim=(0, 2, 3)).clamp_(min=0)
        # sums of squares written as Gram contractions: where the true value is 0 (e.g. the key bias of an
        # attention layer, which softmax cancels) rounding can leave −1e-12; clamping restores the sign
        return out

    def unfold_factor(self, module: nn.Module) -> int:
        """How many times larger a sample's unfolded input is than its input (conv: the kernel size)."""
        return 1


_REGISTRY: list[tuple[tuple[type, ...], LayerKernel]] = []


def register_kernel(*module_types: type) -> Callable[[type], type]:
    """Class decorator: register a :class:`LayerKernel` subclass for ``module_types`` (first match wins)."""
    def deco(cls: type) -> type:
        _REGISTRY.append((tuple(module_types), cls()))
        return cls
    return deco


def kernel_for(module: nn.Module) -> LayerKernel | None:
    """The registered kernel covering ``module`` (its own parameters), or None (generic fallback)."""
    for types, kernel in _REGISTRY:
        if isinstance(module, types) and kernel.supports(module):
            return kernel
    return None


def registered_kernels() -> list[tuple[tuple[type, ...], LayerKernel]]:
    return list(_REGISTRY)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------

@register_kernel(nn.Linear)
class LinearKernel(LayerKernel):
    """y = W a + b on the last dimension; every leading dimension but the batch is a position."""

    kind, factored = "linear", True

    def patches(self, module, a):
        return a.reshape(a.shape[0], -1, a.shape[-1])

    def output_rows(self, module, g):
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def shape(self, module, in_shape, out_shape):
        return module.in_features, module.out_features, int(math.prod(in_shape[:-1]))

    def squared_sums(self, module, a, g, max_bytes=None):
        if a.ndim != 2:
            return super().squared_sums(module, a, g, max_bytes)
        g2 = (g * g).sum(0)                     # Σ_k (g_ki a_iᵀ)² summed over i = (Σ_k g_k²)ᵀ a²: no outer products
        out = {"weight": g2.T @ (a * a)}
        if module.bias is not None:
            out["bias"] = g2.sum(0)
        return out


def unfold_patches(module: nn.Conv1d | nn.Conv2d, a: Tensor) -> Tensor:
    """Input patches (B, T, C_in·k) of a Conv1d/Conv2d, in the order of ``weight.reshape(out, -1)``; a Conv1d
    is unfolded as a Conv2d of height 1 (the one unfold helper of the package)."""
    if isinstance(module, nn.Conv1d):
        cols = F.unfold(a.unsqueeze(2), (1, module.kernel_size[0]), dilation=(1, module.dilation[0]),
                        padding=(0, module.padding[0]), stride=(1, module.stride[0]))
    else:
        cols = F.unfold(a, module.kernel_size, dilation=module.dilation, padding=module.padding,
                        stride=module.stride)
    return cols.transpose(1, 2)


@register_kernel(nn.Conv1d, nn.Conv2d)
class ConvKernel(LayerKernel):
    """Convolution as a Linear layer on unfolded patches (groups = 1, numeric zero padding)."""

    kind, factored = "conv", True

    def supports(self, module):
        return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)

    def patches(self, module, a):
        return unfold_patches(module, a)

    def output_rows(self, module, g):
        return g.reshape(g.shape[0], g.shape[1], g.shape[2], -1).transpose(2, 3)

    def shape(self, module, in_shape, out_shape):
        return (module.in_channels * int(math.prod(module.kernel_size)), module.out_channels,
                int(math.prod(out_shape[1:])))

    def unfold_factor(self, module):
        return int(math.prod(module.kernel_size))


@register_kernel(nn.modules.batchnorm._BatchNorm)
class BatchNormKernel(LayerKernel):
    """Eval-mode BatchNorm y = γ·x̂ + β, x̂ = (a − running_mean)/√(running_var + eps), per channel (dim 1)."""

    kind = "bn"

    def supports(self, module):
        return module.running_mean is not None and module.running_var is not None

    def shape(self, module, in_shape, out_shape):
        return module.num_features, module.num_features, int(math.prod(out_shape[1:]))

    def per_sample_grads(self, module, a, g):
        k, b, ch = g.shape[0], g.shape[1], g.shape[2]
        view = (1, -1) + (1,) * (a.ndim - 2)
        xhat = (a - module.running_mean.view(view)) / torch.sqrt(module.running_var.view(view) + module.eps)
        gs = g.reshape(k, b, ch, -1)
        out = {}
        if module.weight is not None:
            out["weight"] = (gs * xhat.reshape(1, b, ch, -1)).sum(-1).transpose(0, 1)   # (B, K, C)
        if module.bias is not None:
            out["bias"] = gs.sum(-1).transpose(0, 1)
        return out


# --------------------------------------------------------------------------------------------------
# generic fallback
# --------------------------------------------------------------------------------------------------

def func_per_sample_grads(model: nn.Module, params: dict[str, Tensor], names: list[str],
                          buffers: dict[str, Tensor], x: Inputs, cotangents: Tensor,
                          output: Callable[[Tensor], Tensor] | None = None, per_sample: str = "vmap"
                          ) -> dict[str, Tensor]:
    """{name: (B, R, *shape)}: ∂(cotangents[i, r] · output(f(x_i)))/∂θ for the parameters ``names`` (the
    others held at ``params``), by ``torch.func``: vmap over samples of one VJP vmapped over the R
    cotangents (B, R, c). ``output`` maps the logits of one sample (default: identity; e.g. log-softmax for
    the Fisher). Works for any module; the model must be in eval mode (samples independent).
    ``per_sample="loop"``: the same numbers one sample at a time by autograd, where ``vmap`` does not run
    (:mod:`scrubnet.curvature.fallbacks`)."""
    if per_sample == "loop":
        return loop_per_sample_grads(model, params, names, buffers, x, cotangents, output)
    fixed = {k: v for k, v in params.items() if k not in names}
    free = {k: params[k] for k in names}

    def per_sample(p, xi, ci):
        def f(q):
            logits = call_functional(model, ({**fixed, **q}, buffers), xi.unsqueeze(0)).squeeze(0)
            return logits if output is None else output(logits)
        _, pull = vjp(f, p)
        (grads,) = vmap(pull)(ci)
        return grads

    return vmap(per_sample, in_dims=(None, 0, 0))(free, x, cotangents)


def loop_per_sample_grads(model: nn.Module, params: dict[str, Tensor], names: list[str],
                          buffers: dict[str, Tensor], x, cotangents: Tensor,
                          output: Callable[[Tensor], Tensor] | None = None) -> dict[str, Tensor]:
    """The per-sample twin of ``vmap``: {name: (B, R, *shape)} = ∂(cotangents[i, r]·output(f(x_i)))/∂θ, one
    sample at a time (batch 1) and one backward per cotangent, by ordinary autograd."""
    fixed = {k: v.detach() for k, v in params.items() if k not in names}
    free = {k: params[k].detach().requires_grad_(True) for k in names}
    b, r = cotangents.shape[0], cotangents.shape[1]
    out = {k: torch.zeros((b, r) + tuple(free[k].shape), dtype=free[k].dtype, device=free[k].device)
           for k in names}
    with torch.enable_grad():
        for i in range(b):
            logits = call_functional(model, ({**fixed, **free}, buffers), x[i:i + 1])[0]
            o = logits if output is None else output(logits)
            for j in range(r):
                gs = torch.autograd.grad(o, list(free.values()), grad_outputs=cotangents[i, j].to(o.dtype),
                                         retain_graph=j < r - 1, allow_unused=True)
                for k, g in zip(names, gs):
                    if g is not None:
                        out[k][i, j] = g
    return out
