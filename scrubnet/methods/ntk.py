"""NTK one-shot scrubbing ("Forgetting Outside the Box"), computed matrix-free; and NTK + Fisher noise.

Decisions: docs/decisions/ntk.md, "NTK scrub". Notation: D = D_r ⊔ D_f with N = |D|, N_r = |D_r|,
c classes, J_S the (|S|·c × p) Jacobian of the logits on a set S at the linearisation point w* (eval mode),
Θ_S = J_S J_Sᵀ, λ_S = wd·|S| (the training loss is a *mean* CE + (wd/2)‖w − w_0‖²), r_S the per-sample
residual (CE: softmax(f) − onehot(y), i.e. the loss Hessian in logit space replaced by I; MSE:
f − t for the loss ½‖f − t‖², t = the recipe's ``target_scale``·onehot(y)).

Linearised training on S reaches

    pull="point" (authors' code):           w_lin(S) = w* − J_Sᵀ (Θ_S + λ_S I)⁻¹ r_S
    pull="w0"    (exact training pull, default): w_lin(S) = w_0 + J_Sᵀ (Θ_S + λ_S I)⁻¹ (J_S (w* − w_0) − r_S)

("point" pulls toward w*, which is what the code does; "w0" keeps the pull toward w_0 of the real objective,
and for a linear model with MSE it makes w_lin(S) the exact ridge solution from any w*). The scrub direction

    δw = w_lin(D_r) − w_lin(D) = Jᵀ a − J_rᵀ a_r,   a = (Θ + λ_D)⁻¹ b_D,  a_r = (Θ_rr + λ_r)⁻¹ b_r

(b = r, or r − J(w* − w_0)) is two ridge solves on one Gram Θ over [D_r; D_f] (Θ_rr is its leading block)
and a single VJP; J is never stored (``scrubnet.curvature.ntk``). This equals P·J_fᵀ·M·V_c of the
corrected Proposition 2 when one ridge is used in all three Grams (tests).

Step length (the "trapezium" rescaling of the authors' code): scale = 1 + 2|cos θ|·‖m‖/‖δw‖ with
m = (w(D) − w_0) − (w_lin(D_r) − w*) and θ the angle between δw and m; ``trapezium=False`` uses scale 1.
The scrubbed weights are w(D) + scale·δw (always applied at the trained weights, even when linearised at
w_0, as in the code). The evaluator compares the step with w(D_r) − w(D) (``weight_step_ratio`` =
‖w(D_r) − w(D)‖/‖scale·δw‖, ``weight_step_cosine``, ``weight_distance_ratio``; see
:func:`scrubnet.readouts.information.weight_step_geometry`).

Defaults (measurements in docs/decisions/ntk.md, "NTK scrub"):

* ``pull="w0"`` (default) vs the code's ``pull="point"``: with the pull toward w(D) the linearised
  problem ignores the balance (1/N)Jᵀr ≈ −wd(w(D) − w_0) that holds at the trained weights, so δw is tiny
  and the scrub barely moves; with the exact pull the step is too short in norm but better aligned.
* ``trapezium=False`` (default): with ``pull="w0"`` the trapezium scale overshoots (farther from the retrain
  mean than the original on loss_forget); the unit step moves every forget readout toward retrain with
  retain and test error unchanged. The trapezium scale is always computed and logged
  (``trapezium_scale``); ``step_scale`` sets a fixed multiplier. The authors' configuration is
  ``pull="point", trapezium=True``. Figure 4 (``ntk_activation_line.png``) shows whether the unit step
  undershoots: the L1 distance to retrain on D_f along w(D) + α·(scrub − w(D)).

Solvers: float64 Cholesky with jitter escalation (reported) when the Nc×Nc Gram fits in half of
``memory_budget_bytes``, else (or with ``solver="cg"``) conjugate gradient on Θ-vector products
Θu = J(Jᵀu), which never forms Θ.

``ntk-fisher`` then adds the Fisher noise at the scrubbed point (``scrubnet.methods.fisher.fisher_noise``
on D_r, α default 1e-9 as in the authors' code for NTK+Fisher); the evaluator turns its Gaussian into the
white-box ``info_weights_nats`` (Fisher noise at the retrain model) and the black-box
``info_activations_nats_{forget,retain,test}`` (``scrubnet.readouts.activation_info``).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import cost_multipliers, fallbacks_report, probe_paths
from scrubnet.curvature.ntk import (DEFAULT_BUDGET, batch_for_budget, gram_bytes, jacobian_jvp, jacobian_vjp, ntk_gram,
                                    ntk_gram_flops, ntk_gram_schedule, solve_gram, solve_ntk_cg)
from scrubnet.curvature.params import flatten, get_flat, set_flat, trainable_params
from scrubnet.methods.artifacts import ntk_direction_key
from scrubnet.methods.base import ForgetContext, ForgettingMethod, Option, ScrubResult, WeightGaussian, register
from scrubnet.models.loss import LossSpec
from scrubnet.training.cost import (CostEstimate, fisher_diagonal_cost, forward_flops, gemm_seconds,
                                    per_sample_factor, product_factor, seconds_at, trainable_numel)
from scrubnet.data.stream import as_stream
from scrubnet.methods.fisher import (DEFAULT_LOSS_BUDGET, alpha_for_budget, check_noise_scale, fisher_noise,
                                     stream_fisher)
from scrubnet.models.call import call_model, cat_inputs

LINEARIZE_AT = ("trained", "w0")
PULLS = ("point", "w0")
LOSSES = ("ce", "mse")
SOLVERS = ("auto", "cholesky", "cg")
RIDGES = ("set_size", "fixed")


@dataclass
class NTKStep:
    """Result of :func:`ntk_direction` (flat vectors of length p, float64)."""

    delta_w: Tensor                 # w_lin(D_r) − w_lin(D)
    retain_displacement: Tensor     # w_lin(D_r) − w*
    info: dict[str, float] = field(default_factory=dict)


def residuals(logits: Tensor, y: Tensor, loss: str, num_classes: int, target_scale: float = 1.0,
              label_smoothing: float = 0.0) -> Tensor:
    """Per-sample residual (N, c): ∂loss/∂logits for CE (softmax − t, t = (1 − ε)·onehot + ε/c with label
    smoothing ε), f − t for ½‖f − t‖² (t = target_scale·onehot)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if logits.shape[-1] != num_classes:
        raise ValueError(f"logits have {logits.shape[-1]} classes, expected {num_classes}")
    return LossSpec(loss, target_scale, label_smoothing).residual(logits, y)


def _model_at(model: nn.Module, flat: Tensor) -> nn.Module:
    return set_flat(copy.deepcopy(model), flat.to(get_flat(model).dtype)).eval()


def _solve(model, x, theta, rhs, ridge, solver, cg_tol, cg_max_iter, batch_size):
    if solver == "cg":
        return solve_ntk_cg(model, x, rhs, ridge, tol=cg_tol, max_iter=cg_max_iter, batch_size=batch_size)
    sol, info = solve_gram(theta, rhs.reshape(-1), ridge)
    return sol.reshape(rhs.shape), info


def ntk_direction(model: nn.Module, retain: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor], *,
                  wd: float, w0: Tensor, num_classes: int, lin_model: nn.Module | None = None,
                  loss: str = "ce", pull: str = "point", ridge: str = "set_size", ridge_value: float | None = None,
                  solver: str = "auto", memory_budget_bytes: int = DEFAULT_BUDGET, cg_tol: float = 1e-8,
                  cg_max_iter: int = 1000, target_scale: float = 1.0, batch_size: int | None = None,
                  label_smoothing: float = 0.0) -> NTKStep:
    """δw = w_lin(D_r) − w_lin(D) at the linearisation point ``lin_model`` (default ``model``).

    retain/forget: (x, y) tensors; w0: flat (p,) fine-tuning start. ``ridge="set_size"`` uses λ_D = wd·N and
    λ_r = wd·N_r; ``ridge="fixed"`` uses ``ridge_value`` (default wd) for both (the Proposition-2 setting).
    """
    for name, val, allowed in (("loss", loss, LOSSES), ("pull", pull, PULLS), ("solver", solver, SOLVERS),
                               ("ridge", ridge, RIDGES)):
        if val not in allowed:
            raise ValueError(f"unknown {name} {val!r}; choose one of {', '.join(allowed)}")
    ridgeless = not wd > 0 and not (ridge == "fixed" and ridge_value and ridge_value > 0)
    x_r, y_r = retain
    x_f, y_f = forget
    if len(y_r) == 0:
        raise ValueError("the retain set is empty")
    lin = model if lin_model is None else lin_model
    n_r, n = len(y_r), len(y_r) + len(y_f)
    x = cat_inputs([x_r, x_f]) if len(y_f) else x_r
    y = torch.cat([y_r, y_f]) if len(y_f) else y_r
    if batch_size is None:
        batch_size = batch_for_budget(lin, x, memory_budget_bytes // 4)
    if ridgeless:
        # no weight decay: the ridgeless (minimum-norm) limit, regularised by RIDGELESS_RELATIVE × the mean
        # diagonal of Θ (trace estimated by ‖Jᵀu‖² with one Rademacher u: E‖Jᵀu‖² = tr Θ)
        gen = torch.Generator(device=x.device).manual_seed(0)
        u = (torch.randint(0, 2, (n, num_classes), generator=gen, device=x.device) * 2 - 1).to(get_flat(lin).dtype)
        trace = float(jacobian_vjp(lin, x, u, batch_size=batch_size).double().pow(2).sum())
        lam_d = lam_r = RIDGELESS_RELATIVE * max(trace, 1e-30) / (n * num_classes)
    else:
        lam_d, lam_r = (wd * n, wd * n_r) if ridge == "set_size" else ((ridge_value or wd),) * 2
    info: dict[str, float] = {"ridge_full": lam_d, "ridge_retain": lam_r, "gram_rows": float(n * num_classes)}
    if ridgeless:
        info["ridgeless"] = 1.0

    t0 = time.perf_counter()
    with torch.no_grad():
        was = lin.training
        lin.eval()
        logits = torch.cat([call_model(lin, x[s:s + batch_size]) for s in range(0, n, batch_size)])
        lin.train(was)
    if logits.shape[1] != num_classes:
        raise ValueError(f"model has {logits.shape[1]} outputs, num_classes is {num_classes}")
    b = residuals(logits, y, loss, num_classes, target_scale, label_smoothing).to(torch.float64)
    w_star = get_flat(lin).to(torch.float64)
    delta0 = w_star - w0.to(torch.float64)
    if pull == "w0":
        b = b - jacobian_jvp(lin, x, delta0, batch_size=batch_size).to(torch.float64)

    if solver == "auto":
        solver = "cholesky" if gram_bytes(n * num_classes) <= memory_budget_bytes // 2 else "cg"
    info["solver_cg"] = float(solver == "cg")
    theta = None
    if solver == "cholesky":
        theta = ntk_gram(lin, x, memory_budget_bytes=memory_budget_bytes)
        info["gram_seconds"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    a, sd = _solve(lin, x, theta, b, lam_d, solver, cg_tol, cg_max_iter, batch_size)
    theta_rr = None if theta is None else theta[:n_r * num_classes, :n_r * num_classes]
    a_r, sr = _solve(lin, x_r, theta_rr, b[:n_r], lam_r, solver, cg_tol, cg_max_iter, batch_size)
    info.update(sd.as_dict("solve_full_"))
    info.update(sr.as_dict("solve_retain_"))
    info["solve_seconds"] = time.perf_counter() - t1
    del theta, theta_rr

    coef = a.clone()
    coef[:n_r] -= a_r
    dt = get_flat(lin).dtype
    delta_w = jacobian_vjp(lin, x, coef.to(dt), batch_size=batch_size).to(torch.float64)
    retain_disp = -jacobian_vjp(lin, x_r, a_r.to(dt), batch_size=batch_size).to(torch.float64)
    if pull == "w0":
        retain_disp = retain_disp - delta0
    info["direction_seconds"] = time.perf_counter() - t0
    return NTKStep(delta_w, retain_disp, info)


def trapezium_scale(delta_w: Tensor, m: Tensor) -> tuple[float, float]:
    """(scale, cos θ) with scale = 1 + 2|cos θ|·‖m‖/‖δw‖ and cos θ = ⟨δw, m⟩/(‖δw‖‖m‖) (the authors' code)."""
    dn, mn = float(delta_w.norm()), float(m.norm())
    if dn == 0.0:
        return 1.0, 0.0
    if mn == 0.0:
        return 1.0, 0.0
    cos = float(torch.dot(delta_w, m)) / (dn * mn)
    return 1.0 + 2.0 * abs(cos) * mn / dn, cos


#: ridge of the wd = 0 (ridgeless) limit, relative to the mean diagonal of the Gram Θ
RIDGELESS_RELATIVE = 1e-6


# memory-bound work per entry of the NTK's float64 Grams (Θ over D and its block over D_r) in the Cholesky
# solves, in GEMM-FLOP equivalents: the identity and ridge-shifted copy, the factor's allocation, the two
# triangular solves and the residual product. Measured by profiling the MLP at N = 1,000 (5,000 Gram rows):
# 1.0 s of the solves' 3.2 s CPU time outside the factorisations (decisions.md)
GRAM_ENTRY_FLOP_EQUIV = 1800.0


def ntk_solver(n_rows: int, memory_budget_bytes: int, solver: str = "auto") -> str:
    """Cholesky when the float64 Gram fits in half the budget (the method's own rule), else CG."""
    if solver != "auto":
        return solver
    return "cholesky" if gram_bytes(n_rows) <= memory_budget_bytes // 2 else "cg"


def ntk_cost(model: nn.Module, x1: Tensor, n_r: int, n_f: int, c: int, *, memory_budget_bytes: int = DEFAULT_BUDGET,
             solver: str = "auto", cg_max_iter: int = 1000, pull: str | None = "w0", jvp: float = 1.0
             ) -> CostEstimate:
    """NTK scrub: Gram Θ over D = D_r ⊔ D_f (every Jacobian row once + per-layer contraction,
    :func:`~scrubnet.curvature.ntk.ntk_gram_flops`), two float64 Cholesky factorisations ((Nc)³/3 and
    (N_r c)³/3), the JVP of the w_0 pull and two VJPs (≈ 3 forwards each over D). With CG (Gram over half
    the budget) every iteration is one VJP + one JVP over D and over D_r, ``cg_max_iter`` at most (upper
    bound; exactly that many when the tolerance is not reached). The Gram and the factorisations run at the
    NTK efficiency, plus :data:`GRAM_ENTRY_FLOP_EQUIV` per Gram entry for the solves' memory-bound work; the
    VJP/JVP passes are batched forward/backward products like Newton's and run at its efficiency. Peak: the
    float64 Gram, its Cholesky copy and factor (3·8·(Nc)²) plus the Gram's buffer budget (an upper bound: the
    solves hold ≈ 5 Grams at once, fewer than 3 Grams + the budget since a Gram is at most half the budget on
    this path). ``jvp``: the cost of one JVP relative to forward mode (2 under the double-VJP fallback)."""
    n = n_r + n_f
    rows, rows_r = n * c, n_r * c
    fwd = forward_flops(model, x1)
    solver = ntk_solver(rows, memory_budget_bytes, solver)
    vjp = 3.0 * fwd
    passes = 3.0 + (1.0 if pull == "w0" else 0.0)
    products = n * vjp * (2.0 + jvp * (passes - 3.0)) + n * fwd
    gram = 0.0
    schedule: dict = {}
    if solver == "cholesky":
        g = ntk_gram_flops(model, x1, n)
        # when the factors do not fit: layer groups or chunks capture (and rebuild) more than once
        schedule = ntk_gram_schedule(model, x1, n, memory_budget_bytes=memory_budget_bytes)
        gram = g["total"] + (rows ** 3 + rows_r ** 3) / 3.0
        passes += c
        peak = 3 * gram_bytes(rows) + memory_budget_bytes
    else:
        products += cg_max_iter * (1.0 + jvp) * vjp * (n + n_r)
        passes += 2.0 * cg_max_iter * 2
        peak = memory_budget_bytes // 4 + 8 * 4 * trainable_numel(model)
    extra = schedule.get("extra_flops", 0.0)
    flops = gram + extra + products
    # the schedule's extra work (captures again, per-row gradients rebuilt: batched GEMMs) at the GEMM rate:
    # at the NTK efficiency it made the estimate 2.3× the measured time of ResNet-18 ×1.0 (11 layer groups)
    seconds = per_sample_factor(model, "ntk") * seconds_at(gram, "ntk") + gemm_seconds(extra) \
        + product_factor(model) * seconds_at(products, "newton")
    if solver == "cholesky":
        seconds += gemm_seconds(GRAM_ENTRY_FLOP_EQUIV * (rows ** 2 + rows_r ** 2))
    return CostEstimate("ntk", flops, seconds, int(peak), passes,
                        {"solver": solver, "gram_rows": rows, "gram_bytes": gram_bytes(rows),
                         "gram_flops": gram, "schedule_extra_flops": extra, "product_flops": products,
                         **({"gram_schedule": schedule["schedule"], "gram_groups": schedule["groups"]}
                            if schedule else {})})


@register("ntk")
class NTKScrub(ForgettingMethod):
    """NTK one-shot scrubbing (module docstring). The loss, its target scale and the decay are the recipe's.

    Parameters
    ----------
    linearize_at : {"trained", "w0"}
        Where the model is linearised: w(D) (default, as the authors' code) or w_0.
    pull : {"w0", "point"} or None
        The centre of the decay pull: w_0 or the linearisation point (the authors' code); default "w0" when
        the recipe's wd > 0, else "point".
    trapezium : bool
        Scale δw by the trapezium rule (default False; module docstring).
    ridge : {"set_size", "fixed"}
        Ridge of the Gram solves: wd·N for a set of N samples (default) or ``ridge_value``.
    ridge_value : float or None
        The fixed ridge (default: the recipe's wd).
    solver : {"auto", "cholesky", "cg"}
        Gram solver (default "auto": Cholesky when the Gram fits ``memory_budget_bytes``).
    memory_budget_bytes : int
        Bytes the Gram may use (default 1 GiB).
    cg_tol, cg_max_iter : float, int
        CG's relative tolerance and cap (defaults 1e-8, 1000).
    batch_size : int or None
        Samples per Jacobian chunk (default: planned).
    step_scale : float or None
        A fixed multiplier of δw; overrides the trapezium when given.
    cg_budget : int or None
        The budgeted mode: the CG solver at most this many iterations per solve (replaces ``solver`` and
        ``cg_max_iter``), the residual reached reported instead of a failure. Default None: off.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the model at w + scale·δw; ``info``: ``scale``, ``trapezium_scale``, ``cos_delta_m``,
        ``delta_w_norm``, ``m_norm`` (weight units), the solves' ``solve_full_*`` / ``solve_retain_*``,
        ``gram_seconds``, ``solve_seconds``, ``direction_seconds``, ``ntk_seconds`` (seconds), ``fallbacks``.
        ``ok`` is False when a CG solve stopped above its tolerance.
    """

    uses_curvature = True
    passes = "Gram (or CG iterations) over D_r ∪ D_f, in memory"
    figure_step = "ntk"
    options = {"linearize_at": Option(str, choices=LINEARIZE_AT, default="trained"),
               "pull": Option(str | None, choices=PULLS), "trapezium": Option(bool, default=False),
               "ridge": Option(str, choices=RIDGES, default="set_size"), "ridge_value": Option(float | None, "> 0"),
               "solver": Option(str, choices=SOLVERS, default="auto"),
               "memory_budget_bytes": Option(int, ">= 1", default=DEFAULT_BUDGET),
               "cg_tol": Option(float, "> 0", default=1e-8), "cg_max_iter": Option(int, ">= 0", default=1000),
               "batch_size": Option(int | None, ">= 1"), "step_scale": Option(float | None, "> 0"),
               "cg_budget": Option(int | None, ">= 1")}
    #: the budgeted mode (:func:`scrubnet.cost_guard.budgeted_options`): CG at most ``cg_budget`` iterations
    #: per solve, the residual reached reported instead of a failure
    budget_knob = "cg_budget"
    budget_replaces = ("cg_max_iter", "solver")

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, *, memory_budget_bytes: int = DEFAULT_BUDGET,
             solver: str = "auto", cg_max_iter: int = 1000, pull: str | None = "w0", cg_budget: int | None = None,
             **_options) -> CostEstimate:
        """The NTK scrub's cost (:func:`ntk_cost`; budgeted: the CG solver at ``cg_budget`` iterations), with
        the JVPs doubled when the model needs the double-VJP fallback
        (:func:`~scrubnet.curvature.fallbacks.cost_multipliers`)."""
        if cg_budget is not None:
            solver, cg_max_iter = "cg", int(cg_budget)
        jvp = cost_multipliers(probe_paths(model, x1))["jvp"]
        est = ntk_cost(model, x1, n_retain, n_forget, num_classes, memory_budget_bytes=memory_budget_bytes,
                       solver=solver, cg_max_iter=cg_max_iter, pull=pull, jvp=jvp)
        est.details["cg_budgeted"] = float(cg_budget is not None)
        return est

    def __init__(self, linearize_at: str = "trained", pull: str | None = None, trapezium: bool = False,
                 ridge: str = "set_size",
                 ridge_value: float | None = None, solver: str = "auto",
                 memory_budget_bytes: int = DEFAULT_BUDGET, cg_tol: float = 1e-8, cg_max_iter: int = 1000,
                 batch_size: int | None = None, step_scale: float | None = None, cg_budget: int | None = None):
        if cg_budget is not None and int(cg_budget) < 1:
            raise ValueError(f"cg_budget must be ≥ 1, got {cg_budget}")
        self.cg_budget = None if cg_budget is None else int(cg_budget)
        if self.cg_budget is not None:
            solver, cg_max_iter = "cg", self.cg_budget
        if step_scale is not None and not float(step_scale) > 0:
            raise ValueError(f"step_scale must be > 0 or None, got {step_scale}")
        self.step_scale = None if step_scale is None else float(step_scale)
        if linearize_at not in LINEARIZE_AT:
            raise ValueError(f"linearize_at must be one of {', '.join(LINEARIZE_AT)}, got {linearize_at!r}")
        for name, val, allowed in (("pull", pull, PULLS), ("solver", solver, SOLVERS),
                                   ("ridge", ridge, RIDGES)):
            if val is not None and val not in allowed:
                raise ValueError(f"unknown {name} {val!r}; choose one of {', '.join(allowed)}")
        if int(memory_budget_bytes) <= 0:
            raise ValueError("memory_budget_bytes must be positive")
        self.linearize_at, self.pull, self.trapezium = linearize_at, pull, bool(trapezium)
        self.ridge, self.ridge_value, self.solver = ridge, ridge_value, solver
        self.memory_budget_bytes, self.cg_tol, self.cg_max_iter = int(memory_budget_bytes), cg_tol, cg_max_iter
        self.batch_size = None if batch_size is None else int(batch_size)

    def _w0_flat(self, model: nn.Module, ctx: ForgetContext) -> Tensor:
        params = trainable_params(model)
        center = ctx.center(model)
        if set(params) - set(center):
            raise ValueError("the NTK scrub needs a decay centre with every trainable parameter of the model")
        return flatten({k: center[k].detach().to(v.dtype) for k, v in params.items()})

    def _resolved(self, ctx: ForgetContext) -> tuple[str, str, float]:
        """(pull, loss, wd): the options, else from the recipe — pull toward the decay centre when the recipe
        has weight decay, the minimum-norm change from the trained weights ("point") when it has none."""
        wd = float(ctx.recipe.wd)
        pull = self.pull or ("w0" if wd > 0 else "point")
        return pull, ctx.recipe.curvature_loss, wd

    def _direction_options(self, ctx: ForgetContext) -> dict:
        """The options that change δw (the cache key of the direction)."""
        pull, loss, _ = self._resolved(ctx)
        smoothing = {"label_smoothing": ctx.recipe.label_smoothing} if ctx.recipe.label_smoothing else {}
        return {"linearize_at": self.linearize_at, "pull": pull, "loss": loss,
                "target_scale": ctx.recipe.target_scale, "ridge": self.ridge, "ridge_value": self.ridge_value,
                "solver": self.solver, "cg_tol": self.cg_tol, "cg_max_iter": self.cg_max_iter, **smoothing}

    def direction(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> tuple[NTKStep, Tensor]:
        """δw for this model and data, memoised in ``ctx.cache`` (so ntk and ntk-fisher share one Gram)."""
        w0 = self._w0_flat(model, ctx)
        pull, loss, wd = self._resolved(ctx)
        key = ntk_direction_key(model, ctx.center(model), retain, forget, wd=wd, num_classes=ctx.num_classes,
                                options=self._direction_options(ctx))

        def compute() -> NTKStep:
            lin = model if self.linearize_at == "trained" else _model_at(model, w0)
            return ntk_direction(model, retain, forget, wd=wd, w0=w0, num_classes=ctx.num_classes,
                                 lin_model=lin, loss=loss, pull=pull, ridge=self.ridge,
                                 ridge_value=self.ridge_value, solver=self.solver,
                                 memory_budget_bytes=self.memory_budget_bytes, cg_tol=self.cg_tol,
                                 cg_max_iter=self.cg_max_iter, target_scale=ctx.recipe.target_scale,
                                 batch_size=self.batch_size, label_smoothing=ctx.recipe.label_smoothing)

        if ctx.cache is None:
            return compute(), w0
        cached = key in ctx.cache
        step = ctx.cache.get_or_compute(key, compute)
        if cached:
            step = NTKStep(step.delta_w, step.retain_displacement, {**step.info, "cached": 1.0})
        return step, w0

    def scrub(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> ScrubResult:
        if ctx.num_classes < 1:
            raise ValueError("the NTK scrub needs ctx.num_classes")
        t0 = time.perf_counter()
        step, w0 = self.direction(model, retain, forget, ctx)
        w_d = get_flat(model).to(torch.float64)
        m = (w_d - w0.to(torch.float64)) - step.retain_displacement
        tscale, cos_m = trapezium_scale(step.delta_w, m)
        scale = self.step_scale if self.step_scale is not None else (tscale if self.trapezium else 1.0)
        scrubbed = _model_at(model, w_d + scale * step.delta_w)
        info = dict(step.info)
        info.update({"scale": scale, "trapezium_scale": tscale, "cos_delta_m": cos_m,
                     "delta_w_norm": float(step.delta_w.norm()), "m_norm": float(m.norm()),
                     "ntk_seconds": time.perf_counter() - t0})
        info["fallbacks"] = fallbacks_report(model, retain)   # autodiff paths taken (curvature.fallbacks)
        res = ScrubResult(model=scrubbed, info=info)
        if self.cg_budget is not None:   # budgeted: the residuals reached are the report, not a failure
            info.update(ntk_budgeted=1.0, ntk_cg_budget=float(self.cg_budget))
            return res
        for part in ("full", "retain"):
            if info.get(f"solve_{part}_converged", 1.0) == 0.0:
                res.fail(f"the {part}-set ridge solve stopped after {info[f'solve_{part}_iterations']:.0f} iterations "
                         f"with relative residual {info[f'solve_{part}_relative_residual']:.3g} above its tolerance")
        return res


@register("ntk-fisher")
class NTKFisherScrub(NTKScrub):
    """NTK scrub followed by Fisher noise at the scrubbed point ("Forgetting Outside the Box", NTK + Fisher).

    :meth:`noise_at` is the Fisher noise at another model (the evaluator applies it to the retrain model for the
    white-box and black-box bounds).

    Parameters
    ----------
    alpha : float or None
        Fisher noise scale (scrubnet's protocol: 1e-9, the authors' NTK+Fisher value). Give it or
        ``retain_loss_budget``, not both.
    form : {"code", "paper"}
        The Fisher variance formula (default "code").
    retain_loss_budget : float or None
        Nats the noise may add to the mean retain cross-entropy (as :class:`FisherForgetting`).
    **ntk_options
        The options of :class:`NTKScrub`.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the noisy scrubbed model with ``noise`` its Gaussian; ``info``: the NTK scrub's keys
        plus ``alpha`` and ``fisher_seconds`` (seconds); ``ok`` as the NTK scrub's.
    """

    noisy = True
    protocol_options = {"alpha": 1e-9}
    options = {**NTKScrub.options, "alpha": Option(float | None, "> 0"),
               "form": Option(str, choices=("code", "paper"), default="code"),
               "retain_loss_budget": Option(float | None, "> 0")}

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, **options) -> CostEstimate:
        """The NTK scrub's cost plus the Fisher diagonal at the scrubbed point."""
        est = super().cost(model, x1, n_retain, n_forget, num_classes, config, **options)
        fis = fisher_diagonal_cost(model, x1, n_retain)
        return CostEstimate("ntk-fisher", est.flops + fis.flops, est.seconds + fis.seconds,
                            max(est.peak_bytes, fis.peak_bytes), est.passes + fis.passes, est.details)

    def __init__(self, alpha: float | None = None, form: str = "code", retain_loss_budget: float | None = None,
                 **ntk_options):
        super().__init__(**ntk_options)
        check_noise_scale(alpha, retain_loss_budget)
        if form not in ("code", "paper"):
            raise ValueError(f"form must be 'code' or 'paper', got {form!r}")
        self.alpha, self.form = (None if alpha is None else float(alpha)), form
        self.budget = None if alpha is not None else float(retain_loss_budget or DEFAULT_LOSS_BUDGET)
        self.alpha_used = self.alpha

    def _noise_options(self, ctx: ForgetContext) -> dict:
        if self.alpha_used is None:
            raise ValueError("noise_at needs the α of a scrub: run the scrub first (or give alpha)")
        return dict(alpha=self.alpha_used, num_classes=ctx.num_classes, forget_class=ctx.forget_class,
                    form=self.form)

    def noise_at(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> WeightGaussian:
        """Fisher noise at ``model`` with its own Fisher on D_r (the retrain model needs no NTK step)."""
        gen = torch.Generator(device=get_flat(model).device).manual_seed(0)
        # the retain data may arrive as a stream (scrubnet.forget(..., reference=...)): its Fisher is streamed
        fisher = stream_fisher(model, as_stream(retain), "true", None, ctx.cache)
        _, mean, var = fisher_noise(model, None, generator=gen, fisher=fisher, **self._noise_options(ctx))
        return WeightGaussian(mean, var)

    def scrub(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> ScrubResult:
        res = super().scrub(model, retain, forget, ctx)
        t0 = time.perf_counter()
        gen = torch.Generator(device=get_flat(res.model).device).manual_seed(10_007 * int(ctx.seed) + 41)
        if self.alpha is None:  # α from the retain-loss budget at the scrubbed point (its own Fisher)
            fisher = stream_fisher(res.model, as_stream(retain), "true", None, ctx.cache)
            self.alpha_used = alpha_for_budget(res.model, fisher, self.budget, num_classes=ctx.num_classes,
                                               form=self.form)
        if self.alpha is not None:
            fisher = stream_fisher(res.model, as_stream(retain), "true", None, None)
        noisy, mean_s, var_s = fisher_noise(res.model, None, generator=gen, fisher=fisher,
                                            **self._noise_options(ctx))
        info = dict(res.info)
        info["alpha"] = self.alpha_used
        info["fisher_seconds"] = time.perf_counter() - t0
        return ScrubResult(model=noisy.eval(), info=info, noise=WeightGaussian(mean_s, var_s), ok=res.ok,
                           reasons=res.reasons)
