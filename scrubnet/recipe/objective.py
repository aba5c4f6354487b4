"""The recipe's retain objective, streamed over D_r, and the stationarity check that runs before a curvature method.

The recipe (:class:`scrubnet.recipe.TrainingRecipe`) states what the model minimised; on the retain set

    L_r(w) = (1/N_r) Σ_{i∈D_r} ℓ(f_w(x_i), y_i) + (wd/2)·‖M ⊙ (w − c)‖²,

with M the mask of decayed parameters (those in the recipe's centre) and c the decay centre (``ctx.center(model)``: the given w_0,
or zeros for ordinary weight decay). Curvature methods (Newton, Fisher, NTK, LQF) are local: they assume w sits
near a minimum of L_r (up to the small gradient D_f contributes). :func:`stationarity` measures how far it is:

    g = ∇L_r(w),   H = G_r + wd·M   (Gauss–Newton of the data part plus the decay),
    Δ = ½ gᵀδ_k,  δ_k = k steps of CG on H δ = g from 0   (the decrease of the quadratic model of L_r
                                                           reachable in the first k Krylov directions),
    ratio = Δ / max(L_r(w), floor).

Δ grows with k from the Cauchy decrease ‖g‖⁴/(2gᵀHg) (k = 1) toward the Newton decrement ½gᵀH⁻¹g — what a
Newton step expects to shed; k = :data:`STATIONARITY_CG_STEPS`. At a minimum Δ ≈ 0,
while a model trained without the pull the recipe claims (w_0 = its random initialisation) can shed almost the
whole pull term, ratio ≈ 1. :func:`check_stationarity` refuses when ``ratio`` exceeds
:data:`STATIONARITY_THRESHOLD` (the measurement that set it is in docs/decisions/own-model.md, "Stationarity check").

Everything is a sum over chunks of the :class:`~scrubnet.data.stream.DataStream` divided by N_r: 1 + k passes
over D_r (one for L_r and g, one per CG step), memory one chunk's forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from scrubnet.curvature.ggn import GGNOperator, mean_loss_and_grad
from scrubnet.curvature.params import trainable_params
from scrubnet.curvature.solvers import conjugate_gradient
from scrubnet.data.stream import DataStream
from scrubnet.recipe import TrainingRecipe

#: refuse a curvature method when the Cauchy decrease left exceeds this fraction of the objective
STATIONARITY_THRESHOLD = 0.25
#: CG steps of the decrease estimate (each one pass over D_r)
STATIONARITY_CG_STEPS = 5
#: the objective's floor (nats) in the ratio, so a model at near-zero loss is judged on an absolute scale
OBJECTIVE_FLOOR = 0.1


class RecipeMismatch(ValueError):
    """The model is far from a minimum of what the recipe says it minimised."""


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


def stream_loss_and_grad(model: nn.Module, data: DataStream, *, loss: str, batch_size: int = 512
                         ) -> tuple[float, Tensor]:
    """(mean ℓ, its flat gradient) over the stream: Σ_chunks N_c·(mean, grad)_c / N (eval mode)."""
    total, grad, n = 0.0, None, 0
    for x, y in data.chunks():
        lc, gc = mean_loss_and_grad(model, x, y, loss=loss, batch_size=batch_size)
        total += lc * len(y)
        grad = gc * len(y) if grad is None else grad + gc * len(y)
        n += len(y)
    if n == 0:
        raise ValueError("the retain set is empty")
    return total / n, grad / n


def stream_ggn_matvec(model: nn.Module, data: DataStream, v: Tensor, *, loss: str, batch_size: int = 512) -> Tensor:
    """G_r v over the stream: Σ_chunks N_c·(G_c v) / N."""
    out, n = torch.zeros_like(v), 0
    for x, _ in data.chunks():
        out += GGNOperator(model, x, loss=loss, batch_size=batch_size).matvec(v) * len(x)
        n += len(x)
    return out / max(n, 1)


@dataclass
class Stationarity:
    """What :func:`stationarity` measured: objective L_r, its data part, ‖g‖, ‖g_data‖, ‖wd·M(w − c)‖, the decrease Δ
    of the quadratic model, ratio = Δ / max(L_r, floor) and balance = ‖g‖ / (‖g_data‖ + ‖wd·M(w − c)‖)
    (≈ 0 when the two parts cancel, 1 when one of them dominates)."""

    objective: float
    data_loss: float
    grad_norm: float
    data_grad_norm: float
    pull_grad_norm: float
    cauchy_decrease: float
    ratio: float
    balance: float

    def as_dict(self, prefix: str = "stationarity_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


def stationarity(model: nn.Module, retain: DataStream, recipe: TrainingRecipe, w0: dict[str, Tensor] | None,
                 *, batch_size: int = 512, cg_steps: int = None) -> Stationarity:
    """Measure how far ``model`` is from a minimum of the recipe's retain objective (module docstring)."""
    if recipe.target_scale != 1.0:
        raise ValueError(f"the stationarity check measures ½‖f − onehot(y)‖²; a recipe target scale of "
                         f"{recipe.target_scale:g} is not supported (pass force=True to skip the check)")
    loss, wd = recipe.curvature_loss, float(recipe.wd)
    cg_steps = STATIONARITY_CG_STEPS if cg_steps is None else int(cg_steps)
    w = torch.cat([p.detach().reshape(-1) for p in trainable_params(model).values()])
    mask, anchor = pull_mask_and_anchor(model, w0)
    pull = mask * (w - anchor)
    data_loss, g_data = stream_loss_and_grad(model, retain, loss=loss, batch_size=batch_size)
    g = g_data + wd * pull
    objective = data_loss + 0.5 * wd * float(pull @ pull)
    gg = float(g @ g)

    def hvp(v: Tensor) -> Tensor:
        return stream_ggn_matvec(model, retain, v, loss=loss, batch_size=batch_size) + wd * mask * v

    # k CG steps on H δ = g from δ = 0: the quadratic model's decrease m(0) − m(δ_k) = ½ gᵀδ_k grows with k
    # toward the Newton decrement ½ gᵀH⁻¹g (k = 1 is the Cauchy point)
    delta, _ = conjugate_gradient(hvp, g, tol=1e-12, max_iter=cg_steps) if gg > 0 else (torch.zeros_like(g), None)
    decrease = 0.5 * float(g @ delta)
    pull_norm = wd * float(torch.linalg.vector_norm(pull))
    data_norm = float(torch.linalg.vector_norm(g_data))
    return Stationarity(objective, data_loss, gg ** 0.5, data_norm, pull_norm, decrease,
                        decrease / max(objective, OBJECTIVE_FLOOR),
                        gg ** 0.5 / (data_norm + pull_norm) if data_norm + pull_norm > 0 else 0.0)


def mismatch_message(st: Stationarity, recipe: TrainingRecipe, method: str) -> str:
    """The refusal, naming the likely mistake."""
    head = (f"{method}: the model is far from a minimum of the recipe's objective {recipe.describe()} "
            f"(a gradient step could still lower it by {st.cauchy_decrease:.3g} of {st.objective:.3g}, ratio "
            f"{st.ratio:.3g} > {STATIONARITY_THRESHOLD}); ")
    decay_suspect = recipe.wd > 0 and st.pull_grad_norm >= 0.5 * st.data_grad_norm
    if decay_suspect and recipe.pulls_to_start:
        why = ("the pull toward w_0 is not balanced by the data: was the model trained with this pull? for ordinary "
               "weight decay set recipe.wd_center to None (TOML: wd_center = \"zero\"), or give the true start")
    elif decay_suspect:
        why = ("the weight decay is not balanced by the data: is recipe.wd the coefficient the model was trained "
               "with, toward 0? (a pull toward a start needs recipe.wd_center)")
    else:
        why = ("the data gradient is large: is the model trained to convergence on this data (D_r ∪ D_f), with "
               f"this loss ({recipe.loss})?")
    return head + why + "; pass force=True to scrub anyway"


def check_stationarity(model: nn.Module, retain: DataStream, recipe: TrainingRecipe, w0, *, method: str,
                       batch_size: int = 512) -> Stationarity:
    """:func:`stationarity`, raising :class:`RecipeMismatch` when ``ratio`` > :data:`STATIONARITY_THRESHOLD`."""
    st = stationarity(model, retain, recipe, w0, batch_size=batch_size)
    if not st.ratio <= STATIONARITY_THRESHOLD:
        raise RecipeMismatch(mismatch_message(st, recipe, method))
    return st
