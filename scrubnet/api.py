"""One call to scrub a user's model: :func:`forget`.

    scrubbed, result = scrubnet.forget(model, retain, forget_set, method="fisher",
                                       recipe=TrainingRecipe(wd=5e-4))

builds the :class:`~scrubnet.methods.ForgetContext` from the recipe, the model and the data
(:meth:`ForgetContext.from_recipe`) and runs the method through :func:`scrubnet.scrub.scrub_and_measure`, the
one scrub path every entry point shares (the stationarity check first for a curvature method, the method's
own failure, the retain-error rule). It returns the scrubbed model with a :class:`ForgetResult`: ``ok`` and the
reasons, the method's report, the readouts when asked (error and loss on D_r, D_f and a test set, streamed in
chunks) and, for a noisy method given a ``reference`` model (e.g. one retrained without D_f), the white-box
information bound. With held-out data (``test``) every scrub gets a forgetting verdict (``result.forgetting``:
does D_f now look like data the model never saw?); a method whose purpose is forgetting that ends at
``did_not_forget`` or ``moved_wrong_way`` fails unless ``on_not_forgotten="warn"``. A failed scrub raises
:class:`ScrubFailed` unless ``on_failure="return"``.
"""
from __future__ import annotations

import inspect
import time
from typing import Any

from torch import nn

from scrubnet.cost_guard import budgeted_options, measured_cost, price_call, refuse_over
from scrubnet.data.stream import BatchKeys, as_stream
from scrubnet.methods import ForgetContext, get_method
from scrubnet.methods.base import first_inputs, method_class
from scrubnet.models import find_classifier
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import ON_NOT_FORGOTTEN, RETAIN_ERROR_TOLERANCE, ForgetResult, ScrubFailed, scrub_and_measure

ON_FAILURE = ("raise", "return")

__all__ = ["ForgetResult", "ON_FAILURE", "ON_NOT_FORGOTTEN", "ScrubFailed", "forget"]


def forget(model: nn.Module, retain, forget, method: str = "finetune", recipe: TrainingRecipe | None = None, *,
           seed: int = 0, on_failure: str = "raise", num_classes: int | None = None,
           forget_class: int | None = None, classifier: str | None = None, force: bool = False,
           readouts: bool = False, test=None, reference: nn.Module | None = None,
           keys: BatchKeys | None = None, chunk_size: int = 512,
           retain_error_tolerance: float = RETAIN_ERROR_TOLERANCE, on_not_forgotten: str = "fail",
           max_cost_vs_retrain: float | None = None,
           **method_options: Any
           ) -> tuple[nn.Module, ForgetResult]:
    """Scrub ``forget`` (D_f) from ``model`` trained on D = D_r ∪ D_f with ``recipe``.

    retain, forget, test: (x, y) tensors, a ``Dataset`` or a ``DataLoader`` with tuple or dict batches
        (dict keys: :class:`~scrubnet.data.stream.BatchKeys`, ``keys`` to name others).
    method, **method_options: a registered method and its options (``scrubnet.methods.available_methods()``;
        checked against the method's declared option rules).
    num_classes, classifier: the class count, else read from the classifier (``head``/``fc``/``classifier`` or
        the dotted name ``classifier``, which is also handed to a method taking a ``classifier`` option), else
        from the width of the model's output on the first chunk of ``retain``.
    recipe: how the model was trained (default ``TrainingRecipe()``: mean cross-entropy, no weight decay).
    force: run a curvature method even when the model is far from a minimum of the recipe's objective.
    readouts: also measure error and loss on D_r, D_f (and ``test``) before and after, streamed.
    test: held-out data (neither model trained on them, e.g. the test set): with it every scrub gets the
        forgetting verdict ``result.forgetting`` (:class:`~scrubnet.readouts.forgetting.ForgettingVerdict`).
    on_not_forgotten: ``"fail"`` (default: a forgetting method whose verdict is did_not_forget or
        moved_wrong_way is ``ok=False``, the numbers in the reason) or ``"warn"`` (``result.warnings``).
    reference: a model retrained without D_f; with a noisy method gives the information bound.
    retain_error_tolerance: the scrub fails when the retain error rises by more than this (a fraction: 0.05
        = 5 points); measured on every call (two streamed passes over D_r).
    on_failure: ``"raise"`` (:class:`ScrubFailed`) or ``"return"`` (the result says ``ok=False``).
    keys, chunk_size: how dict batches are read and how many samples a chunk holds.
    max_cost_vs_retrain: refuse (:class:`~scrubnet.training.cost.BudgetExceeded`, before any work) when the
        call's estimate is above this many retrainings from the model's initialisation with the recipe
        (:func:`scrubnet.cost_guard.price_call`).

    When the method would cost more than one retraining and has a budgeted mode (Newton and NTK: a CG
    budget, reporting the residual reached; Fisher: a subsample, reporting its variance) that mode runs,
    (within ``max_cost_vs_retrain`` when that is lower), unless its option (or one it replaces) is given (:func:`scrubnet.cost_guard.budgeted_options`).

    Returns (scrubbed model, :class:`ForgetResult`); ``result.cost`` records the measured CPU seconds, the
    retraining estimate and their ratio ``cost_vs_retrain``. ``model`` is not modified.
    """
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
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
    retain_s, forget_s = as_stream(retain, keys, chunk_size), as_stream(forget, keys, chunk_size)
    test_s = None if test is None else as_stream(test, keys, chunk_size)
    call = {"n_test": 0 if test_s is None else len(test_s), "readouts": bool(readouts)}
    est, ref = price_call(method, method_options, model, retain_s, forget_s, ctx, **call)
    target = 1.0 if max_cost_vs_retrain is None else min(1.0, float(max_cost_vs_retrain))
    budgeted = budgeted_options(method, method_options, model, retain_s, forget_s, ctx, est, target, **call)
    if budgeted is not None:  # the full method would cost more than retraining: its budgeted mode
        method_options, est = budgeted
        scrubber = get_method(method, **method_options)
    refuse_over(est, max_cost_vs_retrain, method)
    t0 = time.process_time()
    out = scrub_and_measure(scrubber, model, retain_s, forget_s,
                            ctx, retain_error_tolerance=retain_error_tolerance, reference=reference,
                            readouts=readouts, test=test_s,
                            on_not_forgotten=on_not_forgotten)
    out.cost = measured_cost(time.process_time() - t0, est, ref)
    if budgeted is not None:
        out.cost["budgeted"] = est.details["budgeted"]
    if not out.ok and on_failure == "raise":
        raise ScrubFailed(out)
    return out.model, out
