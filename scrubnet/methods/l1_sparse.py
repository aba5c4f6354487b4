"""ℓ1-sparse unlearning: fine-tune on D_r with an ℓ1 penalty whose weight decays linearly over the epochs
(Jia et al., "Model Sparsity Can Simplify Machine Unlearning").

Epoch e (0-based, of E) minimises, batch by batch, CE(batch of D_r) + γ_e·‖w‖₁ with γ_e = γ·(1 − e/E) over
every trainable parameter, so its gradient adds γ_e·sign(w). Defaults and sources: docs/decisions/field-methods.md
("ℓ1-sparse").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.methods._field import (RELEASED_BATCH, Option, SGDFieldMethod, guarded_epochs, set_sgd, sgd_options,
                                     sgd_start, step, stream_batches, train_cost, train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models.call import call_model


def l1_weight(gamma: float, epoch: int, epochs: int) -> float:
    """The penalty's weight in one epoch.

    Parameters
    ----------
    gamma : float
        γ, the weight of the first epoch.
    epoch, epochs : int
        e (0-based) and E.

    Returns
    -------
    float
        γ_e = γ·(1 − e/E).
    """
    return gamma * (1.0 - epoch / epochs)


def l1_norm(model: nn.Module) -> Tensor:
    """‖w‖₁ of ``model``.

    Returns
    -------
    Tensor, scalar
        The sum of |w| over the trainable parameters (differentiable).
    """
    return sum(p.abs().sum() for p in model.parameters() if p.requires_grad)


@register("l1-sparse")
class L1Sparse(SGDFieldMethod):
    """ℓ1-sparse fine-tuning on D_r (module docstring). Streams D_r.

    Parameters
    ----------
    gamma : float
        ℓ1 weight at the first epoch (default 5e-5), decaying linearly to γ/E in the last.
    epochs : int
        Passes over D_r (default 10).
    lr, momentum, weight_decay : float
        SGD step size, momentum and decay coefficient (defaults 0.01, 0.9, 5e-4).
    batch_size : int or None
        Retain samples per SGD step (default 256, the released `--batch_size`; None: the recipe's).

    Returns
    -------
    ScrubResult
        The sparsified model (eval mode); ``info["l1_norm_after"]`` is ‖w‖₁ of its weights.
        When the training diverged (a non-finite loss): ``ok`` False with the reason.
    """

    options = {"gamma": Option(float, ">= 0", default=5e-5), **sgd_options(lr=0.01)}

    def __init__(self, gamma: float = 5e-5, epochs: int = 10, lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 5e-4, batch_size: int | None = RELEASED_BATCH):
        if not float(gamma) >= 0:
            raise ValueError(f"gamma must be ≥ 0, got {gamma!r}")
        self.gamma = float(gamma)
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 302)

        def epoch(e):
            gamma_e = l1_weight(self.gamma, e, self.epochs)
            train_mode(model, ctx)
            for xr, yr in stream_batches(retain, bs, g, dev):
                step(opt, F.cross_entropy(call_model(model, xr), yr) + gamma_e * l1_norm(model))

        failed = guarded_epochs(model, self.epochs, epoch, "l1-sparse")
        with torch.no_grad():
            l1 = float(l1_norm(model))
        res = ScrubResult(model.eval(), info={"l1_norm_after": l1})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = RELEASED_BATCH,
             **_options):
        """ℓ1-sparse: ``epochs`` passes over D_r (the penalty is O(p) per step)."""
        return train_cost(model, x1, n_r, int(epochs), int(batch_size or config.batch_size))

