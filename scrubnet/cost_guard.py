"""Pricing, in one place: a call's cost against the user's retraining, priced before any work, refused above a
ceiling, measured after.

* :func:`estimate` — a method's predicted cost (its class's ``cost``, counted by the engine of
  :mod:`scrubnet.training.cost`: FLOPs of every layer, the measured GEMM rate) beside the FLOP model's
  retraining (:func:`retrain_estimate`); what ``scrubnet.estimate`` is.
* :func:`retrain_reference` — the reference every cost of a user's model is divided by: the user's retraining
  *measured* on this machine (:func:`scrubnet.recipe.retrain.measure_retraining`: their training function run
  on a probe of D_r at two sizes, or the recipe's training step timed on one batch, times the steps of their
  epochs), once per process for the same call; scrubnet's own protocol keeps the FLOP model of its
  retraining from w_0.
* :func:`price_call` — what one :func:`scrubnet.forget` call runs (the method, the recipe check before a
  curvature method, the retain-error rule's two forward passes over D_r) against that reference;
  :func:`budgeted_options` sizes a budgeted mode under one retraining; :func:`refuse_over` raises
  :class:`~scrubnet.training.cost.BudgetExceeded` before any work above ``max_cost_vs_retrain``;
  :func:`priced_scrub` runs the call so priced and records :func:`measured_cost` (``ForgetResult.cost``).
"""
from __future__ import annotations

import copy
import time

import torch
from torch import Tensor, nn

from scrubnet.data.stream import DataStream
from scrubnet.methods import ForgettingMethod, get_method
from scrubnet.methods.artifacts import artifact_key
from scrubnet.methods.base import ForgetContext, costed_methods, method_class
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.objective import STATIONARITY_CG_MAX, RecipeMismatch, check_stationarity
from scrubnet.recipe.retrain import measure_retraining
from scrubnet.scrub import ForgetResult, scrub_and_measure
from scrubnet.training import TrainConfig
from scrubnet.training.cost import (CostEstimate, check_budget, estimating_on, forward_flops, retrain_reference_cost,
                                    seconds_at)

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
        The call's context: its recipe (or the user's ``train``) prices the reference
        (:func:`retrain_reference`); ``verify_recipe`` (and not ``force``) adds the
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
    ref = retrain_reference(model, retain, ctx)
    if method not in costed_methods():
        return None, ref
    est = estimate(model, n_r, n_f, method=method, num_classes=ctx.num_classes or None, x_probe=x1,
                   config=ctx.config, recipe=ctx.recipe, retrain_from_init=ctx.start is None, **options)
    if method_class(method).anchor == "retrain" and ctx.start is None:   # the user's retraining is the reference
        est = CostEstimate(method, ref.flops, ref.seconds, ref.peak_bytes, ref.passes, dict(ref.details))
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


#: the user's retraining as measured, once per process for a model, |D_r|, recipe and training function: every
#: decision taken on it (a budgeted mode's size) is then the same for the same call within a process
_MEASURED: dict = {}


def retrain_reference(model: nn.Module, retain: DataStream, ctx: ForgetContext) -> CostEstimate:
    """The retraining every cost is compared with.

    Parameters
    ----------
    model : nn.Module
        The model to scrub.
    retain : DataStream
        D_r.
    ctx : ForgetContext
        A user's model (no ``ctx.start``): the user's retraining measured on this machine
        (:func:`~scrubnet.recipe.retrain.measure_retraining` with ``ctx.train``, ``ctx.recipe``,
        ``ctx.retrain_start``), once per process for the same model, |D_r|, recipe and training. scrubnet's
        protocol: the FLOP model of retraining with its recipe (:func:`retrain_estimate`).

    Returns
    -------
    CostEstimate
        ``seconds`` the retraining's (CPU seconds; GPU: wall); ``flops`` the FLOP model's count of it;
        ``details``: ``model_seconds`` (the FLOP model's seconds beside the measurement), ``probe_seconds``.
    """
    x1 = _probe_input(retain)
    flop_model = retrain_estimate(model, len(retain), x_probe=x1, recipe=ctx.recipe)
    if ctx.start is not None:
        return flop_model
    key = artifact_key("retrain_price", weights=[model], options={
        "n_retain": len(retain), "recipe": ctx.recipe.to_dict(), "train": id(ctx.train), "seed": ctx.seed,
        "start": id(ctx.retrain_start), "device": str(x1.device)})
    fresh = key not in _MEASURED
    if fresh:
        _MEASURED[key] = measure_retraining(model, retain, train=ctx.train, recipe=ctx.recipe, seed=ctx.seed,
                                            start=ctx.retrain_start)
    out = copy.deepcopy(_MEASURED[key])
    if not fresh:
        out.details["probe_seconds"] = 0.0     # measured before in this process: nothing spent now
    out.flops = flop_model.flops
    if out.passes != out.passes:   # the user's function: its epochs unknown
        out.passes = flop_model.passes
    out.details["model_seconds"] = flop_model.seconds
    return out


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
    ``cost_vs_retrain`` (measured / retraining estimate), ``retrain_probe_seconds`` (what measuring the
    reference cost, not in ``seconds``; a user's model) and, when the method has a cost model,
    ``estimate_seconds`` and ``estimate_cost_vs_retrain``."""
    out = {"seconds": float(seconds), "retrain_seconds_estimate": float(ref.seconds),
           "cost_vs_retrain": float(seconds) / max(float(ref.seconds), 1e-12)}
    if isinstance(ref.details.get("probe_seconds"), float):   # what timing the user's retraining cost, apart
        out["retrain_probe_seconds"] = ref.details["probe_seconds"]
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


def priced_scrub(scrubber: ForgettingMethod, method_options: dict, model: nn.Module, retain_s, forget_s,
                  ctx: ForgetContext, test_s, max_cost_vs_retrain: float | None, **measure) -> ForgetResult:
    """:func:`~scrubnet.scrub.scrub_and_measure` after pricing the call against the user's retraining
    (:func:`price_call`): the method's budgeted mode when the full method would cost more
    (:func:`budgeted_options`), refused over ``max_cost_vs_retrain``.

    Parameters
    ----------
    scrubber, method_options : ForgettingMethod, dict
        The method and its options.
    model, retain_s, forget_s, ctx, test_s
        The model, D_r, D_f (streams), the context and the held-out set (or None).
    max_cost_vs_retrain : float or None
        The refusal ceiling in retrainings.
    **measure
        :func:`~scrubnet.scrub.scrub_and_measure`'s keywords.

    Returns
    -------
    ForgetResult
        ``cost`` holds the measured CPU seconds against the reference and the estimate (:func:`measured_cost`).
    """
    method = scrubber.name
    call = {"n_test": 0 if test_s is None else len(test_s), "readouts": bool(measure["readouts"])}
    est, ref = price_call(method, method_options, model, retain_s, forget_s, ctx, **call)
    target = 1.0 if max_cost_vs_retrain is None else min(1.0, float(max_cost_vs_retrain))
    budgeted = budgeted_options(method, method_options, model, retain_s, forget_s, ctx, est, target, **call)
    if budgeted is not None:  # the full method would cost more than retraining: its budgeted mode
        method_options, est = budgeted
        scrubber = get_method(method, **method_options)
    refuse_over(est, max_cost_vs_retrain, method)
    t0 = time.process_time()
    out = scrub_and_measure(scrubber, model, retain_s, forget_s, ctx, test=test_s, **measure)
    out.cost = measured_cost(time.process_time() - t0, est, ref)
    if budgeted is not None:
        out.cost["budgeted"] = est.details["budgeted"]
    ratio = out.cost["cost_vs_retrain"]
    if ratio > 1.0 and scrubber.forgets and method != "retrain":   # the clock overruled the estimate: say it
        said = "" if est is None else f" (estimated {out.cost['estimate_cost_vs_retrain']:.2g}×)"
        out.warnings.append(f"cost more than retraining: {out.cost['seconds']:.3g} CPU-s measured against "
                            f"{out.cost['retrain_seconds_estimate']:.3g} s estimated to retrain with the recipe, "
                            f"{ratio:.2g}× one retraining{said}")
    return out


def estimate(model: nn.Module, n_retain: int, n_forget: int, *, method: str, num_classes: int | None = None,
             x_probe: Tensor | None = None, in_shape: tuple[int, ...] | None = None,
             config: TrainConfig | None = None, recipe: TrainingRecipe | None = None,
             retrain_epochs: int | None = None, retrain_from_init: bool | None = None, **options) -> CostEstimate:
    """Predicted cost of ``method`` on ``model``: the method class's :meth:`~ForgettingMethod.cost`, with the cost
    of retraining beside it.

    Parameters
    ----------
    model : nn.Module
        The trained model (not modified; one probe sample is run through it).
    n_retain, n_forget : int
        |D_r| ≥ 1 and |D_f| ≥ 0, samples.
    method : str
        A registered method with a cost model (:func:`costed_methods`).
    num_classes : int, optional
        c (default: the model's output width on the probe).
    x_probe : Tensor, optional
        A batch of inputs, shape (n, ...); its first sample fixes the input shape.
    in_shape : tuple of int, optional
        The shape of one input, without the batch dimension (zeros of it are the probe) when ``x_probe`` is not
        given.
    config : TrainConfig, optional
        Fine-tuning hyperparameters of the training-based methods (scrubnet's protocol; default
        ``TrainConfig()``).
    recipe : TrainingRecipe, optional
        How the model was trained (a user's model): its epochs and batch size price the retraining reference,
        and ``retrain`` is priced as that retraining (from the model's initialisation). Default
        ``TrainingRecipe()`` for the reference; ``retrain`` then keeps the protocol's estimate (from w_0, at
        the config's epoch cap).
    retrain_epochs : int, optional
        The epochs of the retraining reference (default the recipe's).
    retrain_from_init : bool, optional
        Whether ``retrain`` runs from the model's initialisation (a user's model: priced as the reference) or
        from the protocol's w_0 (its own estimate); default: True when ``recipe`` is given.
    **options
        The method's own options (the same keywords as ``get_method(method, **options)``, checked the same way).

    Returns
    -------
    CostEstimate
        FLOPs, seconds, peak bytes and passes (:mod:`scrubnet.training.cost` for the fields), with
        ``retrain_flops``, ``retrain_seconds`` (:func:`~scrubnet.training.cost.retrain_reference_cost`) and
        ``cost_vs_retrain`` = seconds / retrain_seconds.

    Raises
    ------
    ValueError
        An unknown method or one without a cost model, a bad option, bad sizes, or neither ``x_probe`` nor
        ``in_shape``.
    """
    cls = method_class(method)
    if cls is None or method not in costed_methods():
        raise ValueError(f"no cost model for method {method!r}; methods with one: {', '.join(costed_methods())}")
    options = cls.check_options(options)
    if int(n_retain) < 1 or int(n_forget) < 0:
        raise ValueError(f"need n_retain ≥ 1 and n_forget ≥ 0, got {n_retain} and {n_forget}")
    x1, num_classes = _probe(model, x_probe, in_shape, num_classes)
    ref = retrain_estimate(model, int(n_retain), x_probe=x1, recipe=recipe, epochs=retrain_epochs)
    if cls.anchor == "retrain" and (recipe is not None if retrain_from_init is None else retrain_from_init):
        est = CostEstimate(method, ref.flops, ref.seconds, ref.peak_bytes, ref.passes, dict(ref.details))
    else:
        est = cls.cost(model, x1, int(n_retain), int(n_forget), int(num_classes), config or TrainConfig(), **options)
    est.method = method
    return est.against(ref)


def _probe(model: nn.Module, x_probe, in_shape, num_classes) -> tuple[Tensor, int]:
    """(one probe sample, c) for the estimates; sets the device whose GEMM rate prices them."""
    if x_probe is None:
        if in_shape is None:
            raise ValueError("estimate needs x_probe (a batch of inputs) or in_shape")
        param = next(model.parameters())
        x_probe = torch.zeros((1, *in_shape), dtype=param.dtype, device=param.device)
    x1 = x_probe[:1]
    if num_classes is None:
        with eval_mode(model), torch.no_grad():
            num_classes = int(call_model(model, x1).shape[-1])
    estimating_on(x1.device)
    return x1, int(num_classes)


def retrain_estimate(model: nn.Module, n_retain: int, *, x_probe: Tensor | None = None,
                     in_shape: tuple[int, ...] | None = None, recipe: TrainingRecipe | None = None,
                     epochs: int | None = None) -> CostEstimate:
    """The cost of retraining ``model`` from its initialisation on |D_r| = ``n_retain`` samples with
    ``recipe`` (its ``epochs`` unless ``epochs``, its ``batch_size``):
    :func:`~scrubnet.training.cost.retrain_reference_cost`.

    Returns
    -------
    CostEstimate
        ``flops`` (FLOPs of the training loop), ``seconds`` on this machine, ``passes`` = epochs.
    """
    x1, _ = _probe(model, x_probe, in_shape, 0)
    r = recipe or TrainingRecipe()
    ep = r.epochs if epochs is None else int(epochs)
    if ep < 1:
        raise ValueError(f"the retraining reference needs ≥ 1 epoch, got {ep}")
    return retrain_reference_cost(model, x1, int(n_retain), ep, r.batch_size)
