"""Solvers for the user weights: the exact step (dual or CG, chosen by size), the papers' SGD step, SGD training.

Which exact solver (``SolverConfig.solver = 'auto'``, the default; the choice is recorded in every step's
info as ``solver``):

* **dual** when the user-data Gram has at most ``dual_max_rows`` rows (N·c ≤ 5000 by default: the float64
  eigenvectors then take ≤ 200 MB; above, the one-off eigendecomposition, O((Nc)³), outgrows the CG path; see
  docs/decisions/mlforgetting.md, "ML-Forgetting solvers") — the Gram
  built once per checkpoint, a Schur complement per request (:mod:`scrubnet.mlforget.dual`); direct, so
  exact to rounding;
* **cg** otherwise — the Newton step Δ = H_{D_r}⁻¹ g_{D_r}(w_u) by conjugate gradient on JVP/VJP products
  in float64, warm-started at the current weights (an exact Newton step from any point lands on the
  minimiser; starting at the previous solution leaves only the change to resolve), preconditioned by a
  randomised Nyström sketch of H built once (on the user data, at training) and reused by every request.
  It stops at an **absolute** tolerance: ‖HΔ − g‖ ≤ µ·``weight_tol``, which bounds the weight error
  ‖w' − w*‖ ≤ ‖HΔ − g‖/λ_min(H) ≤ ``weight_tol`` because H ⪰ µI (default 1e-6 = σ/100 at the default σ,
  i.e. at most ½·10⁻⁴ nats of the Gaussian KL). A tolerance relative to the initial residual would leave an
  error proportional to ‖g‖, which from zero (retraining) is large.

Retraining from scratch (the yardstick and the reference of the readouts) uses the best exact solver of the
same family: the dual from scratch on D_r (Gram, Cholesky, one VJP) or CG from zero with the same
preconditioner and the same absolute tolerance.

* :func:`newton_step` — the CG step above (float32 or float64, whatever the objective's dtype), optionally
  preconditioned with K-FAC of the core network, (G ⊗ A + µI)⁻¹ per layer, or the Nyström sketch
  (SPD preconditioners: they change the iterations, not the answer; ``benchmarks/mlforget_cost.py --precond``
  measures the iterations and times); or, ``solver='sgd'``,
  the thesis's SGD on the auxiliary quadratic L̂(v) = ½ vᵀ H v − gᵀ v with mini-batch estimates of vᵀHv and
  the exact, fixed g (momentum 0.999, lr × 0.5 per epoch, 3 epochs at 0.01) — fast but inexact.
* :func:`fit_user_weights_sgd` — the papers' training of w_u from 0 by SGD on L_D (50 epochs, batch 64,
  lr 0.05, momentum 0.9, ×0.1 at epochs 25 and 40).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scrubnet.curvature.kfac import KFACPreconditioner, compute_kfac, kfac_layers, param_name
from scrubnet.curvature.solvers import certified_cg, conjugate_gradient  # noqa: F401 (certified_cg: re-export)
from scrubnet.mlforget.objective import UserObjective


@dataclass
class SolverConfig:
    """How Newton steps are solved (module docstring). ``solver``: 'auto' (default: 'dual' when N·c ≤
    ``dual_max_rows``, else 'cg'), 'dual', 'cg' (both exact) or 'sgd' (the papers', inexact)."""

    solver: str = "auto"
    dual_max_rows: int = 5000      # N·c up to which the dual (Gram + eigendecomposition) is used
    primal_max_rows: int = 4096    # side q of the p×p (or head-block) system up to which the primal is used
    primal_ratio: float = 2.0      # the primal when q·primal_ratio ≤ the dual's rows (N·c, or N for the head block)
    budget_nats: float | None = None  # certified requests: stop at a proven KL(scrubbed ‖ retrained) ≤ budget
    weight_tol: float = 1e-6       # CG: absolute bound on ‖w' − w*‖ (stop at ‖HΔ − g‖ ≤ µ·weight_tol)
    cg_tol: float = 0.0            # CG: optional relative residual ‖HΔ − g‖/‖g‖ that also stops it
    cg_max_iter: int = 5000
    precond: str = "nystrom"       # CG: 'none', 'kfac' or 'nystrom' (measured: K-FAC barely lowers the condition
    #                                number of the MLP's GGN — 1741 → 1413 on a tiny one)
    precond_rank: int = 200        # sketch size of the Nyström preconditioner
    precond_samples: int = 2048    # samples of D_r the K-FAC factors are estimated on
    sgd_epochs: int = 3
    sgd_lr: float = 0.01
    sgd_momentum: float = 0.999
    sgd_lr_decay: float = 0.5      # per epoch
    sgd_batch_size: int = 128

    def __post_init__(self):
        if self.solver not in ("auto", "dual", "cg", "sgd", "primal"):
            raise ValueError(f"solver must be 'auto', 'dual', 'primal', 'cg' or 'sgd', got {self.solver!r}")
        if self.budget_nats is not None and not (self.budget_nats > 0 and self.budget_nats < float("inf")):
            raise ValueError(f"budget_nats must be a finite number > 0, got {self.budget_nats}")
        if not self.weight_tol > 0 or not self.cg_tol >= 0:
            raise ValueError("weight_tol must be positive and cg_tol ≥ 0")

    def exact_solver(self, rows: int, primal_rows: int | None = None, primal_against: int | None = None) -> str:
        """The exact solver, 'primal', 'dual' or 'cg', for a Gram of ``rows`` = N·c rows: the one forced by
        ``solver``, else (for 'auto', and for training and retraining when the requests use 'sgd') chosen by
        size and memory: the primal when its side q = ``primal_rows`` is at most ``primal_max_rows`` and
        q·``primal_ratio`` ≤ ``primal_against`` (the dual's rows, or N for the head block: the smaller of
        the two systems, when well below), else the dual when ``rows`` ≤ ``dual_max_rows``, else CG."""
        if self.solver in ("dual", "cg", "primal"):
            return self.solver
        against = rows if primal_against is None else primal_against
        if primal_rows is not None and primal_rows <= self.primal_max_rows and \
                primal_rows * self.primal_ratio <= against:
            return "primal"
        return "dual" if rows <= self.dual_max_rows else "cg"
        if self.precond not in ("kfac", "none", "nystrom"):
            raise ValueError(f"precond must be 'none', 'kfac' or 'nystrom', got {self.precond!r}")


@dataclass
class StepInfo:
    """What one Newton step did (for the ledger and the readouts)."""

    solver: str
    iterations: int
    relative_residual: float
    grad_norm: float | None       # ‖g_{D_r}(w_u)‖ (None for the dual, which never forms the gradient)
    loss_before: float | None     # L_{D_r}(w_u) (None for the dual)
    seconds: float
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"solver": self.solver, "iterations": self.iterations, "relative_residual": self.relative_residual,
                "grad_norm": self.grad_norm, "loss_before": self.loss_before, "seconds": self.seconds, **self.extra}


def kfac_preconditioner(obj: UserObjective, samples: int, generator: torch.Generator | None = None):
    """(G ⊗ A + µI)⁻¹ for the factorable linearised layers (identity elsewhere), from ≤ ``samples`` points."""
    model = obj.model
    lin = set(model.linearized_names)
    layers = []
    for name, mod in kfac_layers(model.base).items():
        w = param_name(name, "weight")
        b = param_name(name, "bias")
        if w in lin and (mod.bias is None or b in lin):
            layers.append(name)
    if not layers:
        return None
    n = obj.n
    idx = torch.randperm(n, generator=generator)[:samples] if n > samples else torch.arange(n)
    factors = compute_kfac(model.base, obj.x[idx], loss="mse", layers=layers)
    shapes = [d.shape for d in model.delta]
    return KFACPreconditioner(factors, model.linearized_names, shapes, damping=obj.mu)


class NystromPreconditioner:
    """Randomised Nyström preconditioner of H = F + µI (Frangella, Tropp & Udell 2023).

    F ≈ U diag(λ) Uᵀ from ℓ products F·Ω (Ω orthonormal Gaussian, p×ℓ); the preconditioner's inverse is
    P⁻¹v = (λ_ℓ + µ) U (diag(λ) + µI)⁻¹ Uᵀ v + (v − U Uᵀ v), symmetric positive definite. Built once from
    H_D and reused for the H_{D_r} of later requests (it only changes the CG iterations, not the answer).
    """

    def __init__(self, obj: UserObjective, rank: int, generator: torch.Generator | None = None):
        p = obj.model.num_linearized
        dtype = obj.model.delta[0].dtype
        rank = min(rank, p)
        omega = torch.linalg.qr(torch.randn(p, rank, generator=generator, dtype=torch.float64))[0]
        y = torch.stack([obj.hvp(omega[:, i].to(dtype)).double() - obj.mu * omega[:, i] for i in range(rank)], 1)
        nu = (p ** 0.5) * torch.finfo(dtype).eps * float(torch.linalg.matrix_norm(y, ord=2))
        y_nu = y + nu * omega
        chol = torch.linalg.cholesky(omega.T @ y_nu + 0.0 * torch.eye(rank, dtype=torch.float64))
        b = torch.linalg.solve_triangular(chol, y_nu.T, upper=False).T
        u, sv, _ = torch.linalg.svd(b, full_matrices=False)
        self.u = u.to(dtype)
        self.lam = (sv ** 2 - nu).clamp_min(0.0).to(dtype)
        self.mu = obj.mu
        self.rank = rank

    def inverse_lam_min(self) -> float:
        """λ_min(P⁻¹) = (λ_ℓ + µ)/(λ_1 + µ): P⁻¹ is (λ_ℓ + µ)/(λ_i + µ) on the sketch, 1 on its complement."""
        return float((self.lam[-1] + self.mu) / (self.lam[0] + self.mu)) if self.rank else 1.0

    def __call__(self, v: Tensor) -> Tensor:
        c = self.u.T @ v
        return (self.lam[-1] + self.mu) * (self.u @ (c / (self.lam + self.mu))) + v - self.u @ c


def newton_step(obj: UserObjective, w: Tensor, cfg: SolverConfig, *, generator: torch.Generator | None = None,
                precond=None, target_error: float | None = None) -> tuple[Tensor, StepInfo]:
    """Δ ≈ H⁻¹ g(w) on the objective's data; returns (Δ, info). The new weights are w − Δ.

    CG (any ``cfg.solver`` but 'sgd') stops at ‖HΔ − g‖ ≤ max(µ·weight_tol, cg_tol·‖g‖); the info records
    the absolute residual and the bound ``weight_error_bound`` = ‖HΔ − g‖/µ on ‖w − Δ − w*‖.
    With ``target_error`` (certified requests): :func:`certified_cg` to a proven ‖w − Δ − w*‖ ≤ target."""
    t0 = time.perf_counter()
    g, loss = obj.gradient(w)
    gnorm = float(torch.linalg.vector_norm(g))
    if cfg.solver != "sgd" and target_error is not None:
        if precond is None and cfg.precond == "nystrom":
            precond = NystromPreconditioner(obj, cfg.precond_rank, generator)
        plm = precond.inverse_lam_min() if isinstance(precond, NystromPreconditioner) else 1.0
        if precond is not None and not isinstance(precond, NystromPreconditioner):
            precond = None  # only the Nyström preconditioner has a known spectrum bound
        delta, ci = certified_cg(obj.hvp, g, lam_min=obj.mu, target=target_error, max_iter=cfg.cg_max_iter,
                                 precond=precond, precond_lam_min=plm)
        info = StepInfo("cg-certified", ci["iterations"], ci["residual_bound"] * obj.mu / max(gnorm, 1e-300),
                        gnorm, loss, 0.0,
                        {"converged": bool(ci["converged"]), "preconditioner": "nystrom" if precond is not None
                         else "none", "weight_error_bound": ci["weight_error_bound"],
                         "residual_bound": ci["residual_bound"], "hvp_products": ci["matvecs"]})
        info.seconds = time.perf_counter() - t0
        return delta, info
    if cfg.solver != "sgd":
        if precond is None and cfg.precond == "kfac":
            precond = kfac_preconditioner(obj, cfg.precond_samples, generator)
        elif precond is None and cfg.precond == "nystrom":
            precond = NystromPreconditioner(obj, cfg.precond_rank, generator)
        tol = max(cfg.cg_tol, obj.mu * cfg.weight_tol / max(gnorm, 1e-300))
        delta, si = conjugate_gradient(obj.hvp, g, tol=tol, max_iter=cfg.cg_max_iter, precond=precond)
        abs_res = si.relative_residual * gnorm
        info = StepInfo("cg", si.iterations, si.relative_residual, gnorm, loss, 0.0,
                        {"converged": bool(si.converged), "preconditioner": cfg.precond if precond is not None
                         else "none", "absolute_residual": abs_res, "weight_error_bound": abs_res / obj.mu})
    else:
        delta = _sgd_auxiliary(obj, g, cfg, generator)
        res = float(torch.linalg.vector_norm(obj.hvp(delta) - g)) / max(gnorm, 1e-300)
        steps = cfg.sgd_epochs * -(-obj.n // cfg.sgd_batch_size)
        info = StepInfo("sgd", steps, res, gnorm, loss, 0.0)
    info.seconds = time.perf_counter() - t0
    return delta, info


@torch.no_grad()
def _sgd_auxiliary(obj: UserObjective, g: Tensor, cfg: SolverConfig, generator) -> Tensor:
    """Minimise L̂(v) = ½ vᵀHv − gᵀv from v = 0 with SGD+momentum; the batch estimate of Hv is
    (1/B) Σ_b Jᵀ J v + µ v and g is the exact full-data gradient (fixed)."""
    v = torch.zeros_like(g)
    buf = torch.zeros_like(g)
    lr = cfg.sgd_lr
    for _ in range(cfg.sgd_epochs):
        perm = torch.randperm(obj.n, generator=generator)
        for i in range(0, obj.n, cfg.sgd_batch_size):
            idx = perm[i:i + cfg.sgd_batch_size]
            xb = obj.x[idx]
            hv = obj.model.vjp(xb, obj.model.jvp(xb, v)) / len(idx) + obj.mu * v
            grad = hv - g
            buf.mul_(cfg.sgd_momentum).add_(grad)
            v -= lr * buf
        lr *= cfg.sgd_lr_decay
    return v


@dataclass
class SGDTrainConfig:
    """The papers' SGD for fitting w_u from 0 (50 epochs, batch 64, lr 0.05, momentum 0.9, ×0.1 at 25 and 40)."""

    epochs: int = 50
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 64
    milestones: tuple[int, ...] = (25, 40)
    gamma: float = 0.1


def fit_user_weights_sgd(obj: UserObjective, cfg: SGDTrainConfig, generator: torch.Generator,
                         w_init: Tensor | None = None, stop_below: float | None = None,
                         eval_every_epoch: bool = False) -> tuple[Tensor, dict]:
    """SGD(+momentum) on L_D from ``w_init`` (default 0), batch gradients by reverse-over-forward.

    If ``stop_below`` is given, the full training loss is evaluated after every epoch and training stops
    as soon as it is ≤ ``stop_below`` (used by the benchmark: "retrain to the same training loss").
    Returns (w, {"epochs", "loss", "reached", "train_seconds", "train_cpu_seconds"}); the times exclude the
    per-epoch loss evaluations.
    """
    model = obj.model
    p = model.num_linearized
    w = torch.zeros(p, dtype=model.delta[0].dtype) if w_init is None else w_init.clone()
    w = w.requires_grad_(True)
    opt = torch.optim.SGD([w], lr=cfg.lr, momentum=cfg.momentum)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(cfg.milestones), gamma=cfg.gamma)
    loss_full, epoch, reached, seconds, cpu = float("nan"), 0, False, 0.0, 0.0
    for epoch in range(1, cfg.epochs + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        perm = torch.randperm(obj.n, generator=generator)
        for i in range(0, obj.n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            xb, yb = obj.x[idx], obj.y[idx]
            f0, jv = model.output_and_jvp(xb, w)
            r = f0.detach() + jv - obj.targets(yb, f0.dtype)
            loss = 0.5 * (r ** 2).sum() / len(idx) + 0.5 * obj.mu * (w * w).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        seconds += time.perf_counter() - t0
        cpu += time.process_time() - c0
        if stop_below is not None or eval_every_epoch:
            loss_full = obj.loss(w.detach())
            if stop_below is not None and loss_full <= stop_below:
                reached = True
                break
    w = w.detach()
    if loss_full != loss_full:
        loss_full = obj.loss(w)
    return w, {"epochs": epoch, "loss": loss_full, "reached": reached, "train_seconds": seconds,
               "train_cpu_seconds": cpu}
