"""What a :func:`scrubnet.forget` request checks after its method ran: the remaining classes' test error on a
whole-class request (:func:`~scrubnet.tuning.check.remaining_class_rule`), and for ``method="auto"`` what the
profile chose and whether the profile fits the request (its forget-set kind and size) — then the request's
self-check against the profile's promise (:func:`self_check`)."""
from __future__ import annotations

from typing import Callable

from torch import nn

from scrubnet.tuning.check import remaining_class_rule, request_class
from scrubnet.tuning.data import labels_of
from scrubnet.tuning.profile import TunedProfile, note_auto

__all__ = ["after_request", "profile_kind_warning"]


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


def after_request(out, run: Callable, model: nn.Module, retain, forget, test_s, ctx, prof: TunedProfile | None, *,
                  tolerance: float, keys=None, max_cost_vs_retrain: float | None = None):
    """The request's checks after its method ran (module docstring); returns the result the caller reports.

    Parameters
    ----------
    out : ForgetResult
        The method's result.
    run : callable
        ``run(method, options) -> ForgetResult``: the same request with another method or options (the
        self-check's next step).
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
        The request's cost ceiling (the self-check's next steps stay under it).

    Returns
    -------
    ForgetResult
    """
    cls, n_forget = ctx.forget_class, None
    if test_s is not None or prof is not None:
        try:   # an iterable-style loader cannot be read by index: its class is then the one given, if any
            y_f = labels_of(forget, keys)
            n_forget = len(y_f)
            if cls is None:
                cls = request_class(labels_of(retain, keys), y_f, None)
        except ValueError:
            pass
    remaining_class_rule(out, model, test_s, cls, tolerance)
    if prof is None:
        return out
    note_auto(out, prof, n_forget if n_forget is not None else int(prof.validation["n"]))
    kind = profile_kind_warning(prof, cls)
    if kind is not None:
        out.warnings.append(kind)
    return out
