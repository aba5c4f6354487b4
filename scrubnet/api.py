"""One call to scrub a user's model: :func:`forget`.

    scrubbed, result = scrubnet.forget(model, retain, forget_set, method="fisher",
                                       recipe=TrainingRecipe(wd=5e-4))

builds the :class:`~scrubnet.methods.ForgetContext` from the recipe, the model and the data
(:meth:`ForgetContext.from_recipe`), runs the method (the stationarity check first for a curvature method),
and returns the scrubbed model with a :class:`ForgetResult`: ``ok`` and the reasons, the method's report,
the readouts when asked (error and loss on D_r, D_f and a test set, streamed in chunks) and, for a noisy
method given a ``reference`` model (e.g. one retrained without D_f), the white-box information bound.
A failed scrub raises :class:`ScrubFailed` unless ``on_failure="return"``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from scrubnet.data.stream import BatchKeys, as_stream
from scrubnet.methods import ForgetContext, WeightGaussian, get_method
from scrubnet.methods.base import first_inputs, method_class
from scrubnet.models import find_classifier
from scrubnet.recipe import TrainingRecipe
from scrubnet.readouts.basic import stream_error_and_loss
from scrubnet.readouts.information import weight_information

ON_FAILURE = ("raise", "return")


class ScrubFailed(RuntimeError):
    """The method did not do what it claims; ``.result`` holds the :class:`ForgetResult` (model included)."""

    def __init__(self, result: "ForgetResult"):
        self.result = result
        super().__init__(f"method {result.method!r} failed: " + "; ".join(result.reasons))


@dataclass
class ForgetResult:
    """What :func:`forget` reports.

    ok, reasons:  whether the scrub did what it claims, and why not (one sentence each).
    method:       the method's name; recipe: the recipe used.
    report:       the method's own numbers (seconds, solver iterations and residuals, step lengths, α …).
    noise:        the Gaussian a noisy method sampled the weights from (None for a deterministic one).
    bounds:       ``info_weights_nats`` = KL(scrub's Gaussian ‖ the same procedure at ``reference``) when a
                  reference was given to a noisy method.
    readouts:     error/loss on retain, forget (and test) of the scrubbed and the input model, when asked.
    """

    ok: bool
    reasons: list[str]
    method: str
    recipe: TrainingRecipe
    report: dict[str, float] = field(default_factory=dict)
    noise: WeightGaussian | None = None
    bounds: dict[str, float] = field(default_factory=dict)
    readouts: dict[str, float] = field(default_factory=dict)


def forget(model: nn.Module, retain, forget, method: str = "finetune", recipe: TrainingRecipe | None = None, *,
           seed: int = 0, on_failure: str = "raise", num_classes: int | None = None,
           forget_class: int | None = None, classifier: str | None = None, force: bool = False,
           readouts: bool = False, test=None, reference: nn.Module | None = None,
           keys: BatchKeys | None = None, chunk_size: int = 512, retain_error_tolerance: float = 0.05,
           **method_options: Any
           ) -> tuple[nn.Module, ForgetResult]:
    """Scrub ``forget`` (D_f) from ``model`` trained on D = D_r ∪ D_f with ``recipe``.

    retain, forget, test: (x, y) tensors, a ``Dataset`` or a ``DataLoader`` with tuple or dict batches
        (dict keys: :class:`~scrubnet.data.stream.BatchKeys`, ``keys`` to name others).
    method, **method_options: a registered method and its options (``scrubnet.methods.available_methods()``).
    num_classes, classifier: the class count, else read from the classifier (``head``/``fc``/``classifier`` or
        the dotted name ``classifier``, which is also handed to a method taking a ``classifier`` option), else
        from the width of the model's output on the first chunk of ``retain``.
    recipe: how the model was trained (default ``TrainingRecipe()``: mean cross-entropy, no weight decay).
    force: run a curvature method even when the model is far from a minimum of the recipe's objective.
    readouts: also measure error and loss on D_r, D_f (and ``test``) before and after, streamed.
    reference: a model retrained without D_f; with a noisy method gives the information bound.
    retain_error_tolerance: the scrub fails when the retain error rises by more than this (a fraction: 0.05
        = 5 points); measured on every call (two streamed passes over D_r).
    on_failure: ``"raise"`` (:class:`ScrubFailed`) or ``"return"`` (the result says ``ok=False``).
    keys, chunk_size: how dict batches are read and how many samples a chunk holds.

    Returns (scrubbed model, :class:`ForgetResult`). ``model`` is not modified.
    """
    if not 0 <= retain_error_tolerance <= 1:
        raise ValueError(f"retain_error_tolerance must be in [0, 1], got {retain_error_tolerance}")
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    recipe = TrainingRecipe() if recipe is None else recipe
    keys = keys or BatchKeys()
    retain_s, forget_s = as_stream(retain, keys, chunk_size), as_stream(forget, keys, chunk_size)
    probe = None
    if num_classes is None:  # only read when the model has no classifier to count its classes
        try:
            find_classifier(model, classifier)
        except ValueError:
            probe = first_inputs(retain_s) if classifier is None else None
    ctx = ForgetContext.from_recipe(model, recipe, num_classes=num_classes, seed=seed, forget_class=forget_class,
                                    classifier=classifier, probe=probe)
    ctx.force, ctx.chunk_size = bool(force), int(chunk_size)
    cls = method_class(method)
    if classifier is not None and cls is not None and "classifier" not in method_options \
            and "classifier" in inspect.signature(cls.__init__).parameters:
        method_options = {**method_options, "classifier": classifier}   # one name for the head, everywhere
    scrubber = get_method(method, **method_options)
    res = scrubber(model, retain_s, forget_s, ctx)
    out = ForgetResult(ok=res.ok, reasons=list(res.reasons), method=method, recipe=recipe, report=dict(res.info),
                       noise=res.noise)
    if reference is not None and res.noise is not None:
        other = scrubber.noise_at(reference, retain_s, forget_s, ctx)
        if other is not None:
            out.bounds.update(weight_information(res.noise.mean, res.noise.var, other.mean, other.var))
    # the honesty check every method gets: a scrub that costs the retain set more than a few points of error
    # is reported as failed, whatever the method thinks of itself
    err_in, loss_in = stream_error_and_loss(model, retain_s)
    err_out, loss_out = stream_error_and_loss(res.model, retain_s)
    out.report.update(retain_error_before=err_in, retain_error_after=err_out)
    if err_out - err_in > retain_error_tolerance:
        out.ok = False
        out.reasons.append(f"the retain error rose from {100 * err_in:.1f} % to {100 * err_out:.1f} %, more than "
                           f"the tolerance of {100 * retain_error_tolerance:g} points")
    if readouts:
        out.readouts.update(retain_error=err_out, retain_loss=loss_out, original_retain_error=err_in,
                            original_retain_loss=loss_in)
        sets = {"forget": forget_s}
        if test is not None:
            sets["test"] = as_stream(test, keys, chunk_size)
        for part, data in sets.items():
            for tag, m in (("", res.model), ("original_", model)):
                err, loss = stream_error_and_loss(m, data)
                out.readouts[f"{tag}{part}_error"], out.readouts[f"{tag}{part}_loss"] = err, loss
    if not out.ok and on_failure == "raise":
        raise ScrubFailed(out)
    return res.model, out
