"""A call's cost against retraining: priced before any work, refused above a ceiling, measured after.

:func:`price_call` prices what one :func:`scrubnet.forget` call runs (:func:`scrubnet.methods.base.estimate`
with the recipe: the method, the recipe check before a curvature method, the retain-error rule's two
forward passes over D_r) beside the reference, retraining from the model's initialisation with the recipe
(its epochs, its batch size). :func:`refuse_over` raises
:class:`~scrubnet.training.cost.BudgetExceeded` before any work when the estimate is above
``max_cost_vs_retrain`` retrainings; :func:`measured_cost` is what a result records afterwards
(``ForgetResult.cost``).
"""
from __future__ import annotations

from torch import nn

from scrubnet.data.stream import DataStream
from scrubnet.methods.base import ForgetContext, estimate, method_class, costed_methods, retrain_estimate
from scrubnet.recipe.objective import STATIONARITY_CG_MAX, RecipeMismatch, check_stationarity
from scrubnet.training.cost import CostEstimate, check_budget, forward_flops, seconds_at

#: the forgetting verdict's sample of D_r (``forgetting_verdict(max_retain=...)``'s default)
VERDICT_MAX_RETAIN = 10_000

#: a budgeted mode is sized to cost ≤ target / BUDGET_MARGIN by the estimate: the cost model measured up to
#: 1.2–1.7× its estimates of Fisher on a ResNet and a transformer (docs/decisions/cost-vs-retrain.md), and a
#: mode meant to cost less than one retraining must do so on the clock, not only on paper
BUDGET_MARGIN = 1.5


def _probe_input(retain: DataStream):
    """The first sample of D_r (shape (1, ...)), for the FLOP count."""
    if retain.kind == "tensors":
        return retain.x[:1]
    for x, _ in retain.chunks(1):
        return x[:1]
    raise ValueError("D_r is empty")


def price_call(method: str, options: dict, model: nn.Module, retain: DataStream, forget: DataStream,
               ctx: ForgetContext, *, n_test: int = 0, readouts: bool = False
               ) -> tuple[CostEstimate | None, CostEstimate]:
    """(the call's estimate or None for a method without a cost model, the retraining reference).

    Parameters
    ----------
    method, options : str, dict
        The method and its options as the call runs it.
    model : nn.Module
        The model to scrub.
    retain, forget : DataStream
        D_r and D_f.
    ctx : ForgetContext
        The call's context: its recipe prices the reference; ``verify_recipe`` (and not ``force``) adds the
        recipe check before a curvature method (1 gradient pass and at most
        :data:`~scrubnet.recipe.objective.STATIONARITY_CG_MAX` GGN products over D_r: an upper bound, its CG
        stops as soon as the verdict is decided).
    n_test : int
        Held-out samples given to the call: the forgetting verdict runs one forward per set per model (D_f,
        held-out, ≤ 10,000 samples of D_r; before and after).
    readouts : bool
        Whether the call measures error and loss on D_f and the held-out set (before and after).

    Returns
    -------
    tuple
        The estimate's ``seconds`` include the checks; ``details`` itemises them (``recipe_check_seconds``,
        ``retain_rule_seconds``).
    """
    x1 = _probe_input(retain)
    n_r, n_f = len(retain), len(forget)
    ref = retrain_estimate(model, n_r, x_probe=x1, recipe=ctx.recipe)
    if method not in costed_methods():
        return None, ref
    est = estimate(model, n_r, n_f, method=method, num_classes=ctx.num_classes or None, x_probe=x1,
                   config=ctx.config, recipe=ctx.recipe, retrain_from_init=ctx.start is None, **options)
    fwd = n_r * forward_flops(model, x1)
    per = fwd / n_r
    extra = {"retain_rule_flops": 2.0 * fwd}   # error and loss of D_r before and after
    if n_test:
        extra["verdict_flops"] = 2.0 * per * (n_f + n_test + min(n_r, VERDICT_MAX_RETAIN))
    if readouts:
        extra["readouts_flops"] = 2.0 * per * (n_f + n_test)
    cls = method_class(method)
    if cls.uses_curvature and cls.needs_retain and ctx.verify_recipe and not ctx.force:
        extra["recipe_check_flops"] = 3.0 * fwd * (1 + 2 * STATIONARITY_CG_MAX)
    for k, f in extra.items():
        s = seconds_at(f, "newton")
        est.flops += f
        est.seconds += s
        if est.seconds_upper is not None:
            est.seconds_upper += s
        est.details[k.replace("_flops", "_seconds")] = s
    return est.against(ref), ref


def refuse_over(est: CostEstimate | None, max_cost_vs_retrain: float | None, method: str) -> None:
    """Raise :class:`~scrubnet.training.cost.BudgetExceeded` when ``est`` is above ``max_cost_vs_retrain``
    retrainings; ``ValueError`` when a ceiling is asked of a method without a cost model."""
    if max_cost_vs_retrain is None:
        return
    if est is None:
        raise ValueError(f"max_cost_vs_retrain: method {method!r} declares no cost estimate")
    check_budget(est, max_cost_vs_retrain=max_cost_vs_retrain)


def recipe_refusal(method: str, model: nn.Module, retain: DataStream, ctx: ForgetContext) -> str | None:
    """The recipe check a curvature method's call would run first (it stops as soon as its verdict is decided): the
    refusal message when it would refuse, else None (also None when the call would not run it)."""
    cls = method_class(method)
    if cls is None or not (cls.uses_curvature and cls.needs_retain and ctx.verify_recipe and not ctx.force):
        return None
    try:
        check_stationarity(model, retain, ctx.recipe, ctx.center(model), method=method)
    except RecipeMismatch as e:
        return str(e)
    return None


def measured_cost(seconds: float, est: CostEstimate | None, ref: CostEstimate) -> dict[str, float]:
    """What a result records: ``seconds`` (measured process CPU time of the call), ``retrain_seconds_estimate``,
    ``cost_vs_retrain`` (measured / retraining estimate) and, when the method has a cost model,
    ``estimate_seconds`` and ``estimate_cost_vs_retrain``."""
    out = {"seconds": float(seconds), "retrain_seconds_estimate": float(ref.seconds),
           "cost_vs_retrain": float(seconds) / max(float(ref.seconds), 1e-12)}
    if est is not None:
        out.update(estimate_seconds=float(est.seconds), estimate_cost_vs_retrain=float(est.cost_vs_retrain))
        if est.seconds_upper is not None:
            out["estimate_seconds_upper"] = float(est.seconds_upper)
    return out


def budgeted_options(method: str, options: dict, model: nn.Module, retain: DataStream, forget: DataStream,
                     ctx: ForgetContext, est: CostEstimate | None, target: float = 1.0, **call
                     ) -> tuple[dict, CostEstimate] | None:
    """The budgeted mode a call runs by default when the full method would cost more than ``target``
    retrainings: (options with the method's ``budget_knob`` set, its estimate), or None (the full method: it
    is within the target, the method has no budgeted mode, the caller set the knob or an option it replaces,
    or no budget fits).

    The knob (Newton's ``cg_budget``, NTK's ``cg_budget``, Fisher's ``subsample``) is the largest value whose
    estimate stays within ``target`` / :data:`BUDGET_MARGIN` (within ``target`` when none does): the estimates
    are affine in it, so two of them fix the slope. Judged on
    the estimates' :attr:`~scrubnet.training.cost.CostEstimate.ceiling` (the upper bound where one is stated).
    ``call``: :func:`price_call`'s ``n_test`` and ``readouts``.
    """
    cls = method_class(method)
    knob = getattr(cls, "budget_knob", None)
    if knob is None or est is None or est.ceiling_vs_retrain <= target:
        return None
    if knob in options or any(k in options for k in getattr(cls, "budget_replaces", ())):
        return None
    lo = 8 if knob == "subsample" else 1
    replaced = getattr(cls, "budget_replaces", ())
    # at most the full method's own count: the sample count, or the iteration cap the budget replaces
    full = len(retain) - 1 if knob == "subsample" else int(options.get(replaced[0], cls.options[replaced[0]].default))
    if full < lo:
        return None
    a, _ = price_call(method, {**options, knob: lo}, model, retain, forget, ctx, **call)
    b, _ = price_call(method, {**options, knob: 2 * lo}, model, retain, forget, ctx, **call)
    slope = (b.ceiling - a.ceiling) / lo
    if not slope > 0:
        return None
    for aim in (target / BUDGET_MARGIN, target):   # the margin when a budget fits under it, else the target
        k = min(full, lo + int((aim * a.retrain_seconds - a.ceiling) / slope))
        while k >= lo:
            opts = {**options, knob: k}
            chosen, _ = price_call(method, opts, model, retain, forget, ctx, **call)
            if chosen.ceiling_vs_retrain <= aim:
                chosen.details["budgeted"] = f"{knob}={k}"
                return opts, chosen
            k = int(k * 0.9) if k > 10 else k - 1
    return None
