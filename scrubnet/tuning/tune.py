"""Tuning on the user's model, the field's way: :func:`tune`.

1. Draw ``draws`` validation forget sets V_1 … V_k like D_f (:func:`~scrubnet.tuning.data.draw_like`: same size
   and class mix, from D_r, so disjoint from D_f and from each other; whole other classes when D_f is a whole
   class).
2. Retrain without them with the user's own training (``train(model, data) -> model``), timed, checked
   (:func:`~scrubnet.tuning.check.check_trained`: the same architecture, finite weights, the class count): the
   validation golds and the cost every candidate is measured against. Random draws share one retraining
   without V_1 ∪ … ∪ V_k (each V_i is as unseen by it as by a retraining without V_i alone; the others are a few
   samples more left out); a class draw needs its own retraining (a model without two classes is another task).
3. Run the candidates — each method with each of its options (:func:`~scrubnet.tuning.profile.candidate_grid`,
   the same small budget per method) — on the task "forget V_i from the model" through the one scrub path (the
   retain guard and the retain rule included), by successive halving over the draws: every candidate on V_1,
   the best third (at least two) on V_2, the best third of those on V_3 …; a candidate is ranked by its worst
   draw so far. Each run is one task: with ``engine`` (:mod:`scrubnet.audit.engine`: ``local`` or ``ray``) the
   runs of a rung go out as Ray tasks; every random choice of a run is fixed by the seed, so the profile is the
   same on any engine.
4. Keep a :class:`~scrubnet.tuning.profile.TunedProfile`: what was tried, how close on each draw, what it cost,
   and the method a request runs (:func:`~scrubnet.tuning.profile.choose_across`: within tolerance on its
   *worst* draw, the cheapest by its FLOP count — not by a clock that flips the choice on noise).

A request then runs ``scrubnet.forget(..., method="auto", profile=P)``: the chosen method at its tuned options,
judged by the usual verdict. Decision and measurements: docs/decisions/own-model-tuning.md.
"""
from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.audit.engine import LocalEngine
from scrubnet.checkpoint import weights_sha256
from scrubnet.cost_guard import estimate
from scrubnet.data.stream import BatchKeys, DataStream, as_stream
from scrubnet.methods import ForgetContext, get_method
from scrubnet.methods.base import first_inputs
from scrubnet.models.call import call_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import RETAIN_ERROR_TOLERANCE, scrub_and_measure
from scrubnet.tuning.data import complement, cut, draw_like, fresh, join, labels_of, stream
from scrubnet.tuning.check import check_trained, request_class
from scrubnet.tuning.profile import (DEFAULT_CANDIDATES, TunedProfile, Trial, candidate_grid, choose_across,
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
        ``forget_error``, ``forget_loss``, ``retain_error``, ``test_error``, ``test_loss``, ``mia_auc``.
    """
    lf, wf = _per_sample(model, forget)
    _, wr = _per_sample(model, retain)
    lt, wt = _per_sample(model, test)
    return {"forget_error": float(wf.float().mean()), "forget_loss": float(lf.mean()),
            "retain_error": float(wr.float().mean()), "test_error": float(wt.float().mean()),
            "test_loss": float(lt.mean()), "mia_auc": membership_auc(lf, lt)}


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


def _work(model: nn.Module, n_retain: int, n_forget: int, method: str, options: dict, recipe, x1) -> float:
    """A run's FLOP count over the retraining's (the cost model's; deterministic, unlike a clock: the choice
    must not flip on timing noise); nan for a method without a cost model."""
    try:
        est = estimate(model, n_retain, n_forget, method=method, x_probe=x1, recipe=recipe, **options)
    except (ValueError, TypeError, RuntimeError):
        return math.nan
    return math.nan if est.cost_vs_retrain is None else float(est.cost_vs_retrain)


def _run_trial(shared: dict, payload: tuple) -> Trial:
    """One candidate run on validation draw ``i`` (an engine task: ``shared`` is sent once; every random choice
    is fixed by the seed, so the run is the same in any process)."""
    i, method, options = payload
    d = shared["draws"][i]
    ctx, keys, seed = d["ctx"], shared["keys"], shared["seed"]
    t0 = time.process_time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            res = scrub_and_measure(get_method(method, **options), shared["model"],
                                    as_stream(fresh(d["retain"], seed), keys), as_stream(fresh(d["forget"], seed), keys),
                                    ctx)
        except (ValueError, RuntimeError, TypeError) as e:
            return Trial(method, options, {}, math.inf, -math.inf, time.process_time() - t0, False,
                         f"{type(e).__name__}: {e}"[:300], draw=i)
    seconds = time.process_time() - t0
    m = evaluate(res.model, *d["sets"])
    gold = d["gold"]
    return Trial(method, options, m, distance(m, gold) if res.ok else math.inf,
                 forget_closure(m, d["original"], gold), seconds, bool(res.ok), "; ".join(res.reasons)[:300],
                 draw=i)


def _validation_context(model: nn.Module, recipe: TrainingRecipe, v: DataStream, seed: int,
                        forget_class: int | None) -> ForgetContext:
    """The context of the validation task (the class count from the model's output on V's first chunk)."""
    with torch.no_grad():
        c = int(call_model(model.eval(), first_inputs(v)).shape[-1])
    return ForgetContext.from_recipe(model, recipe, num_classes=c, seed=seed, forget_class=forget_class)


def _draws(y_r: Tensor, y_f: Tensor, seed: int, whole: int | None, k: int) -> list[tuple[Tensor, int | None]]:
    """k validation forget sets like D_f (positions in D_r), disjoint from each other: random draws each from
    what the ones before left; class draws k distinct other classes (fewer when D_r has fewer)."""
    out: list[tuple[Tensor, int | None]] = []
    taken = torch.zeros(len(y_r), dtype=torch.bool)
    for j in range(k):
        free = torch.nonzero(~taken).flatten()
        if len(free) == 0:
            break
        idx, cls = draw_like(y_r[free], y_f, seed + 7919 * j, whole)
        if len(idx) == 0:
            break
        idx = free[idx]
        out.append((idx, cls))
        taken[idx] = True
    return out


def _send_user_code_by_value(engine, model: nn.Module, *data) -> None:
    """On a Ray engine, the user's own modules (the model's classes, a loader's ``collate_fn``) are pickled by
    value: a worker cannot import a file loaded from a path (``--model net.py:make_net``) or a test's module."""
    if getattr(engine, "name", "local") != "ray":
        return
    from ray import cloudpickle   # optional: only on a Ray engine

    objs = [type(m) for m in model.modules()] + [getattr(d, "collate_fn", None) for d in data]
    for o in objs:
        name = getattr(o, "__module__", None)
        if not name or name == "__main__" or name.split(".")[0] in ("torch", "scrubnet", "transformers", "peft",
                                                                       "builtins", "typing", "functools"):
            continue
        mod = sys.modules.get(name)
        if mod is not None:
            try:
                cloudpickle.register_pickle_by_value(mod)
            except ValueError:      # not a registrable module (already by value, or a package's internal)
                pass


def rung_plan(n: int, draws: int, eta: int) -> list[int]:
    """How many candidates run on each draw under successive halving: n, then ⌈n/eta⌉ (at least 2, at most the
    rung before) … one entry per draw."""
    sizes = [n]
    for _ in range(1, draws):
        sizes.append(min(sizes[-1], max(2, math.ceil(sizes[-1] / eta))))
    return sizes


def _rank_key(trials: list[Trial]) -> tuple:
    """A candidate's standing over the draws it ran: within tolerance on every one first, then its worst
    closure, then its length (a broken or failed draw puts it last; the FLOP count is taken of the finalists
    only: counting costs as much as a run)."""
    worst = min(t.closure if (t.ok and t.metrics) else -math.inf for t in trials)
    return (all(t.within for t in trials), worst, -float(trials[0].options.get("epochs", 0)))


def tune(model: nn.Module, retain, forget, *, train: Callable, test, recipe: TrainingRecipe | None = None,
         init: nn.Module | None = None, forget_class: int | None = None, seed: int = 0,
         methods: tuple[str, ...] = DEFAULT_CANDIDATES, budget: int = 1, draws: int = 3, eta: int = 3,
         tolerance: float = RETAIN_ERROR_TOLERANCE, min_closure: float = 0.5, retain_probe: int = 1000,
         keys: BatchKeys | None = None, engine=None, progress: Callable[[int, int, str], None] | None = None
         ) -> TunedProfile:
    """Tune the forgetting methods on the user's model against the user's own retraining (module docstring).

    Parameters
    ----------
    model : nn.Module
        The trained model; not modified.
    retain, forget : tensors, Dataset or DataLoader
        D_r and D_f of the request the profile is for (D_f's size and class mix are copied; D_f is never used
        as a validation set).
    train : callable
        The user's training, ``train(model, data) -> model``: called on a copy of ``init`` and a validation
        retain set in the form ``retain`` was given (once for random draws, once per draw for class draws); what
        it returns is checked (the model's architecture, finite weights, the class count) before it is used.
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
        Fixes the validation draws and every method's random choices.
    methods : tuple of str
        The candidates.
    budget : int
        Options tried per method (the same for every method). 1 by default: on the benchmark's 24 cases a
        second option closed no more cases and its tuning cost 1.4× as much (docs/decisions/own-model-tuning.md).
    draws, eta : int
        Validation forget sets (at least 1; 3 by default) and the successive-halving factor: the best
        ⌈n/eta⌉ candidates (at least 2) go on to the next draw.
    tolerance, min_closure : float
        Within tolerance of the retraining: retain and test error within ``tolerance``, at least
        ``min_closure`` of the forget-loss gap closed — on the chosen candidate's worst draw.
    retain_probe : int
        Samples of D ∖ V the retain error is measured on.
    keys : BatchKeys, optional
        How dict batches are read.
    engine : LocalEngine or RayEngine, optional
        Where the candidates' runs go (:func:`scrubnet.audit.engine.make_engine`); default in this process.
    progress : callable, optional
        ``progress(done, total, what)`` after the retraining(s) and after every run (``total`` the planned
        count of steps).

    Returns
    -------
    TunedProfile
        Save it with :meth:`~scrubnet.tuning.profile.TunedProfile.save`; run it with
        ``scrubnet.forget(..., method="auto", profile=profile)``.
    """
    recipe = recipe or TrainingRecipe()
    engine = engine or LocalEngine()
    t_start = time.process_time()
    y_r, y_f = labels_of(retain, keys), labels_of(forget, keys)
    whole = request_class(y_r, y_f, forget_class)
    picked = _draws(y_r, y_f, seed, whole, max(1, int(draws)))
    if not picked:
        raise ValueError("no validation forget set like D_f can be drawn from D_r")
    grid = [(m, o) for m in methods for o in candidate_grid(m, recipe, budget)]
    plan = rung_plan(len(grid), len(picked), eta)
    n_gold = 1 if whole is None else len(picked)
    total_steps, done = n_gold + sum(plan), 0
    start = init if init is not None else model

    def gold_for(excluded: Tensor) -> tuple[nn.Module, float, object]:
        rest = complement(len(y_r), excluded)
        r_x = join(cut(retain, rest, seed), forget, seed)
        t0 = time.process_time()
        with torch.random.fork_rng(devices=[]):   # the user's own random draws, fixed by the seed
            torch.manual_seed(int(seed))
            trained = train(copy.deepcopy(start), r_x)
        spent = time.process_time() - t0
        check_trained(trained, model, first_inputs(stream(cut(retain, excluded[:2], seed), keys)))
        return trained.eval(), spent, rest

    golds, retrain_times = [], []
    if whole is None:
        g, spent, _ = gold_for(torch.cat([i for i, _ in picked]).sort().values)
        golds, retrain_times = [g] * len(picked), [spent]
        done += 1
        if progress:
            progress(done, total_steps, "retrained once without the validation draws")
    else:
        for j, (idx, cls) in enumerate(picked):
            g, spent, _ = gold_for(idx)
            golds.append(g)
            retrain_times.append(spent)
            done += 1
            if progress:
                progress(done, total_steps, f"retrained without validation class {cls}")
    retrain_seconds = statistics.fmean(retrain_times)

    shared: dict = {"model": model, "keys": keys, "seed": int(seed), "draws": []}
    draw_info = []
    for j, ((idx, cls), gold) in enumerate(zip(picked, golds)):
        rest = complement(len(y_r), idx)
        v, r_v = cut(retain, idx, seed), join(cut(retain, rest, seed), forget, seed)
        probe = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(seed + j))[:retain_probe]]
        sets = (stream(v, keys), stream(cut(retain, probe.sort().values, seed), keys), stream(test, keys))
        original, gold_m = evaluate(model, *sets), evaluate(gold, *sets)
        ctx = _validation_context(model, recipe, sets[0], seed, cls)
        shared["draws"].append({"retain": r_v, "forget": v, "sets": sets, "original": original, "gold": gold_m,
                                "ctx": ctx})
        draw_info.append({"n": int(len(idx)), "class": cls, "gold": gold_m, "original": original,
                          "classes": {int(c): int((y_r[idx] == c).sum()) for c in y_r[idx].unique()}})

    _send_user_code_by_value(engine, model, retain, forget)
    trials: list[Trial] = []
    alive = list(range(len(grid)))
    per_cand: dict[int, list[Trial]] = {c: [] for c in alive}
    trial_seconds = 0.0
    for i, size in enumerate(plan):
        if i > 0:
            alive = sorted(alive, key=lambda c: _rank_key(per_cand[c]), reverse=True)[:size]
            alive.sort()
        payloads = [(i, *grid[c]) for c in alive]
        for pos, t in engine.map(_run_trial, shared, payloads):
            c = alive[pos]
            t.within = within_tolerance(t, shared["draws"][i]["gold"], tolerance, min_closure)
            per_cand[c].append(t)
            trial_seconds += t.seconds
            done += 1
            if progress:
                progress(done, total_steps, f"draw {i + 1}/{len(plan)}: {t.method}")
    # the finalists' cost by the FLOP model (deterministic: the choice must not flip on a clock's noise)
    x1 = first_inputs(shared["draws"][0]["sets"][0])
    n_rv = int(len(y_r) + len(y_f) - len(picked[0][0]))
    for c in alive:
        w = _work(model, n_rv, len(picked[0][0]), grid[c][0], grid[c][1], recipe, x1)
        for t in per_cand[c]:
            t.work = w
    for c in sorted(per_cand):
        trials.extend(sorted(per_cand[c], key=lambda t: t.draw))
    d0 = draw_info[0]
    validation = {"n": d0["n"], "class": d0["class"], "classes": d0["classes"], "retrain_seconds": retrain_seconds,
                  "retrainings": len(retrain_times), "gold": d0["gold"], "seed": seed, "draws": draw_info,
                  "plan": plan, "engine": getattr(engine, "name", "local")}
    prof = TunedProfile(model_sha256=weights_sha256(model), validation=validation, original=d0["original"],
                        trials=trials, tolerance=float(tolerance), min_closure=float(min_closure))
    prof.chosen = choose_across(per_cand, grid, len(plan), retrain_seconds, [d["gold"] for d in draw_info],
                                tolerance)
    spent_here = time.process_time() - t_start
    # a remote engine's runs are not on this process's clock: their measured seconds are added
    prof.tuning_seconds = spent_here if getattr(engine, "name", "local") == "local" else spent_here + trial_seconds
    return prof
