"""The artifacts the methods of one seed share, and the one place their cache keys are built.

Expensive intermediate results — the Fisher diagonal of a model on D_r, the NTK direction (its Gram and two
ridge solves), the ML-Forgetting models, the protocol's retrain model — are computed once per seed and reused
by every method that needs the same thing. An entry is keyed by :class:`ArtifactKey`:

* ``kind``     what the artifact is ("fisher_diag", "ntk_direction", "mlforget", "retrain", …);
* ``weights``  sha256 of the weights it was computed from (every tensor of each model's ``state_dict``, or of
               a dict of tensors such as w_0, with names, dtypes and shapes), so two models with equal
               weights share and any change of a weight or a BatchNorm statistic does not;
* ``data``     sha256 of the data tensors (dtype, shape, bytes; device-independent);
* ``options``  canonical JSON of every option that changes the artifact (sorted keys, floats by ``repr``).

Two requests share an entry only if all four agree; :func:`artifact_key` is the only constructor used by the
package, and ``tests/methods/test_artifacts.py`` checks that options which change an artifact change its key.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch
from torch import Tensor, nn

from scrubnet.models.call import ModelInputs

T = TypeVar("T")
Weights = nn.Module | Mapping[str, Tensor]


def _update_tensor(h, t: Tensor) -> None:
    t = t.detach()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def weights_fingerprint(*weights: Weights | None) -> str:
    """sha256 over the named tensors of each model's ``state_dict`` (parameters and buffers) or dict, in order;
    ``None`` entries count as empty."""
    h = hashlib.sha256()
    for w in weights:
        state = {} if w is None else (w.state_dict() if isinstance(w, nn.Module) else w)
        h.update(f"#{len(state)}|".encode())
        for name in state:
            h.update(name.encode() + b"|")
            _update_tensor(h, state[name])
    return h.hexdigest()


def data_fingerprint(*tensors: Tensor | None) -> str:
    """sha256 over the given tensors (dtype, shape and bytes each; ``None`` counts as an absent tensor; a
    :class:`~scrubnet.models.call.ModelInputs` counts with every field and its name)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none|")
        elif isinstance(t, ModelInputs):  # the main input, then each extra under its name
            _update_tensor(h, t.main)
            for name, v in sorted(t.extras.items()):
                h.update(f"extra:{name}|".encode())
                _update_tensor(h, v)
        else:
            _update_tensor(h, torch.as_tensor(t))
    return h.hexdigest()


def _canonical(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"artifact option of type {type(value).__name__} has no canonical form")


def options_fingerprint(options: Mapping[str, Any] | None) -> str:
    """Canonical JSON of the options (sorted keys; floats by ``repr`` so 1e-5 and 1.0000001e-5 differ)."""
    return json.dumps(_canonical(dict(options or {})), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ArtifactKey:
    """What an artifact is, the weights and data it was computed from, and the options that shape it."""

    kind: str
    weights: str
    data: str
    options: str


def artifact_key(kind: str, *, weights: Iterable[Weights | None] = (), data: Iterable[Tensor | None] = (),
                 options: Mapping[str, Any] | None = None) -> ArtifactKey:
    """The key of an artifact of ``kind`` computed from ``weights`` (models or dicts of tensors) on ``data``
    with ``options`` (every option that changes the result)."""
    if not kind:
        raise ValueError("an artifact needs a kind")
    return ArtifactKey(kind, weights_fingerprint(*weights), data_fingerprint(*data), options_fingerprint(options))


class ArtifactCache:
    """Artifacts shared by the methods of one seed, keyed by :class:`ArtifactKey` (see the module docstring).

    ``hits`` and ``misses`` count :meth:`get_or_compute` calls.
    """

    def __init__(self) -> None:
        self._entries: dict[ArtifactKey, Any] = {}
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: ArtifactKey, compute: Callable[[], T]) -> T:
        """The artifact under ``key``, computing and storing it on the first request."""
        if not isinstance(key, ArtifactKey):
            raise TypeError(f"cache keys are ArtifactKey, got {type(key).__name__}")
        if key in self._entries:
            self.hits += 1
            return self._entries[key]
        self.misses += 1
        value = compute()
        self._entries[key] = value
        return value

    def put(self, key: ArtifactKey, value: Any) -> None:
        """Store an artifact computed elsewhere (e.g. the protocol's retrain model)."""
        if not isinstance(key, ArtifactKey):
            raise TypeError(f"cache keys are ArtifactKey, got {type(key).__name__}")
        self._entries[key] = value

    def __contains__(self, key: ArtifactKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[ArtifactKey]:
        return list(self._entries)


# --- the keys of the package's artifacts (every option that changes the result is in the key) -------------

def fisher_key(model: nn.Module, x: Tensor, y: Tensor | None, kind: str) -> ArtifactKey:
    """Diagonal Fisher of ``model`` on ``x`` (``y`` matters only for the empirical Fisher)."""
    return artifact_key("fisher_diag", weights=[model], data=[x, y if kind == "empirical" else None],
                        options={"kind": kind})


def ntk_direction_key(model: nn.Module, w0: Mapping[str, Tensor], retain: tuple[Tensor, Tensor],
                      forget: tuple[Tensor, Tensor], *, wd: float, num_classes: int,
                      options: Mapping[str, Any]) -> ArtifactKey:
    """The NTK scrub direction δw of ``model`` (pull toward ``w0``) for (D_r, D_f) under the method's
    ``options`` (linearisation point, pull, loss, ridge, solver and its tolerances …)."""
    return artifact_key("ntk_direction", weights=[model, w0], data=[*retain, *forget],
                        options={"wd": float(wd), "num_classes": int(num_classes), **options})


def mlforget_key(start: nn.Module | None, split, *, train: Mapping[str, Any], ml: Mapping[str, Any],
                 seed: int) -> ArtifactKey:
    """The ML-Forgetting artifacts of one seed: trained from ``start`` on ``split`` (core data, D, D_f)."""
    return artifact_key("mlforget", weights=[start],
                        data=[getattr(split, "x_core", None), getattr(split, "y_core", None), split.x, split.y,
                              split.forget_idx],
                        options={"train": dict(train), "ml": dict(ml), "seed": int(seed)})


def retrain_key(start: nn.Module, x: Tensor, y: Tensor, forget_idx: Tensor, *, train: Mapping[str, Any],
                seed: int, mode: str) -> ArtifactKey:
    """The gold-standard retrain model: fine-tuned from ``start`` on D = (x, y) without ``forget_idx``."""
    return artifact_key("retrain", weights=[start], data=[x, y, forget_idx],
                        options={"train": dict(train), "seed": int(seed), "mode": mode})
