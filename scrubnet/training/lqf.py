"""LQF — Linear Quadratic Fine-tuning (thesis Ch. 5) and the leave-one-out influence of a training sample.

Model: f_lin(x) = f_{w0}(x) + J(x)·Δw (:class:`~scrubnet.models.linearized.LinearizedModel`, Leaky-ReLU,
BatchNorm in eval mode, all or a chosen set of layers linearised). Loss (eq. 5.3, normalised as a mean
with ½ so that its Hessian is H = F + λI with F = (1/N) Σ J_nᵀ J_n; docs/decisions/ntk.md, "LQF"):

    L(Δw) = (1/N) Σ_n ½‖f_lin(x_n) − α·onehot(y_n)‖² + (λ/2)‖Δw‖²          (α = 15; ‖Δw‖ = ‖w − w0‖)

Optimisers (``LQFConfig.optimizer``):
* ``'kfac'`` (default): SGD with momentum on the K-FAC-preconditioned gradient (G ⊗ A + λI)⁻¹ g. The
  Hessian is constant (fixed by w0), so the factors are computed once, on the training data at w0, with the
  MSE output Hessian Λ = I. Parameters outside Linear/Conv layers (e.g. BN γ/β) get the plain gradient.
  The weight decay is in the loss (not in the update), so K-FAC preconditions it with the data term.
* ``'sgd'``: plain SGD with momentum; ``'adam'``: Adam (Table 5.3).
* :func:`solve_lqf` gives the exact minimiser by conjugate gradient on JVP/VJP products (for tests, for
  the influence formula, and whenever the data fit).

Influence (multiclass, sign corrected; docs/decisions/ntk.md, "LQF"): removing sample i and retraining (mean loss over
the N−1 others) changes the test prediction by

    Δf(x_t) = f_{w*}(x_t) − f_{w*_{−i}}(x_t) = −J_t H_{−i}⁻¹ (J_iᵀ r_i + λ w*)/(N − 1),
    H_{−i} = (1/(N−1)) Σ_{j≠i} J_jᵀ J_j + λI,   r_i = f_{w*}(x_i) − α·onehot(y_i)

(derived from one Newton step on L_{−i} at w*, exact because L_{−i} is quadratic, using ∇L(w*) = 0). With
e_i = (αy_i − f(x_i))/N this is J_t H_{−i}⁻¹ J_iᵀ e_i · N/(N−1) − the λ term, i.e. the thesis's eq. 5.8 has
the right sign for Δf and eq. 5.7 (w*_{−i} = w* + H⁻¹ g e) has the wrong one; the thesis also drops the
λw* term, which vanishes only without weight decay. ``inverse='cg'`` solves with H_{−i} matrix-free (exact);
``inverse='kfac'`` is the thesis's route: A = (N/(N−1))F + λI with F ≈ K-FAC, and the rank-c downdate by
Woodbury, H_{−i}⁻¹ = A⁻¹ + A⁻¹J_iᵀ((N−1)I_c − J_i A⁻¹ J_iᵀ)⁻¹ J_i A⁻¹ (exact when K-FAC is, e.g. one
linear layer; the printed (N−1)I + α_i is the formula for *adding* a sample).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.curvature.kfac import KFACFactor, KFACPreconditioner, compute_kfac, kfac_layers, param_name
from scrubnet.curvature.solvers import SolveInfo, conjugate_gradient
from scrubnet.models.call import call_model
from scrubnet.models.linearized import LinearizedModel


@dataclass
class LQFConfig:
    """LQF hyperparameters. ``target_scale`` = s of the MSE target s·onehot(y) (15, the paper's); ``wd`` = the
    decay coefficient λ of (λ/2)‖w − w0‖²; ``kfac_damping`` defaults to ``wd``."""

    target_scale: float = 15.0
    wd: float = 1e-4
    lr: float = 0.1
    momentum: float = 0.9
    epochs: int = 20
    batch_size: int = 128
    optimizer: str = "kfac"
    kfac_damping: float | None = None
    leaky_slope: float | None = 0.01
    linearize: list[str] | None = None
    chunk: int = 2048

    def __post_init__(self):
        if self.optimizer not in ("kfac", "sgd", "adam"):
            raise ValueError(f"optimizer must be 'kfac', 'sgd' or 'adam', got {self.optimizer!r}")
        if not self.wd > 0:
            raise ValueError(f"wd (λ) must be positive, got {self.wd}")
        if self.target_scale <= 0:
            raise ValueError(f"target_scale must be positive, got {self.target_scale}")


def lqf_model(start: nn.Module, cfg: LQFConfig) -> LinearizedModel:
    """The linearised model around ``start`` (w0), Δw = 0."""
    return LinearizedModel(start, prefixes=cfg.linearize, leaky_slope=cfg.leaky_slope)


def lqf_loss(model: LinearizedModel, x: Tensor, y: Tensor, cfg: LQFConfig, num_classes: int) -> Tensor:
    """L on a batch (differentiable w.r.t. Δw)."""
    out = call_model(model, x)
    target = cfg.target_scale * F.one_hot(y, num_classes).to(out.dtype)
    reg = sum((d ** 2).sum() for d in model.delta)
    return 0.5 * ((out - target) ** 2).sum() / len(y) + 0.5 * cfg.wd * reg


def kfac_for(model: LinearizedModel, x: Tensor, damping: float, scale: float = 1.0,
             max_samples: int | None = None) -> KFACPreconditioner | None:
    """(scale·G ⊗ A + damping·I)⁻¹ for the factorable linearised layers of ``model`` (MSE, at w0)."""
    lin = set(model.linearized_names)
    layers = [n for n, m in kfac_layers(model.base).items()
              if param_name(n, "weight") in lin and (m.bias is None or param_name(n, "bias") in lin)]
    if not layers:
        return None
    xs = x if max_samples is None else x[:max_samples]
    facs = compute_kfac(model.base, xs, loss="mse", layers=layers)
    if scale != 1.0:
        facs = {k: KFACFactor(f.module_name, f.has_bias, f.A * scale, f.G) for k, f in facs.items()}
    return KFACPreconditioner(facs, model.linearized_names, [d.shape for d in model.delta], damping)


class LQFDiverged(FloatingPointError):
    """LQF training reached a non-finite loss (the learning rate is too large for the quadratic)."""


def train_lqf(start: nn.Module, x: Tensor, y: Tensor, num_classes: int, cfg: LQFConfig, seed: int = 0,
              model: LinearizedModel | None = None) -> tuple[LinearizedModel, list[float]]:
    """Train Δw of the LQF model on (x, y); returns the model and the full training loss after each epoch.

    Raises
    ------
    LQFDiverged
        When the full training loss after an epoch is NaN or infinite (it never returns a NaN model).
    """
    model = lqf_model(start, cfg) if model is None else model
    params = list(model.delta)
    device = params[0].device
    g = torch.Generator(device=device).manual_seed(10_007 * seed + 6)
    precond = None
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
        if cfg.optimizer == "kfac":
            precond = kfac_for(model, x, cfg.wd if cfg.kfac_damping is None else cfg.kfac_damping)
    history = []
    n = len(y)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=g, device=device)
        for i in range(0, n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            loss = lqf_loss(model, x[idx], y[idx], cfg, num_classes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if precond is not None:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                pg = precond(flat)
                j = 0
                for p in params:
                    p.grad.copy_(pg[j:j + p.numel()].view_as(p))
                    j += p.numel()
            opt.step()
        history.append(full_loss(model, x, y, cfg, num_classes))
        if not math.isfinite(history[-1]):
            # a step too long for the quadratic's curvature: every later epoch would only carry the NaN on
            raise LQFDiverged(f"LQF training diverged at epoch {len(history)} (loss {history[-1]}) with "
                              f"lr = {cfg.lr:g} ({cfg.optimizer}); lower the learning rate")
    return model, history


@torch.no_grad()
def full_loss(model: LinearizedModel, x: Tensor, y: Tensor, cfg: LQFConfig, num_classes: int) -> float:
    total = 0.0
    for i in range(0, len(y), cfg.chunk):
        out = call_model(model, x[i:i + cfg.chunk])
        total += 0.5 * float(((out - cfg.target_scale * F.one_hot(y[i:i + cfg.chunk], num_classes).to(out.dtype)) ** 2).sum())
    return total / len(y) + 0.5 * cfg.wd * float(sum((d ** 2).sum() for d in model.delta))


class _Quadratic:
    """Matrix-free H = (1/N) Σ JᵀJ + λI and b = (1/N) Σ Jᵀ(α y − f0) of the LQF loss on (x, y)."""

    def __init__(self, model: LinearizedModel, x: Tensor, y: Tensor, cfg: LQFConfig, num_classes: int):
        self.model, self.x, self.y, self.cfg, self.c = model, x, y, cfg, num_classes

    def hvp(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for i in range(0, len(self.y), self.cfg.chunk):
            xb = self.x[i:i + self.cfg.chunk]
            out += self.model.vjp(xb, self.model.jvp(xb, v))
        return out / len(self.y) + self.cfg.wd * v

    def rhs(self) -> Tensor:
        b = torch.zeros(self.model.num_linearized, dtype=self.model.delta[0].dtype, device=self.model.delta[0].device)
        for i in range(0, len(self.y), self.cfg.chunk):
            xb, yb = self.x[i:i + self.cfg.chunk], self.y[i:i + self.cfg.chunk]
            with torch.no_grad():
                f0 = self.model.core_forward(xb)
            b += self.model.vjp(xb, self.cfg.target_scale * F.one_hot(yb, self.c).to(f0.dtype) - f0)
        return b / len(self.y)


def solve_lqf(start_or_model: nn.Module, x: Tensor, y: Tensor, num_classes: int, cfg: LQFConfig, *,
              tol: float = 1e-10, max_iter: int = 2000) -> tuple[LinearizedModel, SolveInfo]:
    """The exact LQF minimiser Δw* = H⁻¹ b by conjugate gradient (JVP/VJP products)."""
    model = start_or_model if isinstance(start_or_model, LinearizedModel) else lqf_model(start_or_model, cfg)
    model = copy.deepcopy(model)
    q = _Quadratic(model, x, y, cfg, num_classes)
    w, info = conjugate_gradient(q.hvp, q.rhs(), tol=tol, max_iter=max_iter)
    model.set_delta_flat(w)
    return model, info


@torch.no_grad()
def influence_on_prediction(model: LinearizedModel, x: Tensor, y: Tensor, i: int, x_test: Tensor,
                            cfg: LQFConfig, num_classes: int, *, inverse: str = "cg",
                            tol: float = 1e-10, max_iter: int = 2000) -> Tensor:
    """Δf(x_test) = f_{w*}(x_test) − f_{w*_{−i}}(x_test), shape (n_test, c), for the LQF model trained to
    its optimum w* on (x, y) (module docstring; exact with ``inverse='cg'``)."""
    n = len(y)
    if not 0 <= i < n:
        raise ValueError(f"sample index {i} out of range [0, {n})")
    if n < 2:
        raise ValueError("leave-one-out needs at least two training samples")
    if inverse not in ("cg", "kfac"):
        raise ValueError(f"inverse must be 'cg' or 'kfac', got {inverse!r}")
    w = model.delta_flat()
    xi = x[i:i + 1]
    f_i = call_model(model, xi)
    r_i = f_i - cfg.target_scale * F.one_hot(y[i:i + 1], num_classes).to(f_i.dtype)
    v = (model.vjp(xi, r_i) + cfg.wd * w) / (n - 1)
    if inverse == "cg":
        keep = torch.ones(n, dtype=torch.bool, device=x.device)
        keep[i] = False
        q = _Quadratic(model, x[keep], y[keep], cfg, num_classes)
        step, _ = conjugate_gradient(q.hvp, v, tol=tol, max_iter=max_iter)
    else:
        a_inv = kfac_for(model, x, damping=cfg.wd, scale=n / (n - 1))
        if a_inv is None:
            raise ValueError("no Linear/Conv layer is linearised: K-FAC cannot approximate the inverse")
        eye = torch.eye(num_classes, dtype=w.dtype, device=w.device)
        j_rows = torch.stack([model.vjp(xi, eye[k:k + 1]) for k in range(num_classes)])  # (c, p) = J_i
        b = torch.stack([a_inv(j_rows[k]) for k in range(num_classes)], dim=1)  # A⁻¹ J_iᵀ, (p, c)
        u = a_inv(v)
        m = (n - 1) * eye - j_rows @ b
        step = u + b @ torch.linalg.solve(m, j_rows @ u)
    return -model.jvp(x_test, step)
