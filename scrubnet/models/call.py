"""How scrubnet calls a user's model: several inputs in, logits out.

**Inputs.** A model may need more than one tensor per sample (a HuggingFace classifier takes
``input_ids`` plus ``attention_mask`` and ``token_type_ids``). Such inputs travel through scrubnet as a
:class:`ModelInputs`: the main input (passed positionally) and named extras (passed as keyword arguments),
all with the same leading sample dimension. A :class:`ModelInputs` indexes, slices, moves and concatenates
like a tensor along that dimension, and is a pytree node, so ``torch.func.vmap`` and ``functional_call`` map
over it like over a tuple of tensors. A plain tensor input stays a plain tensor.

**Outputs.** The model's output is reduced to one logits tensor of shape ``(n, c)`` by :func:`as_logits`:
a tensor as it is; a tuple or list, its first element; a mapping, its ``"logits"`` entry; any other object,
its ``logits`` attribute (HuggingFace's ``ModelOutput``).

Every forward pass in scrubnet goes through :func:`call_model` (ordinary autograd) or
:func:`call_functional` (``torch.func.functional_call`` with given parameters and buffers).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, Union

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.func import functional_call


class ModelInputs:
    """A main input tensor and named extra inputs, with one leading sample dimension.

    Parameters
    ----------
    main : Tensor, shape (n, ...)
        The input passed positionally (e.g. ``input_ids`` of shape (n, L), or images (n, C, H, W)).
    extras : mapping of str to Tensor, each of shape (n, ...)
        Inputs passed as keyword arguments (e.g. ``attention_mask`` of shape (n, L)).

    Returns
    -------
    ModelInputs
        What :func:`call_model` and :func:`call_functional` take in place of a tensor: indexed, sliced and moved
        (``.to()``) along dim 0, joined by :func:`cat_inputs`, a pytree node for ``vmap`` / ``functional_call``.
    """

    __slots__ = ("main", "extras")

    def __init__(self, main: Tensor, extras: Mapping[str, Tensor] | None = None):
        self.main = main
        self.extras = dict(extras or {})
        for k, v in self.extras.items():
            if isinstance(v, Tensor) and isinstance(main, Tensor) and v.dim() > 0 and main.dim() > 0 \
                    and v.shape[0] != main.shape[0]:
                raise ValueError(f"extra input {k!r} holds {v.shape[0]} samples, the main input {main.shape[0]}")

    # --- tensor-like along the sample dimension -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.main)

    @property
    def shape(self) -> torch.Size:
        """The main input's shape (the sample count is ``shape[0]``)."""
        return self.main.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.main.dtype

    @property
    def device(self) -> torch.device:
        return self.main.device

    def __getitem__(self, idx) -> "ModelInputs":
        return ModelInputs(self.main[idx], {k: v[idx] for k, v in self.extras.items()})

    def to(self, *args, **kwargs) -> "ModelInputs":
        """Moves every tensor; a dtype conversion applies to floating tensors only (token ids keep theirs)."""
        def move(t: Tensor) -> Tensor:
            if not t.is_floating_point():
                kw = {k: v for k, v in kwargs.items() if k != "dtype"}
                a = [x for x in args if not isinstance(x, torch.dtype)]
                return t.to(*a, **kw) if (a or kw) else t
            return t.to(*args, **kwargs)
        return ModelInputs(move(self.main), {k: move(v) for k, v in self.extras.items()})

    def detach(self) -> "ModelInputs":
        return ModelInputs(self.main.detach(), {k: v.detach() for k, v in self.extras.items()})

    def clone(self) -> "ModelInputs":
        return ModelInputs(self.main.clone(), {k: v.clone() for k, v in self.extras.items()})

    def unsqueeze(self, dim: int) -> "ModelInputs":
        return ModelInputs(self.main.unsqueeze(dim), {k: v.unsqueeze(dim) for k, v in self.extras.items()})

    def call_args(self) -> tuple[tuple, dict]:
        return (self.main,), dict(self.extras)

    @staticmethod
    def cat(parts: Iterable["ModelInputs"]) -> "ModelInputs":
        parts = list(parts)
        keys = list(parts[0].extras)
        if any(list(p.extras) != keys for p in parts):
            raise ValueError("cannot concatenate inputs with different extra fields")
        return ModelInputs(torch.cat([p.main for p in parts]),
                           {k: torch.cat([p.extras[k] for p in parts]) for k in keys})

    def __repr__(self) -> str:
        ex = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.extras.items())
        return f"ModelInputs(main={tuple(self.main.shape)}{', ' + ex if ex else ''})"


def _flatten(mi: ModelInputs):
    keys = list(mi.extras)
    return [mi.main, *[mi.extras[k] for k in keys]], keys


def _unflatten(values, keys):
    values = list(values)
    return ModelInputs(values[0], dict(zip(keys, values[1:])))


pytree.register_pytree_node(ModelInputs, _flatten, _unflatten,
                            serialized_type_name="scrubnet.models.call.ModelInputs")

#: what scrubnet accepts as a model input
Inputs = Union[Tensor, ModelInputs]


def floating_to(x: Inputs, dtype: torch.dtype) -> Inputs:
    """``x`` with its floating tensors cast to ``dtype``; integer and boolean inputs (token ids, masks) kept.

    Parameters
    ----------
    x : Tensor or ModelInputs, shape (n, ...)
    dtype : torch.dtype
        A floating dtype (e.g. ``torch.float64`` for the solvers that work in double precision).

    Returns
    -------
    Tensor or ModelInputs of the same structure and shapes.
    """
    if isinstance(x, ModelInputs):
        return ModelInputs(floating_to(x.main, dtype), {k: floating_to(v, dtype) for k, v in x.extras.items()})
    return x.to(dtype) if x.is_floating_point() else x


def input_parts(x: Inputs) -> list[Tensor]:
    """Every tensor of ``x``: ``[x]`` for a tensor, the main input then the extras for a ModelInputs."""
    return [x.main, *x.extras.values()] if isinstance(x, ModelInputs) else [x]


def cat_inputs(parts: Iterable[Inputs]) -> Inputs:
    """Concatenate inputs along the sample dimension (tensors or :class:`ModelInputs`)."""
    parts = list(parts)
    if parts and isinstance(parts[0], ModelInputs):
        return ModelInputs.cat(parts)
    return torch.cat(parts)


def as_logits(out: Any) -> Tensor:
    """The logits in a model's output (module docstring); ``TypeError`` naming what was found otherwise."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if isinstance(out, Mapping) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise TypeError(f"the model returned {type(out).__name__}; scrubnet reads logits from a tensor, the first "
                    "element of a tuple, a mapping's 'logits' or an object's .logits")


def _args(x: Inputs) -> tuple[tuple, dict]:
    return x.call_args() if isinstance(x, ModelInputs) else ((x,), {})


def call_model(model: nn.Module, x: Inputs) -> Tensor:
    """``model``'s logits on ``x``: shape (n, c) (ordinary autograd)."""
    args, kwargs = _args(x)
    return as_logits(model(*args, **kwargs))


def call_functional(model: nn.Module, params_and_buffers, x: Inputs) -> Tensor:
    """``model``'s logits on ``x`` with the given parameters and buffers (``torch.func.functional_call``).

    ``params_and_buffers`` is a dict or a tuple of dicts, as ``functional_call`` takes it.
    """
    args, kwargs = _args(x)
    return as_logits(functional_call(model, params_and_buffers, args, kwargs))
