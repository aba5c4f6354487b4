"""The Mixed-Linear (ML) model: core weights trained non-linearly on D_core, user weights linear around them.

Construction for a :class:`~scrubnet.data.Split` (decisions where the thesis is silent; docs/decisions/mlforgetting.md,
"ML-Forgetting"):

1. **Core data.** D_core = the pre-training data (the core classes, used by ``pretrain`` to build w_0, as
   ImageNet is in the thesis) plus ``core_fraction`` (30 %, the papers' split) of the task data D, drawn at
   random (seeded) from D_r = D \\ D_f so that it is never forgotten. User data D_u: ``user_data='all'`` (default)
   = all of D, the core 30 % included but never deletable — the thesis's own Fig. 6.5 protocol ("the user
   data is 100 % of the Aircrafts, so the 30 % appears in both sets"); ``user_data='rest'`` = D minus the core
   part. 'all' keeps the ML model closer to the non-linear original's test error (the linear part then also
   learns from the core 30 %, which the original saw too; figures in docs/decisions/mlforgetting.md, "ML-Forgetting").
2. **Core weights** w_c: a copy of the fine-tuning start w_0 (pre-trained backbone + fresh task head) with its
   ReLUs turned into Leaky-ReLUs (LQF's advice: Leaky-ReLUs linearise better), fine-tuned *non-linearly* with
   cross-entropy on the task part of D_core using the protocol's :func:`scrubnet.training.finetune`.
3. **User weights** w_u (start 0) on the parameters named by ``linearize`` (default: all), trained on D_u
   with the mean MSE to 5·one-hot + (µ/2)‖w_u‖² (:mod:`scrubnet.mlforget.objective`). Default training is the
   exact minimiser by the exact solver chosen by size (:mod:`scrubnet.mlforget.solve`): in the dual it
   builds the user-data Gram and its eigendecomposition, kept in ``MLState.factor`` for every later request
   (:mod:`scrubnet.mlforget.dual`); with CG it builds the Nyström preconditioner kept in ``MLState.precond``.
   ``train_solver='sgd'`` uses the papers' 50-epoch SGD instead.

The returned :class:`MLState` keeps which ids (positions in D) are core, user and already forgotten.
The ML module (``state.model``, a :class:`~scrubnet.models.linearized.LinearizedModel`) maps x → logits
and its only trainable parameters are w_u.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from scrubnet._config import strict_from_dict
from scrubnet.mlforget.certify import (refusal, residual_bound, rounding_bound_a_priori, rounding_error,
                                      solve_rounding_bound, stored_certificate)
from scrubnet.mlforget.dual import DualFactor, dual_fit
from scrubnet.mlforget.objective import UserObjective
from scrubnet.mlforget.prefix import PrefixSplit
from scrubnet.mlforget.primal import PrimalFactor, primal_fit, primal_size
from scrubnet.mlforget.solve import (
    NystromPreconditioner,
    SGDTrainConfig,
    SolverConfig,
    StepInfo,
    fit_user_weights_sgd,
    newton_step,
)
from scrubnet.models.call import floating_to
from scrubnet.models.linearized import LinearizedModel, convert_relu_to_leaky
from scrubnet.training import TrainConfig, finetune


@dataclass
class MLConfig:
    """Hyperparameters of the ML model and of ML-Forgetting.

    mu: µ of (µ/2)‖w_u‖² (mean-normalised loss); target_scale: s of s·one-hot; sigma: noise std added to
    w_u after each forgetting request (z ~ N(0, σ²I)); linearize: parameter-name prefixes of w_u (None =
    all parameters); core_fraction: share of D put in the core; user_data: 'all' or 'rest' (module
    docstring); train_solver: 'newton' (exact) or 'sgd'.
    coupled_noise: when evaluating against the retrained reference S_0(ŵ) = ŵ + σ·ε', draw ε' equal to the
    scrub's ε (common random numbers, the default) instead of independently. Both are samples of the same
    N(0, σ²I), so the distributions compared are unchanged; pairing them per seed removes the
    noise-versus-noise spread from readouts such as the activation distance (with independent draws and
    3 seeds, "inside the band" on those readouts is a coin flip whatever the scrub does), leaving only what
    differs deterministically: the solver error, which ``info_weights_nats`` measures directly.
    """

    mu: float = 0.05
    target_scale: float = 5.0
    sigma: float = 1e-4
    leaky_slope: float | None = 0.01
    linearize: list[str] | None = None
    core_fraction: float = 0.3
    user_data: str = "all"
    train_solver: str = "newton"
    chunk: int = 4096
    solver: SolverConfig = field(default_factory=SolverConfig)
    sgd_train: SGDTrainConfig = field(default_factory=SGDTrainConfig)
    coupled_noise: bool = True

    def __post_init__(self):
        if isinstance(self.solver, dict):
            self.solver = SolverConfig(**self.solver)
        if isinstance(self.sgd_train, dict):
            self.sgd_train = SGDTrainConfig(**{k: tuple(v) if k == "milestones" else v
                                              for k, v in self.sgd_train.items()})
        if not self.mu > 0:
            raise ValueError(f"mu must be positive, got {self.mu}")
        if not self.sigma >= 0:
            raise ValueError(f"sigma must be ≥ 0, got {self.sigma}")
        if not 0.0 <= self.core_fraction < 1.0:
            raise ValueError(f"core_fraction must be in [0, 1), got {self.core_fraction}")
        if self.user_data not in ("all", "rest"):
            raise ValueError(f"user_data must be 'all' or 'rest', got {self.user_data!r}")
        if self.train_solver not in ("newton", "sgd"):
            raise ValueError(f"train_solver must be 'newton' or 'sgd', got {self.train_solver!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sgd_train"]["milestones"] = list(d["sgd_train"]["milestones"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MLConfig":
        return strict_from_dict(cls, d, "ML-Forgetting")


@dataclass
class MLState:
    """An ML model and its bookkeeping. Ids are positions in D (``split.x``)."""

    model: LinearizedModel
    core_ids: Tensor
    user_ids: Tensor
    forgotten_ids: Tensor
    config: MLConfig
    num_classes: int
    seed: int
    train_info: dict = field(default_factory=dict)
    precond: object = None  # a preconditioner of H built once (Nyström) and reused by later requests
    factor: DualFactor | None = None  # the user-data Gram, eigendecomposed once, used by every dual request
    primal: PrimalFactor | None = None  # the p×p user-weight system, eigendecomposed once (primal requests)
    prefix: PrefixSplit | None = None  # the frozen prefix and its features cache (:meth:`space`)
    prefix_checked: bool = False
    base_sha256: str | None = None  # forgettable fine-tuning: sha256 of the pretrained model's state_dict
    user_weights: dict | None = None  # forgettable fine-tuning: which weights are the user's (the spec given)

    def remaining_ids(self) -> Tensor:
        """User ids not yet forgotten (sorted)."""
        keep = ~torch.isin(self.user_ids, self.forgotten_ids)
        return self.user_ids[keep]

    def deletable_ids(self) -> Tensor:
        """User ids that a request may still name (not core, not forgotten)."""
        rem = self.remaining_ids()
        return rem[~torch.isin(rem, self.core_ids)]

    def space(self, x_all: Tensor) -> tuple[LinearizedModel, Tensor]:
        """(ML module, inputs) the solvers run on: the linearised suffix and the cached features h(x_all) when
        the network splits after a frozen prefix (:mod:`scrubnet.mlforget.prefix`), else (``model``,
        ``x_all``). Both give the same J, residuals and user weights (same names and order)."""
        if not self.prefix_checked:
            # a prefix is cut from a traced graph of one tensor input; extra inputs (ModelInputs) run whole
            self.prefix = PrefixSplit.of(self.model, chunk=self.config.chunk, check=x_all[:8]) \
                if isinstance(x_all, Tensor) else None
            self.prefix_checked = True
        if self.prefix is None:
            return self.model, x_all
        return self.prefix.suffix_model, self.prefix.features(x_all)

    def objective(self, x: Tensor, y: Tensor, model: LinearizedModel | None = None) -> UserObjective:
        return UserObjective(self.model if model is None else model, x, y, self.num_classes, self.config.mu,
                             self.config.target_scale, self.config.chunk)

    def objective64(self, x: Tensor, y: Tensor, model: LinearizedModel | None = None) -> UserObjective:
        """The objective on a float64 copy of the ML module (the exact CG solves run in float64)."""
        m = self.model if model is None else model
        return UserObjective(copy.deepcopy(m).double(), floating_to(x, torch.float64), y, self.num_classes, self.config.mu,
                             self.config.target_scale, self.config.chunk)

    def primal_shape(self) -> tuple[int, bool]:
        """(q, block): the side of the primal system and whether the head's per-output block structure applies
        (known once :meth:`space` has looked for a prefix)."""
        block = self.prefix is not None and self.prefix.head_linear
        model = self.prefix.suffix_model if block else self.model
        return primal_size(model, block), block

    def exact_solver(self, n_samples: int) -> str:
        """'primal', 'dual' or 'cg' for ``n_samples`` samples (N·c rows of the Gram), see :class:`SolverConfig`."""
        q, block = self.primal_shape()
        return self.config.solver.exact_solver(n_samples * self.num_classes, q,
                                               n_samples if block else n_samples * self.num_classes)

    def copy(self) -> "MLState":
        return copy.deepcopy(self)


def choose_core_ids(n: int, fraction: float, seed: int, exclude: Tensor | None = None,
                    user_data: str = "rest") -> tuple[Tensor, Tensor]:
    """(core_ids, user_ids): ``round(fraction·n)`` positions of D drawn (numpy default_rng(seed)) from
    those not in ``exclude`` (D_f: the core is never forgotten); the user ids are the rest of D
    (``user_data='rest'``) or all of D (``'all'``)."""
    excl = np.zeros(n, dtype=bool)
    if exclude is not None and len(exclude):
        excl[np.asarray(exclude)] = True
    pool = np.nonzero(~excl)[0]
    k = int(round(fraction * n))
    if k > len(pool):
        raise ValueError(f"core fraction {fraction} needs {k} samples, only {len(pool)} are outside D_f")
    rng = np.random.default_rng(seed)
    core = np.sort(rng.choice(pool, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)
    mask = np.ones(n, dtype=bool)
    if user_data == "rest":
        mask[core] = False
    return torch.as_tensor(core, dtype=torch.long), torch.as_tensor(np.nonzero(mask)[0], dtype=torch.long)


def train_core(start: nn.Module, x: Tensor, y: Tensor, train_cfg: TrainConfig, seed: int,
               leaky_slope: float | None) -> nn.Module:
    """w_c: ``start`` with Leaky-ReLUs, fine-tuned non-linearly (CE + L2 pull to w_0) on the core task data."""
    model = copy.deepcopy(start)
    if leaky_slope is not None:
        convert_relu_to_leaky(model, leaky_slope)
    if len(y) == 0:
        return model.eval()
    core, _ = finetune(model, x, y, train_cfg, seed)
    return core.eval()


def _precond_for(state: MLState, obj: UserObjective, generator: torch.Generator | None):
    """The CG preconditioner: ``state.precond`` when built, else built now from ``obj`` (and kept) if
    ``precond='nystrom'``; K-FAC is built per solve by :func:`newton_step`."""
    if state.config.solver.precond != "nystrom":
        return None
    if state.precond is None:
        state.precond = NystromPreconditioner(obj, state.config.solver.precond_rank,
                                              torch.Generator().manual_seed(state.seed))
    return state.precond


def fit_user_weights(state: MLState, x: Tensor, y: Tensor, generator: torch.Generator, *,
                     ids: Tensor | None = None) -> tuple[Tensor, dict]:
    """Train w_u from 0 on (x, y) — or on (x[ids], y[ids]) when ``ids`` is given, so that the features of a
    frozen prefix are those cached for all of x — with ``state.config.train_solver``; returns (w_u, info).
    Does not set it.

    'newton' = the exact minimiser from scratch with the exact solver chosen by size: the dual
    (:func:`scrubnet.mlforget.dual.dual_fit`: Gram, Cholesky, one VJP) or float64 CG from zero to the
    absolute tolerance, with the state's Nyström preconditioner (built here if missing). This is also the
    retraining yardstick (:func:`retrain_user_weights`)."""
    cfg = state.config
    lin, x = state.space(x)
    if ids is not None:
        x, y = x[ids], y[ids]
    if cfg.train_solver == "newton":
        t0 = time.perf_counter()
        solver = state.exact_solver(len(y))
        if solver == "primal":
            w, info = primal_fit(lin, x, y, state.num_classes, cfg.mu, cfg.target_scale, state.primal_shape()[1])
        elif solver == "dual":
            w, info = dual_fit(lin, x, y, state.num_classes, cfg.mu, cfg.target_scale)
        else:
            obj = state.objective64(x, y, lin)
            zero = torch.zeros(state.model.num_linearized, dtype=torch.float64)
            t1 = time.perf_counter()
            precond = _precond_for(state, obj, generator)
            t2 = time.perf_counter()
            delta, step = newton_step(obj, zero, SolverConfig(**{**asdict(cfg.solver), "solver": "cg"}),
                                      generator=generator, precond=precond)
            w = (-delta).to(state.model.delta[0].dtype)
            info = {k: v for k, v in step.as_dict().items() if isinstance(v, (int, float, str)) and v is not None}
            info["precond_build_s"] = t2 - t1
        info["seconds"] = time.perf_counter() - t0
        return w, {"train_" + k: v for k, v in info.items()}
    obj = state.objective(x, y, lin)
    w, info = fit_user_weights_sgd(obj, cfg.sgd_train, generator)
    return w, {"train_epochs": info["epochs"], "train_loss": info["loss"]}


def build_factor(state: MLState, x_all: Tensor, y_all: Tensor, ids: Tensor) -> DualFactor:
    """The user-data Gram of ``ids`` eigendecomposed (:class:`~scrubnet.mlforget.dual.DualFactor`)."""
    cfg = state.config
    lin, h = state.space(x_all)
    return DualFactor.build(lin, h, y_all, ids, state.num_classes, cfg.mu, cfg.target_scale)


def build_primal(state: MLState, x_all: Tensor, y_all: Tensor, ids: Tensor) -> PrimalFactor:
    """The user-weight system of ``ids`` eigendecomposed (:class:`~scrubnet.mlforget.primal.PrimalFactor`)."""
    cfg = state.config
    lin, h = state.space(x_all)
    return PrimalFactor.build(lin, h, y_all, ids, state.num_classes, cfg.mu, cfg.target_scale,
                              state.primal_shape()[1])


def build_ml_model(start: nn.Module, split, cfg: MLConfig, train_cfg: TrainConfig, seed: int, *,
                   exclude_from_core: Tensor | None = None, core_model: nn.Module | None = None) -> MLState:
    """Build the ML model for ``split`` (module docstring). ``exclude_from_core`` defaults to D_f;
    pass ``core_model`` to reuse trained core weights (then ``start`` is ignored)."""
    n = len(split.y)
    excl = split.forget_idx if exclude_from_core is None else exclude_from_core
    core_ids, user_ids = choose_core_ids(n, cfg.core_fraction, seed, excl, cfg.user_data)
    if core_model is None:
        core_model = train_core(start, split.x[core_ids], split.y[core_ids], train_cfg, seed, cfg.leaky_slope)
    model = LinearizedModel(core_model, prefixes=cfg.linearize)
    state = MLState(model, core_ids, user_ids, torch.zeros(0, dtype=torch.long), cfg, split.num_classes, seed)
    g = torch.Generator().manual_seed(7919 * seed + 11)
    state.space(split.x)
    train_exact_factored(state, split.x, split.y, g)
    return state


def train_exact_factored(state: MLState, x_all: Tensor, y_all: Tensor, g: torch.Generator) -> None:
    """Fit w_u on ``state.user_ids`` and set it: the factor (primal or dual) built once and solved for
    "remove nothing" when the exact solver chosen by size is one of them, else :func:`fit_user_weights`."""
    cfg, model, user_ids = state.config, state.model, state.user_ids

    solver = state.exact_solver(len(user_ids)) if cfg.train_solver == "newton" else ""
    if solver == "primal":
        t0 = time.perf_counter()
        state.primal = build_primal(state, x_all, y_all, user_ids)
        lin, h = state.space(x_all)
        w, info = state.primal.fit(lin, h, y_all, torch.ones(len(user_ids), dtype=torch.bool))
        info = {"train_solver": "primal", "train_seconds": time.perf_counter() - t0, "train_iterations": 0,
                "train_gram_s": state.primal.seconds["gram_s"], "train_eig_s": state.primal.seconds["eig_s"],
                "train_primal_rows": state.primal.rows, "train_primal_block": state.primal.block,
                "train_relative_residual": info["relative_residual"]}
    elif solver == "dual":
        # training is the request "remove nothing" on the factor every later request uses
        t0 = time.perf_counter()
        state.factor = build_factor(state, x_all, y_all, user_ids)
        lin, h = state.space(x_all)
        w, info = state.factor.fit(lin, h, torch.ones(len(user_ids), dtype=torch.bool))
        info = {"train_solver": "dual", "train_seconds": time.perf_counter() - t0, "train_iterations": 0,
                "train_gram_s": state.factor.seconds["gram_s"], "train_eig_s": state.factor.seconds["eig_s"],
                "train_dual_rows": state.factor.rows,
                "train_relative_residual": info["relative_residual"]}
    else:
        w, info = fit_user_weights(state, x_all, y_all, g, ids=user_ids)
    model.set_delta_flat(w)
    state.train_info = info


def distinct_request_ids(ids) -> Tensor:
    """The sorted ids of a forgetting request (int64); ``ValueError`` for an empty request or a repeated id."""
    arr = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
    if arr.numel() == 0:
        raise ValueError("the forgetting request is empty: give at least one sample id")
    uniq, counts = torch.unique(arr, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"duplicated id(s) in the request: {uniq[counts > 1].tolist()[:10]}")
    return uniq


def check_forget_ids(state: MLState, ids) -> Tensor:
    """Validate a forgetting request: ids must be user ids not yet forgotten. Clear ``ValueError`` otherwise."""
    uniq = distinct_request_ids(ids)
    core = uniq[torch.isin(uniq, state.core_ids)]
    if core.numel():
        raise ValueError(f"id(s) {core.tolist()[:10]} belong to the core data, which is never forgotten "
                         "(its information is in the core weights); refusing the request")
    done = uniq[torch.isin(uniq, state.forgotten_ids)]
    if done.numel():
        raise ValueError(f"id(s) {done.tolist()[:10]} were already forgotten by an earlier request; refusing "
                         "to forget them twice")
    unknown = uniq[~torch.isin(uniq, state.user_ids)]
    if unknown.numel():
        raise ValueError(f"id(s) {unknown.tolist()[:10]} are not user data ids (valid: positions in D)")
    if len(uniq) >= len(state.remaining_ids()):
        raise ValueError("the request would forget every remaining user sample; use forget-all instead")
    return uniq


@dataclass
class ForgetOutcome:
    """Result of one request: weights before noise (w'), after noise, and the step's info."""

    w_before_noise: Tensor
    w_after: Tensor
    info: StepInfo

    @property
    def noise(self) -> Tensor:
        """The noise added by this request, σ·ε = w_after − w'."""
        return self.w_after - self.w_before_noise


def reference_noise(cfg: MLConfig, out: ForgetOutcome, seed: int) -> Tensor:
    """σ·ε' for the retrained reference ŵ + σ·ε': the scrub's own draw when ``cfg.coupled_noise``
    (common random numbers), else an independent draw from ``seed``."""
    if cfg.coupled_noise:
        return out.noise.clone()
    g = torch.Generator().manual_seed(int(seed))
    return cfg.sigma * torch.randn(out.w_after.shape, generator=g, dtype=out.w_after.dtype)


def forget_request(state: MLState, x_all: Tensor, y_all: Tensor, ids, *, sigma: float | None = None,
                   noise_seed: int = 0, apply: bool = True, budget_nats: float | None = None,
                   verify_stored: bool = False) -> ForgetOutcome:
    """ML-Forgetting of one request: on the remaining data D_r (user ids minus the forgotten ones minus
    ``ids``), the exact step w' = w_u − H_{D_r}⁻¹ g_{D_r}(w_u) = argmin L_{D_r}; then w_u ← w' + σ·ε,
    ε ~ N(0, I) drawn from ``torch.Generator().manual_seed(noise_seed)``. ``x_all, y_all`` = all of D.

    The solver (:class:`~scrubnet.mlforget.solve.SolverConfig`, recorded in ``info.solver``): 'dual' — the
    Schur complement on the state's eigendecomposed Gram (built here, and timed in ``factor_build_s``, only if
    the state has none, e.g. a checkpoint just loaded; rebuilt on the remaining data once more than half of its
    rows are removed); 'cg' — float64 CG warm-started at w_u with the state's Nyström preconditioner, to the
    absolute tolerance; 'sgd' — the papers' inexact SGD on the auxiliary quadratic.
    'primal' — the Woodbury downdate on the state's eigendecomposed p×p system
    (:mod:`scrubnet.mlforget.primal`; built or rebuilt like the dual's factor).
    A frozen prefix (:mod:`scrubnet.mlforget.prefix`) is run once: every solver works on its features.
    ``budget_nats`` (default ``config.solver.budget_nats``): a certified request — CG stops as soon as the
    proven bound on KL(scrubbed ‖ retrained) at σ is ≤ the budget (:func:`~scrubnet.mlforget.solve.certified_cg`)
    and refuses (``ValueError``) when it cannot; every request's ``info.extra['certificate']`` holds the bound
    on the weights *as stored* (float32 rounding included, :mod:`scrubnet.mlforget.certify`), and an exact
    (primal, dual) request whose bound misses the budget — the float32 rounding alone can — is refused too.
    ``verify_stored``: also the a-posteriori bound from the stored weights' float64 gradient over D_r (one
    JVP and two VJPs per chunk; :func:`~scrubnet.mlforget.certify.residual_bound`); the smaller one is kept.
    With ``apply`` the state is updated (weights and forgotten ids)."""
    ids = check_forget_ids(state, ids)
    sigma = state.config.sigma if sigma is None else float(sigma)
    if sigma < 0:
        raise ValueError(f"sigma must be ≥ 0, got {sigma}")
    t0 = time.perf_counter()
    remaining = state.remaining_ids()
    remaining = remaining[~torch.isin(remaining, ids)]
    w = state.model.delta_flat()
    gen = torch.Generator().manual_seed(int(noise_seed))
    solver = state.config.solver
    budget = solver.budget_nats if budget_nats is None else float(budget_nats)
    if budget is not None and not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"budget_nats must be a finite number > 0, got {budget}")
    lin, h = state.space(x_all)
    exact = state.exact_solver(len(state.remaining_ids()))
    w64 = None
    if solver.solver == "sgd":
        delta, info = newton_step(state.objective(h[remaining], y_all[remaining], lin), w, solver, generator=gen)
        w_prime = w - delta
    elif exact == "primal":
        w64, info = _primal_step(state, x_all, y_all, remaining)
    elif exact == "dual":
        w64, info = _dual_step(state, x_all, y_all, remaining)
    else:
        w64, info = _cg_step(state, lin, h, y_all, remaining, w, gen, sigma, budget)
    if w64 is not None:
        w_prime = w64.to(w.dtype)
    posterior = None
    if verify_stored:
        posterior, pinfo = residual_bound(state.objective64(h[remaining], y_all[remaining], lin), w_prime)
        info.extra["posterior_products"] = pinfo["products"]
    cert = stored_certificate(info, w64, w_prime, sigma, budget, posterior)
    info.extra["certificate"] = cert
    if budget is not None and w64 is not None and not cert["within_budget"]:
        raise ValueError(refusal(cert))
    eps = torch.randn(w.shape, generator=gen, dtype=w.dtype)
    w_new = w_prime + sigma * eps if sigma > 0 else w_prime.clone()
    info.seconds = time.perf_counter() - t0
    info.extra["n_remaining"] = int(len(remaining))
    info.extra["n_forgotten_now"] = int(len(ids))
    info.extra["sigma"] = sigma
    if apply:
        state.model.set_delta_flat(w_new)
        state.forgotten_ids = torch.sort(torch.cat([state.forgotten_ids, ids])).values
    return ForgetOutcome(w_prime, w_new, info)


def _cg_step(state: MLState, lin, h: Tensor, y_all: Tensor, remaining: Tensor, w: Tensor, gen: torch.Generator,
             sigma: float, budget: float | None) -> tuple[Tensor, StepInfo]:
    """w' (float64) by CG warm-started at ``w``; certified (:func:`certified_cg`) when a budget is set, with a
    target ε = σ√(2B) less an a-priori bound on the storage rounding — re-solved once to a target less the
    exact rounding when that bound was too optimistic (the caller refuses a request still over budget)."""
    solver = state.config.solver
    obj = state.objective64(h[remaining], y_all[remaining], lin)
    t1 = time.perf_counter()
    built = state.precond is None
    rem_all = state.remaining_ids()
    precond = _precond_for(state, state.objective64(h[rem_all], y_all[rem_all], lin) if built else obj, gen)
    t2 = time.perf_counter()
    # certified: the proven weight error that keeps KL(N(w', σ²I) ‖ N(w*, σ²I)) = ‖w' − w*‖²/(2σ²) ≤ budget
    target = sigma * math.sqrt(2.0 * budget) if budget is not None and sigma > 0 else None
    cfg = SolverConfig(**{**asdict(solver), "solver": "cg"})
    w_norm = float(torch.linalg.vector_norm(w.double()))
    tries = [] if target is None else [max(target - rounding_bound_a_priori(2 * w_norm + target, w.dtype, w.numel()),
                                           0.5 * target)]
    for k in range(2 if tries else 1):
        delta, info = newton_step(obj, w.double(), cfg, generator=gen, precond=precond,
                                  target_error=tries[k] if tries else None)
        w64 = w.double() - delta
        ex = info.extra
        d_norm, g_norm = float(torch.linalg.vector_norm(delta)), float(info.grad_norm or 0.0)
        # L ≥ λ_max(H_R) estimated (×2): the Nyström sketch's top eigenvalue of F_U scaled to D_r, or the
        # Rayleigh-like ‖g‖/‖Δ‖ (g ≈ HΔ); only the 1e-16-relative fp term uses it
        lam = g_norm / max(d_norm, 1e-300)
        if isinstance(precond, NystromPreconditioner) and precond.rank:
            lam = max(lam, float(precond.lam[0]) * len(rem_all) / len(remaining) + obj.mu)
        k_sum = min(obj.chunk, obj.n) * obj.num_classes + w.numel() + 4
        ex["float64_error_bound"] = (solve_rounding_bound(k_sum, 2 * lam, obj.mu, d_norm + 2 * w_norm, g_norm)
                                     + 2.0 ** -53 * float(torch.linalg.vector_norm(w64)))
        if target is None or not ex["converged"]:
            break
        rho = rounding_error(w64, w64.to(w.dtype))
        slack = target - rho - ex["float64_error_bound"]
        if ex["weight_error_bound"] <= slack or slack <= 0 or k:
            break
        tries.append(0.99 * slack)
    ex["precond_build_s"] = (t2 - t1) if built else 0.0
    if target is not None:
        ex["certified_solves"] = len(tries)
    if target is not None and not ex["converged"]:
        raise ValueError(f"the certified request did not reach its budget of {budget} nats within "
                         f"{solver.cg_max_iter} CG iterations (proven weight error "
                         f"{ex['weight_error_bound']:.3g} > {tries[-1]:.3g}); nothing was applied")
    return w64, info


def _rebuild_reason(fac, remaining: Tensor) -> str:
    """Why a (primal or dual) factor must be rebuilt before a request: "missing" (none, or it lacks some
    remaining rows), "over half removed" (the downdate would remove more rows than it keeps), or "" (reuse)."""
    if fac is None or not bool(torch.isin(remaining, fac.ids).all()):
        return "missing"
    if 2 * (len(fac.ids) - len(remaining)) > len(fac.ids):
        return "over half removed"
    return ""


def _current_factor(state: MLState, attr: str, build, x_all: Tensor, y_all: Tensor, remaining: Tensor):
    """(the state's ``attr`` factor, rebuilt first when :func:`_rebuild_reason` says so — from every remaining
    row when it is missing, from the request's remaining rows when over half would be removed —, the reason)."""
    rebuilt = _rebuild_reason(getattr(state, attr), remaining)
    if rebuilt:
        base = state.remaining_ids() if rebuilt == "missing" else remaining
        setattr(state, attr, build(state, x_all, y_all, base))
    return getattr(state, attr), rebuilt


def _primal_step(state: MLState, x_all: Tensor, y_all: Tensor, remaining: Tensor) -> tuple[Tensor, StepInfo]:
    """w' = argmin L_{remaining} (float64) by the Woodbury downdate on the state's primal factor (built or
    rebuilt)."""
    t0 = time.perf_counter()
    fac, rebuilt = _current_factor(state, "primal", build_primal, x_all, y_all, remaining)
    t1 = time.perf_counter()
    lin, h = state.space(x_all)
    w_prime, d = fac.fit(lin, h, y_all, torch.isin(fac.ids, remaining), dtype=torch.float64)
    extra = {"primal_rows": d["primal_rows"], "primal_block": d["primal_block"], "removed_rows": d["removed_rows"],
             "primal_downdate": d["primal_downdate"],
             "solve_s": d["solve_s"], "weight_error_bound": d["weight_error_bound"],
             "float64_error_bound": d["float64_error_bound"], "factor_build_s": t1 - t0 if rebuilt else 0.0,
             "factor_rebuilt": rebuilt or "no",
             "factor_source": "rebuilt" if rebuilt else fac.source}
    return w_prime, StepInfo("primal", 0, d["relative_residual"], None, None, 0.0, extra)


def _dual_step(state: MLState, x_all: Tensor, y_all: Tensor, remaining: Tensor) -> tuple[Tensor, StepInfo]:
    """w' = argmin L_{remaining} (float64) by the Schur complement on the state's factor (built or rebuilt)."""
    t0 = time.perf_counter()
    fac, rebuilt = _current_factor(state, "factor", build_factor, x_all, y_all, remaining)
    t1 = time.perf_counter()
    lin, h = state.space(x_all)
    keep = torch.isin(fac.ids, remaining)
    w_prime, d = fac.fit(lin, h, keep, dtype=torch.float64)
    # ‖w − w*‖ = ‖J_Rᵀ δa‖ ≤ √λ_max(K) · ‖dual residual‖/λ_R (λ_min(K_RR + λ_R I) ≥ λ_R = n_R µ)
    n_r = int(keep.sum())
    r_norm = float(torch.linalg.vector_norm(fac.residuals[keep]))
    lam_r, lam_max = n_r * fac.mu, float(fac.eigvals.max().clamp_min(0.0))
    bound = lam_max ** 0.5 * d["relative_residual"] * r_norm / lam_r
    # float64 rounding: of the dual residual (3 products with Q, the m×m solve), then of the VJP −J_Rᵀa
    a_norm = d["coefficient_norm"]
    fp = (lam_max ** 0.5 * solve_rounding_bound(3 * fac.rows + d["removed_rows"] + 4, lam_max + lam_r, lam_r,
                                                a_norm, r_norm)
          + solve_rounding_bound(n_r * fac.num_classes + 2, lam_max ** 0.5, 1.0, a_norm, 0.0))
    extra = {"dual_rows": d["dual_rows"], "removed_rows": d["removed_rows"], "solve_s": d["solve_s"],
             "weight_error_bound": bound, "float64_error_bound": fp,
             "vjp_s": d["vjp_s"], "factor_build_s": t1 - t0 if rebuilt else 0.0,
             "factor_rebuilt": rebuilt or "no", "factor_source": "rebuilt" if rebuilt else fac.source}
    return w_prime, StepInfo("dual", 0, d["relative_residual"], None, None, 0.0, extra)


def forget_all(state: MLState) -> None:
    """Forget every user sample: w_u ← 0, so the model is exactly f_{w_c} (seen only D_core)."""
    state.model.reset_delta()
    state.forgotten_ids = state.user_ids.clone()


def retrain_user_weights(state: MLState, x_all: Tensor, y_all: Tensor, *, return_info: bool = False):
    """ŵ_u: w_u trained from scratch (from 0, same seed and training solver as the original; with the default
    'newton' the best exact solver from scratch, see :func:`fit_user_weights`) on the remaining user data of
    ``state``. Never uses the state's factor. With ``return_info``: (ŵ_u, info)."""
    rem = state.remaining_ids()
    g = torch.Generator().manual_seed(7919 * state.seed + 11)
    w, info = fit_user_weights(state, x_all, y_all, g, ids=rem)
    return (w, info) if return_info else w


def remaining_information_nats(w_prime: Tensor, w_hat: Tensor, sigma: float) -> float:
    """KL( N(w', σ²I) ‖ N(ŵ, σ²I) ) = ‖w' − ŵ‖²/(2σ²) in nats — the Gaussian KL with the ½, the convention
    of ``info_weights_nats`` for every method — with w' the scrubbed weights before noise and ŵ the
    retrained ones (both then get the same noise σ·ε). ``inf`` if σ = 0 and the two differ, 0 if identical.
    The thesis's bound on the information left, E‖w' − ŵ‖²/σ², is twice this (:func:`remaining_information_bound`)."""
    d2 = float(torch.sum((w_prime.double() - w_hat.double()) ** 2))
    if sigma == 0:
        return 0.0 if d2 == 0 else float("inf")
    return 0.5 * d2 / sigma ** 2


def remaining_information_bound(w_prime: Tensor, w_hat: Tensor, sigma: float) -> float:
    """‖w' − ŵ‖²/σ² (nats): the thesis's bound on the information about the forgotten data left in the
    noisy weights (= 2 × :func:`remaining_information_nats`), reported as ``info_weights_bound_nats``."""
    return 2.0 * remaining_information_nats(w_prime, w_hat, sigma)


def ml_module_with_weights(state: MLState, w: Tensor) -> LinearizedModel:
    """A copy of the ML module with user weights ``w``."""
    m = copy.deepcopy(state.model)
    m.set_delta_flat(w)
    return m
