"""Newton (quadratic) scrubbing, "Eternal Sunshine" Prop. 3 at t → ∞ and the noisy Newton update (2.8).

The retain objective is the fine-tuning loss restricted to D_r,

    L_r(w) = (1/N_r) Σ_{i∈D_r} ℓ(f_w(x_i), y_i) + (wd/2)·‖w − w_0‖²,

and the scrub is one Newton step on it,

    h(w) = w − H⁻¹ ∇L_r(w),   H = G_r + (wd + damping)·I,

with G_r the Gauss–Newton matrix of the mean loss on D_r (= true Fisher for cross-entropy; the PSD
Levenberg–Marquardt replacement of the Hessian; docs/decisions/fisher-newton.md, "Newton scrub"), applied matrix-free (JVP + VJP, see
:mod:`scrubnet.curvature.ggn`) inside :func:`scrubnet.curvature.solvers.conjugate_gradient`. The gradient
includes the pull term wd·(w − w_0); parameters absent from the recipe's centre get no pull. ``damping`` (default 0:
the pull already makes H positive definite), the CG ``tol`` and ``max_iter`` and what CG achieved are
reported in ``info``. For a model that is linear in w and ``loss="mse"`` (ℓ = ½‖f − onehot(y)‖²), L_r is
quadratic, G_r its exact Hessian, and h(w) is exactly the retrained model (to CG tolerance).

**Optimal noise (Prop. 4 with the λ of the correcting note):** Σ B Σ = λ Σ_h, so for Σ_h = σ_h² I the noise
covariance is Σ = √(λσ_h²)·B^{-1/2}. With ``alpha`` = λσ_h² (the same knob as Fisher forgetting's paper form)
and B the diagonal of the retain objective's curvature at h(w), B = diag(F_r(h(w))) + wd (true-Fisher
diagonal plus the pull; the pull keeps B > 0 where the data carry no curvature, so no clamp is needed):

    S(w) = h(w) + n,   n ~ N(0, diag(√alpha · B^{-1/2})).

``alpha = 0`` (default) gives the deterministic Newton step. With noise the result carries the Gaussian
N(h(w), diag v) and :meth:`NewtonScrub.noise_at` applies the same procedure (Newton step, then noise) to
another model, from which the evaluator reports ``info_weights_nats`` against the retrain model. Without
noise the distributions are point masses and the bound is infinite; the evaluator's
``weight_distance_ratio`` = ‖h(w_o) − w_r‖ / ‖w_o − w_r‖ says whether the step moved toward the retrain
model (< 1).

**Safeguard** (:func:`retain_newton_step`; "Newton safeguard" in docs/decisions/index.md): the step is accepted only
where L_r decreases — Levenberg–Marquardt damping on the Gauss–Newton model (default), Armijo backtracking,
or the paper's plain step (``safeguard="none"``). On the embedded default (MLP on MNIST-1D, wd 0.03) the
plain step raises L_r on every seed and reaches the retrain band only by that overshoot; the safeguarded
step lowers L_r and stays next to the original on the forget readouts (figures in docs/decisions/index.md).
"""
from __future__ import annotations

import copy
import math
import time

import torch
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import cost_multipliers, fallbacks_report, probe_paths
from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.ggn import GGNOperator, mean_loss_and_grad, per_sample_loss
from scrubnet.curvature.params import get_flat, set_flat, trainable_params
from scrubnet.curvature.solvers import SolveInfo, conjugate_gradient
from scrubnet.curvature.ntk import activation_numel_per_sample
from scrubnet.methods.base import ForgetContext, ForgettingMethod, Option, ScrubResult, WeightGaussian, register
from scrubnet.training.cost import (CostEstimate, fisher_diagonal_cost, forward_flops, product_factor, seconds_at,
                                   trainable_numel)
from scrubnet.methods.fisher import sample_gaussian_weights, stream_fisher
from scrubnet.data.stream import DataStream
from scrubnet.models.loss import LossSpec, as_loss
from scrubnet.recipe.objective import pull_mask_and_anchor, stream_ggn_matvec, stream_loss_and_grad
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model


SAFEGUARDS = ("backtrack", "lm", "none")


def _batches(retain, batch_size: int):
    """(x, y) batches of ``retain``: slices of in-memory tensors, or the chunks of a :class:`DataStream`."""
    if isinstance(retain, DataStream):
        yield from retain.chunks(batch_size)
        return
    x, y = retain
    for i in range(0, len(x), batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]


def _retain_objective(model: nn.Module, flat: Tensor, retain, *, loss: LossSpec, wd: float, mask: Tensor,
                      anchor: Tensor, batch_size: int) -> float:
    """L_r at the flat weights ``flat``: mean loss on ``retain`` + (wd/2)‖mask·(w − w_0)‖² (one forward pass)."""
    probe = copy.deepcopy(model)
    set_flat(probe, flat)
    total, n = 0.0, 0
    with torch.no_grad(), eval_mode(probe):
        for xb, yb in _batches(retain, batch_size):
            total += float(per_sample_loss(call_model(probe, xb), yb, loss).sum())
            n += len(yb)
    pull = mask * (flat - anchor)
    return total / n + 0.5 * wd * float(pull @ pull)


def _retain_fit(model: nn.Module, flat: Tensor, retain, batch_size: int) -> tuple[float, float]:
    """(error, mean cross-entropy) on ``retain`` at the flat weights ``flat`` (one forward pass)."""
    probe = copy.deepcopy(model)
    set_flat(probe, flat)
    wrong, ce, n = 0, 0.0, 0
    with torch.no_grad(), eval_mode(probe):
        for xb, yb in _batches(retain, batch_size):
            logits = call_model(probe, xb)
            wrong += int((logits.argmax(1) != yb).sum())
            ce += float(per_sample_loss(logits, yb, "ce").sum())
            n += len(yb)
    return wrong / n, ce / n


#: the "lm" safeguard's re-solves at most, and the halvings of the line search and the data check
NEWTON_DAMPING_TRIES, NEWTON_HALVINGS = 6, 30
#: the budgeted mode's halvings (line search and data check)
BUDGET_HALVINGS = 3
# CG iterations of a typical solve at the default tolerance (1e-5): measured 18 (MLP 40-256-256-5, N = 1,000)
# to 50 (2-layer transformer, N = 64) in benchmarks/cost_check.py's newton-default cases; 30 puts both within
# 2× (docs/decisions/cost-transformers.md). The typical estimate is ``seconds``, the upper bound ``seconds_upper``
NEWTON_TYPICAL_CG_ITERATIONS = 30


def _damped_solve(hvp_at, grad: Tensor, w: Tensor, objective, obj_before: float, *, damping: float, tol: float,
                  max_iter: int, lm: bool, max_damping_tries: int) -> dict:
    """The Newton direction δ = (H + μI)⁻¹g by CG, with μ raised Levenberg–Marquardt style (``lm``) until the
    ratio ρ of actual to predicted decrease is ≥ ¼ (:func:`retain_newton_step`); the last solve's figures."""
    mu, tries, cg_total = float(damping), 0, 0
    while True:
        delta, info = conjugate_gradient(hvp_at(mu), grad, tol=tol, max_iter=max_iter)
        cg_total += info.iterations
        if tries == 0:  # the step at the initial damping: what the safeguard shortened, if it did
            first_norm = float(torch.linalg.vector_norm(delta))
        slope = float(grad @ delta)                              # gᵀδ: decrease rate along −δ at t = 0
        curvature = slope - mu * float(delta @ delta)            # δᵀHδ from (H + μI)δ ≈ g
        obj_full = objective(w - delta)
        predicted = slope - 0.5 * curvature                      # m(0) − m(δ)
        rho = (obj_before - obj_full) / predicted if predicted > 0 else float("-inf")
        if not lm or rho >= 0.25 or tries >= max_damping_tries:
            break
        tries += 1
        mu = max(10.0 * mu, curvature / max(float(delta @ delta), 1e-300))
    return {"delta": delta, "info": info, "slope": slope, "curvature": curvature, "obj_full": obj_full,
            "mu": mu, "tries": tries, "cg_total": cg_total, "first_norm": first_norm}


def _armijo_search(objective, w: Tensor, delta: Tensor, obj_before: float, obj_full: float, slope: float,
                   armijo: float, max_halvings: int) -> tuple[float, float, int]:
    """(t, L_r(w − tδ), trials): the longest t = 1, ½, ¼, … with Armijo's decrease; t = 0 when none has it."""
    t, obj_after, trials = 1.0, obj_full, 1
    accepted = slope > 0 and obj_full <= obj_before - armijo * slope
    while not accepted and trials <= max_halvings and slope > 0:
        t *= 0.5
        obj_after = objective(w - t * delta)
        trials += 1
        accepted = obj_after <= obj_before - armijo * t * slope
    if not accepted:  # no decrease found along δ: keep w (L_r unchanged)
        t, obj_after = 0.0, obj_before
    return t, obj_after, trials


def _data_check(model, retain, w: Tensor, delta: Tensor, t: float, obj_after: float, obj_before: float, objective,
                batch_size: int, loss_tolerance: float, error_tolerance: float, max_halvings: int
                ) -> tuple[float, float, int]:
    """(t, objective, halvings): the data part judged on its own — the total objective can fall while the fit to
    D_r collapses (a pull toward w_0 that dominates L_r); t is halved until the retain CE and error stay within
    the tolerances (t = 0 after ``max_halvings``)."""
    data_rejections = 0
    err0, ce0 = _retain_fit(model, w, retain, batch_size)
    while t > 0:
        err1, ce1 = _retain_fit(model, w - t * delta, retain, batch_size)
        if ce1 - ce0 <= loss_tolerance and err1 - err0 <= error_tolerance:
            break
        data_rejections += 1
        t = t * 0.5 if data_rejections <= max_halvings else 0.0
        obj_after = objective(w - t * delta) if t > 0 else obj_before
    return t, obj_after, data_rejections


def retain_newton_step(model: nn.Module, retain, *, w0: dict[str, Tensor] | None, wd: float,
                       loss: str | LossSpec = "ce", damping: float = 0.0, tol: float = 1e-6, max_iter: int = 500,
                       batch_size: int = 512, safeguard: str = "lm", armijo: float = 1e-4,
                       max_halvings: int = NEWTON_HALVINGS, max_damping_tries: int = NEWTON_DAMPING_TRIES,
                       data_check: bool = False, loss_tolerance: float = 0.05,
                       error_tolerance: float = 0.02) -> tuple[nn.Module, SolveInfo, dict[str, float]]:
    """Safeguarded h(w) = w − t·(G_r + (wd·M + μ)·I)⁻¹ ∇L_r(w) on ``retain`` = (x, y), by CG.

    M is the pull mask (1 on parameters present in ``w0``), μ ≥ ``damping`` the Levenberg–Marquardt damping and
    t ∈ (0, 1] the accepted step length; ∇L_r includes the pull wd·M·(w − w_0). The Gauss–Newton model
    m(δ) = L_r(w) − gᵀδ + ½ δᵀHδ (H = G_r + wd·M) is only a model of L_r (on a BatchNorm CNN its minimiser
    measured L_r 1.02 → 1.93), so the step is accepted only when L_r decreases (Newton safeguard in
    docs/decisions/fisher-newton.md): ``safeguard="lm"`` (default) raises μ ← max(10μ, δᵀHδ/‖δ‖²) and re-solves
    until ρ = actual / predicted decrease ≥ ¼ (:func:`_damped_solve`, at most ``max_damping_tries``), then
    backtracks; ``"backtrack"`` halves t along the undamped δ until Armijo's decrease (``armijo``;
    :func:`_armijo_search`); ``"none"`` takes the plain step. With no decrease in ``max_halvings`` halvings the
    weights stay (t = 0). ``data_check`` also halves t until the retain CE rises by at most ``loss_tolerance``
    nats and the error by at most ``error_tolerance`` (:func:`_data_check`).

    Returns (a new model at h(w), the last CG :class:`SolveInfo`, diagnostics: grad_norm, step_norm (‖t·δ‖),
    full_step_norm (‖δ‖), undamped_step_norm (‖δ‖ of the first solve), objective_before / objective_after /
    objective_full_step (L_r), step_length t, damping μ, damping_tries, line_search_trials, rho (at the
    accepted point), cg_iterations_total, data_rejections). ``model`` is not modified.
    """
    if wd < 0 or damping < 0:
        raise ValueError(f"wd and damping must be ≥ 0, got wd={wd}, damping={damping}")
    loss = as_loss(loss)
    if safeguard not in SAFEGUARDS:
        raise ValueError(f"unknown safeguard {safeguard!r}; choose one of {', '.join(SAFEGUARDS)}")
    if isinstance(retain, DataStream) and retain.kind == "tensors":
        retain = (retain.x, retain.y)
    streamed = isinstance(retain, DataStream)
    if len(retain if streamed else retain[1]) == 0:
        raise ValueError("the Newton scrub needs a non-empty retain set")
    w = get_flat(model)
    mask, anchor = pull_mask_and_anchor(model, w0)
    if streamed:  # sums over chunks (docs/decisions/own-model.md, "Streaming rule")
        data_loss, g_data = stream_loss_and_grad(model, retain, loss=loss, batch_size=batch_size)
    else:
        data_loss, g_data = mean_loss_and_grad(model, *retain, loss=loss, batch_size=batch_size)
    pull = mask * (w - anchor)
    grad = g_data + wd * pull
    obj_before = data_loss + 0.5 * wd * float(pull @ pull)
    ggn_matvec = (lambda v: stream_ggn_matvec(model, retain, v, loss=loss, batch_size=batch_size)) if streamed \
        else GGNOperator(model, retain[0], loss=loss, batch_size=batch_size).matvec

    def objective(flat: Tensor) -> float:
        return _retain_objective(model, flat, retain, loss=loss, wd=wd, mask=mask, anchor=anchor,
                                 batch_size=batch_size)

    def hvp_at(mu: float):
        return lambda v: ggn_matvec(v) + wd * mask * v + mu * v

    s = _damped_solve(hvp_at, grad, w, objective, obj_before, damping=damping, tol=tol, max_iter=max_iter,
                      lm=safeguard == "lm", max_damping_tries=max_damping_tries)
    delta, info, slope, curvature, obj_full = s["delta"], s["info"], s["slope"], s["curvature"], s["obj_full"]
    t, obj_after, trials = 1.0, obj_full, 1
    if safeguard != "none":
        t, obj_after, trials = _armijo_search(objective, w, delta, obj_before, obj_full, slope, armijo, max_halvings)
    data_rejections = 0
    if data_check and t > 0:
        t, obj_after, data_rejections = _data_check(model, retain, w, delta, t, obj_after, obj_before, objective,
                                                    batch_size, loss_tolerance, error_tolerance, max_halvings)
    mu, tries, cg_total, first_norm = s["mu"], s["tries"], s["cg_total"], s["first_norm"]
    w_new = w - t * delta
    rho_t = ((obj_before - obj_after) / (t * slope - 0.5 * t * t * curvature)
             if t > 0 and t * slope - 0.5 * t * t * curvature > 0 else float("nan"))
    new = copy.deepcopy(model)
    set_flat(new, w_new)
    diag = {"grad_norm": float(torch.linalg.vector_norm(grad)),
            "step_norm": t * float(torch.linalg.vector_norm(delta)),
            "full_step_norm": float(torch.linalg.vector_norm(delta)),
            "undamped_step_norm": first_norm,
            "objective_before": obj_before, "objective_after": obj_after, "objective_full_step": obj_full,
            "step_length": t, "damping": mu, "damping_tries": float(tries),
            "line_search_trials": float(trials), "rho": rho_t, "cg_iterations_total": float(cg_total),
            "data_rejections": float(data_rejections)}
    return new.eval(), info, diag


def newton_noise_variance(model: nn.Module, retain, *, alpha: float, wd: float, w0: dict[str, Tensor] | None,
                          batch_size: int | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Mean and variance of the Prop. 4 noise at ``model`` (= h(w)): μ = w, v = √alpha · B^{-1/2} with
    B = diag true Fisher on ``retain`` + wd (on pulled parameters)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if isinstance(retain, DataStream) and retain.kind == "tensors":
        retain = (retain.x, retain.y)
    fisher = stream_fisher(model, retain, "true", batch_size, None) if isinstance(retain, DataStream) else \
        fisher_diag(model, retain[0], kind="true", batch_size=batch_size)
    mean, var = {}, {}
    for name, p in trainable_params(model).items():
        b = fisher[name].to(torch.float64) + (wd if (w0 is not None and name in w0) else 0.0)
        b = b.clamp_min(1e-12)  # unpulled parameter without curvature: finite (huge) noise instead of inf
        mean[name] = p.detach().clone()
        var[name] = (math.sqrt(alpha) * b.rsqrt()).to(p.dtype)
    return mean, var


#: a safeguarded step shorter than this fraction of the step at the initial damping is a near no-op (warned)
NEAR_NOOP_FRACTION = 0.1

#: Levenberg–Marquardt damping used when the recipe has no weight decay (wd = 0): G_r alone is singular
ZERO_WD_DAMPING = 1e-3


@register("newton")
class NewtonScrub(ForgettingMethod):
    """Newton scrub h(w) = w − H⁻¹∇L_r(w) by matrix-free CG, optionally + the optimal noise (module docstring).

    The retain objective is the recipe's (``ctx.recipe``): its loss, its wd and its centre
    (``ctx.center(model)``); no option changes it.

    Parameters
    ----------
    damping : float
        Initial Levenberg–Marquardt μ (default 0; :data:`ZERO_WD_DAMPING` when both it and the recipe's wd
        are 0).
    tol : float
        CG's relative residual tolerance (default 1e-5).
    max_iter : int
        CG's iteration cap (default 300).
    batch_size : int
        Samples per Hessian-vector-product chunk (default 512).
    alpha : float
        Noise scale λσ_h² (default 0 = no noise).
    safeguard : {"lm", "backtrack", "none"}
        How a bad step is shortened (see :func:`retain_newton_step`; default "lm").
    retain_loss_tolerance, retain_error_tolerance : float or None
        The data safeguard: a step raising the retain cross-entropy by more nats (default 0.05), or the retain
        error by more (a fraction, default 0.02), is shortened or rejected; None turns it off.
    cg_budget : int or None
        The budgeted mode: one CG solve of at most this many iterations, the "backtrack" safeguard, no damping
        re-solves; the residual reached is reported instead of a failure. Default None: off.

    Returns
    -------
    ScrubResult
        ``scrub`` returns h(w) (plus noise when ``alpha`` > 0, with ``noise`` its Gaussian); ``info``:
        ``objective_before`` / ``objective_after`` (the retain objective with the pull, at w and at h(w)),
        ``newton_step_length`` (accepted t), ``newton_damping`` (final μ), ``newton_cg_*`` (CG's iterations and
        residuals), ``newton_seconds``, ``alpha``, ``fallbacks``. ``ok`` is False when CG stops at its cap or
        above its tolerance, when its residual grew, or when no step passed the safeguards (the weights are then
        returned unchanged).
    """

    uses_curvature = True
    noisy = True
    streams = True
    passes = "2 + CG iterations per damping try, + 1 per line-search trial, + 2 for the data safeguard"
    options = {"damping": Option(float, ">= 0", default=0.0), "tol": Option(float, "> 0", default=1e-5),
               "max_iter": Option(int, ">= 1", default=300), "batch_size": Option(int, ">= 1", default=512),
               "alpha": Option(float, ">= 0", default=0.0),
               "safeguard": Option(str, choices=SAFEGUARDS, default="lm"),
               "retain_loss_tolerance": Option(float | None, ">= 0", default=0.05),
               "retain_error_tolerance": Option(float | None, ">= 0", default=0.02),
               "cg_budget": Option(int | None, ">= 1")}
    #: the option of the budgeted mode (:func:`scrubnet.cost_guard.budgeted_options`) and what it replaces
    budget_knob = "cg_budget"
    budget_replaces = ("max_iter", "safeguard")

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, max_iter: int = 300, alpha: float = 0.0,
             batch_size: int = 512, safeguard: str = "lm", retain_loss_tolerance: float | None = 0.05,
             cg_budget: int | None = None, **_options) -> CostEstimate:
        """Newton step by CG on the Gauss–Newton/Hessian of the retain loss, a true upper bound: one gradient
        pass, then per solve at most ``max_iter`` GGN-vector products over D_r (each a JVP + a VJP ≈ 2
        forward+backward passes; the JVP doubled when the model needs the double-VJP fallback,
        :func:`~scrubnet.curvature.fallbacks.cost_multipliers`) and one evaluation of the objective; the "lm"
        safeguard solves at most 1 + ``max_damping_tries`` (7) times; the line search and the data safeguard
        add at most 31 and 63 forward passes; plus the Fisher diagonal when ``alpha`` > 0 (noise).
        ``details["seconds_one_solve"]`` is the cost when the first solve is accepted. That bound is
        ``seconds_upper`` (the refusal ceilings use it); ``seconds`` is the typical case: one solve of
        min(``max_iter``, :data:`NEWTON_TYPICAL_CG_ITERATIONS`) iterations (CG at the default tolerance stops
        early: 18–50 iterations measured), its objective and the data check's forwards. Budgeted
        (``cg_budget``): one solve of at most ``cg_budget`` iterations, backtracking with at most
        :data:`BUDGET_HALVINGS` halvings."""
        halvings = NEWTON_HALVINGS
        if cg_budget is not None:
            max_iter, safeguard, halvings = int(cg_budget), "backtrack", BUDGET_HALVINGS
        fwd = forward_flops(model, x1)
        fb = 3.0 * fwd
        jvp = cost_multipliers(probe_paths(model, x1))["jvp"]
        solves = 1 + (NEWTON_DAMPING_TRIES if safeguard == "lm" else 0)
        grad, per_solve = n_retain * fb, n_retain * fb * (1.0 + jvp) * max_iter
        flops = grad + solves * per_solve
        forwards = 0.0
        if safeguard != "none":  # objective per solve, line-search halvings, data-check halvings
            forwards = solves + halvings + (2 * halvings + 3 if retain_loss_tolerance is not None else 0)
        evals = forwards * n_retain * fwd
        # the typical case: one solve of min(max_iter, NEWTON_TYPICAL_CG_ITERATIONS) iterations, its objective,
        # the data check's before/after forwards and one accepted step
        typ_iter = min(max_iter, NEWTON_TYPICAL_CG_ITERATIONS)
        typ_fwd = (2.0 + (2.0 if retain_loss_tolerance is not None else 0.0)) if safeguard != "none" else 0.0
        bn = product_factor(model)
        typical = bn * seconds_at(grad + n_retain * fb * (1.0 + jvp) * typ_iter + typ_fwd * n_retain * fwd, "newton")
        peak = 10 * 8 * trainable_numel(model) + min(batch_size, n_retain) * 3 * 4 * activation_numel_per_sample(model, x1)
        passes = 1.0 + (1.0 + jvp) * max_iter * solves + forwards / 3.0
        seconds = bn * seconds_at(flops + evals, "newton")
        one = bn * seconds_at(grad + per_solve + (n_retain * fwd if safeguard != "none" else 0.0), "newton")
        if alpha > 0:
            fis = fisher_diagonal_cost(model, x1, n_retain)
            flops += fis.flops
            seconds += fis.seconds
            one += fis.seconds
            typical += fis.seconds
            passes += fis.passes
            peak = max(peak, fis.peak_bytes)
        return CostEstimate("newton", flops + evals, min(typical, seconds), int(peak), passes,
                            {"max_iter": max_iter, "solves": solves, "cg_budgeted": float(cg_budget is not None),
                             "jvp_multiplier": jvp, "typical_cg_iterations": typ_iter,
                             "seconds_one_solve": one}, seconds_upper=seconds)

    def __init__(self, damping: float = 0.0, tol: float = 1e-5, max_iter: int = 300, batch_size: int = 512,
                 alpha: float = 0.0, safeguard: str = "lm", retain_loss_tolerance: float | None = 0.05,
                 retain_error_tolerance: float | None = 0.02, cg_budget: int | None = None):
        if cg_budget is not None and int(cg_budget) < 1:
            raise ValueError(f"cg_budget must be ≥ 1, got {cg_budget}")
        self.cg_budget = None if cg_budget is None else int(cg_budget)
        if self.cg_budget is not None:  # budgeted: one truncated solve, backtracking, no damping re-solves
            max_iter, safeguard = self.cg_budget, "backtrack"
        if safeguard not in SAFEGUARDS:
            raise ValueError(f"unknown safeguard {safeguard!r}; choose one of {', '.join(SAFEGUARDS)}")
        self.safeguard = safeguard
        if alpha < 0 or damping < 0:
            raise ValueError("alpha and damping must be ≥ 0")
        if tol <= 0 or max_iter < 1 or batch_size < 1:
            raise ValueError("tol must be > 0, max_iter and batch_size ≥ 1")
        if (retain_loss_tolerance is None) != (retain_error_tolerance is None):
            raise ValueError("give both retain_loss_tolerance and retain_error_tolerance, or neither")
        if retain_loss_tolerance is not None and not (retain_loss_tolerance >= 0 and retain_error_tolerance >= 0):
            raise ValueError("retain_loss_tolerance and retain_error_tolerance must be ≥ 0")
        self.damping, self.tol = float(damping), float(tol)
        self.max_iter, self.batch_size, self.alpha = int(max_iter), int(batch_size), float(alpha)
        self.loss_tol, self.error_tol = retain_loss_tolerance, retain_error_tolerance

    def _settings(self, ctx: ForgetContext) -> tuple[LossSpec, float, float]:
        """(loss, wd, initial damping): the recipe's loss and decay, the damping option."""
        loss = ctx.recipe.loss_spec
        wd = float(ctx.recipe.wd)
        damping = self.damping if (self.damping > 0 or wd > 0) else ZERO_WD_DAMPING
        return loss, wd, damping

    def _procedure(self, model: nn.Module, retain, ctx: ForgetContext):
        """(h(w) model, CG info, diagnostics, noise mean, noise var or None)."""
        loss, wd, damping = self._settings(ctx)
        center = ctx.center(model)
        h, info, diag = retain_newton_step(model, retain, w0=center, wd=wd, loss=loss, damping=damping,
                                           tol=self.tol, max_iter=self.max_iter, batch_size=self.batch_size,
                                           safeguard=self.safeguard,
                                           max_halvings=BUDGET_HALVINGS if self.cg_budget else NEWTON_HALVINGS,
                                           data_check=self.loss_tol is not None and self.safeguard != "none",
                                           loss_tolerance=self.loss_tol or 0.0,
                                           error_tolerance=self.error_tol or 0.0)
        if self.alpha > 0:
            mean, var = newton_noise_variance(h, retain, alpha=self.alpha, wd=wd, w0=center)
            return h, info, diag, mean, var
        return h, info, diag, None, None

    def scrub(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> ScrubResult:
        _, wd, _ = self._settings(ctx)
        t0 = time.perf_counter()
        h, cg, diag, mean, var = self._procedure(model, retain, ctx)
        out = h
        if var is not None:
            gen = torch.Generator(device=get_flat(h).device).manual_seed(10_007 * int(ctx.seed) + 37)
            out = sample_gaussian_weights(h, mean, var, gen)
        info: dict[str, float] = {
            "newton_seconds": time.perf_counter() - t0, "newton_wd": wd, "newton_tol": self.tol,
            "newton_max_iter": float(self.max_iter), "alpha": self.alpha,
            **cg.as_dict("newton_cg_"), **{f"newton_{k}": v for k, v in diag.items()},
            "objective_before": diag["objective_before"], "objective_after": diag["objective_after"]}
        info["fallbacks"] = fallbacks_report(model, retain)   # autodiff paths taken (curvature.fallbacks)
        self._near_noop_check(info)
        noise = None if var is None else WeightGaussian(mean, var)
        res = ScrubResult(model=out.eval(), info=info, noise=noise)
        if info["newton_near_noop"]:
            res.warnings.append(
                f"the Newton step was damped to a near no-op: the accepted step is {info['newton_step_fraction']:.3g} "
                f"of the step at the initial damping (μ {info['newton_damping']:.3g} after "
                f"{int(info['newton_damping_tries'])} re-solves, step length t = {info['newton_step_length']:.3g}, "
                f"‖Δw‖ = {info['newton_step_norm']:.3g}); expect the forget readouts at the original's")
        if self.cg_budget is not None:  # a truncated-Newton step: the residual reached is the report, not a failure
            info.update(newton_budgeted=1.0, newton_cg_budget=float(self.cg_budget))
        elif not cg.converged:
            res.fail(f"CG stopped after {cg.iterations} of at most {self.max_iter} iterations with relative "
                     f"residual {cg.relative_residual:.3g} above its tolerance {self.tol:g}"
                     + (" (the residual grew)" if cg.relative_residual > 1 else ""))
        if diag["step_length"] == 0.0:
            res.fail("no Newton step passed the safeguards (retain objective, retain fit): the weights are "
                     "unchanged")
        return res

    @staticmethod
    def _near_noop_check(info: dict) -> None:
        """``newton_step_fraction`` = ‖accepted t·δ‖ / ‖δ at the initial damping‖ and ``newton_near_noop``
        (1.0 when below :data:`NEAR_NOOP_FRACTION`: the safeguard, not the curvature, decided the step)."""
        first = info["newton_undamped_step_norm"]
        frac = info["newton_step_norm"] / first if first > 0 else 1.0
        info["newton_step_fraction"] = frac
        info["newton_near_noop"] = float(info["newton_step_length"] > 0 and frac < NEAR_NOOP_FRACTION)

    def noise_at(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> WeightGaussian | None:
        """The same procedure at ``model``: its Newton step h, then the Prop. 4 Gaussian at h (None if alpha = 0)."""
        if self.alpha <= 0:
            return None
        _, _, _, mean, var = self._procedure(model, retain, ctx)
        return WeightGaussian(mean, var)
