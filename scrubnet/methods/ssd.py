"""Selective Synaptic Dampening (Foster et al., "Fast Machine Unlearning Without Retraining Through Selective
Synaptic Dampening"): no training, one multiplicative edit of the weights.

Importances F_D on D = D_r ⊔ D_f and F_f on D_f, diagonal, eval mode, one of

* ``importance="batch"`` (default, as released: if-loops/selective-synaptic-dampening): the square of each
  mini-batch's mean loss gradient, averaged over the batches. With ``order="released"`` (default) the batches are
  the release's unshuffled loaders: D is D_r in the release's order followed by D_f, cut into consecutive batches
  (the last batch of D_r may hold the first samples of D_f), and D_f alone in its order. The release's D_r is
  class-sorted in the class setting (its retain set is built class by class) and in ``random_split``'s random
  order otherwise; so here D_r is stably sorted by label when a whole class is forgotten and put in a seeded
  random order otherwise. The batch is the release's script default: 64 in the class setting, 128 otherwise.
  ``order="shuffled"`` is scrubnet's former reading: a seeded permutation of D = D_r ⊔ D_f (and of D_f) in the
  recipe's batch. Batch means cancel on a shuffled D far more than on a class-sorted one (a batch of one class
  has a large mean gradient), so the released order gives a larger F_D and selects fewer weights;
* ``importance="fisher"``: scrubnet's variant, the per-sample Fisher diagonal
  (:func:`~scrubnet.curvature.fisher.fisher_diag`, F_D = (N_r·F_r + N_f·F_f)/N with F_r streamed over D_r).
  Per-sample squares give F_D ≥ (N_f/N)·F_f, so no weight can be selected once N_f/N ≥ 1/α.

Every weight j with F_f,j > α·F_D,j is multiplied by β_j = min(λ·F_D,j / F_f,j, 1); the others are left as they
are. When no weight is selected the result is marked failed, with the reason. Defaults and
sources: docs/decisions/field-methods.md ("SSD").
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.curvature.fisher import FISHER_KINDS, fisher_diag
from scrubnet.device import model_device
from scrubnet.methods._field import (Option, SubsetStream, by_index, check_positive, fisher_diagonal_cost,
                                     forget_in_memory, generator_for, mixed_batches, stream_labels, tensor_batches,
                                     train_cost)
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.methods.fisher import stream_fisher
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model

IMPORTANCES = ("batch", "fisher")
#: the orders the batch importances read the data in (module docstring)
ORDERS = ("released", "shuffled")
#: the release's batch (its scripts' ``-b`` defaults): class forgetting, random forgetting
RELEASED_BATCH_CLASS, RELEASED_BATCH_RANDOM = 64, 128


def dampening(f_d: Tensor, f_f: Tensor, selection_threshold: float, dampening_constant: float) -> tuple[Tensor, Tensor]:
    """SSD's selection and dampening factors for one parameter tensor.

    Parameters
    ----------
    f_d, f_f : Tensor, the parameter's shape
        Importances on D and on D_f (≥ 0).
    selection_threshold, dampening_constant : float
        α (selection) and λ (dampening).

    Returns
    -------
    selected : Tensor (bool)
        F_f > α·F_D.
    factor : Tensor
        min(λ·F_D/F_f, 1) where selected, 1 elsewhere.
    """
    selected = f_f > selection_threshold * f_d
    ratio = torch.where(selected, dampening_constant * f_d / torch.where(selected, f_f, torch.ones_like(f_f)),
                        torch.ones_like(f_f))
    return selected, torch.clamp(ratio, max=1.0)


def batch_importance(model: nn.Module, batches) -> dict[str, Tensor]:
    """The released code's importance estimate.

    Parameters
    ----------
    model : nn.Module
        Evaluated in eval mode (its mode is restored).
    batches : iterable of (inputs (B, ...), int64 labels (B,))

    Returns
    -------
    dict of str to Tensor
        The mean over the batches of (∇_w mean-CE of the batch)², one tensor per trainable parameter.
    """
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    acc = {k: torch.zeros_like(p) for k, p in params.items()}
    n = 0
    with eval_mode(model), torch.enable_grad():
        for xb, yb in batches:
            grads = torch.autograd.grad(F.cross_entropy(call_model(model, xb), yb), list(params.values()),
                                        allow_unused=True)
            for k, g in zip(params, grads):
                if g is not None:
                    acc[k] += g.detach() ** 2
            n += 1
    return {k: v / max(n, 1) for k, v in acc.items()}


@register("ssd")
class SSD(ForgettingMethod):
    """Selective Synaptic Dampening (module docstring). Streams D_r.

    Parameters
    ----------
    selection_threshold : float
        Selection weighting α: a weight is dampened when F_f > α·F_D (default 10).
    dampening_constant : float
        Dampening constant λ: the factor is min(λ·F_D/F_f, 1) (default 1).
    importance : {"batch", "fisher"}
        The released code's squared batch gradients (default) or scrubnet's per-sample Fisher diagonals (module
        docstring).
    kind : {"empirical", "true", "mc"}
        Which Fisher diagonal ``importance="fisher"`` uses (default "empirical": squared gradients of the loss
        at the data's labels, as SSD defines importance).
    order : {"released", "shuffled"}
        The batches of ``importance="batch"``: the release's unshuffled loaders (default) or seeded permutations
        (module docstring).
    batch_size : int or None
        Batch of the importance computation (default for ``importance="batch"``: the release's 64 (class) or 128
        (random) with ``order="released"``, the recipe's with ``"shuffled"``; planned by the Fisher's memory budget
        for ``importance="fisher"``).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the dampened model (eval mode); ``info["ssd_selected_fraction"]`` is the share of the
        weights dampened. ``ok`` is False when no weight was selected.
    """

    streams = True
    passes = "1"
    in_default_run = False
    options = {"selection_threshold": Option(float, "> 0", default=10.0),
               "dampening_constant": Option(float, "> 0", default=1.0),
               "importance": Option(str, None, default="batch", choices=IMPORTANCES),
               "kind": Option(str, None, default="empirical", choices=FISHER_KINDS),
               "order": Option(str, None, default="released", choices=ORDERS),
               "batch_size": Option(int | None, ">= 1", default=None)}

    def __init__(self, selection_threshold: float = 10.0, dampening_constant: float = 1.0, importance: str = "batch",
                 kind: str = "empirical", batch_size: int | None = None, order: str = "released"):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.order = order
        check_positive(selection_threshold=selection_threshold, dampening_constant=dampening_constant,
                       batch_size=batch_size)
        if kind not in FISHER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(FISHER_KINDS)}, got {kind!r}")
        if importance not in IMPORTANCES:
            raise ValueError(f"importance must be one of {', '.join(IMPORTANCES)}, got {importance!r}")
        self.selection_threshold, self.dampening_constant = float(selection_threshold), float(dampening_constant)
        self.kind, self.batch_size = kind, batch_size
        self.importance = importance

    def importances(self, model, retain, forget, ctx) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(F_D, F_f) as {name: tensor} over the trainable parameters."""
        xf, yf = forget_in_memory(forget, model_device(model))
        if self.importance == "batch" and self.order == "shuffled":
            bs = int(self.batch_size or ctx.recipe.batch_size)
            g = generator_for(model, ctx, 309)
            f_d = batch_importance(model, ((x, y) for x, y, _ in mixed_batches(retain, xf, yf, bs, g,
                                                                                model_device(model), "SSD")))
            return f_d, batch_importance(model, tensor_batches(xf, yf, bs, g))
        if self.importance == "batch":
            whole_class = ctx.forget_class is not None
            bs = int(self.batch_size or (RELEASED_BATCH_CLASS if whole_class else RELEASED_BATCH_RANDOM))
            view = by_index(retain, "SSD")
            if whole_class:     # the release's class-by-class retain set
                first = torch.sort(stream_labels(view), stable=True).indices
            else:               # random_split's random order
                g = generator_for(model, ctx, 309)
                first = torch.randperm(len(view), generator=g, device=g.device).cpu()
            d = SubsetStream(view, first, "SSD")
            straight = torch.arange(len(d) + len(yf))
            f_d = batch_importance(model, ((x, y) for x, y, _ in mixed_batches(d, xf, yf, bs, None,
                                                                                model_device(model), "SSD",
                                                                                order=straight)))
            return f_d, batch_importance(model, ((xf[i:i + bs], yf[i:i + bs]) for i in range(0, len(yf), bs)))
        f_r = stream_fisher(model, retain, self.kind, self.batch_size, ctx.cache)
        f_f = fisher_diag(model, xf, yf if self.kind == "empirical" else None, kind=self.kind,
                          batch_size=self.batch_size, seed=ctx.seed)
        n_r, n_f = len(retain), len(yf)
        f_d = {k: (n_r * f_r[k] + n_f * f_f[k]) / (n_r + n_f) for k in f_r}
        return f_d, f_f

    def scrub(self, model, retain, forget, ctx):
        f_d, f_f = self.importances(model, retain, forget, ctx)
        model = copy.deepcopy(model)
        n_sel = n_all = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name not in f_d:
                    continue
                selected, factor = dampening(f_d[name], f_f[name], self.selection_threshold, self.dampening_constant)
                p.mul_(factor.to(p.dtype))
                n_sel += int(selected.sum())
                n_all += p.numel()
        res = ScrubResult(model.eval(), info={"ssd_selected_fraction": n_sel / max(n_all, 1)})
        if n_sel == 0:
            n_f, n = len(forget), len(forget) + len(retain)
            res.fail(f"SSD selected no weight (no importance ratio F_f/F_D above α = {self.selection_threshold:g}); "
                     f"with per-sample importances that is certain when N_f/N = {n_f}/{n} ≥ 1/α: lower "
                     "selection_threshold or use "
                     "importance='batch'" if self.importance == "fisher" else
                     f"SSD selected no weight (no importance ratio F_f/F_D above α = {self.selection_threshold:g})")
        return res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, kind: str = "empirical", batch_size: int | None = None,
             importance: str = "batch", **_options):
        """SSD: one gradient pass over D and one over D_f (``importance="batch"``: a training pass without the
        update), or the Fisher diagonal over both (``"fisher"``); no training."""
        if importance == "batch":
            est = train_cost(model, x1, n_r + 2 * n_f, 1, int(batch_size or config.batch_size))
        else:
            est = fisher_diagonal_cost(model, x1, n_r + n_f, kind=kind, batch_size=batch_size)
        est.passes = est.passes * (n_r + n_f) / max(n_r, 1)
        return est

