"""K-FAC: Kronecker-factored approximation of the Fisher / Gauss–Newton matrix of Linear and Conv layers.

For a layer with input activations a_n (bias column 1 appended) and output pre-activations s_n, the GGN

    F = (1/N) Σ_n J_nᵀ Λ_n J_n,       Λ_n = ∂²ℓ/∂f² (c×c), J_n = ∂f(x_n)/∂w

restricted to the layer's weight matrix W̃ = [W | b] (out × in+1, row-major) is approximated (Martens &
Grosse 2015; Grosse & Martens 2016 for convolutions, spatially uncorrelated derivatives) by

    F_layer ≈ G ⊗ A,   A = (1/(N·T)) Σ_{n,t} a_{n,t} a_{n,t}ᵀ,   G = (1/N) Σ_{n,t} Σ_k g_{n,t,k} g_{n,t,k}ᵀ,

where g_{n,t,k} = ∂(f(x_n)ᵀ s_k(x_n))/∂s_{n,t} is the back-propagated k-th column s_k of a square root of
Λ_n (``loss='mse'``: Λ = I, columns e_k; ``loss='ce'``: Λ = diag(p) − p pᵀ, S = diag(√p) − p √pᵀ, so
S Sᵀ = Λ). T is the number of spatial positions (1 for Linear). For a single Linear layer with MSE the
factorisation is exact: g = e_k, so F = I ⊗ E[a aᵀ]. Cost: one forward and c backward passes per batch.

The damped inverse (G ⊗ A + λ I)⁻¹ is applied exactly in the Kronecker eigenbasis:
    (G ⊗ A + λI)⁻¹ vec(V) = vec(Q_G [(Q_Gᵀ V Q_A) ⊘ (s_G s_Aᵀ + λ)] Q_Aᵀ).

Only ``nn.Linear`` and ``nn.Conv1d/2d`` (groups = 1, zero padding) are factored; other parameters (e.g.
BatchNorm γ/β) are left to the caller (the LQF trainer passes their gradient through unchanged).
curvlinops' ``KFACLinearOperator`` implements the same object; it is not a dependency of scrubnet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import probe_paths
from scrubnet.curvature.kernels import kernel_for
from scrubnet.models.call import Inputs, call_model


@dataclass
class KFACFactor:
    """Factors of one layer: ``A`` ((in·k + bias) square), ``G`` (out square) and their eigenbases."""

    module_name: str
    has_bias: bool
    A: Tensor
    G: Tensor
    eig_A: tuple[Tensor, Tensor] | None = None
    eig_G: tuple[Tensor, Tensor] | None = None

    def eig(self):
        if self.eig_A is None:
            self.eig_A = torch.linalg.eigh(self.A)
            self.eig_G = torch.linalg.eigh(self.G)
        return self.eig_A, self.eig_G

    def dense(self) -> Tensor:
        """G ⊗ A in the ordering of vec([W | b]) row-major — only for tests / tiny layers."""
        return torch.kron(self.G, self.A)


def _loss_hessian_sqrt(logits: Tensor, loss) -> Tensor:
    """S (N, c, c) with S Sᵀ = ∂²ℓ/∂f² per sample; columns are the cotangents to back-propagate (a
    :class:`~scrubnet.models.loss.LossSpec` by its kind: smoothing and target scale leave ∂²ℓ/∂f² unchanged)."""
    loss = getattr(loss, "kind", loss)
    n, c = logits.shape
    if loss == "mse":
        return torch.eye(c, dtype=logits.dtype, device=logits.device).expand(n, c, c)
    if loss == "ce":
        p = torch.softmax(logits.detach(), dim=1)
        sp = p.sqrt()
        return torch.diag_embed(sp) - p.unsqueeze(2) * sp.unsqueeze(1)
    raise ValueError(f"unknown loss {loss!r}: use 'mse' or 'ce'")


def param_name(module_name: str, what: str) -> str:
    """Full parameter name of ``what`` ('weight'/'bias') of the module called ``module_name`` ('' = root)."""
    return f"{module_name}.{what}" if module_name else what


def kfac_layers(model: nn.Module, names: list[str] | None = None) -> dict[str, nn.Module]:
    """The factorable layers of ``model`` by module name (optionally only those in ``names``): the modules
    whose registered kernel (:mod:`scrubnet.curvature.kernels`) is factored — Linear, and Conv1d/Conv2d
    with groups = 1 and numeric zero padding."""
    out = {}
    for n, m in model.named_modules():
        kernel = kernel_for(m)
        if kernel is not None and kernel.factored:
            out[n] = m
    if names is not None:
        missing = [n for n in names if n not in out]
        if missing:
            raise ValueError(f"not factorable (Linear/Conv, groups=1, zero padding) layers of the model: {missing}")
        out = {n: out[n] for n in names}
    return out


@torch.no_grad()
def _accumulate(dst: dict, key: str, val: Tensor) -> None:
    dst[key] = dst[key] + val if key in dst else val


def compute_kfac(model: nn.Module, x: Inputs, *, loss: str = "mse", layers: list[str] | None = None,
                 batch_size: int = 512) -> dict[str, KFACFactor]:
    """K-FAC factors of ``model`` (evaluated in eval mode at its current weights) on inputs ``x``.

    Returns ``{module_name: KFACFactor}`` with A, G as in the module docstring (means over the N samples).
    """
    mods = kfac_layers(model, layers)
    if not mods:
        raise ValueError("the model has no Linear/Conv layers to factor")
    was_training = model.training
    model.eval()
    paths = probe_paths(model, x)   # fused kernels off where they bypass the hooks or lack derivatives
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}
    handles = []
    for name, m in mods.items():
        def hook(mod, inp, out, name=name):
            inputs[name] = inp[0].detach()
            outputs[name] = out
        handles.append(m.register_forward_hook(hook))
    sums_a: dict[str, Tensor] = {}
    sums_g: dict[str, Tensor] = {}
    counts_t: dict[str, int] = {}
    n_total = len(x)
    try:
        for i in range(0, n_total, batch_size):
            xb = x[i:i + batch_size]
            if isinstance(xb, Tensor) and xb.is_floating_point():
                xb = xb.clone().requires_grad_(True)
            with torch.enable_grad(), paths.context():
                logits = call_model(model, xb)
                s = _loss_hessian_sqrt(logits, loss)
                names = [n for n in mods if n in outputs]   # a hook that never fires: no factor
                outs = [outputs[n] for n in names]
                for k in range(logits.shape[1]):
                    grads = torch.autograd.grad(logits, outs, grad_outputs=s[:, :, k], retain_graph=True,
                                                allow_unused=True)
                    for n, g in zip(names, grads):
                        if g is None:
                            continue
                        rows = kernel_for(mods[n]).output_rows(mods[n], g.detach().unsqueeze(0))[0]
                        _accumulate(sums_g, n, torch.einsum("nti,ntj->ij", rows, rows))
            for n, m in mods.items():
                if n not in inputs:
                    continue
                a = kernel_for(m).patches(m, inputs[n])
                if m.bias is not None:
                    a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
                counts_t[n] = a.shape[1]
                _accumulate(sums_a, n, torch.einsum("nti,ntj->ij", a, a))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: KFACFactor(n, mods[n].bias is not None, sums_a[n] / (n_total * counts_t[n]), sums_g[n] / n_total)
            for n in mods if n in sums_g}


def _as_matrix(weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
    v = weight_grad.reshape(weight_grad.shape[0], -1)
    return torch.cat([v, bias_grad.reshape(-1, 1)], dim=1) if bias_grad is not None else v


def kfac_inverse_apply(factor: KFACFactor, weight_grad: Tensor, bias_grad: Tensor | None,
                       damping: float) -> tuple[Tensor, Tensor | None]:
    """(G ⊗ A + λI)⁻¹ applied to the layer gradient (W-shaped, b-shaped); returns the same shapes."""
    (s_a, q_a), (s_g, q_g) = factor.eig()
    v = _as_matrix(weight_grad, bias_grad).to(q_a.dtype)
    inner = q_g.T @ v @ q_a
    inner = inner / (s_g.clamp_min(0)[:, None] * s_a.clamp_min(0)[None, :] + damping)
    out = q_g @ inner @ q_a.T
    if bias_grad is not None:
        return out[:, :-1].reshape(weight_grad.shape).to(weight_grad.dtype), out[:, -1].to(bias_grad.dtype)
    return out.reshape(weight_grad.shape).to(weight_grad.dtype), None


class KFACPreconditioner:
    """P(g) = (G ⊗ A + λI)⁻¹ g per factored layer, identity on the other parameters.

    ``param_names`` lists the parameters (``"<module>.weight"``, ``"<module>.bias"``; see :func:`param_name`)
    in the order of the flat vectors passed to :meth:`__call__`, and ``shapes`` their shapes.
    """

    def __init__(self, factors: dict[str, KFACFactor], param_names: list[str], shapes: list[torch.Size],
                 damping: float):
        if damping <= 0:
            raise ValueError(f"K-FAC damping must be positive, got {damping}")
        self.factors, self.damping = factors, float(damping)
        self.param_names, self.shapes = list(param_names), list(shapes)
        self.offsets = {}
        i = 0
        for n, s in zip(self.param_names, self.shapes):
            k = 1
            for d in s:
                k *= int(d)
            self.offsets[n] = (i, k, s)
            i += k
        self.size = i

    def __call__(self, g: Tensor) -> Tensor:
        if g.numel() != self.size:
            raise ValueError(f"gradient has {g.numel()} entries, preconditioner expects {self.size}")
        out = g.clone()
        for mod, fac in self.factors.items():
            wn, bn = param_name(mod, "weight"), param_name(mod, "bias")
            if wn not in self.offsets:
                continue
            i, k, s = self.offsets[wn]
            wg = g[i:i + k].view(s)
            bg = None
            if fac.has_bias:
                if bn not in self.offsets:  # bias not linearised: factor includes it, drop its row/col
                    raise ValueError(f"parameter {bn} is not among the preconditioned parameters; "
                                     "linearise weight and bias of a layer together")
                j, kb, sb = self.offsets[bn]
                bg = g[j:j + kb].view(sb)
            pw, pb = kfac_inverse_apply(fac, wg, bg, self.damping)
            out[i:i + k] = pw.reshape(-1)
            if pb is not None:
                out[j:j + kb] = pb.reshape(-1)
        return out
