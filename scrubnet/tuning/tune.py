"""Tuning on the user's model, the field's way: :func:`tune`.

1. Draw a validation forget set V like D_f (:func:`~scrubnet.tuning.data.draw_like`: same size and class mix,
   from D_r, so disjoint from D_f; a whole other class when D_f is a whole class).
2. Retrain once without V with the user's own training (``train(model, data) -> model`` on D ∖ V), timed: the
   validation gold and the cost every candidate is measured against.
3. Run each candidate method with each of its options (:func:`~scrubnet.tuning.profile.candidate_grid`, the same
   small budget per method) on the task "forget V from the model", through the one scrub path (the retain
   guard and the retain rule included), and measure how close each result comes to the retraining: forget,
   retain and test error and a membership statistic (the AUC of "a V sample's loss is below a test sample's").
4. Keep a :class:`~scrubnet.tuning.profile.TunedProfile`: what was tried, how close, what it cost, and the method
   a request runs (:func:`~scrubnet.tuning.profile.choose`).

A request then runs ``scrubnet.forget(..., method="auto", profile=P)``: the chosen method at its tuned options,
judged by the usual verdict. Decision and measurements: docs/decisions/own-model-tuning.md.
"""
from __future__ import annotations

import copy
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.checkpoint import weights_sha256
from scrubnet.data.stream import BatchKeys, DataStream, as_stream
from scrubnet.methods import ForgetContext, get_method
from scrubnet.methods.base import first_inputs
from scrubnet.models.call import call_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import RETAIN_ERROR_TOLERANCE, scrub_and_measure
from scrubnet.tuning.data import complement, cut, draw_like, fresh, join, labels_of, stream
from scrubnet.tuning.profile import (DEFAULT_CANDIDATES, TunedProfile, Trial, candidate_grid, choose,
                                     within_tolerance)

__all__ = ["evaluate", "forget_closure", "tune"]


@torch.no_grad()
def _per_sample(model: nn.Module, data: DataStream) -> tuple[Tensor, Tensor]:
    """(losses, wrong) of ``model`` (eval mode) on every sample of ``data``."""
    model.eval()
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    losses, wrong = [], []
    for x, y in data.chunks():
        logits = call_model(model, x.to(dev)).float()
        y = y.to(dev)
        losses.append(F.cross_entropy(logits, y, reduction="none").cpu())
        wrong.append((logits.argmax(-1) != y).cpu())
    return torch.cat(losses), torch.cat(wrong)


def membership_auc(forget_losses: Tensor, test_losses: Tensor) -> float:
    """P(a forget sample's loss < a test sample's loss), ties counted half: 0.5 when D_f looks like unseen data
    of the same mix, toward 1 when the model still fits D_f better than unseen data."""
    f, t = forget_losses[:, None], test_losses[None, :]
    return float(((f < t).float() + 0.5 * (f == t).float()).mean())


def evaluate(model: nn.Module, forget: DataStream, retain: DataStream, test: DataStream) -> dict:
    """The tuning's readouts of ``model``: forget/retain/test error, forget loss, membership AUC.

    Parameters
    ----------
    model : nn.Module
    forget, retain, test : DataStream
        The validation forget set, a probe of the validation retain set, held-out data.

    Returns
    -------
    dict
        ``forget_error``, ``forget_loss``, ``retain_error``, ``test_error``, ``mia_auc``.
    """
    lf, wf = _per_sample(model, forget)
    _, wr = _per_sample(model, retain)
    lt, wt = _per_sample(model, test)
    return {"forget_error": float(wf.float().mean()), "forget_loss": float(lf.mean()),
            "retain_error": float(wr.float().mean()), "test_error": float(wt.float().mean()),
            "mia_auc": membership_auc(lf, lt)}


def forget_closure(scrubbed: dict, original: dict, gold: dict) -> float:
    """The share of the forget-loss gap between the original and the retraining a scrub closed:
    1 − |L_f(scrub) − L_f(gold)| / |L_f(original) − L_f(gold)| (1: on the retraining; ≤ 0: no nearer).

    Parameters
    ----------
    scrubbed, original, gold : dict
        :func:`evaluate` readouts.

    Returns
    -------
    float
    """
    gap = abs(original["forget_loss"] - gold["forget_loss"])
    if not math.isfinite(scrubbed["forget_loss"]):
        return -math.inf
    return 1.0 - abs(scrubbed["forget_loss"] - gold["forget_loss"]) / max(gap, 1e-8)


def distance(m: dict, gold: dict) -> float:
    """Σ |m − gold| over forget, retain and test error and the membership AUC (the tuning's objective)."""
    return sum(abs(m[k] - gold[k]) for k in ("forget_error", "retain_error", "test_error", "mia_auc"))


def _whole_class(y_retain: Tensor, y_forget: Tensor, forget_class: int | None) -> int | None:
    if forget_class is not None:
        return int(forget_class)
    classes = y_forget.unique()
    if len(classes) == 1 and not bool((y_retain == classes[0]).any()):
        return int(classes[0])
    return None


def _trial(model, r_v, v, sets, original, gold, method, options, ctx, keys) -> Trial:
    """One candidate run on the validation task through the one scrub path (the retain guard and the retain
    rule included; no pricing and no verdict: the tuning measures against the retraining itself)."""
    t0 = time.process_time()
    try:
        res = scrub_and_measure(get_method(method, **options), model, as_stream(fresh(r_v, ctx.seed), keys),
                                as_stream(fresh(v, ctx.seed), keys), ctx)
    except (ValueError, RuntimeError, TypeError) as e:
        return Trial(method, options, {}, math.inf, -math.inf, time.process_time() - t0, False,
                     f"{type(e).__name__}: {e}"[:300])
    seconds = time.process_time() - t0
    m = evaluate(res.model, *sets)
    return Trial(method, options, m, distance(m, gold) if res.ok else math.inf,
                 forget_closure(m, original, gold), seconds, bool(res.ok), "; ".join(res.reasons)[:300])


def _validation_context(model: nn.Module, recipe: TrainingRecipe, v: DataStream, seed: int,
                        forget_class: int | None) -> ForgetContext:
    """The context of the validation task (the class count from the model's output on V's first chunk)."""
    with torch.no_grad():
        c = int(call_model(model.eval(), first_inputs(v)).shape[-1])
    return ForgetContext.from_recipe(model, recipe, num_classes=c, seed=seed, forget_class=forget_class)


def tune(model: nn.Module, retain, forget, *, train: Callable, test, recipe: TrainingRecipe | None = None,
         init: nn.Module | None = None, forget_class: int | None = None, seed: int = 0,
         methods: tuple[str, ...] = DEFAULT_CANDIDATES, budget: int = 4,
         tolerance: float = RETAIN_ERROR_TOLERANCE, min_closure: float = 0.5, retain_probe: int = 1000,
         keys: BatchKeys | None = None) -> TunedProfile:
    """Tune the forgetting methods on the user's model against the user's own retraining (module docstring).

    Parameters
    ----------
    model : nn.Module
        The trained model; not modified.
    retain, forget : tensors, Dataset or DataLoader
        D_r and D_f of the request the profile is for (D_f's size and class mix are copied; D_f is never used
        as a validation set).
    train : callable
        The user's training, ``train(model, data) -> model``: called once, on a copy of ``init`` and the
        validation retain set D ∖ V in the form ``retain`` was given.
    test : tensors, Dataset or DataLoader
        Held-out data (the test error and the membership statistic).
    recipe : TrainingRecipe, optional
        How the model was trained (the methods' rates and lengths are relative to it).
    init : nn.Module, optional
        What ``train`` starts from (default: the trained model itself; a function that re-initialises its
        model needs no more).
    forget_class : int, optional
        D_f's class when D_f is a whole class (found from the labels otherwise).
    seed : int
        Fixes the validation draw and every method's random choices.
    methods : tuple of str
        The candidates.
    budget : int
        Options tried per method (the same for every method).
    tolerance, min_closure : float
        Within tolerance of the retraining: retain and test error within ``tolerance``, at least
        ``min_closure`` of the forget-loss gap closed.
    retain_probe : int
        Samples of D ∖ V the retain error is measured on.
    keys : BatchKeys, optional
        How dict batches are read.

    Returns
    -------
    TunedProfile
        Save it with :meth:`~scrubnet.tuning.profile.TunedProfile.save`; run it with
        ``scrubnet.forget(..., method="auto", profile=profile)``.
    """
    recipe = recipe or TrainingRecipe()
    t_start = time.process_time()
    y_r, y_f = labels_of(retain, keys), labels_of(forget, keys)
    idx_v, cls_v = draw_like(y_r, y_f, seed, _whole_class(y_r, y_f, forget_class))
    rest = complement(len(y_r), idx_v)
    v, r_v = cut(retain, idx_v, seed), join(cut(retain, rest, seed), forget, seed)
    t0 = time.process_time()
    with torch.random.fork_rng(devices=[]):   # the user's own random draws, fixed by the seed
        torch.manual_seed(int(seed))
        gold = train(copy.deepcopy(init if init is not None else model), r_v)
    retrain_seconds = time.process_time() - t0
    probe = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(seed))[:retain_probe]]
    sets = (stream(v, keys), stream(cut(retain, probe.sort().values, seed), keys), stream(test, keys))
    original, gold_m = evaluate(model, *sets), evaluate(gold, *sets)
    ctx = _validation_context(model, recipe, sets[0], seed, cls_v)
    trials = []
    for method in methods:
        for options in candidate_grid(method, recipe, budget):
            t = _trial(model, r_v, v, sets, original, gold_m, method, options, ctx, keys)
            t.within = within_tolerance(t, gold_m, tolerance, min_closure)
            trials.append(t)
    validation = {"n": int(len(idx_v)), "class": cls_v, "classes": {int(c): int((y_r[idx_v] == c).sum())
                                                                    for c in y_r[idx_v].unique()},
                  "retrain_seconds": retrain_seconds, "gold": gold_m, "seed": seed}
    prof = TunedProfile(model_sha256=weights_sha256(model), validation=validation, original=original,
                        trials=trials, tolerance=float(tolerance), min_closure=float(min_closure))
    prof.chosen = choose(trials, retrain_seconds, gold_m, tolerance)
    prof.tuning_seconds = time.process_time() - t_start
    return prof
