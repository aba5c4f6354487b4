"""The one small interface every scrubbing method implements.

A method takes the trained model, the retain data D_r and the forget data D_f (plus a
:class:`ForgetContext` with what the protocol knows: the fine-tuning start ``w0``, the training
configuration, the seed, …) and returns a :class:`ScrubResult`: the scrubbed model, the method's own
diagnostics, and — for a method that ends by adding Gaussian noise — the Gaussian it sampled from
(:class:`WeightGaussian`). Methods never modify the model they are given.

Scrub, then measure: a method never sees the retrain reference. The information readouts (white-box and
black-box bounds) are computed by whoever evaluates (:mod:`scrubnet.experiments.runner`), which applies the
method's noise procedure to the reference through :meth:`ForgettingMethod.noise_at` and compares the two
Gaussians with :mod:`scrubnet.readouts.information`.

Methods register themselves by name with :func:`register`; :func:`get_method` builds one from its
name and options (e.g. ``get_method("fisher", alpha=1e-6)``). Every module in ``scrubnet.methods``
is imported on first use, so adding a method is adding a module.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from scrubnet.methods.artifacts import ArtifactCache
from scrubnet.training import DEFAULT_RETRAIN_MODE, TrainConfig

Data = tuple[Tensor, Tensor]


def as_tensors(data) -> Data:
    """Accept ``(x, y)`` tensors, a ``TensorDataset`` or a ``DataLoader`` yielding ``(x, y)`` batches,
    and return ``(x, y)`` tensors."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor):
        return data[0], data[1]
    if isinstance(data, torch.utils.data.TensorDataset):
        return data.tensors[0], data.tensors[1]
    if isinstance(data, torch.utils.data.DataLoader):
        xs, ys = zip(*[(b[0], b[1]) for b in data])
        return torch.cat(xs), torch.cat(ys)
    raise TypeError(f"expected (x, y) tensors, a TensorDataset or a DataLoader, got {type(data).__name__}")


@dataclass
class ForgetContext:
    """What the protocol knows besides (model, D_r, D_f).

    w0:            weights fine-tuning started from (target of the (wd/2)‖w − w_0‖² pull).
    config:        the fine-tuning hyperparameters (lr, momentum, wd, batch size, …).
    num_classes:   c, outputs of the model.
    seed:          fixes every random choice of the method (noise, batch order).
    forget_class:  the forgotten class when a whole class is forgotten, else None.
    split:         the full :class:`scrubnet.data.Split` when known (core data, D order, test set).
    start:         the model at ``w0`` (needed by methods that retrain, e.g. ``retrain``).
    retrain_mode:  how the protocol retrains without D_f ("replace" | "remove", see
                   :func:`scrubnet.training.retrain`).
    cache:         the :class:`~scrubnet.methods.artifacts.ArtifactCache` shared by the methods of one seed
                   (Fisher diagonals, the NTK direction, the ML-Forgetting models, the retrain model).
    """

    w0: dict[str, Tensor]
    config: TrainConfig = field(default_factory=TrainConfig)
    num_classes: int = 0
    seed: int = 0
    forget_class: int | None = None
    split: Any = None
    start: nn.Module | None = None
    retrain_mode: str = DEFAULT_RETRAIN_MODE
    cache: ArtifactCache = field(default_factory=ArtifactCache)


@dataclass
class WeightGaussian:
    """N(mean, diag var) over named trainable parameters: what a noisy scrub samples its weights from.

    ``mean`` and ``var`` map parameter names to tensors of the parameters' shapes (var > 0 wherever noise is
    added). The scrubbed weights are w = mean + √var ⊙ ε with ε ~ N(0, I).
    """

    mean: dict[str, Tensor]
    var: dict[str, Tensor]


@dataclass
class ScrubResult:
    """The scrubbed model and what the method reports about itself.

    ``info`` holds numbers (seconds, scales, solver iterations …); every numeric entry is copied into the
    run's readouts by the experiment runner. ``noise`` is the Gaussian a noisy method sampled ``model`` from
    (None for a deterministic method); the evaluator turns it into the information readouts.
    ``reference`` / ``original`` let a method that trains its own model family (e.g. ML-Forgetting)
    supply the models its readouts must be compared with (activation distance to the retrain model,
    re-learn threshold); left ``None`` the protocol's retrain and original models are used.
    """

    model: nn.Module
    info: dict[str, float] = field(default_factory=dict)
    noise: WeightGaussian | None = None
    reference: nn.Module | None = None
    original: nn.Module | None = None


class ForgettingMethod(ABC):
    """Base class: subclasses set ``name`` (via :func:`register`) and implement :meth:`scrub`.

    ``needs_retain`` is False for methods that use only D_f. Options are constructor keyword arguments.
    """

    name: ClassVar[str] = ""
    needs_retain: ClassVar[bool] = True

    @abstractmethod
    def scrub(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> ScrubResult:
        """Return the scrubbed copy of ``model`` and what was measured; ``model`` itself is left untouched."""

    def noise_at(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> WeightGaussian | None:
        """The Gaussian this method's noise procedure S_0 gives when applied to ``model`` in place of the
        trained model (each model with its own curvature). The evaluator applies it to the same-seed retrain
        model: the white-box bound is KL(scrub's Gaussian ‖ this one). None for a deterministic method."""
        return None

    def __call__(self, model, retain, forget, ctx: ForgetContext) -> ScrubResult:
        """:meth:`scrub` with the inputs checked on entry (finite weights and data) and the result on exit: a
        NaN or inf anywhere raises ``ValueError`` instead of propagating into every weight."""
        retain, forget = as_tensors(retain), as_tensors(forget)
        require_finite_model(model, "the model to scrub")
        for (x, _), part in ((retain, "D_r"), (forget, "D_f")):
            if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                raise ValueError(f"the inputs of {part} contain non-finite values (NaN or inf)")
        res = self.scrub(model, retain, forget, ctx)
        require_finite_model(res.model, f"method {self.name!r} returned a model that")
        return res


def require_finite_model(model: nn.Module, what: str) -> None:
    """``ValueError`` naming the first parameters or buffers of ``model`` that hold a NaN or an inf."""
    bad = [k for k, v in model.state_dict().items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"{what} has non-finite weights (NaN or inf) in {', '.join(bad[:3])}"
                         + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))


_REGISTRY: dict[str, type[ForgettingMethod]] = {}
_LOADED = False


def register(name: str):
    """Class decorator: make a method available under ``name``."""
    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not mod.name.startswith("_"):
            importlib.import_module(f"scrubnet.methods.{mod.name}")
    _LOADED = True


def available_methods() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def method_class(name: str) -> type[ForgettingMethod] | None:
    """The class registered as ``name``, or None."""
    _load_all()
    return _REGISTRY.get(name)


def get_method(name: str, **options) -> ForgettingMethod:
    """Instantiate the method registered as ``name`` with ``options``; clear error if unknown."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as e:
        raise ValueError(f"bad option for method {name!r}: {e}") from None
