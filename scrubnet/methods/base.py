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

from scrubnet.curvature.attention import jvp_safe_attention
from scrubnet.data.stream import BatchKeys, DataStream, as_stream, inputs_finite
from scrubnet.device import model_device
from scrubnet.methods.artifacts import ArtifactCache
from scrubnet.methods.objective import check_stationarity
from scrubnet.models import eval_mode, find_classifier
from scrubnet.models.call import Inputs, call_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import DEFAULT_RETRAIN_MODE, TrainConfig

Data = tuple[Inputs, Tensor]


def as_tensors(data, keys: BatchKeys | None = None) -> Data:
    """``(x, y)`` tensors from ``(x, y)`` tensors, a ``Dataset``, a ``DataLoader`` (tuple or dict batches) or a
    :class:`~scrubnet.data.stream.DataStream`: materialises the data set (for methods that do not stream)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor):
        return data[0], data[1]
    return as_stream(data, keys).tensors()


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
    recipe:        the :class:`~scrubnet.recipe.TrainingRecipe` the model was trained with; every method's
                   objective derives from it. Left ``None`` it is scrubnet's own protocol,
                   ``TrainingRecipe.scrubnet_protocol(w0, config)``. Build a context for a user's model with
                   :meth:`from_recipe` (``w0`` and ``config`` then follow from the recipe).
    force:         run a curvature method even when the stationarity check refuses the recipe.
    verify_recipe: run the stationarity check before a curvature method (:mod:`scrubnet.methods.objective`).
                   :meth:`from_recipe` (hence :func:`scrubnet.forget` and the CLI for a user's model) sets it;
                   scrubnet's own protocol, which trained the model to the recipe itself, leaves it off.
    chunk_size:    samples per chunk when a method streams a Dataset or DataLoader.
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
    recipe: TrainingRecipe | None = None
    force: bool = False
    chunk_size: int = 512
    verify_recipe: bool = False

    def __post_init__(self):
        if self.recipe is None:
            self.recipe = TrainingRecipe.scrubnet_protocol(self.w0, self.config)

    @classmethod
    def from_recipe(cls, model: nn.Module, recipe: TrainingRecipe | None = None, *, num_classes: int | None = None,
                    seed: int = 0, forget_class: int | None = None, classifier: str | None = None,
                    cache: ArtifactCache | None = None, probe: Inputs | None = None) -> "ForgetContext":
        """The context of a model trained with ``recipe`` (default: ordinary training, no weight decay).

        ``w0`` is the recipe's decay centre over the model's trainable parameters (zeros for ordinary weight
        decay), ``config`` carries the recipe's SGD settings, ``num_classes`` defaults to the output features of
        the model's classifier (found as ``head``/``fc``/``classifier``/``get_classifier()`` or ``classifier``),
        else, when no classifier is found, to the width of the model's output on ``probe`` (one batch of
        inputs, e.g. the first chunk of D_r: a nested head such as ``wrapper.bert.classifier`` needs no name).
        """
        recipe = TrainingRecipe() if recipe is None else recipe
        if not isinstance(recipe, TrainingRecipe):
            raise TypeError(f"recipe must be a TrainingRecipe, got {type(recipe).__name__}")
        if num_classes is None:
            num_classes = infer_num_classes(model, probe, classifier)
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ValueError(f"num_classes must be an integer ≥ 2, got {num_classes!r}")
        return cls(w0=recipe.center_for(model), config=recipe.train_config(), num_classes=num_classes,
                   seed=int(seed), forget_class=forget_class, cache=cache or ArtifactCache(), recipe=recipe,
                   verify_recipe=True)


def infer_num_classes(model: nn.Module, probe: Inputs | None = None, classifier: str | None = None) -> int:
    """The class count c: the output features of the model's classifier (:func:`~scrubnet.models.find_classifier`),
    else the width of ``model``'s logits on ``probe`` (one batch, eval mode, no gradient).

    Raises ``ValueError`` naming ``classifier=`` and ``num_classes=`` when neither is available.
    """
    try:
        return find_classifier(model, classifier)[1].out_features
    except ValueError:
        if classifier is not None:
            raise
        if probe is None:
            raise ValueError("cannot tell the model's class count: no nn.Linear classifier under head, fc or "
                             "classifier and no data to run it on; give num_classes=C (or classifier='dotted.name')"
                             ) from None
    with torch.no_grad(), eval_mode(model):
        logits = call_model(model, probe[:min(len(probe), 2)].to(model_device(model)))
    return int(logits.shape[-1])


def first_inputs(data) -> Inputs | None:
    """The inputs of the first chunk of ``data`` (a stream or (x, y)), or None when it is empty."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0] if len(data[0]) else None
    for x, _ in as_stream(data).chunks():
        return x
    return None


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
    ``ok`` is False when the method did not do what it claims (a solver at its iteration cap, diverging or
    ending above its tolerance, a refused step); ``reasons`` says why, one sentence each.
    """

    model: nn.Module
    info: dict[str, float] = field(default_factory=dict)
    noise: WeightGaussian | None = None
    reference: nn.Module | None = None
    original: nn.Module | None = None
    ok: bool = True
    reasons: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> "ScrubResult":
        """Mark the result failed for ``reason`` (kept with the others); returns self."""
        self.ok = False
        self.reasons.append(reason)
        return self


class ForgettingMethod(ABC):
    """Base class: subclasses set ``name`` (via :func:`register`) and implement :meth:`scrub`.

    Options are constructor keyword arguments. Traits, declared on the class and read by the runner, the CLI
    and the audit (never by testing method names):

    needs_retain:      uses D_r (False: only D_f, e.g. ``hiding``).
    class_only:        applies to class forgetting only (a whole forgotten class).
    noisy:             may end by adding Gaussian noise (its ``noise_at`` gives the Gaussian; information
                       bounds apply).
    own_retrain_family: trains its own model family and supplies its own retrain reference (ML-Forgetting).
    uses_curvature:    relies on the model sitting near a minimum of the recipe's objective (Newton, Fisher,
                       NTK, LQF): the stationarity check runs before it (:mod:`scrubnet.methods.stationarity`).
    streams:           reads D_r in chunks without materialising it (Datasets, DataLoaders, tensors alike).
    passes:            passes over D_r it makes, in words (e.g. "epochs", "2 + CG iterations").
    protocol_options:  options scrubnet's own experiments run it with unless configured otherwise (e.g.
                       Fisher's α tuned on the embedded default); a user's call gets the class defaults.
    band_reference:    the method whose readout band this one is judged against (default the retrain model).
    in_default_run:    run when an experiment names no methods.
    """

    name: ClassVar[str] = ""
    needs_retain: ClassVar[bool] = True
    class_only: ClassVar[bool] = False
    noisy: ClassVar[bool] = False
    own_retrain_family: ClassVar[bool] = False
    uses_curvature: ClassVar[bool] = False
    streams: ClassVar[bool] = False
    passes: ClassVar[str] = "1"
    protocol_options: ClassVar[dict] = {}
    band_reference: ClassVar[str] = "retrain"
    in_default_run: ClassVar[bool] = True

    @abstractmethod
    def scrub(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> ScrubResult:
        """Return the scrubbed copy of ``model`` and what was measured; ``model`` itself is left untouched."""

    def noise_at(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> WeightGaussian | None:
        """The Gaussian this method's noise procedure S_0 gives when applied to ``model`` in place of the
        trained model (each model with its own curvature). The evaluator applies it to the same-seed retrain
        model: the white-box bound is KL(scrub's Gaussian ‖ this one). None for a deterministic method."""
        return None

    def __call__(self, model, retain, forget, ctx: ForgetContext) -> ScrubResult:
        """:meth:`scrub` with the inputs checked on entry and the result on exit.

        Data: a method that ``streams`` receives :class:`~scrubnet.data.stream.DataStream` objects (chunks
        checked finite as they are read); the others receive (x, y) tensors. A curvature method first runs
        the stationarity check of the recipe (refused with its reason unless ``ctx.force``). A NaN or inf in
        the weights or the data raises ``ValueError`` instead of propagating into every weight.
        """
        if self.streams:
            retain, forget = as_stream(retain, chunk_size=ctx.chunk_size), as_stream(forget, chunk_size=ctx.chunk_size)
            checks = [(s.x, part) for s, part in ((retain, "D_r"), (forget, "D_f")) if s.kind == "tensors"]
        else:
            retain, forget = as_tensors(retain), as_tensors(forget)
            checks = [(retain[0], "D_r"), (forget[0], "D_f")]
        require_finite_model(model, "the model to scrub")
        for x, part in checks:
            if not inputs_finite(x):
                raise ValueError(f"the inputs of {part} contain non-finite values (NaN or inf)")
        # forward-mode AD has no rule for the fused CPU attention kernels: the math kernel computes the same
        # softmax(QKᵀ/√d)V with differentiable primitives (docs/decisions.md, "SDPA under forward-mode AD")
        with jvp_safe_attention():
            st = None
            if self.uses_curvature and self.needs_retain and ctx.verify_recipe and not ctx.force:
                st = check_stationarity(model, as_stream(retain, chunk_size=ctx.chunk_size), ctx.recipe, ctx.w0,
                                        method=self.name)
            res = self.scrub(model, retain, forget, ctx)
        if st is not None:
            res.info.update(st.as_dict())
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


def protocol_method(name: str, **options) -> ForgettingMethod:
    """:func:`get_method` with the class's ``protocol_options`` under ``options``: the method as scrubnet's own
    experiments run it."""
    cls = method_class(name)
    return get_method(name, **{**(cls.protocol_options if cls is not None else {}), **options})


def get_method(name: str, **options) -> ForgettingMethod:
    """Instantiate the method registered as ``name`` with ``options``; clear error if unknown."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as e:
        raise ValueError(f"bad option for method {name!r}: {e}") from None
