"""The fine-tuning protocol that produces the *original* model w(D) and the *retrain* reference w(D_r).

1. **Pre-train** on the core classes (plain SGD with momentum and ordinary weight decay).
2. **Fine-tuning start** ``w_0``: the pre-trained backbone plus a fresh head (one output per task
   class), initialised from the seed.
3. **Fine-tune** on D from ``w_0`` with the loss

       L(w) = mean_batch CE(f_w(x), y) + (wd/2)·‖w − w_0‖²           (pull toward w_0, not 0)

   using SGD with momentum, BatchNorm statistics frozen (BN layers in eval mode), until the training
   error is zero and then ``extra_epochs`` more, with a cap of ``max_epochs``.
4. **Retrain** with the same seed and schedule rule on D_r, in two modes (default ``replace``):
   ``remove`` trains on D_r only; ``replace`` replaces each forgotten sample by a copy of a random
   retained one so the number of steps per epoch is unchanged (the authors' code).

Every random choice (head initialisation, batch order, replacement copies) comes from the seed, so
the same seed gives identical weights on CPU.

Regularisation schedules (``TrainConfig.wd_from``/``wd_until``, ``pretrain_wd_*``, ``augment*``,
``pretrain_augment*``): a regulariser on only in the epochs [from, until) of its phase — the interrupted
([0, t0)), delayed ([t0, end)) and sliding-window ([t0, t0 + w)) protocols of the critical-periods study.
The defaults (on throughout, no augmentation) run the loop exactly as without schedules.

One SGD loop, :func:`sgd_loop`, serves pre-training, fine-tuning, retraining, the fine-tuning baselines
(Finetune, NegGrad, Random labels) and the re-learn readout: mean cross-entropy, optionally + the pull
(wd/2)‖w − w_0‖², ordinary weight decay, frozen BatchNorm, gradient ascent on chosen samples (capped), batches
by permutation or drawn with replacement, and a stopping rule checked before every epoch.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet._config import strict_from_dict
from scrubnet.curvature.progress import current_progress
from scrubnet.models.call import call_model
from scrubnet.data.augment import AUGMENTATIONS, make_augment
from scrubnet.device import model_device, seeded_generator
from scrubnet.models import freeze_batchnorm, replace_head
from scrubnet.models.loss import LossSpec
from scrubnet.training.guard import guard_after_step, guard_scope


#: the targets of the fine-tuning decay (:class:`TrainConfig` ``decay_toward``)
DECAY_TARGETS = ("init", "zero")

#: how the gold standard is retrained without D_f by default (the authors' code; see :func:`retrain`)
DEFAULT_RETRAIN_MODE = "replace"
RETRAIN_MODES = ("replace", "remove")


@dataclass
class TrainConfig:
    """Hyperparameters of pre-training and fine-tuning (units: learning rates per step, epochs)."""

    lr: float = 0.01
    momentum: float = 0.9
    wd: float = 0.03              # coefficient of (wd/2)‖w − w_0‖² during fine-tuning (papers: 0.1; see
    #                               docs/decisions/conventions.md, "Training protocol")
    batch_size: int = 128
    extra_epochs: int = 5         # epochs after the first zero-training-error epoch
    min_epochs: int = 1
    max_epochs: int = 200
    freeze_bn: bool = True
    pretrain_epochs: int = 30
    pretrain_lr: float = 0.05
    pretrain_momentum: float = 0.9
    pretrain_wd: float = 5e-4      # ordinary weight decay (toward 0) during pre-training
    pretrain_batch_size: int = 128
    # regularisation schedules (the critical-periods protocols): each regulariser is on only in the epochs
    # [from, until) of its phase (until unset: to the end). The defaults keep it on throughout.
    wd_from: int = 0                       # the fine-tuning pull (wd/2)‖w − w_0‖²
    wd_until: int | None = None
    pretrain_wd_from: int = 0              # pre-training weight decay
    pretrain_wd_until: int | None = None
    augment: str = "none"                  # fine-tuning augmentation: none | shift_noise
    augment_from: int = 0
    augment_until: int | None = None
    pretrain_augment: str = "none"         # pre-training augmentation: none | shift_noise
    pretrain_augment_from: int = 0
    pretrain_augment_until: int | None = None
    # the fine-tuning decay's target: "init" (the pull (wd/2)‖w − w_0‖², the papers' protocol) or "zero" (SGD's
    # ordinary weight decay wd·w, as the field trains ResNet-18 on CIFAR-10 from scratch)
    decay_toward: str = "init"
    # a step schedule: the rate is multiplied by lr_gamma after each of these epochs (empty: constant)
    lr_milestones: list[int] = field(default_factory=list)
    lr_gamma: float = 0.1

    def __post_init__(self):
        for kind in (self.augment, self.pretrain_augment):
            if kind not in AUGMENTATIONS:
                raise ValueError(f"unknown augmentation {kind!r}; choose one of {', '.join(AUGMENTATIONS)}")
        if self.decay_toward not in DECAY_TARGETS:
            raise ValueError(f"decay_toward must be one of {', '.join(DECAY_TARGETS)}, got {self.decay_toward!r}")
        if list(self.lr_milestones) != sorted(set(self.lr_milestones)) or any(m < 1 for m in self.lr_milestones):
            raise ValueError(f"lr_milestones must be increasing epochs ≥ 1, got {self.lr_milestones!r}")
        for name in ("wd", "pretrain_wd", "augment", "pretrain_augment"):
            check_window(getattr(self, f"{name}_from"), getattr(self, f"{name}_until"), name)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, prefix: str = "") -> "TrainConfig":
        """Checked: types as annotated, and the ranges of :data:`TRAIN_RANGES`."""
        return strict_from_dict(cls, d, "training", prefix, TRAIN_RANGES)

    def schedule(self, phase: str) -> dict:
        """The :func:`sgd_loop` schedule arguments of ``phase`` ("finetune" or "pretrain"): the regulariser
        windows, None where a regulariser is on throughout (so the loop takes its unscheduled path)."""
        pre = "pretrain_" if phase == "pretrain" else ""
        wd = (getattr(self, f"{pre}wd_from"), getattr(self, f"{pre}wd_until"))
        aug = (getattr(self, f"{pre}augment_from"), getattr(self, f"{pre}augment_until"))
        return {"wd_epochs": None if wd == (0, None) else wd, "augment_epochs": None if aug == (0, None) else aug}


#: allowed ranges of the :class:`TrainConfig` values
TRAIN_RANGES = {"lr_gamma": "> 0",
                "lr": "> 0", "momentum": "[0, 1)", "wd": ">= 0", "batch_size": ">= 1", "extra_epochs": ">= 0",
                "min_epochs": ">= 0", "max_epochs": ">= 1", "pretrain_epochs": ">= 0", "pretrain_lr": "> 0",
                "pretrain_momentum": "[0, 1)", "pretrain_wd": ">= 0", "pretrain_batch_size": ">= 1",
                "wd_from": ">= 0", "wd_until": ">= 1", "pretrain_wd_from": ">= 0", "pretrain_wd_until": ">= 1",
                "augment_from": ">= 0", "augment_until": ">= 1", "pretrain_augment_from": ">= 0",
                "pretrain_augment_until": ">= 1"}

#: an epoch window [from, until): until None = to the end of training
EpochWindow = tuple[int, "int | None"]


def check_window(start: int, until: int | None, what: str = "regulariser") -> None:
    """``ValueError`` unless 0 ≤ start and (until is None or until > start)."""
    if start < 0 or (until is not None and until <= start):
        raise ValueError(f"{what} window [{start}, {until}): need 0 ≤ from < until (until unset: to the end)")


def in_window(epoch: int, window: EpochWindow | None) -> bool:
    """Whether ``epoch`` (0-based) lies in ``window`` = [a, b) (b None: open); None = every epoch."""
    if window is None:
        return True
    a, b = window
    return epoch >= a and (b is None or epoch < b)


@dataclass
class TrainHistory:
    epochs: int
    zero_error_epoch: int | None
    final_loss: float
    final_error: float


def l2_pull(model: nn.Module, w0: dict[str, Tensor]) -> Tensor:
    """Σ ‖w − w_0‖² over the trainable parameters present in ``w0`` (without the wd/2 factor)."""
    total = torch.zeros((), device=model_device(model))
    for name, p in model.named_parameters():
        if p.requires_grad and name in w0:
            total = total + torch.sum((p - w0[name]) ** 2)
    return total


@torch.no_grad()
def predict_logits(model: nn.Module, x: Tensor, batch_size: int = 1024) -> Tensor:
    """Logits of ``model`` in eval mode, batched; the model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    out = torch.cat([call_model(model, x[i:i + batch_size]) for i in range(0, len(x), batch_size)]) if len(x) else \
        torch.zeros(0, device=x.device)
    model.train(was_training)
    return out


def error_rate(model: nn.Module, x: Tensor, y: Tensor) -> float:
    if len(y) == 0:
        return float("nan")
    return float((predict_logits(model, x).argmax(1) != y).float().mean())


def _set_mode(model: nn.Module, freeze_bn: bool) -> None:
    model.train()
    if freeze_bn:
        freeze_batchnorm(model)


def batch_loss(logits: Tensor, y: Tensor, loss_fn: str | LossSpec = "ce", ascent: Tensor | None = None,
               ascent_cap: float | None = None) -> Tensor:
    """The mean training loss of one batch: CE, ½‖f − onehot‖² ("mse"), or CE with the samples flagged in
    ``ascent`` (bool, (B,)) negated and capped at ``ascent_cap`` (−min(CE_i, cap): NegGrad). A
    :class:`~scrubnet.models.loss.LossSpec` adds label smoothing or the MSE target scale."""
    if isinstance(loss_fn, LossSpec):
        if ascent is None:
            return loss_fn.mean(logits, y)
        ce = loss_fn.per_sample(logits, y)
        capped = ce if ascent_cap is None else torch.clamp(ce, max=ascent_cap)
        return torch.where(ascent, -capped, ce).mean()
    if loss_fn == "mse":
        return 0.5 * ((logits - F.one_hot(y, logits.shape[-1]).to(logits.dtype)) ** 2).sum(-1).mean()
    if ascent is None:
        return F.cross_entropy(logits, y)
    ce = F.cross_entropy(logits, y, reduction="none")
    capped = ce if ascent_cap is None else torch.clamp(ce, max=ascent_cap)
    return torch.where(ascent, -capped, ce).mean()


def step_rate(lr: float, epoch: int, milestones=(), gamma: float = 0.1, lr_decay: float = 1.0) -> float:
    """The step size of epoch ``epoch`` (0-based): lr·lr_decay^epoch·gamma^k, k the number of milestones ≤ epoch
    (``torch.optim.lr_scheduler.MultiStepLR`` stepped once per epoch: milestone m starts the lower rate at
    epoch m)."""
    return lr * lr_decay ** epoch * gamma ** sum(1 for m in milestones if m <= epoch)


def _schedule_epoch(opt: torch.optim.Optimizer, epoch: int, lr: float, lr_decay: float, weight_decay: float,
                    weight_decay_epochs: EpochWindow | None, milestones=(), gamma: float = 0.1) -> None:
    """Set epoch ``epoch``'s step size (:func:`step_rate`) and ordinary decay (0 outside its window)."""
    if weight_decay_epochs is not None:
        for group in opt.param_groups:
            group["weight_decay"] = weight_decay if in_window(epoch, weight_decay_epochs) else 0.0
    if lr_decay != 1.0 or milestones:
        for group in opt.param_groups:
            group["lr"] = step_rate(lr, epoch, milestones, gamma, lr_decay)


def _epoch_order(n: int, samples_per_epoch: int | None, generator: torch.Generator, device, data_device
                 ) -> tuple[Tensor, int]:
    """One epoch's sample order (drawn on ``device``, the generator's, moved to ``data_device``) and its
    length: a permutation of the n samples, or ``samples_per_epoch`` indices drawn with replacement."""
    if samples_per_epoch is None:
        return torch.randperm(n, generator=generator, device=device).to(data_device), n
    order = torch.randint(n, (samples_per_epoch,), generator=generator, device=device)
    return order.to(data_device), samples_per_epoch


def sgd_loop(model: nn.Module, x: Tensor, y: Tensor, *, lr: float, momentum: float, batch_size: int,
             max_epochs: int, generator: torch.Generator, w0: dict[str, Tensor] | None = None, wd: float = 0.0,
             weight_decay: float = 0.0, freeze_bn: bool = False, ascent: Tensor | None = None,
             ascent_cap: float | None = None, samples_per_epoch: int | None = None,
             stop: Callable[[int], bool] | None = None, loss_fn: str = "ce", wd_epochs: EpochWindow | None = None,
             weight_decay_epochs: EpochWindow | None = None, augment: Callable[[Tensor], Tensor] | None = None,
             augment_epochs: EpochWindow | None = None, lr_decay: float = 1.0,
             on_epoch: Callable[[int], None] | None = None, on_step: Callable[[int], None] | None = None,
             make_opt: Callable[[nn.Module], torch.optim.Optimizer] | None = None, lr_milestones=(),
             lr_gamma: float = 0.1) -> tuple[int, bool]:
    """The package's one SGD loop; trains ``model`` in place on (x, y) and leaves it in eval mode.

    Per batch B the loss is

        (1/|B|) Σ_{i∈B} ℓ_i + (wd/2)·‖w − w_0‖²,   ℓ_i = CE_i, or −min(CE_i, ascent_cap) where ``ascent[i]``

    (the pull only for parameters in ``w0``, and only when ``w0`` is given), minimised by
    ``torch.optim.SGD(lr, momentum, weight_decay)`` (``weight_decay``: ordinary decay toward 0).
    ``ascent`` (bool, per sample) turns chosen samples into gradient *ascent*, capped at ``ascent_cap``
    (e.g. log c: the gradient vanishes once a sample is at chance). Label noise is passed in as relabelled y.
    ``loss_fn="mse"`` replaces CE_i by ½‖f(x_i) − onehot(y_i)‖² (LQF-style models; no ascent).

    Batches: a fresh permutation of the n samples per epoch (``torch.randperm(n, generator)``), or, with
    ``samples_per_epoch``, that many indices drawn with replacement (``torch.randint``). BatchNorm layers are
    put in eval mode during training when ``freeze_bn``. ``stop(e)`` is called before epoch e (e = epochs done
    so far, 0 … ``max_epochs``, the last call after the final epoch); training ends when it returns True.

    Schedules (the critical-periods protocols; every default leaves the loop as without them):

    * ``wd_epochs`` / ``weight_decay_epochs`` = [a, b): the pull / the ordinary weight decay is applied only
      in epochs a ≤ e < b (b None: to the end); outside, its coefficient is 0 for the whole epoch.
    * ``augment``: x ↦ x' applied to every batch of the epochs in ``augment_epochs`` (None: all epochs); it
      draws from its own generator, so the batch order does not depend on it.
    * ``lr_decay``: epoch e runs at η_e = lr·lr_decay^e (exponential decay per epoch; 1 = constant);
      ``lr_milestones``: η_e is further multiplied by ``lr_gamma`` once per milestone m ≤ e (a step schedule).

    Monitors: ``on_epoch(e)`` is called at the same points as ``stop`` (before epoch e, and once after the last
    epoch), before ``stop``; ``on_step(s)`` after every optimiser step s = 1, 2, … (the model is in train mode
    there; a monitor that evaluates must restore it, as the Fisher-trace monitor does). ``make_opt(model)``:
    another optimiser in place of SGD (a recipe's AdamW). Returns (epochs trained, whether ``stop`` ended it).
    """
    kind = loss_fn.kind if isinstance(loss_fn, LossSpec) else loss_fn
    if kind not in ("ce", "mse") or (kind == "mse" and ascent is not None):
        raise ValueError(f"loss_fn must be 'ce' or 'mse' (mse without ascent), got {loss_fn!r}")
    opt = make_opt(model) if make_opt is not None else torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=lr, momentum=momentum, weight_decay=weight_decay)
    n = len(y)
    device = generator.device
    stopped = False
    epoch = step = 0
    report = current_progress()
    with guard_scope(model):   # a forgetting method's run: the retain guard watches (training/guard.py)
        while True:
            if report is not None:  # the epoch cap is the bar's total: the time remaining is an upper bound
                report(f"training epochs (cap {max_epochs})", epoch, max_epochs)
            if on_epoch is not None:
                on_epoch(epoch)
            if stop is not None and stop(epoch):
                stopped = True
                break
            if epoch >= max_epochs:
                break
            _schedule_epoch(opt, epoch, lr, lr_decay, weight_decay, weight_decay_epochs, lr_milestones, lr_gamma)
            wd_now = wd if in_window(epoch, wd_epochs) else 0.0
            augment_now = augment if augment is not None and in_window(epoch, augment_epochs) else None
            _set_mode(model, freeze_bn)
            order, total = _epoch_order(n, samples_per_epoch, generator, device, x.device)
            for i in range(0, total, batch_size):
                idx = order[i:i + batch_size]
                logits = call_model(model, x[idx] if augment_now is None else augment_now(x[idx]))
                loss = batch_loss(logits, y[idx], loss_fn, None if ascent is None else ascent[idx], ascent_cap)
                if w0 is not None and wd_now > 0:
                    loss = loss + 0.5 * wd_now * l2_pull(model, w0)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                guard_after_step(opt)
                step += 1
                if on_step is not None:
                    on_step(step)
            epoch += 1
    model.eval()
    return epoch, stopped


def train_epochs(model: nn.Module, x: Tensor, y: Tensor, *, lr: float, momentum: float, batch_size: int,
                 epochs: int, generator: torch.Generator, w0: dict[str, Tensor] | None = None,
                 wd_pull: float = 0.0, weight_decay: float = 0.0, freeze_bn: bool = False) -> None:
    """Plain SGD(+momentum) for a fixed number of epochs of mean cross-entropy (+ the L2 pull): :func:`sgd_loop`."""
    sgd_loop(model, x, y, lr=lr, momentum=momentum, batch_size=batch_size, max_epochs=epochs, generator=generator,
             w0=w0, wd=wd_pull, weight_decay=weight_decay, freeze_bn=freeze_bn)


def pretrain(model: nn.Module, x_core: Tensor, y_core: Tensor, cfg: TrainConfig, seed: int) -> nn.Module:
    """Pre-train ``model`` (its head sized for the core classes) on the core data; returns a new model."""
    model = copy.deepcopy(model)
    if len(y_core) == 0 or cfg.pretrain_epochs == 0:
        return model.eval()
    g = seeded_generator(10_007 * seed + 1, model_device(model))
    sched = cfg.schedule("pretrain")
    sgd_loop(model, x_core, y_core, lr=cfg.pretrain_lr, momentum=cfg.pretrain_momentum,
             batch_size=cfg.pretrain_batch_size, max_epochs=cfg.pretrain_epochs, generator=g,
             weight_decay=cfg.pretrain_wd, freeze_bn=False, weight_decay_epochs=sched["wd_epochs"],
             augment=make_augment(cfg.pretrain_augment, 10_007 * seed + 5, model_device(model)),
             augment_epochs=sched["augment_epochs"])
    return model.eval()


def finetune_start(pretrained: nn.Module, num_classes: int, seed: int) -> nn.Module:
    """``w_0``: a copy of the pre-trained backbone with a fresh ``num_classes``-way head (seeded)."""
    return replace_head(copy.deepcopy(pretrained), num_classes, seed=seed).eval()


def finetune(start: nn.Module, x: Tensor, y: Tensor, cfg: TrainConfig, seed: int,
             w0: dict[str, Tensor] | None = None, sustained: bool = False) -> tuple[nn.Module, TrainHistory]:
    """Fine-tune a copy of ``start`` on (x, y) with the L2 pull toward ``w0`` (default: ``start``'s weights)
    until zero training error + ``cfg.extra_epochs`` (cap ``cfg.max_epochs``).

    ``sustained=False`` (``scrubnet run``'s rule): stop ``extra_epochs`` after the *first* zero-error epoch,
    whatever the error is then. ``sustained=True`` (the audit pool's rule, the protocol as stated): the error
    is checked after every epoch and a non-zero error restarts the count, so training stops only once the
    error has been zero after each of ``extra_epochs + 1`` consecutive epochs (or at the cap)."""
    model = copy.deepcopy(start)
    if w0 is None:
        w0 = {k: v.detach().clone() for k, v in start.named_parameters()}
    g = seeded_generator(10_007 * seed + 2, model_device(model))
    zero_at: int | None = None

    def stop(epoch: int) -> bool:  # zero training error, then extra_epochs more
        nonlocal zero_at
        if epoch == 0:
            return False
        if sustained and zero_at is not None and error_rate(model, x, y) > 0.0:
            zero_at = None
        if zero_at is None and epoch >= cfg.min_epochs and error_rate(model, x, y) == 0.0:
            zero_at = epoch
        return zero_at is not None and epoch >= zero_at + cfg.extra_epochs

    sched = cfg.schedule("finetune")
    # decay_toward "zero": SGD's own weight decay (toward 0) in the pull's window, and no pull
    toward_zero = cfg.decay_toward == "zero"
    epoch, _ = sgd_loop(model, x, y, lr=cfg.lr, momentum=cfg.momentum, batch_size=cfg.batch_size,
                        max_epochs=cfg.max_epochs, generator=g, w0=None if toward_zero else w0,
                        wd=0.0 if toward_zero else cfg.wd, weight_decay=cfg.wd if toward_zero else 0.0,
                        weight_decay_epochs=sched["wd_epochs"] if toward_zero else None, freeze_bn=cfg.freeze_bn,
                        stop=stop, wd_epochs=sched["wd_epochs"],
                        augment=make_augment(cfg.augment, 10_007 * seed + 4, model_device(model)),
                        augment_epochs=sched["augment_epochs"], lr_milestones=tuple(cfg.lr_milestones),
                        lr_gamma=cfg.lr_gamma)
    with torch.no_grad():
        logits = predict_logits(model, x)
        final_loss = float(F.cross_entropy(logits, y))
        final_err = float((logits.argmax(1) != y).float().mean())
    return model, TrainHistory(epoch, zero_at, final_loss, final_err)


def replace_forgotten(x: Tensor, y: Tensor, forget_idx: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """D with every forgotten sample replaced by a copy of a random retained one (seeded)."""
    mask = torch.ones(len(y), dtype=torch.bool, device=y.device)
    mask[forget_idx] = False
    retained = torch.nonzero(mask).flatten()
    g = seeded_generator(10_007 * seed + 3, y.device)
    picks = retained[torch.randint(len(retained), (len(forget_idx),), generator=g, device=y.device)]
    x2, y2 = x.clone(), y.clone()
    x2[forget_idx] = x[picks]
    y2[forget_idx] = y[picks]
    return x2, y2


def retrain(start: nn.Module, x: Tensor, y: Tensor, forget_idx: Tensor, cfg: TrainConfig, seed: int,
            mode: str = DEFAULT_RETRAIN_MODE) -> tuple[nn.Module, TrainHistory]:
    """The gold standard: fine-tune from the same ``w_0`` with the same seed without D_f.

    ``mode='remove'`` trains on D_r only; ``mode='replace'`` keeps |D| by replacing forgotten samples
    with copies of random retained ones.
    """
    if mode == "remove":
        mask = torch.ones(len(y), dtype=torch.bool, device=y.device)
        mask[forget_idx] = False
        return finetune(start, x[mask], y[mask], cfg, seed)
    if mode == "replace":
        x2, y2 = replace_forgotten(x, y, forget_idx, seed)
        return finetune(start, x2, y2, cfg, seed)
    raise ValueError(f"unknown retrain mode {mode!r}: use 'remove' or 'replace'")
