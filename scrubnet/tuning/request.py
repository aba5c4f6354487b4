"""What a :func:`scrubnet.forget` request checks after its method ran: the remaining classes' test error on a
whole-class request (:func:`~scrubnet.tuning.check.remaining_class_rule`), and for ``method="auto"`` what the
profile chose and whether the profile fits the request (its forget-set kind and size) — then the request's
self-check against the profile's promise (:func:`self_check`)."""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch
from torch import nn

from scrubnet.tuning.check import per_sample_loss, remaining_class_rule, request_class
from scrubnet.tuning.data import labels_of, stream
from scrubnet.tuning.profile import TunedProfile, note_auto
from scrubnet.tuning.tune import membership_auc

__all__ = ["after_request", "estimated_closure", "profile_kind_warning", "promised_gold_loss", "self_check"]


def profile_kind_warning(prof: TunedProfile, cls: int | None) -> str | None:
    """The warning when a profile tuned on one forget-set kind (random samples, a whole class) serves a request
    of the other: its choice was measured on another task."""
    tuned_class = prof.validation.get("class") is not None
    if tuned_class == (cls is not None):
        return None
    tuned = "whole classes" if tuned_class else "random samples"
    asked = f"the whole class {cls}" if cls is not None else "random samples"
    return (f"auto: the profile was tuned on forget sets of {tuned}, this request forgets {asked}: its choice "
            "was measured on another task; tune on forget sets like this one")


#: the routes that always forget, named when no tuned step within the cost ceiling reaches the profile's promise
ROUTES = ("retraining without D_f (method \"retrain\" with your train= / --train: exact, one retraining)",
          "forgettable fine-tuning (docs/decisions/forgettable.md: train the model forgettable once, then every "
          "deletion is exact)")
#: the self-check's cost ceiling when the request sets none (retrainings, every attempt together): the cost an
#: approximate request is for (measured in docs/decisions/own-model-tuning.md: with a ceiling of one retraining
#: the next steps doubled the median request cost, 0.50 → 1.06, and closed no more cases)
SELF_CHECK_CEILING = 0.5
#: a gap smaller than this (nats) is no gap: a model that generalises to D_f has nothing measurable to forget
GAP_FLOOR = 0.05


def promised_gold_loss(prof: TunedProfile, test_loss_now: float) -> float:
    """The retraining's forget loss a request can expect, without a retraining: the validation draws' ratio of the
    retraining's forget loss to the original's test loss (median over draws), times the original's test loss on
    the request's held-out data (the same ratio when the held-out data are the tuning's)."""
    draws = prof.validation.get("draws") or [{"gold": prof.validation["gold"], "original": prof.original}]
    ratios = sorted(d["gold"]["forget_loss"] / max(d["original"].get("test_loss", 0.0), 1e-8)
                    if "test_loss" in d["original"] else math.nan for d in draws)
    ratios = [r for r in ratios if math.isfinite(r)]
    if not ratios:      # a version-1 profile (no test loss): the validation gold's forget loss as it was
        return float(statistics.median(d["gold"]["forget_loss"] for d in draws))
    return float(statistics.median(ratios)) * test_loss_now


def estimated_closure(l_scrub: float, l_orig: float, l_gold: float) -> float:
    """1 − |L_f(scrub) − ĝ| / |L_f(original) − ĝ| against the promised retraining loss ĝ; with no gap (under
    :data:`GAP_FLOOR`) 1 when the scrub stays within the floor of ĝ, else 0."""
    gap = abs(l_orig - l_gold)
    if not math.isfinite(l_scrub):
        return -math.inf
    if gap < GAP_FLOOR:
        return 1.0 if abs(l_scrub - l_gold) <= GAP_FLOOR else 0.0
    return 1.0 - abs(l_scrub - l_gold) / gap


def _measure(res, model: nn.Module, forget_s, test_s, lf_orig: float, g_hat: float) -> dict:
    lf = per_sample_loss(res.scrub.model, forget_s) if res.scrub is not None else torch.full((1,), math.inf)
    out = {"forget_loss": float(lf.mean()), "estimated_closure": estimated_closure(float(lf.mean()), lf_orig, g_hat),
           "ok": bool(res.ok), "cost_vs_retrain": float(res.cost.get("cost_vs_retrain", math.nan))}
    if test_s is not None and res.scrub is not None:
        out["mia_auc"] = membership_auc(lf, per_sample_loss(res.scrub.model, test_s))
    return out


def self_check(out, run: Callable, model: nn.Module, forget_s, test_s, prof: TunedProfile, finish: Callable,
               ceiling: float | None):
    """The request checked against the profile's promise, without a retraining.

    The promise: the validation draws' retraining loss on the forget set, carried over to D_f
    (:func:`promised_gold_loss`), closed at least ``prof.min_closure`` (:func:`estimated_closure`), with the
    scrub path's checks passed. Where the request falls short, the next steps the profile names
    (``prof.chosen["next"]``: the next finalists, then the chosen method twice as long) run while the request's
    total cost stays within ``ceiling`` retrainings (default :data:`SELF_CHECK_CEILING`); the
    first that keeps the promise is returned, else the attempt that came closest, with a warning naming the
    exact routes that forget (:data:`ROUTES`). Every attempt's numbers are in ``checks["self_check"]``; the
    result's cost is the sum of the attempts'.
    """
    ceiling = SELF_CHECK_CEILING if ceiling is None else float(ceiling)
    test_loss_now = float(per_sample_loss(model, test_s).mean()) if test_s is not None else math.nan
    lf_orig = float(per_sample_loss(model, forget_s).mean())
    g_hat = promised_gold_loss(prof, test_loss_now) if test_s is not None else promised_gold_loss(prof, math.nan)
    if not math.isfinite(g_hat):
        draws = prof.validation.get("draws") or [{"gold": prof.validation["gold"]}]
        g_hat = float(statistics.median(d["gold"]["forget_loss"] for d in draws))
    want = float(prof.min_closure)

    def keeps(m: dict) -> bool:
        return m["ok"] and m["estimated_closure"] >= want

    attempts = [(out, dict(_measure(out, model, forget_s, test_s, lf_orig, g_hat), method=prof.method,
                           options=prof.options))]
    spent = attempts[0][1]["cost_vs_retrain"] if math.isfinite(attempts[0][1]["cost_vs_retrain"]) else 0.0
    first_cost = max(spent, 1e-9)
    if not keeps(attempts[0][1]):
        for step in prof.chosen.get("next", []):
            # the step's cost, predicted from the first run's: scaled by its length
            e0, e1 = prof.options.get("epochs"), step["options"].get("epochs")
            predicted = first_cost * (e1 / e0 if e0 and e1 else 1.0)
            if spent + predicted > ceiling:
                continue
            res = finish(run(step["method"], dict(step["options"])))
            m = dict(_measure(res, model, forget_s, test_s, lf_orig, g_hat), method=step["method"],
                     options=dict(step["options"]))
            spent += m["cost_vs_retrain"] if math.isfinite(m["cost_vs_retrain"]) else predicted
            attempts.append((res, m))
            if keeps(m):
                break
    kept = [a for a in attempts if keeps(a[1])]
    final, fm = kept[0] if kept else max(attempts, key=lambda a: (a[1]["ok"], a[1]["estimated_closure"]))
    final.checks["self_check"] = {"result": [a[0] for a in attempts].index(final), "promised_gold_forget_loss": g_hat, "original_forget_loss": lf_orig,
                                  "min_closure": want, "kept": bool(kept), "attempts": [a[1] for a in attempts],
                                  "cost_ceiling": ceiling, "total_cost_vs_retrain": spent,
                                  "promised_closure_worst": prof.chosen.get("closure_worst")}
    if "cost_vs_retrain" in final.cost:
        final.cost["cost_vs_retrain"] = spent            # every attempt was paid for
        final.cost["attempts"] = float(len(attempts))
    if len(attempts) > 1:
        final.warnings.append(
            f"auto: the first run ({prof.method}) fell short of the profile's promise (estimated closure "
            f"{100 * attempts[0][1]['estimated_closure']:.0f} % < {100 * want:g} %); "
            f"{len(attempts) - 1} next step(s) ran, this result is {fm['method']} at {fm['options']}")
    if not kept:
        final.warnings.append(
            f"auto: no tuned step within {ceiling:g} retraining(s) reached the profile's promise (best estimated "
            f"closure {100 * fm['estimated_closure']:.0f} % of the forget-loss gap, against the retraining's loss "
            f"{g_hat:.3f} nats carried over from the validation draws); routes that forget: " + "; ".join(ROUTES))
    return final


def after_request(out, run: Callable, model: nn.Module, retain, forget, test_s, ctx, prof: TunedProfile | None, *,
                  tolerance: float, keys=None, max_cost_vs_retrain: float | None = None):
    """The request's checks after its method ran (module docstring); returns the result the caller reports.

    Parameters
    ----------
    out : ForgetResult
        The method's result.
    run : callable
        ``run(method, options) -> ForgetResult``: the same request with another method or options (the
        self-check's next steps).
    model : nn.Module
        The model before the request.
    retain, forget : data as the caller gave them
    test_s : DataStream or None
        Held-out data.
    ctx : ForgetContext
    prof : TunedProfile or None
        The profile of ``method="auto"``.
    tolerance : float
        The retain-error tolerance (the remaining classes' test error gets the same).
    keys : BatchKeys, optional
    max_cost_vs_retrain : float, optional
        The request's cost ceiling (the self-check's next steps stay under it; default
        :data:`SELF_CHECK_CEILING`).

    Returns
    -------
    ForgetResult
    """
    cls, n_forget, forget_s = ctx.forget_class, None, None
    if test_s is not None or prof is not None:
        try:   # an iterable-style loader cannot be read by index: its class is then the one given, if any
            y_f = labels_of(forget, keys)
            n_forget = len(y_f)
            forget_s = stream(forget, keys)
            if cls is None:
                cls = request_class(labels_of(retain, keys), y_f, None)
        except ValueError:
            pass

    def finish(res):
        remaining_class_rule(res, model, test_s, cls, tolerance)
        return res
    out = finish(out)
    if prof is None:
        return out
    if forget_s is not None:
        out = self_check(out, run, model, forget_s, test_s, prof, finish, max_cost_vs_retrain)
    note_auto(out, prof, n_forget if n_forget is not None else int(prof.validation["n"]))
    kind = profile_kind_warning(prof, cls)
    if kind is not None:
        out.warnings.append(kind)
    return out
