"""The user's retraining without D_f: the yardstick every method is judged and priced against.

:func:`retrain_like_user` retrains the user's model on D_r the way the user trained it:

* with the user's own training — a callable ``train(model, data) -> model`` or a HuggingFace ``Trainer``
  (duck-typed: an object with ``train()``, ``model`` and ``args``; ``transformers`` is never imported here) —
  handed a copy of the start model and D_r *as the user gave it* (tensors, Dataset or DataLoader), under
  ``torch.manual_seed(seed)`` (the global generators are restored afterwards);
* or, without one, by reproducing the stated :class:`~scrubnet.recipe.TrainingRecipe` faithfully
  (:func:`train_like_recipe`): its optimiser (SGD with momentum and weight decay, or AdamW with its decoupled λ
  on the decayed parameters and its betas), its schedule (constant, cosine or linear decay per step), its loss
  (label smoothing, MSE target scale), its batch size and its epochs.

The start (:func:`initial_model`) is the model's initialisation drawn anew, for its *trainable* parameters
only: a frozen parameter (a frozen pretrained backbone) keeps its weights, and a module whose parameters are
all frozen keeps its buffers too (BatchNorm statistics). Modules are re-drawn by their ``reset_parameters``
(``_reset_parameters`` for ``nn.MultiheadAttention``), a HuggingFace model's modules by its ``_init_weights``;
a bare ``nn.Parameter`` (a ViT's class token and position embedding) is re-drawn as timm and HuggingFace draw
them, a normal of standard deviation 0.02 truncated at ±2σ. A fine-tuned model whose training started from
pretrained weights states that start with ``start=`` (retraining begins from it, not from a fresh draw).

:func:`measure_retraining` prices that retraining on the clock: the user's callable run on a probe of D_r at
two sizes (its cost is affine in the samples), or the recipe's training step timed on one batch, times the
steps of the whole training.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from scrubnet.data.stream import DataStream, as_stream
from scrubnet.device import model_device, seeded_generator
from scrubnet.models import freeze_batchnorm
from scrubnet.models.call import call_model
from scrubnet.training.cost import CostEstimate, trainable_numel

#: standard deviation of the truncated normal a bare ``nn.Parameter`` is re-drawn from (timm's class tokens
#: and position embeddings, HuggingFace's ``initializer_range``)
BARE_PARAMETER_STD = 0.02

TrainFn = Callable[[nn.Module, Any], "nn.Module | None"]


def _reset_fn(m: nn.Module):
    """A module's re-initialiser: ``reset_parameters``, or ``_reset_parameters`` (``nn.MultiheadAttention``)."""
    return getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)


def initial_model(model: nn.Module, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with its trainable parameters drawn anew from their initialisation (module docstring).

    Parameters
    ----------
    model : nn.Module
        The trained model; not modified.
    seed : int
        Fixes the draw (the global CPU generator seeded with 10_007 · seed + 8, restored afterwards).

    Returns
    -------
    nn.Module
        The copy: trainable parameters re-drawn, frozen parameters (and the buffers of wholly frozen modules)
        bit-identical to ``model``'s.
    """
    out = copy.deepcopy(model)
    frozen = {k: p.detach().clone() for k, p in out.named_parameters() if not p.requires_grad}
    hf_init = getattr(out, "_init_weights", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(10_007 * int(seed) + 8)
        for m in out.modules():
            own = list(m.parameters(recurse=False))
            if not any(p.requires_grad for p in own):
                continue       # nothing to train here: weights and buffers kept
            reset = _reset_fn(m)
            if reset is not None and callable(hf_init):
                hf_init(m)       # a HuggingFace model's own initialisation of that module
            elif reset is not None:
                reset()
            else:
                for p in own:
                    if p.requires_grad:
                        nn.init.trunc_normal_(p, std=BARE_PARAMETER_STD, a=-2 * BARE_PARAMETER_STD,
                                              b=2 * BARE_PARAMETER_STD)
        for k, p in out.named_parameters():
            if k in frozen:
                p.copy_(frozen[k])
    return out


def is_trainer(train: Any) -> bool:
    """True for a HuggingFace ``Trainer`` (or anything shaped like one: ``train()``, ``model``, ``args``)."""
    return not isinstance(train, nn.Module) and callable(getattr(train, "train", None)) \
        and hasattr(train, "model") and hasattr(train, "args")


def _run_trainer(trainer: Any, model: nn.Module, data: Any) -> nn.Module:
    """``trainer.train()`` on ``model`` and ``data`` (a Dataset, or a DataLoader's dataset) on a shallow copy of
    the trainer, with a fresh optimiser and scheduler; the trained model."""
    t = copy.copy(trainer)
    t.model = model
    if hasattr(t, "model_wrapped"):
        t.model_wrapped = model
    t.train_dataset = data.dataset if isinstance(data, DataLoader) else data
    t.optimizer, t.lr_scheduler = None, None
    t.train()
    return t.model


def _user_data(retain: Any) -> Any:
    """D_r as the user gave it (a stream's source)."""
    return retain.source if isinstance(retain, DataStream) else retain


@contextmanager
def seeded_globally(seed: int):
    """Run the block under ``torch.manual_seed(seed)`` (the draws of dropout, a user's shuffling), the global
    CPU and CUDA generators restored afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield


def run_user_training(train: TrainFn | Any, start: nn.Module, data: Any, seed: int) -> nn.Module:
    """The user's training of a copy of ``start`` on ``data`` under ``torch.manual_seed(seed)`` (the global
    generators restored afterwards): a callable ``train(model, data)`` (its return value, or the model it
    trained in place when it returns None) or a HuggingFace ``Trainer``."""
    model = copy.deepcopy(start)
    with seeded_globally(seed):
        if is_trainer(train):
            out = _run_trainer(train, model, data)
        elif callable(train):
            out = train(model, data)
        else:
            raise TypeError(f"train must be a callable train(model, data) -> model or a HuggingFace Trainer, got "
                            f"{type(train).__name__}")
    out = model if out is None else out
    if not isinstance(out, nn.Module):
        raise TypeError(f"the training function returned {type(out).__name__}, not the trained nn.Module")
    return out.eval()


def retrain_like_user(model: nn.Module, retain: Any, *, train: TrainFn | Any = None, recipe=None, seed: int = 0,
                      start: nn.Module | None = None) -> nn.Module:
    """The user's model retrained on D_r alone, the way the user trained it (module docstring).

    Parameters
    ----------
    model : nn.Module
        The trained model (its architecture, and the weights of its frozen parameters); not modified.
    retain : tensors, Dataset, DataLoader or DataStream
        D_r; the user's ``train`` receives it as given (a stream: its source).
    train : callable or HuggingFace Trainer, optional
        The user's training: ``train(model, data) -> model`` (or trains in place and returns None), or a
        ``Trainer``. Without it the ``recipe`` is reproduced (:func:`train_like_recipe`).
    recipe : TrainingRecipe, optional
        How the model was trained (required without ``train``).
    seed : int
        Fixes the start's draw and the training's random choices.
    start : nn.Module, optional
        The model training starts from (e.g. the pretrained weights a model was fine-tuned from); default
        :func:`initial_model` (``model``'s initialisation drawn anew, frozen parameters kept).

    Returns
    -------
    nn.Module
        The retrained model, in eval mode.
    """
    start = initial_model(model, seed) if start is None else start
    if train is not None:
        return run_user_training(train, start, _user_data(retain), seed)
    if recipe is None:
        raise ValueError("retrain_like_user needs the user's training (train=) or the recipe it followed (recipe=)")
    out = copy.deepcopy(start)
    with seeded_globally(seed):     # dropout and other global draws: fixed by the seed, as a user's are
        train_like_recipe(out, as_stream(retain), recipe, seed=seed)
    return out.eval()


# --------------------------------------------------------------------------------------------------
# the stated recipe, reproduced
# --------------------------------------------------------------------------------------------------

def decayed_names(model: nn.Module, recipe) -> set[str]:
    """Names of the trainable parameters the recipe's decay acts on: the centre's keys when it names them,
    else every trainable parameter."""
    names = {k for k, p in model.named_parameters() if p.requires_grad}
    return names if recipe.wd_center is None else names & set(recipe.wd_center)


def make_optimizer(model: nn.Module, recipe, lr: float | None = None) -> torch.optim.Optimizer:
    """The recipe's optimiser over ``model``'s trainable parameters at ``lr`` (default the recipe's):
    ``SGD(lr, momentum, weight_decay=wd)`` on the decayed parameters (none when the decay pulls toward a
    non-zero centre: that pull is the loss's term, :func:`explicit_pull`), or
    ``AdamW(lr, betas, weight_decay=adamw_weight_decay)`` on the decayed parameters (0 on the others).

    Parameters
    ----------
    model : nn.Module
        The model being trained.
    recipe : TrainingRecipe
        Its optimiser, rate, momentum / betas and decay.
    lr : float, optional
        The step size (a method's own rate for the recipe's optimiser); default ``recipe.lr``.

    Returns
    -------
    torch.optim.Optimizer
    """
    lr = float(recipe.lr if lr is None else lr)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    decayed = decayed_names(model, recipe)
    if recipe.optimizer == "adamw":
        lam = float(recipe.adamw_weight_decay)
        groups = [{"params": [p for k, p in named if k in decayed], "weight_decay": lam},
                  {"params": [p for k, p in named if k not in decayed], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(recipe.betas))
    wd = 0.0 if explicit_pull(recipe) else float(recipe.wd)
    groups = [{"params": [p for k, p in named if k in decayed], "weight_decay": wd},
              {"params": [p for k, p in named if k not in decayed], "weight_decay": 0.0}]
    return torch.optim.SGD([g for g in groups if g["params"]], lr=lr, momentum=float(recipe.momentum))


def explicit_pull(recipe) -> bool:
    """True when the recipe's decay is a loss term (wd/2)‖w − w_0‖² toward a non-zero centre (SGD only: an
    AdamW recipe's decay is its decoupled λ)."""
    return recipe.optimizer == "sgd" and recipe.wd > 0 and not recipe.center_is_zero


def scheduled_rate(schedule: str, lr: float, step: int, total: int) -> float:
    """The rate of step ``step`` (0-based) of ``total``: ``"cosine"`` lr·(1 + cos(π·step/total))/2, ``"linear"``
    lr·(1 − step/total), ``"constant"`` lr."""
    t = min(step, total) / max(total, 1)
    if schedule == "cosine":
        return 0.5 * lr * (1.0 + math.cos(math.pi * t))
    if schedule == "linear":
        return lr * (1.0 - t)
    return lr


def steps_per_epoch(data: DataStream, batch_size: int) -> int:
    """Optimiser steps of one epoch: the loader's batches, else ⌈n / batch_size⌉."""
    return len(data.loader) if data.kind == "loader" else -(-len(data) // int(batch_size))


def epoch_batches(data: DataStream, batch_size: int, generator: torch.Generator):
    """One epoch's batches: a seeded permutation in batches of ``batch_size`` (tensors, datasets), or a
    DataLoader's own batches in its own order."""
    if data.kind == "loader":
        yield from data.chunks()
        return
    order = torch.randperm(len(data), generator=generator, device=generator.device).cpu()
    for i in range(0, len(order), batch_size):
        yield data.take(order[i:i + batch_size])


def train_like_recipe(model: nn.Module, data: DataStream, recipe, *, seed: int = 0, epochs: int | None = None,
                      lr: float | None = None, schedule: str | None = None,
                      on_step: Callable[[int], None] | None = None, max_steps: int | None = None) -> int:
    """Train ``model`` in place on ``data`` as the recipe states (module docstring); returns the steps taken.

    Parameters
    ----------
    model : nn.Module
        Trained in place, left in eval mode.
    data : DataStream
        The training set (tensors and datasets: a permutation seeded by ``seed`` per epoch; a loader: its
        batches).
    recipe : TrainingRecipe
        Loss, optimiser, decay, schedule, batch size, epochs, BatchNorm rule.
    seed : int
        Fixes the batch order.
    epochs, lr, schedule : optional
        Override the recipe's (a method's own length, rate and schedule for the recipe's optimiser).
    on_step : callable, optional
        Called with the step count after every optimiser step.
    max_steps : int, optional
        Stop after this many steps (the schedule still spans the whole training: a timing probe).

    Returns
    -------
    int
        Optimiser steps taken.
    """
    epochs = int(recipe.epochs if epochs is None else epochs)
    lr = float(recipe.lr if lr is None else lr)
    schedule = recipe.schedule if schedule is None else schedule
    dev = model_device(model)
    opt = make_optimizer(model, recipe, lr)
    g = seeded_generator(10_007 * int(seed) + 9, dev)
    total = epochs * steps_per_epoch(data, recipe.batch_size)
    center = recipe.center_for(model) if explicit_pull(recipe) else None
    step = 0
    for _ in range(epochs):
        model.train()
        if recipe.freeze_bn:
            freeze_batchnorm(model)
        for xb, yb in epoch_batches(data, recipe.batch_size, g):
            if schedule != "constant":
                for group in opt.param_groups:
                    group["lr"] = scheduled_rate(schedule, lr, step, total)
            loss = recipe.loss_spec.mean(call_model(model, xb.to(dev)), yb.to(dev))
            if center is not None:
                loss = loss + 0.5 * recipe.wd * sum(((p - center[k]) ** 2).sum()
                                                    for k, p in model.named_parameters() if k in center)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if on_step is not None:
                on_step(step)
            if max_steps is not None and step >= max_steps:
                model.eval()
                return step
    model.eval()
    return step


# --------------------------------------------------------------------------------------------------
# the retraining priced on the clock
# --------------------------------------------------------------------------------------------------

def _clock(device: torch.device) -> Callable[[], float]:
    """Process CPU time on the CPU (what the cost model's rates are measured in); synchronised wall time on
    a GPU."""
    if device.type == "cuda":
        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return wall
    return time.process_time


def _subset(data: Any, m: int) -> Any:
    """The first ``m`` samples of the user's data, in the user's form (tensors sliced, a Dataset or a
    DataLoader's dataset as a ``Subset``, a DataLoader rebuilt over it with its batch size and collate_fn)."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0][:m], data[1][:m]
    if isinstance(data, DataLoader):
        return DataLoader(Subset(data.dataset, range(m)), batch_size=data.batch_size, collate_fn=data.collate_fn,
                          drop_last=data.drop_last)
    if isinstance(data, Dataset):
        return Subset(data, range(m))
    raise TypeError(f"cannot take a probe of {type(data).__name__}")


def measure_retraining(model: nn.Module, retain: Any, *, train: TrainFn | Any = None, recipe=None, seed: int = 0,
                       start: nn.Module | None = None, probe_samples: int = 256, probe_steps: int = 3,
                       clock: Callable[[], float] | None = None) -> CostEstimate:
    """The retraining :func:`retrain_like_user` would run, priced by timing it on this machine.

    With the user's ``train``: it runs on the first m and 2m samples of D_r (m = ``probe_samples``, at most
    half of D_r); its time is affine in the samples, so T(n) = T(m) + (T(2m) − T(m))·(n − m)/m (the slope at
    least 0, and T(n) at least the proportional T(m)·n/m when the two probes disagree); a probe faster than
    :data:`USER_PROBE_MIN_SECONDS` is run again (at most :data:`USER_PROBE_MAX_REPEATS` times) and its total
    time divided by the runs. With the recipe: one batch of ``batch_size`` samples trained after a warm-up step
    for at least ``probe_steps`` steps and :data:`PROBE_MIN_SECONDS`, the total time of the timed steps over
    their count (the step time) times the training's steps (epochs × steps per epoch).

    Never zero: a clock that ticks coarser than a step reads 0 for most steps, so the price is a total over a
    minimum duration, never a median of per-step deltas; a probe the clock never saw tick is priced at one
    tick of the clock (its resolution) over the steps or runs timed — an upper bound of what it took.

    Parameters
    ----------
    model : nn.Module
        The trained model; not modified.
    retain : tensors, Dataset, DataLoader or DataStream
        D_r.
    train, recipe, seed, start
        As :func:`retrain_like_user`.
    probe_samples, probe_steps : int
        The probe's sizes.
    clock : callable, optional
        The clock read (default: process CPU time; synchronised wall time on a GPU); its ``resolution``
        attribute, when it has one, is its tick (default: the process clock's).

    Returns
    -------
    CostEstimate
        ``method = "retrain (measured)"``, ``seconds`` the retraining's predicted CPU seconds (GPU: wall);
        ``details``: ``probe_seconds`` (what the measurement itself cost) and how it was taken.
    """
    stream = as_stream(retain)
    n = len(stream)
    start = initial_model(model, seed) if start is None else start
    clock = clock or _clock(model_device(model))
    tick = _tick(clock)
    t_all = time.process_time()
    if train is not None:
        data = _user_data(retain)
        m = max(1, min(int(probe_samples), n // 2))
        times, runs = [], []
        for size in (m, 2 * m):
            part, total, k = _subset(data, size), 0.0, 0
            while k < USER_PROBE_MAX_REPEATS and (k == 0 or total < USER_PROBE_MIN_SECONDS):
                t0 = clock()
                run_user_training(train, start, part, seed)
                total += clock() - t0
                k += 1
            times.append(max(total, 0.0) / k if total > 0 else tick / k)   # never seen to tick: ≤ one tick
            runs.append(k)
        slope = max(times[1] - times[0], 0.0) / m
        seconds = max(times[0] + slope * (n - m), times[0] * n / m if slope == 0.0 else 0.0)
        details = {"probe": f"the user's training on {m} and {2 * m} samples", "probe_times": str(times),
                   "probe_runs": str(runs)}
        passes = float("nan")
    else:
        if recipe is None:
            raise ValueError("measure_retraining needs the user's training (train=) or the recipe (recipe=)")
        seconds, details = _time_recipe_steps(start, stream, recipe, seed, probe_steps, clock)
        passes = float(recipe.epochs)
    details["probe_seconds"] = time.process_time() - t_all
    peak = 4 * trainable_numel(model) * (4 if recipe is not None and recipe.optimizer == "adamw" else 3)
    return CostEstimate("retrain (measured)", float("nan"), float(seconds), int(peak), passes, details)


#: the recipe's step is timed until at least this many steps and this much time (and at most
#: :data:`PROBE_MAX_STEPS` steps): a total over a minimum duration is priced even where the clock ticks coarser
#: than a step (a median of per-step deltas read 0 there, and a request then cost "1.7e12 retrainings")
PROBE_MIN_SECONDS = 0.1
PROBE_MAX_STEPS = 1000
#: the user's training on a probe is run again until its runs took this long (at most this many runs)
USER_PROBE_MIN_SECONDS = 0.05
USER_PROBE_MAX_REPEATS = 8


def _tick(clock: Callable[[], float]) -> float:
    """The clock's resolution (seconds): its ``resolution`` attribute, else the process clock's."""
    res = getattr(clock, "resolution", None)
    if res is None:
        res = time.get_clock_info("process_time").resolution
    return max(float(res), 1e-9)


class _Enough(Exception):
    """Raised by the probe's step monitor once enough steps are timed."""


def _time_recipe_steps(start: nn.Module, stream: DataStream, recipe, seed: int, probe_steps: int,
                       clock: Callable[[], float]) -> tuple[float, dict]:
    """(predicted seconds of the recipe's whole training, details): the median time of the steps on the first
    batch of D_r after one warm-up step (at least ``probe_steps`` and :data:`PROBE_MIN_SECONDS`, at most
    :data:`PROBE_MAX_STEPS`), times the training's steps."""
    batch = next(iter(stream.chunks(recipe.batch_size)))   # a loader: its first batch
    model = copy.deepcopy(start)
    stamps: list[float] = [clock()]
    need = max(int(probe_steps), 1)

    def monitor(step: int) -> None:
        stamps.append(clock())
        timed = len(stamps) - 2                            # steps after the warm-up
        if timed >= PROBE_MAX_STEPS or (timed >= need and stamps[-1] - stamps[1] >= PROBE_MIN_SECONDS):
            raise _Enough
    try:
        train_like_recipe(model, DataStream(batch), _one_batch(recipe, len(batch[1])), seed=seed,
                          epochs=PROBE_MAX_STEPS + 1, on_step=monitor)
    except _Enough:
        pass
    timed = max(len(stamps) - 2, 1)
    spent = stamps[-1] - stamps[1] if len(stamps) > 2 else 0.0
    # a total over the timed steps (never a median of per-step deltas: 0 where the clock ticks coarser than a
    # step); a probe the clock never saw tick took at most one tick
    per_step = (spent if spent > 0 else _tick(clock)) / timed
    total = int(recipe.epochs) * steps_per_epoch(stream, recipe.batch_size)
    return per_step * total, {"probe": f"{timed} timed steps on a batch of {len(batch[1])}",
                              "step_seconds": per_step, "optimiser_steps": float(total)}


def _one_batch(recipe, batch: int):
    """The recipe with a batch size of ``batch`` (one step per epoch over a one-batch probe)."""
    return replace(recipe, batch_size=int(batch))

