"""Bad-Teacher (Chundawat et al., "Can Bad Teaching Induce Forgetting? Unlearning in Deep Networks Using an
Incompetent Teacher").

The student starts at the original. Two frozen teachers: the original ("competent") and a randomly initialised
network of the same architecture ("incompetent"). Batches mix a random ``retain_fraction`` of D_r with all of
D_f; every sample's target is the softmax at temperature T of the competent teacher (a D_r sample) or of the
incompetent one (a D_f sample), and the student descends the mean KL(target ‖ softmax(student/T)).

The released setting (the SSD repository's ``blindspot``, from vikram2000b/bad-teaching-unlearning): 1 epoch,
Adam lr 1e-4, 30 % of D_r, batch 256, and the loss ``F.kl_div(log_softmax(s/T), q)`` with torch's default
reduction "mean": the sum over the batch *and the c classes* divided by B·c (``kl="mean"``, the default; with Adam a
constant factor changes only the weight of its ε). On CIFAR-10's random-10 split that makes
⌈(0.3·40,500 + 4,500)/256⌉ = :data:`CIFAR_STEPS` steps; on a small data set a batch of 256 makes one or two.
scrubnet's former choices are options: ``scale_batch=True`` (as many samples per batch, at most 256, as make about
:data:`CIFAR_STEPS` steps: :func:`scaled_batch`) and ``kl="batchmean"`` (the KL per sample).
Defaults and sources: docs/decisions/field-methods.md ("Bad-Teacher").
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.data.stream import DataStream
from scrubnet.device import model_device
from scrubnet.methods._field import (RELEASED_BATCH, Option, SubsetStream, check_positive, forget_in_memory,
                                     generator_for, guarded_epochs, kl_to_targets, make_optimiser, mixed_batches, step,
                                     train_cost, train_mode)
from scrubnet.methods.base import ForgettingMethod, ScrubResult, register
from scrubnet.models.call import call_model

#: optimiser steps of the released setting on CIFAR-10 (random-10: 40,500 retained, 4,500 forgotten)
CIFAR_STEPS = 66
#: the KL reductions (torch's names): the release's elementwise mean, or the mean per sample
KL_REDUCTIONS = ("mean", "batchmean")


def scaled_batch(n_mixed: int, steps: int = CIFAR_STEPS, cap: int = RELEASED_BATCH) -> int:
    """The batch size that makes about ``steps`` steps in one pass over ``n_mixed`` samples.

    Parameters
    ----------
    n_mixed : int
        Samples of the mixed set (the retained part and D_f).
    steps : int
        Steps wanted (default :data:`CIFAR_STEPS`).
    cap : int
        The released batch size, never exceeded.

    Returns
    -------
    int
        min(cap, max(1, ⌈n_mixed / steps⌉)).
    """
    return min(int(cap), max(1, -(-int(n_mixed) // int(steps))))


# std of the normal draw for parameters no submodule's reset_parameters() covers (e.g. a position embedding
# held directly by a model): the common transformer initialisation
LOOSE_PARAM_STD = 0.02


def random_initialisation(model: nn.Module, seed: int) -> nn.Module:
    """The incompetent teacher: ``model``'s architecture at a fresh random initialisation.

    Parameters
    ----------
    model : nn.Module
        Copied, not modified.
    seed : int
        Fixes the draw (the global RNG is forked, so the caller's stream is untouched).

    Returns
    -------
    nn.Module
        A copy with ``reset_parameters()`` of every submodule that has one; parameters no such module owns are
        drawn from N(0, 0.02²). Frozen (no gradient), eval mode.
    """
    net = copy.deepcopy(model)
    dev = model_device(net)
    covered: set[int] = set()
    devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        for m in net.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
                covered.update(id(p) for p in m.parameters(recurse=False))
        g = torch.Generator(device=dev).manual_seed(int(seed) + 1)
        with torch.no_grad():
            for p in net.parameters():
                if id(p) not in covered:
                    p.copy_(LOOSE_PARAM_STD * torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype))
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


@torch.no_grad()
def bad_teacher_targets(competent: nn.Module, incompetent: nn.Module, x, is_forget: Tensor, T: float) -> Tensor:
    """Bad-Teacher's distillation targets.

    Parameters
    ----------
    competent, incompetent : nn.Module
        The original and the randomly initialised teacher.
    x : inputs (n, ...)
    is_forget : Tensor (bool), shape (n,)
        Which rows are D_f samples.
    T : float
        Temperature.

    Returns
    -------
    Tensor, shape (n, c)
        softmax(incompetent(x)/T) on the rows with ``is_forget``, softmax(competent(x)/T) elsewhere.
    """
    good = F.softmax(call_model(competent, x) / T, dim=-1)
    bad = F.softmax(call_model(incompetent, x) / T, dim=-1)
    return torch.where(is_forget[:, None], bad, good)


def retain_subset(retain: DataStream, fraction: float, g: torch.Generator) -> DataStream:
    """A random part of D_r, read on demand.

    Parameters
    ----------
    retain : DataStream
        An indexable D_r (``ValueError`` for a ``DataLoader``).
    fraction : float in (0, 1]
    g : torch.Generator
        Fixes which samples.

    Returns
    -------
    DataStream
        ⌈fraction·N_r⌉ samples (at least one) of D_r.
    """
    n = len(retain)
    k = max(1, int(math.ceil(fraction * n)))
    idx = torch.randperm(n, generator=g, device=g.device)[:k].cpu()
    return SubsetStream(retain, idx, "Bad-Teacher")


@register("bad-teacher")
class BadTeacher(ForgettingMethod):
    """Bad-Teacher distillation (module docstring). Streams D_r (an indexable source).

    Parameters
    ----------
    epochs : int
        Passes over the mixed set (default 1).
    lr : float
        Adam's step size (default 1e-4).
    retain_fraction : float in (0, 1]
        Share of D_r drawn into the mixed set (default 0.3).
    T : float
        Temperature of the KL (default 1).
    batch_size : int or None
        Samples per batch (default 256, the release's; None: :func:`scaled_batch`).
    scale_batch : bool
        Ignore ``batch_size`` and take :func:`scaled_batch` (about :data:`CIFAR_STEPS` steps an epoch, at most 256):
        scrubnet's former default (default False).
    kl : {"mean", "batchmean"}
        The KL's reduction: the release's mean over the B·c terms (default) or the mean over the B samples.

    Returns
    -------
    ScrubResult
        ``scrub`` returns the distilled student (eval mode); ``info["bad_teacher_retain_used"]`` is the number of
        retained samples in the mixed set, ``bad_teacher_steps`` the optimiser steps. When the training diverged
        (a non-finite loss): ``ok`` False with the reason.
    """

    streams = True
    passes = "epochs × retain_fraction"
    in_default_run = False
    options = {"epochs": Option(int, ">= 1", default=1), "lr": Option(float, "> 0", default=1e-4),
               "retain_fraction": Option(float, "(0, 1]", default=0.3), "T": Option(float, "> 0", default=1.0),
               "batch_size": Option(int | None, ">= 1", default=RELEASED_BATCH),
               "scale_batch": Option(bool, None, default=False),
               "kl": Option(str, None, default="mean", choices=KL_REDUCTIONS)}

    def __init__(self, epochs: int = 1, lr: float = 1e-4, retain_fraction: float = 0.3, T: float = 1.0,
                 batch_size: int | None = RELEASED_BATCH, scale_batch: bool = False, kl: str = "mean"):
        check_positive(epochs=epochs, lr=lr, T=T, batch_size=batch_size)
        if not 0.0 < float(retain_fraction) <= 1.0:
            raise ValueError(f"retain_fraction must be in (0, 1], got {retain_fraction!r}")
        if kl not in KL_REDUCTIONS:
            raise ValueError(f"kl must be one of {', '.join(KL_REDUCTIONS)}, got {kl!r}")
        self.scale_batch, self.kl = bool(scale_batch), kl
        self.epochs, self.lr, self.T = int(epochs), float(lr), float(T)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.retain_fraction = float(retain_fraction)

    def scrub(self, model, retain, forget, ctx):
        competent = copy.deepcopy(model).eval()
        for p in competent.parameters():
            p.requires_grad_(False)
        incompetent = random_initialisation(model, 10_007 * ctx.seed + 305)
        student = copy.deepcopy(model)
        dev = model_device(student)
        g = generator_for(student, ctx, 306)
        xf, yf = forget_in_memory(forget, dev)
        part = retain_subset(retain, self.retain_fraction, g)
        opt = make_optimiser(student, "adam", self.lr)
        bs = (scaled_batch(len(part) + len(yf)) if self.scale_batch or self.batch_size is None
              else self.batch_size)
        steps = [0]

        def epoch(_):
            train_mode(student, ctx)
            for xb, _, is_f in mixed_batches(part, xf, yf, bs, g, dev, "Bad-Teacher"):
                target = bad_teacher_targets(competent, incompetent, xb, is_f, self.T)
                loss = kl_to_targets(call_model(student, xb), target, self.T)
                # the release's reduction "mean" divides the summed KL by B·c, "batchmean" by B
                step(opt, loss / target.shape[-1] if self.kl == "mean" else loss)
                steps[0] += 1

        failed = guarded_epochs(student, self.epochs, epoch, "Bad-Teacher")
        res = ScrubResult(student.eval(), info={"bad_teacher_retain_used": float(len(part)),
                                                "bad_teacher_steps": float(steps[0])})
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 1, retain_fraction: float = 0.3,
             batch_size: int | None = RELEASED_BATCH, scale_batch: bool = False, **_options):
        """Bad-Teacher: ``epochs`` passes over ⌈fraction·N_r⌉ + N_f samples, each with two teacher forwards
        (≈ two thirds of a training step more)."""
        n = int(math.ceil(retain_fraction * n_r)) + n_f
        bs = scaled_batch(n) if scale_batch or not batch_size else batch_size
        est = train_cost(model, x1, n, int(epochs), int(bs))
        est.flops *= 5.0 / 3.0
        est.seconds *= 5.0 / 3.0
        est.passes = float(epochs) * int(math.ceil(retain_fraction * n_r)) / max(n_r, 1)
        return est

