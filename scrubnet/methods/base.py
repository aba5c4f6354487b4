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
name and options (e.g. ``get_method("fisher", alpha=1e-6)``), checked against the class's declared
:class:`Option` rules first. A method's cost estimate is its classmethod ``cost``
(:func:`scrubnet.cost_guard.estimate` dispatches to it; :mod:`scrubnet.cost_guard` prices a call against the
user's retraining). Every module in ``scrubnet.methods`` is imported on first use, so adding a method is
adding a module (docs/decisions/scrub-seam.md shows the smallest one).

A context is built in one of two ways: :meth:`ForgetContext.from_recipe` (a user's model and its recipe) and
:func:`protocol_context` (scrubnet's own protocol: the recipe pulls toward the fine-tuning start w_0).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from scrubnet.curvature.attention import jvp_safe_attention
from scrubnet.data.stream import BatchKeys, as_stream, inputs_finite
from scrubnet.device import model_device
from scrubnet.methods.artifacts import ArtifactCache
from scrubnet.methods.options import Option  # noqa: F401  (re-exported: methods import it from here)
from scrubnet.models import eval_mode, find_classifier
from scrubnet.models.call import Inputs, call_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import DEFAULT_RETRAIN_MODE, TrainConfig
from scrubnet.training.cost import CostEstimate

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

    Build a context with :meth:`from_recipe` (a user's model) or :func:`protocol_context` (scrubnet's own
    protocol), not by hand.

    Parameters
    ----------
    recipe : TrainingRecipe
        The :class:`~scrubnet.recipe.TrainingRecipe` the model was trained with: the one source of the objective
        (loss, decay coefficient ``wd`` and centre) and of the SGD settings the fine-tuning baselines reuse.
    num_classes : int
        c, outputs of the model.
    seed : int
        Fixes every random choice of the method (noise, batch order).
    forget_class : int or None
        The forgotten class when a whole class is forgotten, else None.
    split : Split or None
        The full :class:`scrubnet.data.Split` when known (core data, D order, test set).
    start : nn.Module or None
        The model at w_0 (needed by methods that retrain, e.g. ``retrain``).
    schedule : TrainConfig or None
        The protocol's training schedule (epoch caps, stopping rule, pre-training) for methods that retrain; its
        objective and SGD fields are overridden by the recipe's (:attr:`config`).
    retrain_mode : {"replace", "remove"}
        How the protocol retrains without D_f (see :func:`scrubnet.training.retrain`).
    cache : ArtifactCache
        The :class:`~scrubnet.methods.artifacts.ArtifactCache` shared by the methods of one seed (Fisher
        diagonals, the NTK direction, the ML-Forgetting models, the retrain model).
    force : bool
        Run a curvature method even when the stationarity check refuses the recipe.
    chunk_size : int
        Samples per chunk when a method streams a Dataset or DataLoader.
    verify_recipe : bool
        Run the stationarity check before a curvature method (:mod:`scrubnet.recipe.objective`;
        :func:`scrubnet.scrub.scrub_and_measure` runs it). :meth:`from_recipe` sets it; scrubnet's own protocol,
        which trained the model to the recipe itself, leaves it off.
    train : callable or HuggingFace Trainer or None
        The user's own training, ``train(model, data) -> model`` (or a ``Trainer``): what ``retrain`` runs and
        the cost reference times (:mod:`scrubnet.recipe.retrain`); None: the recipe is reproduced.
    retrain_start : nn.Module or None
        Where the user's training started (e.g. the pretrained weights a model was fine-tuned from); None: the
        model's initialisation drawn anew (:func:`~scrubnet.recipe.retrain.initial_model`).

    Returns
    -------
    ForgetContext
        The context a method's ``scrub(model, retain, forget, ctx)`` reads.
    """

    recipe: TrainingRecipe
    num_classes: int = 0
    seed: int = 0
    forget_class: int | None = None
    split: Any = None
    start: nn.Module | None = None
    schedule: TrainConfig | None = None
    retrain_mode: str = DEFAULT_RETRAIN_MODE
    cache: ArtifactCache = field(default_factory=ArtifactCache)
    force: bool = False
    chunk_size: int = 512
    verify_recipe: bool = False
    train: Any = None
    retrain_start: nn.Module | None = None

    def __post_init__(self):
        if not isinstance(self.recipe, TrainingRecipe):
            raise TypeError(f"ForgetContext.recipe must be a TrainingRecipe, got {type(self.recipe).__name__}")

    @property
    def config(self) -> TrainConfig:
        """The training settings of a method that trains: the recipe's lr, momentum, wd, batch size and
        BatchNorm rule over the protocol's :attr:`schedule` (epoch caps and stopping rule)."""
        return self.recipe.train_config(self.schedule)

    def center(self, model: nn.Module) -> dict[str, Tensor]:
        """The decay centre c over ``model``'s trainable parameters (:meth:`TrainingRecipe.center_for`): the
        fine-tuning start w_0 in the protocol, zeros for ordinary weight decay."""
        return self.recipe.center_for(model)

    @classmethod
    def from_recipe(cls, model: nn.Module, recipe: TrainingRecipe | None = None, *, num_classes: int | None = None,
                    seed: int = 0, forget_class: int | None = None, classifier: str | None = None,
                    cache: ArtifactCache | None = None, probe: Inputs | None = None, train: Any = None,
                    retrain_start: nn.Module | None = None) -> "ForgetContext":
        """The context of a user's model trained with ``recipe`` (default: ordinary training, no weight decay).

        ``num_classes`` defaults to the output features of the model's classifier (found as
        ``head``/``fc``/``classifier``/``get_classifier()`` or ``classifier``), else, when no classifier is
        found, to the width of the model's output on ``probe`` (one batch of inputs, e.g. the first chunk of
        D_r: a nested head such as ``wrapper.bert.classifier`` needs no name); the stationarity check is on.
        ``train`` / ``retrain_start``: the user's own training and its start (the fields of the same names).
        """
        recipe = TrainingRecipe() if recipe is None else recipe
        if not isinstance(recipe, TrainingRecipe):
            raise TypeError(f"recipe must be a TrainingRecipe, got {type(recipe).__name__}")
        if num_classes is None:
            num_classes = infer_num_classes(model, probe, classifier)
        if not (isinstance(num_classes, int) and num_classes >= 2):
            raise ValueError(f"num_classes must be an integer ≥ 2, got {num_classes!r}")
        recipe.center_for(model)  # refuse a centre that does not fit the model now, not inside a method
        return cls(recipe=recipe, num_classes=num_classes, seed=int(seed), forget_class=forget_class,
                   cache=cache or ArtifactCache(), verify_recipe=True, train=train, retrain_start=retrain_start)


def protocol_context(start: nn.Module, train: TrainConfig, *, num_classes: int, seed: int = 0,
                     forget_class: int | None = None, split: Any = None, retrain_mode: str = DEFAULT_RETRAIN_MODE,
                     cache: ArtifactCache | None = None) -> ForgetContext:
    """The context of scrubnet's own protocol: the model was fine-tuned from ``start`` (w_0) with ``train``.

    The recipe is :meth:`TrainingRecipe.scrubnet_protocol` (mean CE + (wd/2)‖w − w_0‖², w_0 = ``start``'s
    trainable weights, copied); ``train`` is also the schedule a retraining method follows. The experiment
    runner, the audit pool and ``scrubnet forget --checkpoint`` build their contexts here.

    Parameters
    ----------
    start : nn.Module
        The model at w_0 (kept as ``ctx.start`` for the methods that retrain).
    train : TrainConfig
        The protocol's training configuration (objective, SGD settings and schedule).
    num_classes, seed, forget_class, split, retrain_mode, cache
        As the :class:`ForgetContext` fields.

    Returns
    -------
    ForgetContext
    """
    w0 = {k: v.detach().clone() for k, v in start.named_parameters() if v.requires_grad}
    return ForgetContext(recipe=TrainingRecipe.scrubnet_protocol(w0, train), num_classes=int(num_classes),
                         seed=int(seed), forget_class=forget_class, split=split, start=start, schedule=train,
                         retrain_mode=retrain_mode, cache=cache or ArtifactCache())


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
    ending above its tolerance, a refused step); ``reasons`` says why, one sentence each. ``warnings``: what
    the user must know though the method did what it claims (e.g. a Newton step damped to a near no-op).
    """

    model: nn.Module
    info: dict[str, float] = field(default_factory=dict)
    noise: WeightGaussian | None = None
    reference: nn.Module | None = None
    original: nn.Module | None = None
    ok: bool = True
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> "ScrubResult":
        """Mark the result failed for ``reason`` (kept with the others); returns self."""
        self.ok = False
        self.reasons.append(reason)
        return self


class ForgettingMethod(ABC):
    """Base class: subclasses set ``name`` (via :func:`register`) and implement :meth:`scrub`.

    Options are constructor keyword arguments, declared in ``options`` ({name: :class:`Option`}) and checked
    by :meth:`check_options` before the constructor runs; a class that declares none accepts the names of its
    constructor's parameters (anything, when the constructor takes ``**options``). The method's cost
    estimate is its classmethod :meth:`cost`.

    Traits, declared on the class and read by the runner, the CLI and the audit (never by testing method
    names):

    needs_retain:      uses D_r (False: only D_f, e.g. ``hiding``).
    class_only:        applies to class forgetting only (a whole forgotten class).
    noisy:             may end by adding Gaussian noise (its ``noise_at`` gives the Gaussian; information
                       bounds apply).
    own_retrain_family: trains its own model family and supplies its own retrain reference (ML-Forgetting);
                       it does not apply to a checkpoint or a user's model.
    uses_curvature:    relies on the model sitting near a minimum of the recipe's objective (Newton, Fisher,
                       NTK): the stationarity check runs before it (:mod:`scrubnet.recipe.objective`).
    streams:           reads D_r in chunks without materialising it (Datasets, DataLoaders, tensors alike).
    passes:            passes over D_r it makes, in words (e.g. "epochs", "2 + CG iterations").
    protocol_options:  options scrubnet's own experiments run it with unless configured otherwise (e.g.
                       Fisher's α tuned on the embedded default); a user's call gets the class defaults.
    band_reference:    the method whose readout band this one is judged against (default the retrain model).
    in_default_run:    run when an experiment names no methods.
    forgets:           its purpose is forgetting D_f (default True): a forgetting verdict of did_not_forget or
                       moved_wrong_way fails it (:mod:`scrubnet.scrub`). False for the anchors (the original,
                       the gold standards) and for ``hiding`` (masks outputs only, a baseline of what is not
                       forgetting).
    anchor:            the protocol role of an anchor method, ``"original"`` (the trained model) or
                       ``"retrain"`` (the gold standard), None for a scrub: anchors are listed first in a run's
                       tables, the separation checks compare them, and in the audit their rows are the pool's
                       own originals / retrains, not scrubs.
    audit_scrub_cost:  ``"cheap"`` or ``"expensive"`` (trains its own model per scrub): the audit runs an
                       expensive method on one forget set per split and on half the ε models.
    figure_step:       the method whose deterministic step the NTK line figures follow (``"ntk"`` for the
                       NTK methods), None for the others.
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
    forgets: ClassVar[bool] = True
    anchor: ClassVar[str | None] = None
    audit_scrub_cost: ClassVar[str] = "cheap"
    figure_step: ClassVar[str | None] = None
    options: ClassVar[dict[str, Option] | None] = None

    @classmethod
    def check_options(cls, options: dict) -> dict:
        """``options`` checked against the class's rules (unknown names, types, ranges, choices) and
        converted; ``ValueError`` naming the method and the option otherwise."""
        rules = cls.options
        if rules is None:
            params = inspect.signature(cls.__init__).parameters
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                return dict(options)
            rules = {k: None for k in params if k != "self"}
        unknown = sorted(set(options) - set(rules))
        if unknown:
            raise ValueError(f"bad option for method {cls.name!r}: unknown option(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(sorted(rules)) or 'none'}")
        out = {}
        for k, v in options.items():
            try:
                out[k] = v if rules[k] is None else rules[k].check(k, v)
            except ValueError as e:
                raise ValueError(f"bad option for method {cls.name!r}: {e}") from None
        return out

    @classmethod
    def cost(cls, model: nn.Module, x1: Tensor, n_retain: int, n_forget: int, num_classes: int,
             config: TrainConfig, **options) -> CostEstimate:
        """The predicted cost of one call (:class:`~scrubnet.training.cost.CostEstimate`).

        Parameters
        ----------
        model : nn.Module
            The model to scrub.
        x1 : Tensor
            One probe input, shape (1, ...).
        n_retain, n_forget, num_classes : int
            |D_r|, |D_f| and c.
        config : TrainConfig
            The training settings of a method that trains (the recipe's over the protocol's schedule).
        **options
            The method's options (checked).

        Returns
        -------
        CostEstimate
        """
        raise NotImplementedError(f"method {cls.name!r} declares no cost estimate")

    @abstractmethod
    def scrub(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> ScrubResult:
        """Return the scrubbed copy of ``model`` and what was measured; ``model`` itself is left untouched."""

    def noise_at(self, model: nn.Module, retain: Data, forget: Data, ctx: ForgetContext) -> WeightGaussian | None:
        """The Gaussian this method's noise procedure S_0 gives when applied to ``model`` in place of the
        trained model (each model with its own curvature). The evaluator applies it to the same-seed retrain
        model: the white-box bound is KL(scrub's Gaussian ‖ this one). None for a deterministic method."""
        return None

    def prepare_data(self, retain, forget, ctx: ForgetContext):
        """``(retain, forget)`` as this method reads them: :class:`~scrubnet.data.stream.DataStream` objects
        for a method that ``streams``, (x, y) tensors otherwise."""
        if self.streams:
            return as_stream(retain, chunk_size=ctx.chunk_size), as_stream(forget, chunk_size=ctx.chunk_size)
        return as_tensors(retain), as_tensors(forget)

    def __call__(self, model, retain, forget, ctx: ForgetContext) -> ScrubResult:
        """:meth:`scrub` with the inputs checked on entry and the result on exit.

        Data: see :meth:`prepare_data` (chunks of a stream are checked finite as they are read). A NaN or inf
        in the weights or the data raises ``ValueError`` instead of propagating into every weight. The
        protocol's honesty checks (stationarity, retain error, failure) are
        :func:`scrubnet.scrub.scrub_and_measure`'s.
        """
        retain, forget = self.prepare_data(retain, forget, ctx)
        if self.streams:
            checks = [(s.x, part) for s, part in ((retain, "D_r"), (forget, "D_f")) if s.kind == "tensors"]
        else:
            checks = [(retain[0], "D_r"), (forget[0], "D_f")]
        require_finite_model(model, "the model to scrub")
        for x, part in checks:
            if not inputs_finite(x):
                raise ValueError(f"the inputs of {part} contain non-finite values (NaN or inf)")
        # forward-mode AD has no rule for the fused CPU attention kernels: the math kernel computes the same
        # softmax(QKᵀ/√d)V with differentiable primitives (docs/decisions/own-model.md, "SDPA under forward-mode AD")
        with jvp_safe_attention():
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


def protocol_method(name: str, **options) -> ForgettingMethod:
    """:func:`get_method` with the class's ``protocol_options`` under ``options``: the method as scrubnet's own
    experiments run it."""
    cls = method_class(name)
    return get_method(name, **{**(cls.protocol_options if cls is not None else {}), **options})


def get_method(name: str, **options) -> ForgettingMethod:
    """Instantiate the method registered as ``name`` with ``options`` (checked against its rules first);
    ``ValueError`` naming the method if it is unknown or an option is bad."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    cls = _REGISTRY[name]
    options = cls.check_options(options)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad option for method {name!r}: {e}") from None


def methods_with(**traits) -> list[str]:
    """Registered methods whose class has every given trait value, e.g. ``methods_with(anchor=True)``."""
    _load_all()
    return sorted(n for n, c in _REGISTRY.items() if all(getattr(c, k) == v for k, v in traits.items()))


def anchor_method(role: str) -> str | None:
    """The registered method whose ``anchor`` trait is ``role`` ("original" or "retrain"), or None."""
    names = methods_with(anchor=role)
    return names[0] if names else None


def costed_methods() -> list[str]:
    """Registered methods that declare a cost estimate."""
    _load_all()
    return sorted(n for n, c in _REGISTRY.items() if c.cost.__func__ is not ForgettingMethod.cost.__func__)
