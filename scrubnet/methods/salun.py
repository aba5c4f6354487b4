"""SalUn: saliency-masked random-label unlearning (Fan et al., "SalUn: Empowering Machine Unlearning via
Gradient-based Weight Saliency").

1. Saliency: g = ∇_w L(D_f) at the original (mean cross-entropy over D_f, eval mode, one gradient); the mask m
   marks the ``fraction`` of trainable weights with the largest |g| (exactly round(fraction·p) entries, ranked
   over all parameters together).
2. Random labels restricted to the mask: fine-tune on D_r ⊔ D_f with each D_f label drawn uniformly over the c
   classes, every step w ← SGD step with gradient m ⊙ (∇L + wd·w): the weight decay is inside the mask, so
   no weight outside it moves.

Defaults and sources: docs/decisions/field-methods.md ("SalUn").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.methods._field import (Option, SGDFieldMethod, forget_in_memory, guarded_epochs, mixed_batches,
                                     set_sgd, sgd_options, sgd_start, step, train_cost, train_mode)
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
        Masks shaped like each gradient, True on exactly round(fraction·p) entries: those with the largest |g|,
        ranked over all tensors together (ties broken by position).
    """
    names = list(grads)
    flat = torch.cat([grads[k].detach().abs().reshape(-1) for k in names])
    k = int(round(fraction * flat.numel()))
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
    """SalUn (module docstring). Streams D_r (an indexable source: its batches mix D_r and D_f).

    Parameters
    ----------
    fraction : float in (0, 1]
        Share of the weights in the saliency mask (default 0.5).
    epochs : int
        Passes over D_r ⊔ D_f (default 10).
    lr, momentum, weight_decay : float
        SGD settings (defaults 0.1, 0.9, 5e-4; the decay acts inside the mask only).
    batch_size : int or None
        Samples per batch (default: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info``: ``salun_mask_fraction`` (share of the
        weights the mask let train) and ``salun_labels_changed`` (fraction of D_f labels the random relabelling
        changed). When the training diverged (a non-finite loss): ``ok`` False with the reason.
    """

    options = {"fraction": Option(float, "(0, 1]", default=0.5), **sgd_options(lr=0.1)}

    def __init__(self, fraction: float = 0.5, epochs: int = 10, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 5e-4, batch_size: int | None = None):
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 303, decay=False)  # the decay acts in the mask only
        xf, yf = forget_in_memory(forget, dev)
        mask = saliency_mask(forget_gradient(model, xf, yf), self.fraction)
        y_rand = torch.randint(ctx.num_classes, (len(yf),), generator=g, device=g.device).to(dev)
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}

        @torch.no_grad()
        def masked():   # g ← m ⊙ (∇L + wd·w): nothing outside the mask moves, decay included
            for k, p in params.items():
                gr = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = (gr + self.weight_decay * p) * mask[k]

        def epoch(_):
            train_mode(model, ctx)
            for xb, yb, _ in mixed_batches(retain, xf, y_rand, bs, g, dev, "SalUn"):
                step(opt, F.cross_entropy(call_model(model, xb), yb), masked)

        failed = guarded_epochs(model, self.epochs, epoch, "SalUn")
        kept = sum(int(m.sum()) for m in mask.values())
        res = ScrubResult(model.eval(), info={"salun_mask_fraction": kept / sum(m.numel() for m in mask.values()),
                                              "salun_labels_changed": float((y_rand != yf).float().mean())})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = None, **_options):
        """SalUn: one gradient over D_f (a training pass) and ``epochs`` passes over D_r ⊔ D_f."""
        bs = int(batch_size or config.batch_size)
        est = train_cost(model, x1, n_r + n_f, int(epochs), bs)
        extra = train_cost(model, x1, max(n_f, 1), 1, bs)
        est.flops += extra.flops
        est.seconds += extra.seconds
        est.passes += n_f / max(n_r + n_f, 1)
        return est

