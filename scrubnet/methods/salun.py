"""SalUn: saliency-masked random-label unlearning (Fan et al., "SalUn: Empowering Machine Unlearning via
Gradient-based Weight Saliency").

1. Saliency: g = ∇_w L(D_f) at the original (mean cross-entropy over D_f, eval mode, one gradient); the mask m
   marks the ``fraction`` of trainable weights with the largest |g| (exactly ⌊fraction·p⌋ entries, the release's
   ``int(p·fraction)``, ranked over all parameters together).
2. Random labels restricted to the mask, as the released loop (OPTML-Group Unlearn-Saliency ``RL``) runs them:
   every epoch, first a pass over D_f whose labels are drawn uniformly over the c classes *afresh for every
   batch*, then a pass over D_r with its own labels; every step masks the loss gradient (g ← m ⊙ ∇L) before the
   SGD step. The current release (2026) then puts every weight outside the mask back to its value at the start
   and zeroes its momentum: nothing outside the mask moves. That is ``masked_decay=True`` (the default), taken
   here as g ← m ⊙ (∇L + wd·w) with the optimiser carrying no decay: inside the mask m = 1 and the step is the
   release's; outside it the gradient and the momentum stay 0. ``masked_decay=False`` is the 2024 release (the
   optimiser's decay on every weight, so weights outside the mask shrink toward 0).

Defaults (lr 0.013: the current README's command; batch 256) and sources: docs/decisions/field-methods.md
("SalUn").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.methods._field import (RELEASED_BATCH, Option, SGDFieldMethod, forget_in_memory, guarded_epochs,
                                     set_sgd, sgd_options, sgd_start, step, stream_batches, tensor_batches,
                                     train_cost, train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model


def forget_gradient(model: nn.Module, x, y: Tensor, batch_size: int = 256) -> dict[str, Tensor]:
    """The gradient SalUn's saliency is taken from.

    Parameters
    ----------
    model : nn.Module
        Evaluated in eval mode (its mode is restored).
    x, y : inputs (N, ...) and int64 labels (N,)
        D_f, read ``batch_size`` samples at a time.

    Returns
    -------
    dict of str to Tensor
        ∇_w of the mean cross-entropy over the N samples, one tensor shaped like each trainable parameter.
    """
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    acc = {k: torch.zeros_like(p) for k, p in params.items()}
    with eval_mode(model), torch.enable_grad():
        for i in range(0, len(y), batch_size):
            loss = F.cross_entropy(call_model(model, x[i:i + batch_size]), y[i:i + batch_size], reduction="sum")
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for k, gr in zip(params, grads):
                if gr is not None:
                    acc[k] += gr
    return {k: v / len(y) for k, v in acc.items()}


def saliency_mask(grads: dict[str, Tensor], fraction: float) -> dict[str, Tensor]:
    """SalUn's weight-saliency mask.

    Parameters
    ----------
    grads : dict of str to Tensor
        The forget-loss gradient, one tensor per parameter (p entries in all).
    fraction : float in (0, 1]

    Returns
    -------
    dict of str to Tensor (bool)
        Masks shaped like each gradient, True on exactly ⌊fraction·p⌋ entries (the release's ``int(p·fraction)``):
        those with the largest |g|, ranked over all tensors together (ties broken by position).
    """
    names = list(grads)
    flat = torch.cat([grads[k].detach().abs().reshape(-1) for k in names])
    k = int(fraction * flat.numel())
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        keep[torch.topk(flat, k, sorted=False).indices] = True
    out, at = {}, 0
    for name in names:
        n = grads[name].numel()
        out[name] = keep[at:at + n].reshape(grads[name].shape)
        at += n
    return out


@register("salun")
class SalUn(SGDFieldMethod):
    """SalUn (module docstring). Streams D_r.

    Parameters
    ----------
    fraction : float in (0, 1]
        Share of the weights in the saliency mask (default 0.5).
    epochs : int
        Epochs, each a pass over D_f then one over D_r (default 10).
    lr, momentum, weight_decay : float
        SGD settings (defaults 0.013, 0.9, 5e-4).
    batch_size : int or None
        Samples per batch (default 256, the released `--batch_size`; None: the recipe's).
    masked_decay : bool
        Nothing outside the mask moves, the decay included (default True: the current release, which puts the
        weights outside the mask back after every step); False: the 2024 release's decay on every weight.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info``: ``salun_mask_fraction`` (share of the
        weights the mask let train) and ``salun_labels_changed`` (fraction of the D_f labels drawn over all
        epochs that differ from the true one). When the training diverged (a non-finite loss): ``ok`` False with
        the reason.
    """

    options = {"fraction": Option(float, "(0, 1]", default=0.5), **sgd_options(lr=0.013),
               "masked_decay": Option(bool, None, default=True)}

    def __init__(self, fraction: float = 0.5, epochs: int = 10, lr: float = 0.013, momentum: float = 0.9,
                 weight_decay: float = 5e-4, batch_size: int | None = RELEASED_BATCH, masked_decay: bool = True):
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.fraction, self.masked_decay = float(fraction), bool(masked_decay)
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        # masked_decay: the decay is added to the gradient before masking, so the optimiser carries none
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 303, decay=not self.masked_decay)
        xf, yf = forget_in_memory(forget, dev)
        mask = saliency_mask(forget_gradient(model, xf, yf), self.fraction)
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        decay = self.weight_decay if self.masked_decay else 0.0
        changed = [0, 0]

        @torch.no_grad()
        def masked():   # g ← m ⊙ (∇L + wd·w) (masked_decay, the current release), or m ⊙ ∇L (2024)
            for k, p in params.items():
                gr = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = (gr + decay * p) * mask[k]

        def epoch(_):
            train_mode(model, ctx)
            for xb, yb in tensor_batches(xf, yf, bs, g):    # D_f, labels redrawn for every batch
                y_rand = torch.randint(ctx.num_classes, (len(yb),), generator=g, device=g.device).to(dev)
                changed[0] += int((y_rand != yb).sum())
                changed[1] += len(yb)
                step(opt, F.cross_entropy(call_model(model, xb), y_rand), masked)
            for xb, yb in stream_batches(retain, bs, g, dev):
                step(opt, F.cross_entropy(call_model(model, xb), yb), masked)

        failed = guarded_epochs(model, self.epochs, epoch, "SalUn")
        kept = sum(int(m.sum()) for m in mask.values())
        res = ScrubResult(model.eval(), info={"salun_mask_fraction": kept / sum(m.numel() for m in mask.values()),
                                              "salun_labels_changed": changed[0] / max(changed[1], 1)})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = RELEASED_BATCH,
             **_options):
        """SalUn: one gradient over D_f (a training pass) and ``epochs`` passes over D_r ⊔ D_f."""
        bs = int(batch_size or config.batch_size)
        est = train_cost(model, x1, n_r + n_f, int(epochs), bs)
        extra = train_cost(model, x1, max(n_f, 1), 1, bs)
        est.flops += extra.flops
        est.seconds += extra.seconds
        est.passes += n_f / max(n_r + n_f, 1)
        return est

