"""The field's CIFAR-10 protocol for ``scrubnet bench --dataset cifar10`` and its plan (``--dry-run``).

The field's setting (the OPTML-Group releases' ``main_train.py`` defaults, which the unlearning papers of
2023–26 train their originals with): a ResNet-18 (scrubnet's own, :class:`~scrubnet.models.zoo.ResNet18`)
trained from scratch on 45,000 of CIFAR-10's 50,000 training images (the other 5,000 held out), SGD lr 0.1,
momentum 0.9, weight decay 5e-4 *toward zero* (SGD's own decay, ``decay_toward="zero"``: not the pull toward the
initial weights of scrubnet's fine-tuning recipe), batch 256, 182 epochs with a step schedule (the rate × 0.1
after epochs 91 and 136: ``MultiStepLR``), random crop with 4-pixel padding and a horizontal flip
(``crop_flip``); forget sets: 10 % random (4,500 images) and one class (4,500 images); the test set's 10,000
images. The field methods then run at their released defaults, and each tuned knob gets the bench's trials.

:func:`apply_cifar_protocol` writes that setting into an experiment configuration, ``scale`` ∈ (0, 1] shrinking
the images per class, the epochs (the milestones with them) and the network's width together (a CPU-sized
version); :func:`cifar_plan` counts what a run trains — without reading any data — and estimates its time from
the methods' cost models (:func:`scrubnet.cost_guard.estimate`) at :data:`GPU_FLOPS`. ``--device cuda`` runs it
on a GPU.
"""
from __future__ import annotations

import math

import torch

from scrubnet.experiments.config import ExperimentConfig
from scrubnet.cost_guard import estimate
from scrubnet.methods.base import method_class
from scrubnet.models import build_model
from scrubnet.training.cost import train_cost

#: the field's split of CIFAR-10's 50,000 training images, per class: trained on, held out
TRAIN_PER_CLASS, HELD_OUT_PER_CLASS, TEST_PER_CLASS = 4_500, 500, 1_000
#: the field's training recipe (OPTML-Group ``main_train.py``: --epochs 182, --lr 0.1, --momentum 0.9,
#: --weight_decay 5e-4, --batch_size 256, --decreasing_lr 91,136)
EPOCHS, LR, MOMENTUM, WEIGHT_DECAY, BATCH = 182, 0.1, 0.9, 5e-4, 256
MILESTONES, GAMMA = (91, 136), 0.1
#: the field's augmentation (torchvision RandomCrop(32, padding=4) + RandomHorizontalFlip)
AUGMENT = "crop_flip"
#: the settings the field runs on CIFAR-10
CIFAR_SETTINGS = ("random-10", "class")
#: forget sets × seeds of a full run (sized for one GPU: each unit trains an original and a retrain)
CIFAR_FORGET_SETS, CIFAR_SEEDS = 3, 1
#: the effective training throughput assumed for the estimate (FLOP/s): ResNet-18 on 32×32 images at batch 256
#: in TF32 on one H100 runs far below the peak; 1.5e13 gives ≈ 5 s per 45,000-image epoch (an assumption, not a
#: measurement: no GPU was available to check it)
GPU_FLOPS = 1.5e13


def scaled_width(scale: float) -> float:
    """ResNet-18's width multiplier at ``scale``: 1 at full size, else the power of two nearest ``scale``, at
    least 1/16."""
    if scale >= 1.0:
        return 1.0
    return max(1 / 16, 2.0 ** round(math.log2(scale)))


def scaled_milestones(epochs: int) -> list[int]:
    """The step schedule's milestones for a run of ``epochs`` epochs: 91/182 and 136/182 of it (rounded, at
    least 1, increasing, below ``epochs``; the field's 91 and 136 at 182 epochs)."""
    out = []
    for m in MILESTONES:
        v = max(1, int(round(m * epochs / EPOCHS)))
        if v < epochs and (not out or v > out[-1]):
            out.append(v)
    return out


def apply_cifar_protocol(cfg: ExperimentConfig, scale: float = 1.0) -> ExperimentConfig:
    """Write the field's CIFAR-10 protocol into ``cfg`` (in place; returned).

    Parameters
    ----------
    cfg : ExperimentConfig
        A configuration whose dataset is ``cifar10``.
    scale : float in (0, 1]
        Images per class, epochs and width multiplied by it (at least 2 images per class, 1 epoch).

    Returns
    -------
    ExperimentConfig
        ``cfg``: ten task classes, no pre-training core, ResNet-18, the field's recipe (BatchNorm trained, SGD's
        weight decay toward zero, the step schedule, ``crop_flip`` augmentation).
    """
    if not 0.0 < float(scale) <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")
    epochs = max(1, int(round(EPOCHS * scale)))
    cfg.data.core_classes, cfg.data.task_classes = [], list(range(10))
    cfg.data.n_train_per_class = max(2, int(round(TRAIN_PER_CLASS * scale)))
    cfg.data.n_test_per_class = max(2, int(round(TEST_PER_CLASS * scale)))
    cfg.model = "resnet18"
    cfg.model_options = {**cfg.model_options, "width": scaled_width(scale)}
    t = cfg.train
    t.lr, t.momentum, t.wd, t.batch_size = LR, MOMENTUM, WEIGHT_DECAY, BATCH
    t.min_epochs = t.max_epochs = epochs
    t.freeze_bn = False
    t.decay_toward = "zero"
    t.lr_milestones, t.lr_gamma = scaled_milestones(epochs), GAMMA
    t.augment = AUGMENT
    return cfg


def _unit_flops(model, x1, n_train: int, n_forget: int, epochs: int) -> float:
    """An original (all of D) and a retrain (D_r) of ``epochs`` epochs."""
    return (train_cost(model, x1, n_train, epochs, BATCH).flops
            + train_cost(model, x1, n_train - n_forget, epochs, BATCH).flops)


def cifar_plan(methods: list[str], *, scale: float = 1.0, forget_sets: int = CIFAR_FORGET_SETS,
               seeds: int = CIFAR_SEEDS, trials: int = 5, tuned: set | None = None) -> dict:
    """What ``scrubnet bench --dataset cifar10`` would run, without reading the data.

    Parameters
    ----------
    methods : list of str
        The bench's methods (anchors included).
    scale : float in (0, 1]
        As :func:`apply_cifar_protocol`.
    forget_sets, seeds : int
        Units per setting.
    trials : int
        Tuning trials per tuned method (0: no tuning).
    tuned : set of str, optional
        The methods with a knob.

    Returns
    -------
    dict
        ``split`` (train, held out, test, per setting |D_f| and |D_r|), ``epochs``, ``width``, ``units``,
        ``trainings`` (originals and retrains), ``scrubs`` (tuning and evaluation), ``flops``, ``gpu_hours``
        (at :data:`GPU_FLOPS`), ``milestones`` and ``deviations`` (what differs from the field's recipe: none
        at scale 1).
    """
    epochs = max(1, int(round(EPOCHS * scale)))
    n_train = 10 * max(2, int(round(TRAIN_PER_CLASS * scale)))
    n_test = 10 * max(2, int(round(TEST_PER_CLASS * scale)))
    sizes = {"random-10": int(round(0.1 * n_train)), "class": n_train // 10}
    model = build_model("resnet18", (3, 32, 32), 10, width=scaled_width(scale))
    x1 = torch.zeros(1, 3, 32, 32)
    flops, scrubs, trainings = 0.0, 0, 0
    tuned = set(tuned or ())
    per_scrub: dict = {}     # (method, N_r, N_f) → FLOPs of one scrub (the two settings share their sizes)
    for s, n_f in sizes.items():
        n_units = forget_sets * seeds + (1 if trials else 0)          # the validation split trains too
        trainings += 2 * n_units
        flops += n_units * _unit_flops(model, x1, n_train, n_f, epochs)
        for m in methods:
            cls = method_class(m)
            if cls.anchor is not None or (cls.class_only and s != "class"):
                continue
            runs = forget_sets * seeds + (trials if m in tuned else 0)
            scrubs += runs
            key = (m, n_train - n_f, n_f)
            if key not in per_scrub:
                per_scrub[key] = estimate(model, n_train - n_f, n_f, method=m, num_classes=10, x_probe=x1).flops
            flops += runs * per_scrub[key]
    return {"split": {"train": n_train, "held_out": 10 * int(round(HELD_OUT_PER_CLASS * scale)), "test": n_test,
                      **{s: {"forget": n_f, "retain": n_train - n_f} for s, n_f in sizes.items()}},
            "epochs": epochs, "width": scaled_width(scale), "units": forget_sets * seeds, "trainings": trainings,
            "scrubs": scrubs, "flops": flops, "gpu_hours": flops / GPU_FLOPS / 3600,
            "milestones": scaled_milestones(epochs),
            "deviations": [] if scale >= 1.0 else [f"scaled by {scale:g}: images per class, epochs, milestones "
                                                   "and width"]}


def render_plan(plan: dict, scale: float) -> list[str]:
    """The lines ``--dry-run`` prints: the recipe as the field states it, the split, the work and its estimate."""
    sp = plan["split"]
    ms = plan["milestones"]
    sched = (f"step schedule: lr × {GAMMA:g} after epochs {' and '.join(str(m) for m in ms)} of {plan['epochs']}"
             if ms else f"constant rate over {plan['epochs']} epochs")
    return [f"CIFAR-10, the field's protocol at scale {scale:g}: ResNet-18 (width ×{plan['width']:g}) trained from "
            f"scratch; SGD lr {LR:g}, momentum {MOMENTUM:g}, weight decay {WEIGHT_DECAY:g} toward zero; batch "
            f"{BATCH}; {sched}; augmentation: random crop with 4-pixel padding + horizontal flip",
            f"split: {sp['train']:,} training images / {sp['held_out']:,} held out / {sp['test']:,} test",
            f"random-10: |D_f| = {sp['random-10']['forget']:,}, |D_r| = {sp['random-10']['retain']:,}; "
            f"class: |D_f| = {sp['class']['forget']:,}, |D_r| = {sp['class']['retain']:,}",
            f"units: {plan['units']} per setting; {plan['trainings']} trainings of {plan['epochs']} epochs "
            f"(originals and retrains, validation splits included), {plan['scrubs']} scrubs",
            f"estimated: {plan['flops']:.2e} FLOP ≈ {plan['gpu_hours']:.1f} h on one GPU at an effective "
            f"{GPU_FLOPS:.1e} FLOP/s (an assumption, not a measurement)",
            "differs from the field's recipe: " + ("; ".join(plan["deviations"]) or "nothing")]
