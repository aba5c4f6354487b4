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

from scrubnet.data import Split
from scrubnet.device import model_device
from scrubnet.methods.artifacts import mlforget_key
from scrubnet.methods.base import ForgetContext, ForgettingMethod, ScrubResult, register
from scrubnet.mlforget.model import (MLConfig, MLState, forget_request, ml_module_with_weights, reference_noise,
                                     remaining_information_bound, remaining_information_nats,
                                     retrain_user_weights)
from scrubnet.mlforget.pipeline import train_ml
from scrubnet.mlforget.solve import SolverConfig

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


class _MLBase(ForgettingMethod):
    own_retrain_family = True
    audit_scrub_cost = "expensive"  # trains its own mixed-linear model for every scrub
    def __init__(self, **options):
        self.cfg = ml_config_from_options(options)


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
