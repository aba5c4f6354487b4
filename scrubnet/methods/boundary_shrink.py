"""Boundary Shrink (Chen et al., "Boundary Unlearning"): whole-class forgetting by relabelling each forget sample
with the model's prediction one FGSM step away.

1. Neighbours: for each x in D_f, one FGSM step x' = x + ε·sign(∇_x CE(f(x), y)) on the original (frozen, eval
   mode); the new label is, as released (OPTML ``boundary_sh.py``, Boundary-Unlearning-Code), the plain argmax of
   f(x') — a sample whose step does not cross the boundary keeps its own label (``relabel="argmax"``, default).
   ``relabel="runner-up"`` is scrubnet's variant: the class f(x') ranks highest among the classes ≠ y.
2. Fine-tune on D_f with those labels (inputs x, not x'): ``epochs`` passes, SGD.

D_r is not used. Defaults and sources: docs/decisions/field-methods.md ("Boundary Shrink").
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.methods._field import (RELEASED_BATCH, Option, SGDFieldMethod, check_positive, float_inputs,
                                     forget_in_memory, guarded_epochs, set_sgd, sgd_options, sgd_start, step,
                                     tensor_batches, train_cost, train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model


RELABELS = ("argmax", "runner-up")


def fgsm_neighbour_labels(model: nn.Module, x: Tensor, y: Tensor, eps: float, batch_size: int = 256,
                          relabel: str = "argmax") -> tuple[Tensor, Tensor]:
    """The label of every sample one FGSM step away.

    Parameters
    ----------
    model : nn.Module
        Evaluated in eval mode; its parameters get no gradient (flags restored).
    x, y : float inputs (N, ...) and int64 labels (N,)
    eps : float
        The step x' = x + eps·sign(∇_x CE(model(x), y)) (∞-norm bound, the inputs' units).
    batch_size : int
        Samples per forward pass.
    relabel : {"argmax", "runner-up"}
        The plain argmax of model(x') (the released code's), or its argmax over the classes ≠ y.

    Returns
    -------
    labels : Tensor (int64), shape (N,)
        The new labels.
    x_adv : Tensor, shape (N, ...)
        The stepped inputs x'.
    """
    labels, advs = [], []
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        with eval_mode(model):
            for i in range(0, len(y), batch_size):
                xb = x[i:i + batch_size].detach().clone().requires_grad_(True)
                yb = y[i:i + batch_size]
                with torch.enable_grad():
                    loss = F.cross_entropy(call_model(model, xb), yb, reduction="sum")
                    (gx,) = torch.autograd.grad(loss, xb)
                adv = (xb + eps * gx.sign()).detach()
                with torch.no_grad():
                    logits = call_model(model, adv)
                if relabel == "runner-up":
                    logits = logits.masked_fill(F.one_hot(yb, logits.shape[-1]).bool(), float("-inf"))
                labels.append(logits.argmax(-1))
                advs.append(adv)
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return torch.cat(labels), torch.cat(advs)


@register("boundary-shrink")
class BoundaryShrink(SGDFieldMethod):
    """Boundary Shrink (module docstring): class forgetting only; uses D_f alone.

    Parameters
    ----------
    eps : float
        FGSM step (∞-norm bound, default 0.1), in the units of the model's inputs.
    relabel : {"argmax", "runner-up"}
        The new label: the plain argmax after the step (default, as released) or the best class other than the
        sample's own (scrubnet's variant).
    epochs : int
        Passes over D_f (default 10).
    lr, momentum, weight_decay : float
        SGD settings (defaults 0.01, 0.9, 5e-4).
    batch_size : int or None
        Samples per batch (default 256, the released `--batch_size`; None: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the fine-tuned model (eval mode); ``info``: ``boundary_shrink_classes`` (the number of
        distinct labels D_f was relabelled to) and ``boundary_shrink_crossed`` (the share of D_f whose label
        changed). ``ok`` is False (with the reason) when the
        training diverged.
    """

    needs_retain = False
    class_only = True
    passes = "0"
    options = {"eps": Option(float, "> 0", default=0.1),
               "relabel": Option(str, None, default="argmax", choices=RELABELS), **sgd_options(lr=0.01)}

    def __init__(self, eps: float = 0.1, epochs: int = 10, lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 5e-4, batch_size: int | None = RELEASED_BATCH, relabel: str = "argmax"):
        check_positive(eps=eps)
        if relabel not in RELABELS:
            raise ValueError(f"relabel must be one of {', '.join(RELABELS)}, got {relabel!r}")
        self.eps, self.relabel = float(eps), relabel
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        if ctx.forget_class is None:
            raise ValueError("boundary-shrink applies to class forgetting only: give a whole forget class")
        original = copy.deepcopy(model).eval()
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 308)
        xf, yf = forget_in_memory(forget, dev)
        float_inputs(xf, "Boundary Shrink")
        y_new, _ = fgsm_neighbour_labels(original, xf, yf, self.eps, relabel=self.relabel)

        def epoch(_):
            train_mode(model, ctx)
            for xb, yb in tensor_batches(xf, y_new, bs, g):
                step(opt, F.cross_entropy(call_model(model, xb), yb))

        failed = guarded_epochs(model, self.epochs, epoch, "Boundary Shrink")
        res = ScrubResult(model.eval(), info={"boundary_shrink_classes": float(len(torch.unique(y_new))),
                                              "boundary_shrink_crossed": float((y_new != yf).float().mean())})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, batch_size: int | None = RELEASED_BATCH,
             **_options):
        """Boundary Shrink: one FGSM pass over D_f (a forward + input backward, then a forward) and ``epochs``
        passes over D_f; no pass over D_r."""
        est = train_cost(model, x1, max(n_f, 1), int(epochs) + 2, int(batch_size or config.batch_size))
        est.passes = 0.0
        return est

