"""Selective Synaptic Dampening (Foster et al., "Fast Machine Unlearning Without Retraining Through Selective
Synaptic Dampening"): no training, one multiplicative edit of the weights.

Importances are diagonal Fishers (scrubnet's :func:`~scrubnet.curvature.fisher.fisher_diag`, per-sample
squared gradients, mean over samples, eval mode): F_D on D = D_r ⊔ D_f (as (N_r·F_r + N_f·F_f)/N, F_r streamed
over D_r) and F_f on D_f. Every weight j with F_f,j > α·F_D,j is multiplied by β_j = min(λ·F_D,j / F_f,j, 1);
the others are left as they are. Defaults and sources: docs/notes/field.md ("SSD").
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from scrubnet.curvature.fisher import FISHER_KINDS, fisher_diag
from scrubnet.device import model_device
from scrubnet.methods._field import Option, check_positive, forget_in_memory
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.methods.cost import _fisher_cost, register_cost
from scrubnet.methods.fisher import stream_fisher


def dampening(f_d: Tensor, f_f: Tensor, alpha: float, lam: float) -> tuple[Tensor, Tensor]:
    """(selected, factor): selected = F_f > α·F_D (bool), factor = min(λ·F_D/F_f, 1) where selected, 1 elsewhere."""
    selected = f_f > alpha * f_d
    ratio = torch.where(selected, lam * f_d / torch.where(selected, f_f, torch.ones_like(f_f)), torch.ones_like(f_f))
    return selected, torch.clamp(ratio, max=1.0)


@register("ssd")
class SSD(ForgettingMethod):
    """Selective Synaptic Dampening (module docstring). Streams D_r.

    Parameters
    ----------
    alpha : float
        Selection weighting α: a weight is dampened when F_f > α·F_D (default 10).
    lam : float
        Dampening constant λ: the factor is min(λ·F_D/F_f, 1) (default 1).
    kind : {"empirical", "true", "mc"}
        Which Fisher diagonal measures importance (default "empirical": squared gradients of the loss at the
        data's labels, as SSD defines importance).
    batch_size : int or None
        Batch of the Fisher computation (default: planned by its memory budget).
    """

    streams = True
    passes = "1"
    in_default_run = False
    options = {"alpha": Option(float, "> 0", default=10.0), "lam": Option(float, "> 0", default=1.0),
               "kind": Option(str, None, default="empirical", choices=FISHER_KINDS),
               "batch_size": Option(int | None, ">= 1", default=None)}

    def __init__(self, alpha: float = 10.0, lam: float = 1.0, kind: str = "empirical", batch_size: int | None = None):
        check_positive(alpha=alpha, lam=lam, batch_size=batch_size)
        if kind not in FISHER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(FISHER_KINDS)}, got {kind!r}")
        self.alpha, self.lam, self.kind, self.batch_size = float(alpha), float(lam), kind, batch_size

    def importances(self, model, retain, forget, ctx) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(F_D, F_f) as {name: tensor} over the trainable parameters."""
        xf, yf = forget_in_memory(forget, model_device(model))
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
                selected, factor = dampening(f_d[name], f_f[name], self.alpha, self.lam)
                p.mul_(factor.to(p.dtype))
                n_sel += int(selected.sum())
                n_all += p.numel()
        return ScrubResult(model.eval(), info={"ssd_selected_fraction": n_sel / max(n_all, 1)})

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, kind: str = "empirical", batch_size: int | None = None,
             **_options):
        """SSD: the Fisher diagonal over D_r and over D_f (no training)."""
        est = _fisher_cost(model, x1, n_r + n_f, kind=kind, batch_size=batch_size)
        est.passes = est.passes * (n_r + n_f) / max(n_r, 1)
        return est


register_cost("ssd")(SSD.cost)
