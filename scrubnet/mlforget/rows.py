"""Per-sample Jacobian rows of a network in a subset of its weights, for any model input.

J_i = ∂f(x_i)/∂w ∈ R^{c×p} for every sample of a batch: one ``jacrev`` per sample, vmapped over the samples
(``torch.func.vmap``). A network with data-dependent control flow in its forward cannot be vmapped over its
inputs — a HuggingFace transformer inspects its attention mask (``mask.all()``) to pick a kernel — and then the
rows are computed one sample at a time (the same numbers, a Python loop). The model is called through
:func:`~scrubnet.models.call.call_functional`, so a :class:`~scrubnet.models.call.ModelInputs` brings its
extra inputs (attention masks) along.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from scrubnet.models.call import Inputs, call_functional


def per_sample_jacobian(net: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], names: list[str],
                        x: Inputs, num_classes: int) -> Tensor:
    """The Jacobians of ``net``'s logits in the parameters ``names`` at ``params``, one per sample.

    Parameters
    ----------
    net : nn.Module
        Called as ``functional_call(net, (params, buffers), x)``; must be in eval mode (per-sample outputs).
    params, buffers : dict of str to Tensor
        Every parameter and buffer of ``net``.
    names : list of str
        The parameters differentiated (their order is the columns' order, each flattened).
    x : Tensor or ModelInputs, B samples
    num_classes : int
        c, the number of logits.

    Returns
    -------
    Tensor, shape (B, c, p)
        p = the total size of the parameters ``names``.
    """
    frozen = {n: p for n, p in params.items() if n not in set(names)}
    w = {n: params[n] for n in names}

    def f(wd, xi):
        return call_functional(net, ({**frozen, **wd}, buffers), xi.unsqueeze(0)).squeeze(0)

    b = len(x)
    with sdpa_kernel([SDPBackend.MATH]):  # the fused CPU attention kernels have no batching rule
        return _rows(f, w, x, b, names, num_classes)


def _rows(f, w: dict[str, Tensor], x: Inputs, b: int, names: list[str], num_classes: int) -> Tensor:
    try:
        jac = vmap(jacrev(f), in_dims=(None, 0))(w, x)
    except RuntimeError as e:
        if "vmap" not in str(e):
            raise
        # data-dependent control flow in the forward (module docstring): one sample at a time
        per = [jacrev(f)(w, x[i]) for i in range(b)]
        jac = {n: torch.stack([r[n] for r in per]) for n in names}
    return torch.cat([jac[n].reshape(b, num_classes, -1) for n in names], 2)
