"""NegGrad+: descend β·L(D_r) − (1−β)·L(D_f) jointly (Kurmanji et al., "Towards Unbounded Machine Unlearning").

As Kurmanji's released code (meghdadk/SCRUB, ``run_neggrad_epoch``) runs it: every step pairs a batch of D_r with
the next batch of D_f and takes one plain SGD step (no momentum, no optimiser decay) on

    β·(CE(retain batch) + (wd/2)·‖w − w_0‖²) − (1−β)·CE(forget batch),

w_0 the weights the scrub starts from (the release's ``l2_penalty(model, model_init, weight_decay)``, wd 0.1: the
notebook's ``--weight-decay``). An epoch is one pass over D_r in batches of 128; D_f comes in batches of 64 from
a loader that ``itertools.cycle`` replays, so within an epoch the first pass's D_f batches repeat in the same order
(a new shuffle each epoch). The release trains in eval mode (``model.eval()``: BatchNorm's running statistics,
no dropout). scrubnet's former choices are options: ``init_decay=0`` (no proximal term),
``forget_order="reshuffle"`` (a new permutation of D_f at every pass), ``mode="train"``. Sources:
docs/decisions/field-methods.md ("NegGrad+").
"""
from __future__ import annotations

from torch import Tensor, nn
import torch.nn.functional as F

from scrubnet.methods._field import (Option, SGDFieldMethod, check_positive, forget_in_memory, guarded_epochs,
                                     set_sgd, sgd_options, sgd_start, step, stream_batches, tensor_batches, train_cost,
                                     train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models.call import call_model


def proximal(model: nn.Module, init: dict[str, Tensor]) -> Tensor:
    """‖w − w_0‖² over the trainable parameters (``init``: w_0 by parameter name), scalar, differentiable."""
    return sum(((p - init[k]) ** 2).sum() for k, p in model.named_parameters() if p.requires_grad)


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
    """Batches of in-memory (x, y) without end: reshuffled at every pass (``repeat`` False), or the first pass's
    batches replayed in the same order (``repeat`` True: ``itertools.cycle`` over a shuffled loader)."""

    def __init__(self, x, y: Tensor, batch_size: int, g, repeat: bool = False):
        self.x, self.y, self.batch_size, self.g, self.repeat = x, y, batch_size, g, repeat
        self.it, self.first = iter(()), None

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            if self.repeat and self.first is not None:
                self.it = iter(self.first)
            else:
                batches = tensor_batches(self.x, self.y, self.batch_size, self.g)
                if self.repeat:
                    self.first = list(batches)
                    batches = iter(self.first)
                self.it = batches
            return next(self.it)


#: the orders D_f's batches come in (see :class:`_Cycle`)
FORGET_ORDERS = ("cycle", "reshuffle")
#: the modes the steps run in
MODES = ("eval", "train")


@register("neggrad-plus")
class NegGradPlus(SGDFieldMethod):
    """NegGrad+ (module docstring).

    Parameters
    ----------
    beta : float in (0, 1)
        Weight of the retain loss (and of the proximal term); the forget loss gets −(1 − β). Default 0.95.
    init_decay : float
        wd of the proximal term (wd/2)·‖w − w_0‖² (default 0.1, the release's; 0: scrubnet's former loss).
    epochs : int
        Passes over D_r (default 10).
    lr, momentum, weight_decay : float
        SGD settings (defaults 0.01, 0 and 0: plain SGD, as released).
    batch_size : int or None
        Retain samples per step (default 128, the release's; None: the recipe's).
    forget_batch : int or None
        Forget samples per step (default 64, the release's; None: ``batch_size``'s value).
    forget_order : {"cycle", "reshuffle"}
        D_f's batches within an epoch: the first pass's replayed (default, the release's ``itertools.cycle``) or
        reshuffled at every pass.
    mode : {"eval", "train"}
        The mode the steps run in (default "eval", as released; "train": with BatchNorm frozen when the recipe
        froze it).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info["neggrad_plus_steps"]`` is the number of SGD
        steps taken. When the training diverged (a non-finite loss): ``ok`` False with the reason.
    """

    options = {"beta": Option(float, "(0, 1)", default=0.95), "init_decay": Option(float, ">= 0", default=0.1),
               **sgd_options(lr=0.01, batch=128),
               "momentum": Option(float, "[0, 1)", default=0.0), "weight_decay": Option(float, ">= 0", default=0.0),
               "forget_batch": Option(int | None, ">= 1", default=64),
               "forget_order": Option(str, None, default="cycle", choices=FORGET_ORDERS),
               "mode": Option(str, None, default="eval", choices=MODES)}

    def __init__(self, beta: float = 0.95, epochs: int = 10, lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, batch_size: int | None = 128, init_decay: float = 0.1,
                 forget_batch: int | None = 64, forget_order: str = "cycle", mode: str = "eval"):
        if not 0.0 < float(beta) < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta!r}")
        if not float(init_decay) >= 0:
            raise ValueError(f"init_decay must be ≥ 0, got {init_decay!r}")
        if forget_order not in FORGET_ORDERS:
            raise ValueError(f"forget_order must be one of {', '.join(FORGET_ORDERS)}, got {forget_order!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.beta, self.init_decay = float(beta), float(init_decay)
        self.forget_batch = None if forget_batch is None else int(forget_batch)
        self.forget_order, self.mode = forget_order, mode
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)
        check_positive(forget_batch=self.forget_batch)

    def scrub(self, model, retain, forget, ctx):
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 301)
        xf, yf = forget_in_memory(forget, dev)
        init = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
        fb = self.forget_batch or bs
        repeat = self.forget_order == "cycle"
        carried = _Cycle(xf, yf, fb, g)     # "reshuffle": one endless stream across the epochs
        steps = [0]

        def epoch(_):
            if self.mode == "eval":
                model.eval()
            else:
                train_mode(model, ctx)
            # one shuffle of D_f per epoch, replayed (the release's cycle), or reshuffled at every pass
            cycle = _Cycle(xf, yf, fb, g, repeat=True) if repeat else carried
            for xr, yr in stream_batches(retain, bs, g, dev):
                xb, yb = cycle.next()
                loss = neggrad_plus_loss(model, xr, yr, xb, yb, self.beta)
                if self.init_decay:
                    loss = loss + self.beta * (self.init_decay / 2) * proximal(model, init)
                step(opt, loss)
                steps[0] += 1

        failed = guarded_epochs(model, self.epochs, epoch, "NegGrad+")
        res = ScrubResult(model.eval(), info={"neggrad_plus_steps": float(steps[0])})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = 128,
             forget_batch: int | None = 64, **_options):
        """NegGrad+: ``epochs`` passes over D_r, each of its ⌈N_r/B⌉ steps also a forget batch of min(B_f, N_f)
        samples (the optimiser-step overhead is counted per B samples of either set: an upper bound)."""
        bs = int(batch_size or config.batch_size)
        fb = int(forget_batch or bs)
        return train_cost(model, x1, n_r + -(-n_r // bs) * min(fb, n_f), int(epochs), bs)

