"""ML-Forgetting (thesis Ch. 6) and its gold standard, as methods of the default protocol.

* ``mlforget`` — trains the Mixed-Linear model of the seed (core weights w_c: w_0 fine-tuned with CE on 30 %
  of D drawn from D_r; user weights w_u: linear, MSE to 5·one-hot, µ‖w_u‖²/2; see
  :mod:`scrubnet.mlforget.model`), forgets D_f in one request (the exact step, by the solver chosen by size:
  the dual on the Gram eigendecomposed at training, or warm-started preconditioned CG; noise σ·ε) and returns
  the scrubbed ML module. Its ``reference`` is the ML model retrained from scratch on the remaining data
  with the best exact solver (the dual from scratch, or CG from zero, to a tight absolute tolerance; this is
  what ``mlforget-retrain`` returns) and its ``original`` the ML model before forgetting, so the runner
  measures activation distance and the re-learn threshold inside the ML family. The activation distance of
  both methods is measured to the *noiseless* retrained ML model ŵ_u, so the noise gives the band a non-zero
  width.
  ``info_weights_nats`` = ‖w'_u − ŵ_u‖²/(2σ²), the Gaussian KL between the scrubbed and the retrained
  model under the same noise (w'_u: scrubbed before noise), ½ included as for every method;
  ``info_weights_bound_nats`` = ‖w'_u − ŵ_u‖²/σ², the thesis's bound (twice the KL).
  Timing (seconds, also in the readouts): ``ml_train_s`` = building the ML model, which includes the
  once-per-checkpoint factor (``ml_factor_s``: Gram + eigendecomposition, or the Nyström sketch);
  ``ml_forget_s`` = the request alone (solve, VJP, noise); ``ml_retrain_s`` = retraining the user weights
  from scratch on D_r with the best exact solver (for the dual: Gram of D_r, Cholesky, VJP).
* ``mlforget-retrain`` — the ML model retrained without D_f plus σ noise, the thesis's baseline
  S_0(w) = w + z. By default z is the scrub's own draw (common random numbers, ``coupled_noise``; see
  :class:`~scrubnet.mlforget.model.MLConfig`), so the two differ only by the solver error.

The returned modules are :class:`~scrubnet.models.linearized.LinearizedModel` s: x → logits, and w_u are
their only trainable parameters (the re-learn readout fine-tunes exactly those). The trained ML original is
cached in ``ctx.cache`` (keyed by the options), so ``mlforget-retrain`` reuses it.

Options: any :class:`~scrubnet.mlforget.model.MLConfig` field (``mu``, ``sigma``, ``linearize``, …) and
``solver``/``cg_tol``/``precond`` for the Newton step.
"""
from __future__ import annotations

import copy
import time

import torch

from scrubnet.curvature.ntk_gram import ntk_gram_flops
from scrubnet.data import Split
from scrubnet.device import model_device
from scrubnet.methods.artifacts import mlforget_key
from scrubnet.methods.base import ForgetContext, ForgettingMethod, ScrubResult, register
from scrubnet.mlforget.model import (MLConfig, MLState, forget_request, ml_module_with_weights, reference_noise,
                                     remaining_information_bound, remaining_information_nats,
                                     retrain_user_weights)
from scrubnet.mlforget.pipeline import train_ml
from scrubnet.mlforget.solve import SolverConfig
from scrubnet.training.cost import CostEstimate, forward_flops, gemm_seconds, seconds_at, train_cost, trainable_numel

_SOLVER_KEYS = {"solver", "cg_tol", "cg_max_iter", "precond", "precond_rank", "dual_max_rows", "weight_tol",
                "primal_max_rows", "primal_ratio", "budget_nats"}


def ml_config_from_options(options: dict) -> MLConfig:
    opts = dict(options)
    solver = {k: opts.pop(k) for k in list(opts) if k in _SOLVER_KEYS}
    cfg = MLConfig.from_dict(opts)
    if solver:
        cfg.solver = SolverConfig(**{**cfg.solver.__dict__, **solver})
    return cfg


def ml_artifacts(ctx: ForgetContext, cfg: MLConfig) -> dict:
    """The ML original, the one-request scrub and the ML retrain for this seed (computed once, cached)."""
    if ctx.split is None:
        raise ValueError("ML-Forgetting trains its own mixed-linear model family on scrubnet's protocol split "
                         "(ctx.split): it does not scrub a user's model; use scrubnet run")
    key = mlforget_key(ctx.start, ctx.split, train=ctx.config.to_dict(), ml=cfg.to_dict(), seed=ctx.seed)
    return ctx.cache.get_or_compute(key, lambda: _ml_artifacts(ctx, cfg))


def _ml_artifacts(ctx: ForgetContext, cfg: MLConfig) -> dict:
    """Computed on the CPU (the mixed-linear solvers' generators are CPU generators); the returned modules are
    moved to the device of ``ctx.start``."""
    device = model_device(ctx.start) if ctx.start is not None else torch.device("cpu")
    split = ctx.split.to("cpu") if isinstance(ctx.split, Split) else ctx.split  # tests pass plain namespaces
    start = None if ctx.start is None else copy.deepcopy(ctx.start).cpu()
    t0 = time.perf_counter()
    state = train_ml(split, cfg, ctx.config, ctx.seed, start=start)
    t_train = time.perf_counter() - t0
    original = copy.deepcopy(state.model)
    scrub_state: MLState = state.copy()
    t0 = time.perf_counter()
    out = forget_request(scrub_state, split.x, split.y, split.forget_idx, sigma=cfg.sigma,
                         noise_seed=1_000_003 * ctx.seed + 1)
    t_forget = time.perf_counter() - t0
    t0 = time.perf_counter()
    w_hat, retrain_info = retrain_user_weights(scrub_state, split.x, split.y, return_info=True)
    t_retrain = time.perf_counter() - t0
    retrain_model = ml_module_with_weights(state, w_hat + reference_noise(cfg, out, 1_000_003 * ctx.seed + 2))
    ti = state.train_info
    factor_s = ti.get("train_gram_s", 0.0) + ti.get("train_eig_s", 0.0) + ti.get("train_precond_build_s", 0.0)
    art = {"original": original.to(device), "scrubbed": scrub_state.model.to(device),
           "retrain": retrain_model.to(device), "retrain_exact": ml_module_with_weights(state, w_hat).to(device),
           "outcome": out,
           "info_weights_nats": remaining_information_nats(out.w_before_noise, w_hat, cfg.sigma),
           "info_weights_bound_nats": remaining_information_bound(out.w_before_noise, w_hat, cfg.sigma),
           "retrain_solver": retrain_info.get("train_solver", cfg.train_solver),
           "times": {"ml_train_s": t_train, "ml_factor_s": factor_s, "ml_forget_s": t_forget,
                     "ml_retrain_s": t_retrain},
           "sizes": {"ml_n_core": float(len(state.core_ids)), "ml_n_user": float(len(state.user_ids)),
                     "ml_num_user_weights": float(state.model.num_linearized)}}
    return art


# memory-bound work per Gram entry of the dual (the Gram's float64 copy, the eigenvector products of a
# request, the Schur complement's temporaries), in GEMM-FLOP equivalents: set, not fitted; with it the call's
# CPU time on the default MLP at 2,000 and 4,500 rows was 1.15× and 1.4× the estimate (docs/decisions/cost-transformers.md)
ML_GRAM_ENTRY_FLOP_EQUIV = 400.0


def mlforget_cost(model, x1, n_retain: int, n_forget: int, num_classes: int, config, cfg: MLConfig) -> CostEstimate:
    """The build of the mixed-linear model and one forgetting request of ``n_forget`` samples, dual solver.

    Build: the core fine-tuning (CE on ``core_fraction`` of D, at the config's epoch cap: an upper bound),
    the Gram of the user data's Jacobian rows (:func:`~scrubnet.curvature.ntk_gram.ntk_gram_flops`: the
    Jacobian pass and the layer-wise contractions; R = N_u·c rows) and its float64 eigendecomposition
    (≈ 9·R³). Request: the Jacobian rows of D_f, the Schur
    complement of the removed rows through the eigenbasis (≈ 4·R²·R_f), the new weights (one VJP over the
    user data), and the residual certificate (a JVP and two VJPs over the user data).

    Returns
    -------
    CostEstimate
        ``seconds`` = build + request (one call builds the model); ``details["build_seconds"]`` and
        ``details["request_seconds"]`` apart, and, against a reference, ``details["request_vs_retrain"]``.
    """
    n_all = n_retain + n_forget
    n_core = int(cfg.core_fraction * n_all)
    n_user = n_all if cfg.user_data == "all" else n_all - n_core
    c = int(num_classes)
    rows, rows_f = n_user * c, n_forget * c
    solver = cfg.solver.exact_solver(rows)
    if solver != "dual":
        raise ValueError(f"mlforget: no cost estimate for the {solver!r} solver yet (N·c = {rows} rows > "
                         f"dual_max_rows = {cfg.solver.dual_max_rows}); the dual path is priced")
    p = trainable_numel(model)
    if cfg.linearize is not None:
        p = sum(q.numel() for name, q in model.named_parameters()
                if q.requires_grad and any(name.startswith(pre) for pre in cfg.linearize))
    fwd = forward_flops(model, x1)
    core = train_cost(model, x1, n_core, int(config.max_epochs), int(config.batch_size)) if n_core else None
    gram, eig = ntk_gram_flops(model, x1, n_user)["total"], 9.0 * float(rows) ** 3
    build_flops = gram + eig + (core.flops if core else 0.0)
    build = (seconds_at(gram + eig, "ntk") + gemm_seconds(ML_GRAM_ENTRY_FLOP_EQUIV * rows ** 2)
             + (core.seconds if core else 0.0))
    req_vjp = n_forget * fwd * (1.0 + 2.0 * c) + 3.0 * n_user * 3.0 * fwd
    schur = 4.0 * rows ** 2 * max(rows_f, 1)
    request = seconds_at(req_vjp, "newton") + seconds_at(schur, "ntk") + gemm_seconds(ML_GRAM_ENTRY_FLOP_EQUIV * rows ** 2)
    peak = 8 * rows ** 2 * 3 + 4 * rows * p
    return CostEstimate("mlforget", build_flops + req_vjp + schur, build + request, int(peak),
                        float(n_core and config.max_epochs) + (1.0 + 2.0 * c) + 3.0,
                        {"solver": solver, "gram_rows": rows, "core_samples": n_core, "build_seconds": build,
                         "request_seconds": request, "request_flops": req_vjp + schur})


class _MLBase(ForgettingMethod):
    own_retrain_family = True
    audit_scrub_cost = "expensive"  # trains its own mixed-linear model for every scrub
    def __init__(self, **options):
        self.cfg = ml_config_from_options(options)

    @classmethod
    def cost(cls, model, x1, n_retain, n_forget, num_classes, config, **options) -> CostEstimate:
        """The ML model's build and one request (:func:`mlforget_cost`)."""
        return mlforget_cost(model, x1, n_retain, n_forget, num_classes, config, ml_config_from_options(options))


@register("mlforget")
class MLForget(_MLBase):
    """ML-Forgetting of D_f in one request (module docstring). Needs ``ctx.split`` and ``ctx.start``.

    Parameters
    ----------
    **options
        Any :class:`~scrubnet.mlforget.model.MLConfig` field (``mu``, ``target_scale``, ``sigma`` (noise std in
        weight units), ``linearize``, ``core_fraction``, …) and the Newton step's solver settings ``solver``,
        ``cg_tol``, ``cg_max_iter``, ``precond``, ``precond_rank``, ``dual_max_rows``, ``weight_tol``,
        ``primal_max_rows``, ``primal_ratio``, ``budget_nats``.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the scrubbed ML module (a :class:`~scrubnet.models.linearized.LinearizedModel`), with
        ``reference`` the noiseless ML retrain and ``original`` the ML model before forgetting; ``info``:
        ``info_weights_nats``, ``info_weights_bound_nats`` (nats), ``sigma``, ``solver``, ``retrain_solver``,
        ``solver_iterations``, ``solver_relative_residual``, the timings ``ml_train_s``, ``ml_factor_s``,
        ``ml_forget_s``, ``ml_retrain_s`` (seconds) and the sizes ``ml_n_core``, ``ml_n_user``,
        ``ml_num_user_weights``.
    """

    band_reference = "mlforget-retrain"  # judged against the retrained mixed-linear model, not the DNN

    def scrub(self, model, retain, forget, ctx: ForgetContext) -> ScrubResult:
        art = ml_artifacts(ctx, self.cfg)
        step = art["outcome"].info
        info = {"info_weights_nats": art["info_weights_nats"],
                "info_weights_bound_nats": art["info_weights_bound_nats"], "sigma": self.cfg.sigma,
                "solver": step.solver, "retrain_solver": art["retrain_solver"],
                "solver_iterations": float(step.iterations), "solver_relative_residual": step.relative_residual,
                **art["times"], **art["sizes"]}
        return ScrubResult(model=copy.deepcopy(art["scrubbed"]), info=info, reference=art["retrain_exact"],
                           original=art["original"])


@register("mlforget-retrain")
class MLForgetRetrain(_MLBase):
    """The ML model retrained from scratch without D_f (the band ``mlforget`` must fall into).

    Parameters
    ----------
    **options
        The same options as :class:`MLForget` (the two share the cached ML artifacts of a seed).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the ML retrain plus σ noise, with ``reference`` the noiseless retrain and ``original``
        the ML model before forgetting; ``info``: ``sigma`` and the sizes ``ml_n_core``, ``ml_n_user``,
        ``ml_num_user_weights``.
    """

    forgets = False  # a gold standard, not a scrub

    def scrub(self, model, retain, forget, ctx: ForgetContext) -> ScrubResult:
        art = ml_artifacts(ctx, self.cfg)
        info = {"sigma": self.cfg.sigma, **art["sizes"]}
        return ScrubResult(model=copy.deepcopy(art["retrain"]), info=info, reference=art["retrain_exact"],
                           original=art["original"])
