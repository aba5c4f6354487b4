"""Newton (quadratic) scrubbing, "Eternal Sunshine" Prop. 3 at t → ∞ and the noisy Newton update (2.8).

The retain objective is the fine-tuning loss restricted to D_r,

    L_r(w) = (1/N_r) Σ_{i∈D_r} ℓ(f_w(x_i), y_i) + (wd/2)·‖w − w_0‖²,

and the scrub is one Newton step on it,

    h(w) = w − H⁻¹ ∇L_r(w),   H = G_r + (wd + damping)·I,

with G_r the Gauss–Newton matrix of the mean loss on D_r (= true Fisher for cross-entropy; the PSD
Levenberg–Marquardt replacement of the Hessian, spec §A5), applied matrix-free (JVP + VJP, see
:mod:`scrubnet.curvature.ggn`) inside :func:`scrubnet.curvature.solvers.conjugate_gradient`. The gradient
includes the pull term wd·(w − w_0); parameters absent from ``ctx.w0`` get no pull. ``damping`` (default 0:
the pull already makes H positive definite), the CG ``tol`` and ``max_iter`` and what CG achieved are
reported in ``info``. For a model that is linear in w and ``loss="mse"`` (ℓ = ½‖f − onehot(y)‖²), L_r is
quadratic, G_r its exact Hessian, and h(w) is exactly the retrained model (to CG tolerance).

**Optimal noise (Prop. 4 with the λ of the correcting note):** Σ B Σ = λ Σ_h, so for Σ_h = σ_h² I the noise
covariance is Σ = √(λσ_h²)·B^{-1/2}. With ``alpha`` = λσ_h² (the same knob as Fisher forgetting's paper form)
and B the diagonal of the retain objective's curvature at h(w), B = diag(F_r(h(w))) + wd (true-Fisher
diagonal plus the pull; the pull keeps B > 0 where the data carry no curvature, so no clamp is needed):

    S(w) = h(w) + n,   n ~ N(0, diag(√alpha · B^{-1/2})).

``alpha = 0`` (default) gives the deterministic Newton step. With noise and the retrain reference known, the
same procedure is applied to the retrain model and ``info_weights_nats`` (and ``_code``) are reported.
Without noise the distributions are point masses and the bound is infinite; ``newton_dist_ratio`` =
‖h(w_o) − w_r‖ / ‖w_o − w_r‖ is reported instead (< 1: the step moved toward the retrain model).

Measured on the embedded default (MLP on MNIST-1D, wd 0.03, 3 seeds, ``scrubnet run``): CG converges to
tol 1e-5 in 61 ± 2 iterations (≈ 2 s); the deterministic Newton scrub lands in the retrain band on the
forget-set readouts while keeping retain/test error (loss_forget 0.243 ± 0.031 vs retrain 0.194 ± 0.024 and
original 0.049; error_forget 13.3 % vs 8.0 % / 0 %; mia_forget 74.7 % vs 76.0 % / 98.7 %; re-learn time
100 = retrain's; error_retain 1.0 %, error_test 30.9 % vs original 31.1 %). In weight space it moves farther
from w_r (newton_dist_ratio ≈ 1.7): the step changes directions the retain data barely constrain, which the
readouts cannot see.
"""
from __future__ import annotations

import copy
import math
import time

import torch
from torch import Tensor, nn

from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.ggn import LOSSES, GGNOperator, mean_loss_and_grad
from scrubnet.curvature.params import get_flat, set_flat, trainable_params
from scrubnet.curvature.solvers import SolveInfo, conjugate_gradient
from scrubnet.methods.base import ForgetContext, ForgettingMethod, ScrubResult, register
from scrubnet.methods.fisher import sample_gaussian_weights
from scrubnet.readouts.information import weight_information


def pull_mask_and_anchor(model: nn.Module, w0: dict[str, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Flat (mask, w_0): mask = 1 on parameters present in ``w0`` (they feel the L2 pull), else 0."""
    masks, anchors = [], []
    for name, p in trainable_params(model).items():
        if w0 is not None and name in w0:
            if w0[name].shape != p.shape:
                raise ValueError(f"w0[{name!r}] has shape {tuple(w0[name].shape)}, parameter {tuple(p.shape)}")
            masks.append(torch.ones(p.numel(), dtype=p.dtype, device=p.device))
            anchors.append(w0[name].detach().reshape(-1).to(p.device, p.dtype))
        else:
            masks.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
            anchors.append(p.detach().reshape(-1))
    return torch.cat(masks), torch.cat(anchors)


def newton_step(model: nn.Module, retain, *, w0: dict[str, Tensor] | None, wd: float, loss: str = "ce",
                damping: float = 0.0, tol: float = 1e-6, max_iter: int = 500, batch_size: int = 512
                ) -> tuple[nn.Module, SolveInfo, dict[str, float]]:
    """h(w) = w − (G_r + (wd + damping)·I)⁻¹ (∇L_ℓ(w) + wd·(w − w_0)) on ``retain`` = (x, y), by CG.

    Returns (a new model at h(w), the CG :class:`SolveInfo`, diagnostics {grad norm, step norm, retain
    objective before/after}). ``model`` is not modified.
    """
    if wd < 0 or damping < 0:
        raise ValueError(f"wd and damping must be ≥ 0, got wd={wd}, damping={damping}")
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    x, y = retain
    if len(x) == 0:
        raise ValueError("the Newton scrub needs a non-empty retain set")
    w = get_flat(model)
    mask, anchor = pull_mask_and_anchor(model, w0)
    data_loss, g_data = mean_loss_and_grad(model, x, y, loss=loss, batch_size=batch_size)
    pull = mask * (w - anchor)
    grad = g_data + wd * pull
    obj_before = data_loss + 0.5 * wd * float(pull @ pull)
    ggn = GGNOperator(model, x, loss=loss, batch_size=batch_size)

    def hvp(v: Tensor) -> Tensor:
        return ggn.matvec(v) + wd * mask * v + damping * v

    delta, info = conjugate_gradient(hvp, grad, tol=tol, max_iter=max_iter)
    new = copy.deepcopy(model)
    set_flat(new, w - delta)
    new_loss, _ = mean_loss_and_grad(new, x, y, loss=loss, batch_size=batch_size)
    pull_new = mask * (w - delta - anchor)
    diag = {"grad_norm": float(torch.linalg.vector_norm(grad)), "step_norm": float(torch.linalg.vector_norm(delta)),
            "objective_before": obj_before, "objective_after": new_loss + 0.5 * wd * float(pull_new @ pull_new)}
    return new.eval(), info, diag


def newton_noise_variance(model: nn.Module, retain, *, alpha: float, wd: float, w0: dict[str, Tensor] | None,
                          batch_size: int | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Mean and variance of the Prop. 4 noise at ``model`` (= h(w)): μ = w, v = √alpha · B^{-1/2} with
    B = diag true Fisher on ``retain`` + wd (on pulled parameters)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    fisher = fisher_diag(model, retain[0], kind="true", batch_size=batch_size)
    mean, var = {}, {}
    for name, p in trainable_params(model).items():
        b = fisher[name].to(torch.float64) + (wd if (w0 is not None and name in w0) else 0.0)
        b = b.clamp_min(1e-12)  # unpulled parameter without curvature: finite (huge) noise instead of inf
        mean[name] = p.detach().clone()
        var[name] = (math.sqrt(alpha) * b.rsqrt()).to(p.dtype)
    return mean, var


@register("newton")
class NewtonScrub(ForgettingMethod):
    """Newton scrub h(w) = w − H⁻¹∇L_r(w) by matrix-free CG, optionally + the optimal noise (module docstring).

    Options: loss ("ce" | "mse"), wd (default: the fine-tuning wd of ``ctx.config``), damping, tol, max_iter,
    batch_size, alpha (noise scale λσ_h²; 0 = no noise), information (white-box bound when noisy).
    """

    def __init__(self, loss: str = "ce", wd: float | None = None, damping: float = 0.0, tol: float = 1e-5,
                 max_iter: int = 300, batch_size: int = 512, alpha: float = 0.0, information: bool = True):
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
        if alpha < 0 or damping < 0 or (wd is not None and wd < 0):
            raise ValueError("alpha, damping and wd must be ≥ 0")
        if tol <= 0 or max_iter < 1 or batch_size < 1:
            raise ValueError("tol must be > 0, max_iter and batch_size ≥ 1")
        self.loss, self.wd, self.damping, self.tol = loss, wd, float(damping), float(tol)
        self.max_iter, self.batch_size, self.alpha = int(max_iter), int(batch_size), float(alpha)
        self.information = bool(information)

    def _procedure(self, model: nn.Module, retain, ctx: ForgetContext, wd: float):
        """(h(w) model, CG info, diagnostics, noise mean, noise var or None)."""
        h, info, diag = newton_step(model, retain, w0=ctx.w0, wd=wd, loss=self.loss, damping=self.damping,
                                    tol=self.tol, max_iter=self.max_iter, batch_size=self.batch_size)
        if self.alpha > 0:
            mean, var = newton_noise_variance(h, retain, alpha=self.alpha, wd=wd, w0=ctx.w0)
            return h, info, diag, mean, var
        return h, info, diag, None, None

    def scrub(self, model: nn.Module, retain, forget, ctx: ForgetContext) -> ScrubResult:
        wd = float(ctx.config.wd if self.wd is None else self.wd)
        t0 = time.perf_counter()
        h, cg, diag, mean, var = self._procedure(model, retain, ctx, wd)
        out = h
        if var is not None:
            gen = torch.Generator().manual_seed(10_007 * int(ctx.seed) + 37)
            out = sample_gaussian_weights(h, mean, var, gen)
        info: dict[str, float] = {
            "newton_seconds": time.perf_counter() - t0, "newton_wd": wd, "newton_damping": self.damping,
            "newton_tol": self.tol, "newton_max_iter": float(self.max_iter), "alpha": self.alpha,
            **cg.as_dict("newton_cg_"), **{f"newton_{k}": v for k, v in diag.items()}}
        if ctx.reference is not None:
            w_o, w_h, w_r = get_flat(model), get_flat(h), get_flat(ctx.reference)
            gap = float(torch.linalg.vector_norm(w_o - w_r))
            info["newton_dist_ratio"] = float(torch.linalg.vector_norm(w_h - w_r)) / gap if gap > 0 else 0.0
            if var is not None and self.information:
                t1 = time.perf_counter()
                _, _, _, mean_r, var_r = self._procedure(ctx.reference, retain, ctx, wd)
                info.update(weight_information(mean, var, mean_r, var_r))
                info["information_seconds"] = time.perf_counter() - t1
        return ScrubResult(model=out.eval(), info=info)
