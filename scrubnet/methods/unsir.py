"""UNSIR (Tarun et al., "Fast Yet Effective Machine Unlearning"): whole-class forgetting by error-maximising
noise.

1. Noise: a batch N of ``noise_batch`` inputs shaped like D_f's, labelled with the forgotten class c_f,
   initialised N(0, 1) and moved by Adam for ``noise_steps`` steps to *minimise*
   −CE(model(N), c_f) + ``noise_reg``·mean_i ‖N_i‖² (the model frozen, eval mode): the noise maximises the
   forgotten class's loss, kept bounded by the ℓ2 term.
2. Impair: ``impair_epochs`` passes over D_r ⊔ N (labels: D_r's own, c_f for the noise).
3. Repair: ``repair_epochs`` passes over D_r.

As released (the SSD repository's ``UNSIR``, from vikram2000b/Fast-Machine-Unlearning), ``impair_set="released"``:

* the retained data are the first :data:`RETAIN_PER_CLASS` (500) samples of every retained class (in D_r's order);
* the noise batch has 32 inputs, and the impair set holds :data:`NOISE_COPIES` (80) copies of its first
  :data:`NOISE_DISTINCT` (3) inputs — 240 noise rows (the release's loop runs over the first dimension of one
  noise image, its 3 colour channels) — mixed into that subset: 240/4,740 ≈ 5 % of the impair set on CIFAR-10,
  240/640 = 37.5 % on the embedded class setting (4 retained classes of 100);
* impair: one pass in shuffled batches of 32 (the noise batch size), Adam lr 1e-4; repair: one pass over the same
  subset in shuffled batches of 128, a fresh Adam at lr 1e-4.

``impair_set="scaled"`` is scrubnet's former reading: a noise batch of max(1, round(32/45,000 · N_r)) inputs
(:func:`scaled_noise_batch`: the share one batch of 32 has of CIFAR-10's 45,000 images) mixed once into all of
D_r, both phases over all of D_r in batches of ``batch_size`` (the recipe's). Not reproduced: the release's noise
loop leaves the model's gradients of the 25 noise steps in ``.grad``, and the first impair step adds them (a
side effect of never zeroing the model's gradients). Defaults and sources: docs/decisions/field-methods.md
("UNSIR").
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.device import model_device
from scrubnet.methods._field import (Option, SubsetStream, by_index, check_positive, float_inputs,
                                     forget_in_memory, generator_for, guarded_epochs, make_optimiser, mixed_batches,
                                     step, stream_batches, stream_labels, train_cost, train_mode)
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model


#: the released noise batch (32) as a share of CIFAR-10's 45,000 training images ("scaled" impair set)
CIFAR_NOISE_SHARE = 32 / 45_000
#: the release's impair set: copies of the first few noise inputs, and the retained samples per class
NOISE_COPIES, NOISE_DISTINCT, RETAIN_PER_CLASS = 80, 3, 500
#: the released noise batch, impair batch (= the noise batch) and repair batch
NOISE_BATCH, IMPAIR_BATCH, REPAIR_BATCH = 32, 32, 128
#: the readings of the impair set (module docstring)
IMPAIR_SETS = ("released", "scaled")


def released_retain_subset(labels: Tensor, forget_class: int, per_class: int | None = RETAIN_PER_CLASS) -> Tensor:
    """The release's retained subset: the first ``per_class`` positions of every class other than ``forget_class``.

    Parameters
    ----------
    labels : Tensor, int64, (N_r,)
        D_r's labels in its order.
    forget_class : int
    per_class : int or None
        Samples per class (None: all).

    Returns
    -------
    Tensor, int64
        Positions in D_r, class by class (ascending class), each class's in D_r's order.
    """
    parts = []
    for c in torch.unique(labels).tolist():
        if c != int(forget_class):
            pos = (labels == c).nonzero().flatten()
            parts.append(pos if per_class is None else pos[:int(per_class)])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def scaled_noise_batch(n_retain: int, share: float = CIFAR_NOISE_SHARE) -> int:
    """The noise batch that is ``share`` of the impair phase's samples.

    Parameters
    ----------
    n_retain : int
        N_r.
    share : float
        The noise's share (default :data:`CIFAR_NOISE_SHARE`).

    Returns
    -------
    int
        max(1, round(share · N_r)).
    """
    return max(1, int(round(share * int(n_retain))))


def error_maximising_noise(model: nn.Module, shape: tuple[int, ...], cls: int, *, steps: int, lr: float, reg: float,
                           generator: torch.Generator, dtype: torch.dtype = torch.float32
                           ) -> tuple[Tensor, list[float]]:
    """UNSIR's error-maximising noise for the class ``cls``.

    Adam on the noise minimises −CE(model(N), cls) + reg·mean_i ‖N_i‖²; the model is used in eval mode and gets
    no gradient (its ``requires_grad`` flags are restored).

    Parameters
    ----------
    model : nn.Module
    shape : tuple of int
        (B, ...): B noise inputs shaped like the model's inputs.
    cls : int
        The forgotten class.
    steps : int
    lr, reg : float
        Adam's step on the noise and the weight of the ℓ2 term.
    generator : torch.Generator
        Draws the N(0, 1) start (on its device).
    dtype : torch.dtype

    Returns
    -------
    noise : Tensor, shape ``shape``
    trace : list of float
        CE(model(N), cls) in nats before each step and after the last (``steps`` + 1 values).
    """
    dev = generator.device
    noise = torch.randn(shape, generator=generator, device=dev, dtype=dtype).requires_grad_(True)
    target = torch.full((shape[0],), int(cls), dtype=torch.long, device=dev)
    opt = torch.optim.Adam([noise], lr=lr)
    trace = []
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        with eval_mode(model), torch.enable_grad():
            for _ in range(steps):
                ce = F.cross_entropy(call_model(model, noise), target)
                trace.append(float(ce.detach()))
                step(opt, -ce + reg * noise.pow(2).reshape(shape[0], -1).sum(1).mean())
            with torch.no_grad():
                trace.append(float(F.cross_entropy(call_model(model, noise), target)))
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return noise.detach(), trace


@register("unsir")
class UNSIR(ForgettingMethod):
    """UNSIR (module docstring): class forgetting only. Streams D_r (an indexable source: impair mixes in noise).

    Parameters
    ----------
    impair_set : {"released", "scaled"}
        The release's impair and repair sets (default) or scrubnet's former scaled noise share (module docstring).
    noise_batch : int or None
        Noise inputs learned (default 32; "scaled": :func:`scaled_noise_batch`).
    noise_steps : int
        Their optimisation steps (default 25).
    noise_lr, noise_reg : float
        Adam step on the noise and weight of its ℓ2 term (defaults 0.1, 0.1).
    impair_epochs, repair_epochs : int
        Passes of the two phases (defaults 1, 1).
    lr : float
        Adam's step size in both phases (default 1e-4).
    retain_per_class : int or None
        "released": retained samples per class (default 500; None: all of D_r).
    impair_batch, repair_batch : int or None
        Batch sizes of the phases (defaults: 32 and 128 for "released", ``batch_size`` for "scaled").
    batch_size : int or None
        "scaled": samples per batch (default: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the repaired model; ``info``: ``unsir_noise_ce_start``, ``unsir_noise_ce_end`` (the
        forgotten class's cross-entropy on the noise at the first and last noise step, nats), ``unsir_noise_rows``
        and ``unsir_retain_used`` (the impair set's noise rows and retained samples). ``ok`` is False (with the
        reason) when a phase diverged.
    """

    streams = True
    class_only = True
    passes = "2"
    in_default_run = False
    options = {"impair_set": Option(str, None, default="released", choices=IMPAIR_SETS),
               "noise_batch": Option(int | None, ">= 1", default=None),
               "noise_steps": Option(int, ">= 1", default=25),
               "noise_lr": Option(float, "> 0", default=0.1), "noise_reg": Option(float, ">= 0", default=0.1),
               "impair_epochs": Option(int, ">= 0", default=1), "repair_epochs": Option(int, ">= 0", default=1),
               "lr": Option(float, "> 0", default=1e-4),
               "retain_per_class": Option(int | None, ">= 1", default=RETAIN_PER_CLASS),
               "impair_batch": Option(int | None, ">= 1", default=None),
               "repair_batch": Option(int | None, ">= 1", default=None),
               "batch_size": Option(int | None, ">= 1", default=None)}

    def __init__(self, noise_batch: int | None = None, noise_steps: int = 25, noise_lr: float = 0.1,
                 noise_reg: float = 0.1,
                 impair_epochs: int = 1, repair_epochs: int = 1, lr: float = 1e-4, batch_size: int | None = None,
                 impair_set: str = "released", retain_per_class: int | None = RETAIN_PER_CLASS,
                 impair_batch: int | None = None, repair_batch: int | None = None):
        check_positive(noise_batch=noise_batch, noise_steps=noise_steps, noise_lr=noise_lr, lr=lr,
                       batch_size=batch_size, retain_per_class=retain_per_class, impair_batch=impair_batch,
                       repair_batch=repair_batch)
        if not (float(noise_reg) >= 0 and int(impair_epochs) >= 0 and int(repair_epochs) >= 0):
            raise ValueError("noise_reg, impair_epochs and repair_epochs must be ≥ 0")
        if impair_set not in IMPAIR_SETS:
            raise ValueError(f"impair_set must be one of {', '.join(IMPAIR_SETS)}, got {impair_set!r}")
        self.noise_batch = None if noise_batch is None else int(noise_batch)
        self.noise_steps, self.noise_lr = int(noise_steps), float(noise_lr)
        self.noise_reg, self.lr, self.batch_size = float(noise_reg), float(lr), batch_size
        self.impair_epochs, self.repair_epochs = int(impair_epochs), int(repair_epochs)
        self.impair_set, self.retain_per_class = impair_set, retain_per_class
        self.impair_batch, self.repair_batch = impair_batch, repair_batch

    def scrub(self, model, retain, forget, ctx):
        if ctx.forget_class is None:
            raise ValueError("unsir applies to class forgetting only: give a whole forget class")
        model = copy.deepcopy(model)
        dev = model_device(model)
        xf, _ = forget_in_memory(forget, dev)
        float_inputs(xf, "UNSIR")
        g = generator_for(model, ctx, 307)
        released = self.impair_set == "released"
        if released:
            view = by_index(retain, "UNSIR")
            keep = released_retain_subset(stream_labels(view), ctx.forget_class, self.retain_per_class)
            retain = SubsetStream(view, keep, "UNSIR")
            nb = self.noise_batch or NOISE_BATCH
            bs_impair = int(self.impair_batch or IMPAIR_BATCH)
            bs_repair = int(self.repair_batch or REPAIR_BATCH)
        else:
            nb = self.noise_batch or scaled_noise_batch(len(retain))
            bs = int(self.batch_size or ctx.recipe.batch_size)
            bs_impair, bs_repair = int(self.impair_batch or bs), int(self.repair_batch or bs)
        noise, trace = error_maximising_noise(model, (nb, *xf.shape[1:]), ctx.forget_class,
                                              steps=self.noise_steps, lr=self.noise_lr, reg=self.noise_reg,
                                              generator=g, dtype=xf.dtype)
        if released:    # 80 copies of the first 3 noise inputs (module docstring)
            noise = noise[:min(NOISE_DISTINCT, nb)].repeat(NOISE_COPIES, *([1] * (noise.dim() - 1)))
        y_noise = torch.full((len(noise),), int(ctx.forget_class), dtype=torch.long, device=dev)
        res = ScrubResult(model, info={"unsir_noise_ce_start": trace[0], "unsir_noise_ce_end": trace[-1],
                                       "unsir_noise_batch": float(nb), "unsir_noise_rows": float(len(noise)),
                                       "unsir_retain_used": float(len(retain))})
        opt = make_optimiser(model, "adam", self.lr)

        def impair(_):
            train_mode(model, ctx)
            for xb, yb, _ in mixed_batches(retain, noise, y_noise, bs_impair, g, dev, "UNSIR"):
                step(opt, F.cross_entropy(call_model(model, xb), yb))

        failed = guarded_epochs(model, self.impair_epochs, impair, "UNSIR's impair phase")
        if failed:
            return res.fail(failed)
        opt = make_optimiser(model, "adam", self.lr)

        def repair(_):
            train_mode(model, ctx)
            for xb, yb in stream_batches(retain, bs_repair, g, dev):
                step(opt, F.cross_entropy(call_model(model, xb), yb))

        failed = guarded_epochs(model, self.repair_epochs, repair, "UNSIR's repair phase")
        model.eval()
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, noise_batch: int | None = None, noise_steps: int = 25,
             impair_epochs: int = 1, repair_epochs: int = 1, batch_size: int | None = None,
             impair_set: str = "released", retain_per_class: int | None = RETAIN_PER_CLASS,
             impair_batch: int | None = None, **_options):
        """UNSIR: ``noise_steps`` steps on a noise batch, then impair (retained + noise rows) and repair (retained)
        passes; "released" retains at most ``retain_per_class`` samples of each of the c − 1 classes."""
        if impair_set == "released":
            bs = int(impair_batch or IMPAIR_BATCH)
            n_used = n_r if retain_per_class is None else min(n_r, int(retain_per_class) * max(c - 1, 1))
            nb = int(noise_batch or NOISE_BATCH)
            rows = NOISE_COPIES * min(NOISE_DISTINCT, nb)
        else:
            bs = int(batch_size or config.batch_size)
            n_used, nb = n_r, int(noise_batch or scaled_noise_batch(n_r))
            rows = nb
        est = train_cost(model, x1, n_used, int(impair_epochs) + int(repair_epochs), bs)
        extra = train_cost(model, x1, nb * int(noise_steps) + rows * int(impair_epochs), 1, bs)
        est.flops += extra.flops
        est.seconds += extra.seconds
        return est

