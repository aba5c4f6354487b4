"""GA (gradient ascent, "NegGrad" in the field's tables): ascend the cross-entropy of D_f alone.

Each step takes a batch of D_f and descends −CE(batch) with SGD; an epoch is one pass over D_f. D_r is not used.
The defaults are OPTML-Group's released ``GA`` (Unlearn-Sparse / Unlearn-Saliency): 5 epochs, lr 1e-4, SGD with
momentum 0.9 and weight decay 5e-4 (the maintainers suggest 5e-4–1e-3 when it does not forget). scrubnet's own
``neggrad`` (fine-tuning on all of D with the D_f loss negated and capped at chance) is another method. Sources:
docs/decisions/field-methods.md ("GA").
"""
from __future__ import annotations

import torch.nn.functional as F

from scrubnet.methods._field import (RELEASED_BATCH, Option, SGDFieldMethod, forget_in_memory, guarded_epochs,
                                     set_sgd, sgd_options, sgd_start, step, tensor_batches, train_cost, train_mode)
from scrubnet.methods.base import ScrubResult, register
from scrubnet.models.call import call_model


@register("ga")
class GradientAscent(SGDFieldMethod):
    """Gradient ascent on D_f (module docstring).

    Parameters
    ----------
    epochs : int
        Passes over D_f (default 5).
    lr, momentum, weight_decay : float
        SGD settings (defaults 1e-4, 0.9, 5e-4: the released code's).
    batch_size : int or None
        Forget samples per step (default 256, the released `--batch_size`; None: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the model after the ascent (eval mode); ``info["ga_steps"]`` is the number of SGD steps
        taken. When the ascent diverged (a non-finite loss): ``ok`` False with the reason.
    """

    needs_retain = False
    passes = "0"
    options = {**sgd_options(lr=1e-4), "epochs": Option(int, ">= 1", default=5)}

    def __init__(self, epochs: int = 5, lr: float = 1e-4, momentum: float = 0.9, weight_decay: float = 5e-4,
                 batch_size: int | None = RELEASED_BATCH):
        set_sgd(self, epochs, lr, momentum, weight_decay, batch_size)

    def scrub(self, model, retain, forget, ctx):
        model, dev, bs, g, opt = sgd_start(self, model, ctx, 310)
        xf, yf = forget_in_memory(forget, dev)
        steps = [0]

        def epoch(_):
            train_mode(model, ctx)
            for xb, yb in tensor_batches(xf, yf, bs, g):
                step(opt, -F.cross_entropy(call_model(model, xb), yb))
                steps[0] += 1

        failed = guarded_epochs(model, self.epochs, epoch, "GA")
        res = ScrubResult(model.eval(), info={"ga_steps": float(steps[0])})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 5, batch_size: int | None = RELEASED_BATCH,
             **_options):
        """GA: ``epochs`` passes over D_f; no pass over D_r."""
        est = train_cost(model, x1, max(n_f, 1), int(epochs), int(batch_size or config.batch_size))
        est.passes = 0.0
        return est
