"""The recipe's retain objective, streamed over D_r, and the stationarity check that runs before a curvature method.

The recipe (:class:`scrubnet.recipe.TrainingRecipe`) states what the model minimised; on the retain set

    L_r(w) = (1/N_r) Σ_{i∈D_r} ℓ(f_w(x_i), y_i) + (wd/2)·‖M ⊙ (w − c)‖²,

with M the mask of decayed parameters (those in the recipe's centre) and c the decay centre (``ctx.center(model)``: the given w_0,
or zeros for ordinary weight decay). Curvature methods (Newton, Fisher, NTK, LQF) are local: they assume w sits
near a minimum of L_r (up to the small gradient D_f contributes). :func:`stationarity` measures how far it is:

    g = ∇L_r(w),   H = G_r + wd·M   (Gauss–Newton of the data part plus the decay),
    Δ = ½ gᵀH⁻¹g   (the Newton decrement: what a Newton step expects to shed, by CG to a relative
                    residual of :data:`STATIONARITY_CG_TOL`, at most :data:`STATIONARITY_CG_MAX` steps),
    ratio = Δ / max(L_r(w), floor).

The CG iterates' ½gᵀδ_k rise monotonically toward Δ, so CG stops as soon as the ratio's lower bound passes
:data:`STATIONARITY_THRESHOLD`. An under-stated decay is cheap in loss (Δ small) but not in weight space, so a
second test reads the direction: implied_wd = −⟨g_data, M(w − c)⟩/‖M(w − c)‖² and its cosine; a stated wd > 0 is
refused when the data gradient is a decay's (cosine ≥ :data:`UNDERSTATED_ALIGNMENT`) of more than
:data:`DECAY_FACTOR` × wd. :func:`check_stationarity` refuses on either; the measurements that set the thresholds
(converged, over- and under-stated decay, unconverged, label smoothing, AdamW) are in docs/decisions/recipes.md.

Everything is a sum over chunks of the :class:`~scrubnet.data.stream.DataStream` divided by N_r: 1 + k passes
over D_r (one for L_r and g, one per CG step), memory one chunk's forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from scrubnet.curvature.ggn import GGNOperator, mean_loss_and_grad
from scrubnet.curvature.params import trainable_params
from scrubnet.curvature.solvers import cg_iterate
from scrubnet.data.stream import DataStream
from scrubnet.models.loss import LossSpec
from scrubnet.recipe import TrainingRecipe

#: refuse a curvature method when the Newton decrement exceeds this fraction of the objective
STATIONARITY_THRESHOLD = 0.25
#: CG steps at most for the decrement (each one pass over D_r), and the relative residual that ends CG
STATIONARITY_CG_MAX = 100
STATIONARITY_CG_TOL = 1e-2
#: an implied decay this many times above or below recipe.wd names the decay as the mistake
DECAY_FACTOR = 3.0
#: refuse a stated wd > 0 when the data gradient's cosine with −(w − c) is at least this and the decay it
#: balances exceeds DECAY_FACTOR × wd (docs/decisions/recipes.md: ≥ 0.98 for an under-stated decay, ≤ 0.69 right)
UNDERSTATED_ALIGNMENT = 0.9
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


def stream_loss_and_grad(model: nn.Module, data: DataStream, *, loss: str | LossSpec, batch_size: int = 512
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


def stream_ggn_matvec(model: nn.Module, data: DataStream, v: Tensor, *, loss: str | LossSpec,
                      batch_size: int = 512) -> Tensor:
    """G_r v over the stream: Σ_chunks N_c·(G_c v) / N."""
    out, n = torch.zeros_like(v), 0
    for x, _ in data.chunks():
        out += GGNOperator(model, x, loss=loss, batch_size=batch_size).matvec(v) * len(x)
        n += len(x)
    return out / max(n, 1)


@dataclass
class Stationarity:
    """What :func:`stationarity` measured.

    objective, data_loss: L_r and its data part (nats); grad_norm, data_grad_norm, pull_grad_norm: ‖g‖, ‖g_data‖,
    ‖wd·M(w − c)‖; decrement: ½gᵀδ with δ the CG solution of Hδ = g (the Newton decrement, a lower bound when
    ``converged`` is False); ratio = decrement / max(L_r, floor); balance = ‖g‖ / (‖g_data‖ + ‖wd·M(w − c)‖);
    implied_wd = −⟨g_data, M(w − c)⟩ / ‖M(w − c)‖² (the decay that would best balance the data gradient) and
    alignment = its cosine −⟨g_data, M(w − c)⟩ / (‖g_data‖·‖M(w − c)‖) (≈ 1 when the data gradient is a decay's);
    cg_steps: CG steps (passes over D_r) spent.
    """

    objective: float
    data_loss: float
    grad_norm: float
    data_grad_norm: float
    pull_grad_norm: float
    decrement: float
    ratio: float
    balance: float
    implied_wd: float = float("nan")
    alignment: float = float("nan")
    cg_steps: int = 0
    converged: bool = True

    @property
    def cauchy_decrease(self) -> float:
        """The former name of :attr:`decrement`."""
        return self.decrement

    def as_dict(self, prefix: str = "stationarity_") -> dict[str, float]:
        """The fields as floats under ``prefix``."""
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


def newton_decrement(hvp, g: Tensor, *, scale: float, tol: float = STATIONARITY_CG_TOL,
                     max_iter: int = STATIONARITY_CG_MAX, refuse_above: float = STATIONARITY_THRESHOLD
                     ) -> tuple[float, int, bool]:
    """½gᵀH⁻¹g by CG on Hδ = g from δ = 0 (``hvp`` = v ↦ Hv, H positive semidefinite).

    The CG iterates' ½gᵀδ_k increase monotonically toward the decrement, so the loop also stops as soon as
    ½gᵀδ_k / ``scale`` exceeds ``refuse_above`` (the answer is then known: refuse).

    Returns
    -------
    (decrement, steps, converged): converged is True when ‖Hδ − g‖ ≤ tol·‖g‖ or the early stop fired.
    """
    g_norm = float(torch.linalg.vector_norm(g))
    if g_norm == 0.0:
        return 0.0, 0, True
    above = [False]

    def stop(st) -> bool:
        if 0.5 * float(g @ st.x) / scale > refuse_above:
            above[0] = True
            return True
        return float(torch.linalg.vector_norm(st.r)) <= tol * g_norm

    st = cg_iterate(hvp, g, stop, max_iter=max_iter)
    done = above[0] or float(torch.linalg.vector_norm(st.r)) <= tol * g_norm
    return 0.5 * float(g @ st.x), st.it, done


def stationarity(model: nn.Module, retain: DataStream, recipe: TrainingRecipe, w0: dict[str, Tensor] | None,
                 *, batch_size: int = 512, max_iter: int | None = None, early_stop: bool = True,
                 tol: float = STATIONARITY_CG_TOL) -> Stationarity:
    """Measure how far ``model`` is from a minimum of the recipe's retain objective (module docstring).

    Parameters
    ----------
    model : the trained model (not modified; evaluated in eval mode).
    retain : D_r as a stream.
    recipe : the stated objective (its :attr:`~TrainingRecipe.loss_spec` and ``wd``).
    w0 : the decay centre over the trainable parameters (``ctx.center(model)``); None = no decay mask.
    batch_size : samples per forward/backward.
    max_iter : CG steps at most (default :data:`STATIONARITY_CG_MAX`).
    tol : CG's relative residual at which the decrement is taken (default :data:`STATIONARITY_CG_TOL`).
    early_stop : stop CG once the ratio's lower bound exceeds :data:`STATIONARITY_THRESHOLD` (the verdict is
        known); False runs CG to its tolerance.

    Returns
    -------
    Stationarity
    """
    loss, wd = recipe.loss_spec, float(recipe.wd)
    w = torch.cat([p.detach().reshape(-1) for p in trainable_params(model).values()])
    mask, anchor = pull_mask_and_anchor(model, w0)
    pull = mask * (w - anchor)
    data_loss, g_data = stream_loss_and_grad(model, retain, loss=loss, batch_size=batch_size)
    g = g_data + wd * pull
    objective = data_loss + 0.5 * wd * float(pull @ pull)

    def hvp(v: Tensor) -> Tensor:
        return stream_ggn_matvec(model, retain, v, loss=loss, batch_size=batch_size) + wd * mask * v

    scale = max(objective, OBJECTIVE_FLOOR)
    decrement, steps, converged = newton_decrement(
        hvp, g, scale=scale, tol=tol, max_iter=STATIONARITY_CG_MAX if max_iter is None else int(max_iter),
        refuse_above=STATIONARITY_THRESHOLD if early_stop else float("inf"))
    pull_sq, gp = float(pull @ pull), -float(g_data @ pull)
    data_norm = float(torch.linalg.vector_norm(g_data))
    pull_norm = wd * pull_sq ** 0.5
    gn = float(torch.linalg.vector_norm(g))
    return Stationarity(objective, data_loss, gn, data_norm, pull_norm, decrement, decrement / scale,
                        gn / (data_norm + pull_norm) if data_norm + pull_norm > 0 else 0.0,
                        gp / pull_sq if pull_sq > 0 else float("nan"),
                        gp / (data_norm * pull_sq ** 0.5) if pull_sq > 0 and data_norm > 0 else float("nan"),
                        steps, converged)


def mismatch_message(st: Stationarity, recipe: TrainingRecipe, method: str) -> str:
    """The refusal, naming the likely mistake: the pull toward w_0, an over- or under-stated weight decay (AdamW's
    decoupled decay stated as recipe.wd among them), or an unconverged model."""
    head = (f"{method}: the model is far from a minimum of the recipe's objective {recipe.describe()} "
            f"(a Newton step could still lower it by {st.decrement:.3g} of {st.objective:.3g}, ratio "
            f"{st.ratio:.3g}, refused above {STATIONARITY_THRESHOLD}); ")
    if recipe.wd > 0 and not recipe.center_is_zero and st.pull_grad_norm >= 0.5 * st.data_grad_norm:
        why = ("the pull toward w_0 is not balanced by the data: was the model trained with this pull? for ordinary "
               "weight decay set recipe.wd_center to None (TOML: wd_center = \"zero\"), or give the true start")
    elif decay_understated(st, recipe):
        why = (f"the data gradient balances a weight decay of about {st.implied_wd:.3g}, stronger than recipe.wd = "
               f"{recipe.wd:g}: state the coefficient the model was trained with (a model trained with AdamW's "
               f"decoupled decay: TrainingRecipe.from_adamw(model, optimizer), not recipe.wd = its weight_decay)")
    elif recipe.wd > 0 and st.implied_wd < recipe.wd / DECAY_FACTOR and st.pull_grad_norm >= 0.5 * st.data_grad_norm:
        why = (f"the weight decay is not balanced by the data (the data gradient balances about "
               f"{max(st.implied_wd, 0.0):.3g}, recipe.wd = {recipe.wd:g}): was the model trained with this "
               f"coefficient? (AdamW: TrainingRecipe.from_adamw(model, optimizer))")
    else:
        why = ("the data gradient is large: is the model trained to convergence on this data (D_r ∪ D_f), with "
               f"this loss ({recipe.loss_spec.describe()}) and this weight decay (the data gradient balances about "
               f"{st.implied_wd:.3g}, recipe.wd = {recipe.wd:g})?")
    return head + why + "; " + INSTEAD + "; pass force=True to scrub anyway"


#: what a refused curvature method's message says to do instead (docs/guides/own-model.md, "Where the curvature
#: methods serve")
INSTEAD = ("the curvature methods serve models at a minimum of the stated objective (scrubnet's protocol, "
           "ML-Forgetting, a convex head on fixed features); for this model tune the fine-tuning methods on it "
           "against your own retraining (scrubnet tune / scrubnet.tuning.tune.tune, then method \"auto\") or train "
           "it forgettable (docs/guides/own-model.md)")


def decay_understated(st: Stationarity, recipe: TrainingRecipe) -> bool:
    """True when the data gradient is a decay's (alignment ≥ :data:`UNDERSTATED_ALIGNMENT`) with a coefficient
    above :data:`DECAY_FACTOR` × the stated wd > 0: the model was trained with a stronger decay than stated (an
    under-statement costs the Newton decrement little — the decay's direction is cheap in loss — but moves the
    step far in weight space)."""
    return recipe.wd > 0 and st.alignment >= UNDERSTATED_ALIGNMENT and st.implied_wd > DECAY_FACTOR * recipe.wd


def check_stationarity(model: nn.Module, retain: DataStream, recipe: TrainingRecipe, w0, *, method: str,
                       batch_size: int = 512) -> Stationarity:
    """:func:`stationarity`, raising :class:`RecipeMismatch` when ``ratio`` > :data:`STATIONARITY_THRESHOLD` or the
    stated decay is under-stated (:func:`decay_understated`).

    Parameters
    ----------
    model, retain, recipe, w0, batch_size : as :func:`stationarity`.
    method : the method's name, for the message.

    Returns
    -------
    Stationarity
    """
    st = stationarity(model, retain, recipe, w0, batch_size=batch_size)
    if not st.ratio <= STATIONARITY_THRESHOLD or decay_understated(st, recipe):
        raise RecipeMismatch(mismatch_message(st, recipe, method))
    return st
