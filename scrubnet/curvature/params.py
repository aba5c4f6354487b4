"""Flat-vector views of a module's parameters, for the curvature and solver code.

Every routine here orders parameters as ``model.named_parameters()`` does and only includes those
with ``requires_grad``; a flat vector has ``p = sum(numel)`` entries.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def trainable_params(model: nn.Module) -> dict[str, Tensor]:
    """``{name: detached parameter}`` for every parameter with ``requires_grad``."""
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def num_params(model: nn.Module) -> int:
    return sum(v.numel() for v in model.parameters() if v.requires_grad)


def flatten(tensors: dict[str, Tensor]) -> Tensor:
    """Concatenate a dict of tensors into one 1-D vector (dict order)."""
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def unflatten(vec: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector back into tensors shaped like ``like`` (same keys, same order)."""
    out, i = {}, 0
    for k, t in like.items():
        n = t.numel()
        out[k] = vec[i:i + n].view_as(t)
        i += n
    if i != vec.numel():
        raise ValueError(f"vector has {vec.numel()} entries, parameters need {i}")
    return out


def get_flat(model: nn.Module) -> Tensor:
    """The trainable parameters of ``model`` as one flat vector (a copy)."""
    return flatten(trainable_params(model)).clone()


@torch.no_grad()
def set_flat(model: nn.Module, vec: Tensor) -> nn.Module:
    """Write a flat vector into the trainable parameters of ``model`` (in place); returns the model."""
    params = [p for p in model.parameters() if p.requires_grad]
    i = 0
    for p in params:
        n = p.numel()
        p.copy_(vec[i:i + n].view_as(p))
        i += n
    if i != vec.numel():
        raise ValueError(f"vector has {vec.numel()} entries, model has {i} trainable parameters")
    return model
