"""NegGrad+: descend β·L(D_r) − (1−β)·L(D_f) jointly (Kurmanji et al., "Towards Unbounded Machine Unlearning").

Every step pairs a batch of D_r with the next batch of D_f (D_f reshuffled whenever it runs out) and takes one
optimiser step on β·CE(retain batch) − (1−β)·CE(forget batch); an epoch is one pass over D_r. The defaults are
Kurmanji's released code (meghdadk/SCRUB): β = 0.95 and plain SGD (no momentum, no weight decay). Sources:
docs/decisions/field-methods.md ("NegGrad+").
"""
from __future__ import annotations

from torch import Tensor, nn
import torch.nn.functional as F

from scrubnet.methods._field import (Option, SGDFieldMethod, forget_in_memory, guarded_epochs, set_sgd, sgd_options,
                                     sgd_start, step, stream_batches, tensor_batches, train_cost, train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models.call import call_model


def neggrad_plus_loss(model: nn.Module, xr, yr: Tensor, xf, yf: Tensor, beta: float) -> Tensor:
    """The NegGrad+ objective of one pair of batches.

    Parameters
    ----------
    model : nn.Module
    xr, yr : inputs (B_r, ...) and int64 labels (B_r,)
        A batch of D_r.
    xf, yf : inputs (B_f, ...) and int64 labels (B_f,)
        A batch of D_f.
    beta : float in (0, 1)

    Returns
    -------
    Tensor, scalar (nats)
        β·CE(model(xr), yr) − (1−β)·CE(model(xf), yf), each CE a mean over its batch.
    """
    return beta * F.cross_entropy(call_model(model, xr), yr) - (1 - beta) * F.cross_entropy(call_model(model, xf), yf)


class _Cycle:
    """Batches of in-memory (x, y), reshuffled at every pass, without end."""

    def __init__(self, x, y: Tensor, batch_size: int, g):
        self.x, self.y, self.batch_size, self.g = x, y, batch_size, g
        self.it = iter(())

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = tensor_batches(self.x, self.y, self.batch_size, self.g)
            return next(self.it)


@register("neggrad-plus")
class NegGradPlus(SGDFieldMethod):
    """NegGrad+ (module docstring).

    Parameters
    ----------
    beta : float in (0, 1)
        Weight of the retain loss; the forget loss gets −(1 − β). Default 0.95 (the released code's).
    epochs : int
        Passes over D_r (default 10).
    lr, momentum, weight_decay : float
        SGD settings (defaults 0.01, 0 and 0: plain SGD, as released).
    batch_size : int or None
        Retain and forget batch size (default: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info["neggrad_plus_steps"]`` is the number of SGD
        steps taken. When the training diverged (a non-finite loss): ``ok`` False with the reason.
    """

    options = {"beta": Option(float, "(0, 1)", default=0.95), **sgd_options(lr=0.01),
               "momentum": Option(float, "[0, 1)", default=0.0), "weight_decay": Option(float, ">= 0", default=0.0)}

    def __init__(self, beta: float = 0.95, epochs: int = 10, lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, batch_size: int | None = None):
        if not 0.0 < float(beta) < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta!r}")
        self.beta = float(beta)
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 301)
        xf, yf = forget_in_memory(forget, dev)
        cycle = _Cycle(xf, yf, bs, g)
        steps = [0]

        def epoch(_):
            train_mode(model, ctx)
            for xr, yr in stream_batches(retain, bs, g, dev):
                xb, yb = cycle.next()
                step(opt, neggrad_plus_loss(model, xr, yr, xb, yb, self.beta))
                steps[0] += 1

        failed = guarded_epochs(model, self.epochs, epoch, "NegGrad+")
        res = ScrubResult(model.eval(), info={"neggrad_plus_steps": float(steps[0])})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = None, **_options):
        """NegGrad+: ``epochs`` passes over D_r, each of its ⌈N_r/B⌉ steps also a forget batch of min(B, N_f)
        samples (the optimiser-step overhead is counted per B samples of either set: an upper bound)."""
        bs = int(batch_size or config.batch_size)
        return train_cost(model, x1, n_r + -(-n_r // bs) * min(bs, n_f), int(epochs), bs)

