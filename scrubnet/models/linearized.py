"""Linearised networks: first-order Taylor expansion of any ``nn.Module`` in (a chosen subset of) its weights.

    f_lin(x) = f_{w0}(x) + J(x)·Δw,        J(x) = ∂f_w(x)/∂w |_{w0} ∈ R^{c×p}

``Δw`` (the *tangent*) is the only trainable state: one ``nn.Parameter`` per linearised parameter tensor,
initialised at 0, so at construction f_lin = f_{w0}. Both terms come out of **one forward-mode pass**
(``torch.func.jvp`` over ``functional_call``); gradients w.r.t. ``Δw`` flow back through the JVP
(reverse-over-forward), so the linear model trains with any ordinary optimiser.

Decisions (the papers are silent):
* The frozen network is kept in **eval mode** whatever ``.train()`` says: BatchNorm uses its running
  statistics (a per-sample function, which is what the linearisation argument needs), dropout is off.
* ``prefixes`` selects the linearised parameters by name prefix (e.g. ``("features.3", "head")`` = the
  last block and the head); the others stay at w0 and contribute nothing to J.
* ``leaky_slope`` converts every ``nn.ReLU`` module to ``nn.LeakyReLU(leaky_slope)`` first (LQF, Ch. 5):
  with ReLU the filters that are off at w0 get zero Jacobian and never train. Functional ``F.relu`` calls
  inside ``forward`` cannot be seen and are left alone.
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch
from torch import Tensor, nn
from torch.func import jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from scrubnet.models.call import Inputs, ModelInputs, call_functional, call_model


def convert_relu_to_leaky(model: nn.Module, slope: float = 0.01) -> nn.Module:
    """Replace every ``nn.ReLU`` submodule of ``model`` by ``nn.LeakyReLU(slope)`` in place; returns it."""
    if not slope >= 0:
        raise ValueError(f"leaky slope must be ≥ 0, got {slope}")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.ReLU):
            setattr(model, name, nn.LeakyReLU(slope))
        else:
            convert_relu_to_leaky(child, slope)
    return model


def select_parameter_names(model: nn.Module, prefixes: Iterable[str] | None) -> list[str]:
    """Names of ``model``'s parameters that start with one of ``prefixes`` (all when ``None``).

    A prefix matches a whole dotted component (``"head"`` matches ``head.weight`` but not ``header.w``).
    Raises ``ValueError`` if a prefix matches nothing."""
    names = [n for n, _ in model.named_parameters()]
    if prefixes is None:
        return names
    prefixes = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    if not prefixes:
        raise ValueError("empty list of parameter prefixes: nothing would be linearised")
    chosen = []
    for pre in prefixes:
        hits = [n for n in names if n == pre or n.startswith(pre.rstrip(".") + ".")]
        if not hits:
            raise ValueError(f"prefix {pre!r} matches no parameter; parameters are: {', '.join(names[:20])}")
        chosen += hits
    return [n for n in names if n in set(chosen)]  # model order, no duplicates


class LinearizedModel(nn.Module):
    """f_lin(x) = f_{w0}(x) + J(x)·Δw around a frozen copy of ``base`` (see module docstring).

    Attributes: ``base`` (frozen copy, eval mode, ``requires_grad=False``), ``linearized_names``
    (parameter names of ``base`` in J), ``delta`` (``nn.ParameterList`` of Δw tensors, same order).
    Inputs/outputs are those of ``base``: x (B, …) → logits (B, c).
    """

    def __init__(self, base: nn.Module, prefixes: Iterable[str] | None = None, leaky_slope: float | None = None):
        super().__init__()
        base = copy.deepcopy(base)
        if leaky_slope is not None:
            convert_relu_to_leaky(base, leaky_slope)
        base.eval()
        for p in base.parameters():
            p.requires_grad_(False)
        self.base = base
        self.linearized_names = select_parameter_names(base, prefixes)
        params = dict(base.named_parameters())
        self.delta = nn.ParameterList([nn.Parameter(torch.zeros_like(params[n])) for n in self.linearized_names])

    # -- the frozen network is always in eval mode -------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self.base.eval()
        return self

    def _primals(self) -> dict[str, Tensor]:
        params = dict(self.base.named_parameters())
        return {n: params[n].detach() for n in self.linearized_names}

    def _as_tangent_dict(self, tangent) -> dict[str, Tensor]:
        if tangent is None:
            return {n: d for n, d in zip(self.linearized_names, self.delta)}
        if isinstance(tangent, dict):
            return {n: tangent[n] for n in self.linearized_names}
        if isinstance(tangent, Tensor) and tangent.ndim == 1:
            return self.unflatten(tangent)
        if isinstance(tangent, (list, tuple)):
            return dict(zip(self.linearized_names, tangent))
        raise TypeError("tangent must be None, a dict name→tensor, a list of tensors or a flat vector")

    def core_forward(self, x: Inputs) -> Tensor:
        """f_{w0}(x), the frozen network alone (its logits, :func:`~scrubnet.models.call.as_logits`)."""
        return call_model(self.base, x)

    def output_and_jvp(self, x: Tensor, tangent=None) -> tuple[Tensor, Tensor]:
        """(f_{w0}(x), J(x)·v) in one forward-mode pass; v defaults to Δw. Shapes (B, c) each."""
        tangents = self._as_tangent_dict(tangent)
        primals = self._primals()

        def f(p):
            return call_functional(self.base, p, x)

        # forward-mode AD is implemented for the composite attention kernel only (not the fused CPU ones)
        with sdpa_kernel([SDPBackend.MATH]):
            return jvp(f, (primals,), (tangents,))

    def forward(self, x: Inputs, **extras: Tensor) -> Tensor:
        """f_{w0}(x) + J(x)·Δw, shape (B, c); keyword inputs join ``x`` as extras (as :func:`call_model` passes
        a :class:`~scrubnet.models.call.ModelInputs`)."""
        if extras:
            x = ModelInputs(x.main, {**x.extras, **extras}) if isinstance(x, ModelInputs) else ModelInputs(x, extras)
        out, jv = self.output_and_jvp(x)
        return out + jv

    def jvp(self, x: Tensor, tangent) -> Tensor:
        """J(x)·v, (B, c), for a tangent ``v`` (flat vector of length p, dict or list)."""
        return self.output_and_jvp(x, tangent)[1]

    def vjp(self, x: Tensor, cotangent: Tensor) -> Tensor:
        """J(x)ᵀ·u as a flat vector of length p, for u of shape (B, c) (summed over the batch).

        One reverse pass of ordinary autograd through ``functional_call`` (``torch.func.vjp`` computes the same
        product but its first call costs ≈1.7 s of lazy imports, paid by every short-lived CLI process)."""
        primals = {n: t.clone().requires_grad_(True) for n, t in self._primals().items()}
        with torch.enable_grad():
            out = call_functional(self.base, primals, x)
            grads = torch.autograd.grad(out, [primals[n] for n in self.linearized_names], cotangent,
                                        allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(primals[n])).reshape(-1)
                          for n, g in zip(self.linearized_names, grads)])

    # -- flat views of Δw -------------------------------------------------------------------------
    @property
    def num_linearized(self) -> int:
        return sum(d.numel() for d in self.delta)

    def delta_flat(self) -> Tensor:
        """Δw as one flat vector (a detached copy), in ``linearized_names`` order."""
        return torch.cat([d.detach().reshape(-1) for d in self.delta]).clone()

    def unflatten(self, vec: Tensor) -> dict[str, Tensor]:
        if vec.numel() != self.num_linearized:
            raise ValueError(f"vector has {vec.numel()} entries, the linearised parameters need {self.num_linearized}")
        out, i = {}, 0
        for n, d in zip(self.linearized_names, self.delta):
            out[n] = vec[i:i + d.numel()].view_as(d)
            i += d.numel()
        return out

    @torch.no_grad()
    def set_delta_flat(self, vec: Tensor) -> "LinearizedModel":
        parts = self.unflatten(vec.to(self.delta[0].dtype))
        for n, d in zip(self.linearized_names, self.delta):
            d.copy_(parts[n])
        return self

    @torch.no_grad()
    def reset_delta(self) -> "LinearizedModel":
        """Δw ← 0: the model becomes the frozen network f_{w0} exactly."""
        for d in self.delta:
            d.zero_()
        return self
