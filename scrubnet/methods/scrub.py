"""SCRUB (Kurmanji et al., "Towards Unbounded Machine Unlearning"): a student, initialised at the original,
moves away from the original (the teacher, frozen) on D_f while staying close to it on D_r.

Epoch e (of E): when e < ``msteps``, first a pass of *max-steps* over D_f — descend −T²·KL(p_t ‖ p_s) at
temperature T, i.e. ascend the distillation divergence —, then, every epoch, a pass of *min-steps* over D_r —
descend γ·CE(student, y) + α·T²·KL(p_t ‖ p_s). p_t = softmax(teacher/T), p_s = softmax(student/T), KL means
over the batch (Hinton's T² keeps the gradients' scale). The defaults are the released small-scale configuration
(meghdadk/SCRUB ``small_scale_unlearning.ipynb``): Adam lr 5e-4, wd 0.1, T = 2, α = 0.5, γ = 1, msteps 3,
10 epochs, batches 32 / 64, and the rate multiplied by 0.1 after epochs 5, 8 and 9 (:func:`scrub_lr`).
Sources: docs/decisions/field-methods.md ("SCRUB").
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.device import model_device
from scrubnet.methods._field import (Option, check_positive, distill_kl, forget_in_memory,
                                     generator_for, guarded_epochs, make_optimiser, step, stream_batches,
                                     tensor_batches, train_cost, train_mode)
from scrubnet.methods.base import ForgetContext, ForgettingMethod, ScrubResult, register
from scrubnet.models.call import call_model

#: ``on_step(kind, loss, x, y, student)``, called before each optimiser step (kind "max" or "min")
StepHook = Callable[[str, Tensor, Tensor, Tensor, nn.Module], None]


def parse_epochs(value) -> tuple[int, ...]:
    """``"5,8,9"``, a sequence of ints or ``""`` as a sorted tuple of epochs (``ValueError`` when not ≥ 1)."""
    parts = [v for v in str(value).replace(" ", "").split(",") if v] if isinstance(value, str) else list(value)
    try:
        out = tuple(sorted(int(v) for v in parts))
    except (TypeError, ValueError):
        raise ValueError(f"lr_decay_epochs must be comma-separated epochs, got {value!r}") from None
    if any(e < 1 for e in out):
        raise ValueError(f"lr_decay_epochs must be ≥ 1, got {value!r}")
    return out


def scrub_lr(lr: float, epoch: int, decay_epochs: tuple[int, ...], rate: float) -> float:
    """The released code's step size in one epoch.

    Parameters
    ----------
    lr : float
        The initial rate.
    epoch : int
        The epoch, 1-based (as the released loop counts).
    decay_epochs : tuple of int
        The epochs after which the rate is multiplied by ``rate``.
    rate : float

    Returns
    -------
    float
        lr · rate^k with k the number of decay epochs strictly before ``epoch``.
    """
    return lr * rate ** sum(epoch > d for d in decay_epochs)


def scrub_max_loss(student: nn.Module, teacher: nn.Module, x, T: float) -> Tensor:
    """The max-step loss on a forget batch.

    Parameters
    ----------
    student, teacher : nn.Module
        The teacher is evaluated without gradient.
    x : inputs (B, ...)
    T : float
        Temperature.

    Returns
    -------
    Tensor, scalar (nats)
        −T²·KL(softmax(teacher(x)/T) ‖ softmax(student(x)/T)), mean over the batch.
    """
    with torch.no_grad():
        t = call_model(teacher, x)
    return -distill_kl(call_model(student, x), t, T)


def scrub_min_loss(student: nn.Module, teacher: nn.Module, x, y: Tensor, T: float, kl_weight: float,
                   ce_weight: float) -> Tensor:
    """The min-step loss on a retain batch.

    Parameters
    ----------
    student, teacher : nn.Module
    x, y : inputs (B, ...) and int64 labels (B,)
    T, kl_weight, ce_weight : float
        Temperature and the weights of the KL and of the cross-entropy.

    Returns
    -------
    Tensor, scalar (nats)
        γ·CE(student(x), y) + α·T²·KL(p_t ‖ p_s), means over the batch.
    """
    with torch.no_grad():
        t = call_model(teacher, x)
    s = call_model(student, x)
    return ce_weight * F.cross_entropy(s, y) + kl_weight * distill_kl(s, t, T)


@register("scrub")
class Scrub(ForgettingMethod):
    """SCRUB (module docstring). Streams D_r.

    Parameters
    ----------
    epochs : int
        Epochs in all (default 10); the first ``msteps`` (default 3; all when ``msteps`` ≥ ``epochs``) also
        run max-steps.
    msteps : int
        Epochs that run a max-step on D_f before the min-step (default 3).
    lr, weight_decay : float
        Adam settings (defaults 5e-4, 0.1).
    T : float
        Distillation temperature (default 2, the small-scale configuration's).
    kl_weight, ce_weight : float
        Weights of the KL and the cross-entropy in the min-steps (defaults 0.5, 1).
    retain_batch, forget_batch : int
        Batch sizes (defaults 32, 64).
    lr_decay_epochs : str
        Comma-separated epochs after which the rate is multiplied by ``lr_decay_rate`` (default "5,8,9"; "" for
        a constant rate).
    lr_decay_rate : float
        The factor (default 0.1).

    Returns
    -------
    ScrubResult
        ``scrub`` returns the student (eval mode); ``info``: ``scrub_max_steps``, ``scrub_min_steps`` (optimiser
        steps of each kind). When the training diverged (a non-finite loss): ``ok`` False with the reason.
    """

    streams = True
    passes = "epochs"
    in_default_run = False
    options = {"epochs": Option(int, ">= 1", default=10), "msteps": Option(int, ">= 0", default=3),
               "lr": Option(float, "> 0", default=5e-4), "weight_decay": Option(float, ">= 0", default=0.1),
               "T": Option(float, "> 0", default=2.0), "kl_weight": Option(float, ">= 0", default=0.5),
               "ce_weight": Option(float, ">= 0", default=1.0), "retain_batch": Option(int, ">= 1", default=32),
               "forget_batch": Option(int, ">= 1", default=64), "lr_decay_epochs": Option(str, None, default="5,8,9"),
               "lr_decay_rate": Option(float, "> 0", default=0.1)}

    def __init__(self, epochs: int = 10, msteps: int = 3, lr: float = 5e-4, weight_decay: float = 0.1,
                 T: float = 2.0, kl_weight: float = 0.5, ce_weight: float = 1.0, retain_batch: int = 32,
                 forget_batch: int = 64, lr_decay_epochs="5,8,9", lr_decay_rate: float = 0.1):
        check_positive(epochs=epochs, lr=lr, T=T, retain_batch=retain_batch, forget_batch=forget_batch,
                       lr_decay_rate=lr_decay_rate)
        self.lr_decay_epochs, self.lr_decay_rate = parse_epochs(lr_decay_epochs), float(lr_decay_rate)
        if not int(msteps) >= 0:
            raise ValueError(f"msteps must be ≥ 0, got {msteps!r}")
        self.epochs, self.msteps, self.lr, self.weight_decay = int(epochs), int(msteps), float(lr), float(weight_decay)
        self.T, self.kl_weight, self.ce_weight = float(T), float(kl_weight), float(ce_weight)
        self.retain_batch, self.forget_batch = int(retain_batch), int(forget_batch)

    def run(self, model: nn.Module, retain, forget, ctx: ForgetContext, on_step: StepHook | None = None
            ) -> tuple[nn.Module, dict[str, float], str | None]:
        """The scrubbed student, the step counts and the reason it stopped early (None: it did not);
        ``on_step`` sees every step's loss before it is taken."""
        teacher = copy.deepcopy(model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        student = copy.deepcopy(model)
        dev = model_device(student)
        g = generator_for(student, ctx, 304)
        xf, yf = forget_in_memory(forget, dev)
        opt = make_optimiser(student, "adam", self.lr, weight_decay=self.weight_decay)
        counts = {"scrub_max_steps": 0.0, "scrub_min_steps": 0.0}

        def epoch(e):
            for group in opt.param_groups:
                group["lr"] = scrub_lr(self.lr, e + 1, self.lr_decay_epochs, self.lr_decay_rate)
            train_mode(student, ctx)
            if e < self.msteps:
                for xb, yb in tensor_batches(xf, yf, self.forget_batch, g):
                    loss = scrub_max_loss(student, teacher, xb, self.T)
                    if on_step is not None:
                        on_step("max", loss, xb, yb, student)
                    step(opt, loss)
                    counts["scrub_max_steps"] += 1
            for xb, yb in stream_batches(retain, self.retain_batch, g, dev):
                loss = scrub_min_loss(student, teacher, xb, yb, self.T, self.kl_weight, self.ce_weight)
                if on_step is not None:
                    on_step("min", loss, xb, yb, student)
                step(opt, loss)
                counts["scrub_min_steps"] += 1

        failed = guarded_epochs(student, self.epochs, epoch, "SCRUB")
        return student.eval(), counts, failed

    def scrub(self, model, retain, forget, ctx):
        student, counts, failed = self.run(model, retain, forget, ctx)
        res = ScrubResult(student, info=counts)
        return res.fail(failed) if failed else res

    @classmethod
    def cost(cls, model, x1, n_r, n_f, c, config, *, epochs: int = 10, msteps: int = 3, retain_batch: int = 32,
             **_options):
        """SCRUB: ``epochs`` passes over D_r and ``msteps`` over D_f, each sample also a teacher forward (no
        backward: ≈ a third of a training step)."""
        n = int(epochs) * n_r + int(msteps) * n_f
        est = train_cost(model, x1, n, 1, int(retain_batch))
        est.flops *= 4.0 / 3.0
        est.seconds *= 4.0 / 3.0
        est.passes = float(epochs) + float(msteps) * n_f / max(n_r, 1)
        return est

