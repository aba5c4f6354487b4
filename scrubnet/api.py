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
``did_not_forget``, ``moved_wrong_way`` or ``hidden`` fails unless ``on_not_forgotten="warn"``. A failed scrub raises
:class:`ScrubFailed` unless ``on_failure="return"``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from scrubnet.cost_guard import priced_scrub
from scrubnet.data.stream import BatchKeys, as_stream
from scrubnet.methods import ForgetContext, get_method
from scrubnet.methods.base import first_inputs, method_class
from scrubnet.models import find_classifier
from scrubnet.readouts.references import ReferenceModels, load_references
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import ON_NOT_FORGOTTEN, RETAIN_ERROR_TOLERANCE, ForgetResult, ScrubFailed
from scrubnet.tuning.profile import TunedProfile, resolve_profile
from scrubnet.tuning.request import after_request

ON_FAILURE = ("raise", "return")

__all__ = ["ForgetResult", "ON_FAILURE", "ON_NOT_FORGOTTEN", "ScrubFailed", "forget"]


def forget(model: nn.Module, retain, forget, method: str = "finetune", recipe: TrainingRecipe | None = None, *,
           seed: int = 0, on_failure: str = "raise", num_classes: int | None = None, forget_class: int | None = None,
           classifier: str | None = None, force: bool = False, readouts: bool = False, test=None,
           reference: nn.Module | None = None, keys: BatchKeys | None = None, chunk_size: int = 512,
           retain_error_tolerance: float = RETAIN_ERROR_TOLERANCE, on_not_forgotten: str = "fail",
           max_cost_vs_retrain: float | None = None, train: Any = None, retrain_start: nn.Module | None = None,
           profile: TunedProfile | str | None = None, references: Any = None, forget_ids: Any = None,
           **method_options: Any) -> tuple[nn.Module, ForgetResult]:
    """Scrub ``forget`` (D_f) from ``model`` trained on D = D_r ∪ D_f with ``recipe``.

    Parameters
    ----------
    model : nn.Module
        The trained model: logits (n, c), or a tuple / mapping / ``.logits`` holding them; not modified.
    retain, forget : tensors, Dataset or DataLoader
        D_r, D_f: ``(x (n, ...), y (n,))`` tensors, or a ``Dataset`` / ``DataLoader`` of tuple or dict batches.
    method, profile : str; TunedProfile, str or None
        A registered method (``scrubnet.methods.available_methods()``; default ``"finetune"``), or ``"auto"``: the
        method and options of ``profile`` (this model's tuned profile or its file: :func:`scrubnet.tuning.tune.tune`).
    recipe : TrainingRecipe, optional
        How the model was trained (default ``TrainingRecipe()``: mean cross-entropy, no weight decay).
    seed, on_failure : int, {"raise", "return"}
        Fixes the method's random choices; a failed scrub raises :class:`ScrubFailed` or returns ``ok=False``.
    num_classes : int, optional
        c (default: from the classifier, else the width of the model's output on the first chunk of ``retain``).
    forget_class : int, optional
        The forgotten class when a whole class is forgotten (class-only methods need it).
    classifier : str, optional
        Dotted name of the final ``nn.Linear`` if not ``head``/``fc``/``classifier`` (handed to methods too).
    force, readouts : bool
        Run a curvature method even when the model is far from a minimum of the recipe's objective; measure error
        (fraction) and loss (nats) on D_r, D_f (and ``test``) before and after, streamed.
    test : tensors, Dataset or DataLoader, optional
        Held-out data (neither model trained on them, e.g. the test set): with it every scrub gets the
        forgetting verdict ``result.forgetting`` (:class:`~scrubnet.readouts.forgetting.ForgettingVerdict`).
    on_not_forgotten : {"fail", "warn"}
        A forgetting method whose verdict is did_not_forget, moved_wrong_way or hidden fails, or only warns.
    reference : nn.Module, optional
        A model retrained without D_f; with a noisy method gives the information bound (nats).
    keys, chunk_size : BatchKeys or None, int
        How dict batches are read (:class:`~scrubnet.data.stream.BatchKeys`); samples per streamed chunk.
    retain_error_tolerance : float
        The largest allowed rise of the retain error (a fraction: 0.05 = 5 points), measured on every call.
    max_cost_vs_retrain : float, optional
        Refuse (``BudgetExceeded``) before any work above this many of the user's retrainings (``price_call``).
    train, retrain_start : callable or HuggingFace Trainer, nn.Module, optional
        The user's ``train(model, data) -> model`` and its start: ``retrain`` runs it, the cost times it.
    references, forget_ids : ReferenceModels or directory, sequence of int; optional
        Reference models of ``model`` (:func:`~scrubnet.readouts.references.train_references`, or the directory
        ``scrubnet references`` / :meth:`~scrubnet.readouts.references.ReferenceModels.save` wrote) and D_f's
        positions in the training data they were split from: the verdict's scores are calibrated by them
        (docs/guides/verdict.md). ``forget_ids`` is required with ``references``.
    **method_options
        The method's options, checked against its rules. A method costing more than one retraining runs its
        budgeted mode unless its option is given (:func:`scrubnet.cost_guard.budgeted_options`).

    Returns
    -------
    model, result : nn.Module, ForgetResult
        The scrubbed model (a new module); what the scrub reports: ``ok`` and why, its numbers, checks, readouts,
        bounds, verdict, ``cost`` (CPU seconds against retraining).

    Raises
    ------
    ScrubFailed
        The scrub failed its checks and ``on_failure="raise"``.
    ValueError
        Bad input (an unknown method or option, non-finite weights or data); ``RecipeMismatch`` when a curvature
        method refuses a model not at a minimum of the recipe's objective (unless ``force``).
    """
    method, method_options, auto = _resolve(method, method_options, profile, model, on_failure)
    keys = keys or BatchKeys()
    retain_s = as_stream(retain, keys, chunk_size)
    ctx = _context(model, recipe, retain_s, num_classes=num_classes, seed=seed, forget_class=forget_class,
                   classifier=classifier, force=force, chunk_size=chunk_size)
    ctx.train, ctx.retrain_start = train, retrain_start
    method_options = _with_classifier(method, classifier, method_options)
    scrubber = get_method(method, **method_options)  # bad options refused before anything is priced
    retain_s, forget_s = as_stream(retain, keys, chunk_size), as_stream(forget, keys, chunk_size)
    test_s = None if test is None else as_stream(test, keys, chunk_size)
    refs = _references(references, forget_ids, model, len(forget_s))
    measure = dict(retain_error_tolerance=retain_error_tolerance, reference=reference, readouts=readouts,
                   on_not_forgotten=on_not_forgotten, references=refs,
                   forget_ids=None if refs is None else [int(i) for i in forget_ids])

    def run(name: str, options: dict):
        # the global generator (a model's dropout draws from it) fixed by the seed and restored after: the same
        # request gives the same result whatever ran before it (the retraining's price probe, a request before)
        with torch.random.fork_rng(devices=_cuda_devices(model)):
            torch.manual_seed(int(seed))
            return priced_scrub(get_method(name, **options), options, model, retain_s, forget_s, ctx, test_s,
                                max_cost_vs_retrain, **measure)
    out = after_request(run(method, method_options), run, model, retain, forget, test_s, ctx, auto,
                        tolerance=retain_error_tolerance, keys=keys, max_cost_vs_retrain=max_cost_vs_retrain)
    if not out.ok and on_failure == "raise":
        raise ScrubFailed(out)
    return out.model, out


def _cuda_devices(model: nn.Module) -> list:
    """The CUDA devices of ``model``'s parameters (their generators are forked with the CPU's)."""
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _references(references: Any, forget_ids: Any, model: nn.Module, n_forget: int) -> ReferenceModels | None:
    """The verdict's reference models: given, or loaded from their directory into copies of ``model``;
    ``forget_ids`` checked (one training position per forget example, inside the references' split)."""
    if references is None:
        if forget_ids is not None:
            raise ValueError("forget_ids locate D_f for the reference models: give references= too")
        return None
    if forget_ids is None:
        raise ValueError("references need forget_ids: D_f's positions in the training data they were split from")
    if not isinstance(references, ReferenceModels):
        references = load_references(references, model)
    ids = [int(i) for i in forget_ids]
    if len(ids) != n_forget or min(ids) < 0 or max(ids) >= references.members.shape[1]:
        raise ValueError(f"forget_ids must give one position per forget example (got {len(ids)} for {n_forget}), "
                         f"inside the {references.members.shape[1]} training examples the references split")
    return references


def _resolve(method: str, method_options: dict, profile, model: nn.Module, on_failure: str
             ) -> tuple[str, dict, TunedProfile | None]:
    """(method, options, profile): ``on_failure`` checked; ``"auto"`` resolved to the profile's method and its
    tuned options (the caller's options override them), the profile refused on other weights."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    if method != "auto":
        return method, method_options, None
    auto = resolve_profile(profile, model)
    return auto.method, {**auto.options, **method_options}, auto


def _context(model: nn.Module, recipe: TrainingRecipe | None, retain_s, *, num_classes: int | None, seed: int,
             forget_class: int | None, classifier: str | None, force: bool = False, chunk_size: int = 512
             ) -> ForgetContext:
    """:meth:`ForgetContext.from_recipe`, the class count read from the model's output on the first chunk of
    ``retain_s`` only when the model has no classifier to count its classes."""
    probe = None
    if num_classes is None:
        try:
            find_classifier(model, classifier)
        except ValueError:
            probe = first_inputs(retain_s) if classifier is None else None
    ctx = ForgetContext.from_recipe(model, recipe, num_classes=num_classes, seed=seed, forget_class=forget_class,
                                    classifier=classifier, probe=probe)
    ctx.force, ctx.chunk_size = bool(force), int(chunk_size)
    return ctx


def _with_classifier(method: str, classifier: str | None, method_options: dict) -> dict:
    """``method_options`` with ``classifier`` handed to a method taking that option (one name for the head,
    everywhere) unless the options name one."""
    cls = method_class(method)
    if classifier is not None and cls is not None and "classifier" not in method_options \
            and "classifier" in inspect.signature(cls.__init__).parameters:
        method_options = {**method_options, "classifier": classifier}
    return method_options
