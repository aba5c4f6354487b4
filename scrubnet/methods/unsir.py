"""UNSIR (Tarun et al., "Fast Yet Effective Machine Unlearning"): whole-class forgetting by error-maximising
noise.

1. Noise: a batch N of ``noise_batch`` inputs shaped like D_f's, labelled with the forgotten class c_f,
   initialised N(0, 1) and moved by Adam for ``noise_steps`` steps to *minimise*
   −CE(model(N), c_f) + ``noise_reg``·mean_i ‖N_i‖² (the model frozen, eval mode): the noise maximises the
   forgotten class's loss, kept bounded by the ℓ2 term.
2. Impair: ``impair_epochs`` passes over D_r ⊔ N (labels: D_r's own, c_f for the noise).
3. Repair: ``repair_epochs`` passes over D_r.

The released setting (the SSD repository) learns one batch of 32 noise inputs and mixes it into D_r: on
CIFAR-10 that is :data:`CIFAR_NOISE_SHARE` = 32/45,000 ≈ 0.07 % of the impair phase's samples. The default
``noise_batch`` keeps that share on any data (:func:`scaled_noise_batch`: at least one input), so the noise
weighs in the impair phase what it weighed there. Defaults and sources: docs/decisions/field-methods.md ("UNSIR").
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.device import model_device
from scrubnet.methods._field import (Option, check_positive, float_inputs, forget_in_memory,
                                     generator_for, guarded_epochs, make_optimiser, mixed_batches, step,
                                     stream_batches, train_cost, train_mode)
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model


#: the released noise batch (32) as a share of CIFAR-10's 45,000 training images
CIFAR_NOISE_SHARE = 32 / 45_000


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
    noise_batch : int or None
        Noise samples (default :func:`scaled_noise_batch`: the released 32-in-45,000 share of N_r, at least 1).
    noise_steps : int
        Their optimisation steps (default 25).
    noise_lr, noise_reg : float
        Adam step on the noise and weight of its ℓ2 term (defaults 0.1, 0.1).
    impair_epochs, repair_epochs : int
        Passes of the two phases (defaults 1, 1).
    lr : float
        Adam's step size in both phases (default 1e-4).
    batch_size : int or None
        Samples per batch (default: the recipe's).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the repaired model; ``info``: ``unsir_noise_ce_start``, ``unsir_noise_ce_end`` (the
        forgotten class's cross-entropy on the noise at the first and last noise step, nats). ``ok`` is False
        (with the reason) when a phase diverged.
    """

    streams = True
    class_only = True
    passes = "2"
    in_default_run = False
    options = {"noise_batch": Option(int | None, ">= 1", default=None),
               "noise_steps": Option(int, ">= 1", default=25),
               "noise_lr": Option(float, "> 0", default=0.1), "noise_reg": Option(float, ">= 0", default=0.1),
               "impair_epochs": Option(int, ">= 0", default=1), "repair_epochs": Option(int, ">= 0", default=1),
               "lr": Option(float, "> 0", default=1e-4), "batch_size": Option(int | None, ">= 1", default=None)}

    def __init__(self, noise_batch: int | None = None, noise_steps: int = 25, noise_lr: float = 0.1,
                 noise_reg: float = 0.1,
                 impair_epochs: int = 1, repair_epochs: int = 1, lr: float = 1e-4, batch_size: int | None = None):
        check_positive(noise_batch=noise_batch, noise_steps=noise_steps, noise_lr=noise_lr, lr=lr,
                       batch_size=batch_size)
        if not (float(noise_reg) >= 0 and int(impair_epochs) >= 0 and int(repair_epochs) >= 0):
            raise ValueError("noise_reg, impair_epochs and repair_epochs must be ≥ 0")
        self.noise_batch = None if noise_batch is None else int(noise_batch)
        self.noise_steps, self.noise_lr = int(noise_steps), float(noise_lr)
        self.noise_reg, self.lr, self.batch_size = float(noise_reg), float(lr), batch_size
        self.impair_epochs, self.repair_epochs = int(impair_epochs), int(repair_epochs)

    def scrub(self, model, retain, forget, ctx):
        if ctx.forget_class is None:
            raise ValueError("unsir applies to class forgetting only: give a whole forget class")
        model = copy.deepcopy(model)
        dev = model_device(model)
        bs = int(self.batch_size or ctx.recipe.batch_size)
        xf, _ = forget_in_memory(forget, dev)
        float_inputs(xf, "UNSIR")
        g = generator_for(model, ctx, 307)
        nb = self.noise_batch or scaled_noise_batch(len(retain))
        noise, trace = error_maximising_noise(model, (nb, *xf.shape[1:]), ctx.forget_class,
                                              steps=self.noise_steps, lr=self.noise_lr, reg=self.noise_reg,
                                              generator=g, dtype=xf.dtype)
        y_noise = torch.full((nb,), int(ctx.forget_class), dtype=torch.long, device=dev)
        res = ScrubResult(model, info={"unsir_noise_ce_start": trace[0], "unsir_noise_ce_end": trace[-1],
                                       "unsir_noise_batch": float(nb)})
        opt = make_optimiser(model, "adam", self.lr)

        def impair(_):
            train_mode(model, ctx)
            for xb, yb, _ in mixed_batches(retain, noise, y_noise, bs, g, dev, "UNSIR"):
                step(opt, F.cross_entropy(call_model(model, xb), yb))

        failed = guarded_epochs(model, self.impair_epochs, impair, "UNSIR's impair phase")
        if failed:
            return res.fail(failed)
        opt = make_optimiser(model, "adam", self.lr)

        def repair(_):
            train_mode(model, ctx)
            for xb, yb in stream_batches(retain, bs, g, dev):
                step(opt, F.cross_entropy(call_model(model, xb), yb))

        failed = guarded_epochs(model, self.repair_epochs, repair, "UNSIR's repair phase")
        model.eval()
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, noise_batch: int | None = None, noise_steps: int = 25,
             impair_epochs: int = 1, repair_epochs: int = 1, batch_size: int | None = None, **_options):
        """UNSIR: ``noise_steps`` steps on a noise batch, then impair (D_r + noise) and repair (D_r) passes."""
        bs = int(batch_size or config.batch_size)
        est = train_cost(model, x1, n_r, int(impair_epochs) + int(repair_epochs), bs)
        nb = int(noise_batch or scaled_noise_batch(n_r))
        extra = train_cost(model, x1, nb * (int(noise_steps) + int(impair_epochs)), 1, bs)
        est.flops += extra.flops
        est.seconds += extra.seconds
        return est

