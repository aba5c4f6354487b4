"""The retain guard: every fine-tuning method stops early, and backs off, when the retain error rises.

One guard for every loop that fine-tunes a model to forget (the field's methods through
:func:`scrubnet.methods._field.step` and ``guarded_epochs``, the baselines through
:func:`~scrubnet.training.sgd_loop` and their streamed loops): the scrub pipeline
(:func:`scrubnet.scrub.scrub_and_measure`) activates a :class:`RetainGuard` around a forgetting method; the loop
registers the model it trains (:func:`guard_scope`) and calls :func:`guard_after_step` after each optimiser step.
Every ``check_every`` steps the guard measures the model's error on a fixed probe of D_r (a seeded draw of at
most ``probe_size`` samples, measured in eval mode, no random numbers drawn, so an untriggered guard changes
no result). A check within ``tolerance`` of the original model's error is *good*: its weights are kept as the
fallback. A rise past ``tolerance`` but within ``wreck`` (default max(4 · tolerance, 0.1)) is let run: fine-tuning
with a fresh optimiser often spikes the retain error for a few steps and recovers. A rise past ``wreck``
puts back the weights of the last good check, clears the optimiser's state (momentum, Adam's moments) and
halves every step size (backs off); after ``max_backoffs`` back-offs the training stops there. When the scope
ends the final weights are checked against ``tolerance`` (the last good ones put back when they fail), so the
model a method returns passed the probe check. What the guard did is in :attr:`RetainGuard.events` (the
pipeline turns them into warnings).

Decision and measurements: docs/decisions/own-model-tuning.md.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import Tensor, nn

from scrubnet.models.call import call_model

#: the guard's default share of the retain-error tolerance (the probe is a sample: keep a margin)
GUARD_SHARE = 0.5


class GuardStop(Exception):
    """Raised by :func:`guard_after_step` when the guard has backed off as often as allowed; the loop's
    :func:`guard_scope` catches it (the weights are already those of the last good check)."""


class RetainGuard:
    """Watches a fine-tuning loop's retain error on a probe of D_r (module docstring).

    Parameters
    ----------
    probe : list of (inputs, labels)
        Chunks of D_r the error is measured on (inputs a tensor or ``ModelInputs``).
    base_error : float
        The original model's error on the probe (a fraction).
    tolerance : float
        The largest allowed rise of the probe error (a fraction: 0.025 = 2.5 points) of the weights returned.
    wreck : float, optional
        The rise that backs off mid-training (default max(4 · tolerance, 0.1)).
    check_every : int
        Optimiser steps between checks.
    max_backoffs : int
        Back-offs (weights put back, step sizes halved) before the training is stopped.

    Returns
    -------
    RetainGuard
        Activate it with :func:`active_guard`; ``events`` lists what it did (one sentence each).
    """

    def __init__(self, probe: list, base_error: float, tolerance: float, check_every: int = 8,
                 max_backoffs: int = 2, wreck: float | None = None):
        if not 0 <= tolerance <= 1:
            raise ValueError(f"tolerance must be in [0, 1], got {tolerance}")
        if check_every < 1 or max_backoffs < 0:
            raise ValueError("check_every must be >= 1 and max_backoffs >= 0")
        self.probe, self.base_error, self.tolerance = probe, float(base_error), float(tolerance)
        self.check_every, self.max_backoffs = int(check_every), int(max_backoffs)
        self.wreck = max(4 * self.tolerance, 0.1) if wreck is None else float(wreck)
        self.model: nn.Module | None = None
        self.good: dict[str, Tensor] | None = None
        self.steps = self.backoffs = self.checks = 0
        self.stopped = False
        self.progressed = False   # a check after some step passed: the returned weights moved
        self.events: list[str] = []

    @classmethod
    def from_stream(cls, model: nn.Module, retain, tolerance: float, seed: int = 0, probe_size: int = 256,
                    **kw) -> "RetainGuard":
        """A guard whose probe is a seeded draw of ``probe_size`` samples of ``retain`` (a
        :class:`~scrubnet.data.stream.DataStream`; a ``DataLoader``'s first batches), its base error
        ``model``'s on it.

        Parameters
        ----------
        model : nn.Module
            The original model.
        retain : DataStream
            D_r.
        tolerance : float
            The allowed rise of the probe error (a fraction).
        seed : int
            Fixes the probe.
        probe_size : int
            Samples in the probe.
        **kw
            ``check_every``, ``max_backoffs``.

        Returns
        -------
        RetainGuard
            Not yet active.
        """
        probe: list = []
        if retain.indexable:
            g = torch.Generator().manual_seed(10_007 * int(seed) + 77)
            idx = torch.randperm(len(retain), generator=g)[:probe_size]
            for i in range(0, len(idx), 128):
                probe.append(retain.take(idx[i:i + 128]))
        else:
            n = 0
            for x, y in retain.chunks():
                probe.append((x, y))
                n += len(y)
                if n >= probe_size:
                    break
        guard = cls(probe, 0.0, tolerance, **kw)
        guard.base_error = guard.error(model)
        return guard

    @torch.no_grad()
    def error(self, model: nn.Module) -> float:
        """``model``'s error on the probe, measured in eval mode (each module's mode put back afterwards)."""
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        wrong = total = 0
        try:
            for x, y in self.probe:
                logits = call_model(model, x.to(dev))
                finite = torch.isfinite(logits).all(-1)   # a non-finite output counts as an error
                wrong += int(((logits.argmax(-1) != y.to(dev)) | ~finite).sum())
                total += len(y)
        finally:
            for m, t in modes:
                m.training = t
        return wrong / max(total, 1)

    def _snapshot(self) -> None:
        self.good = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def watch(self, model: nn.Module) -> None:
        """Start watching ``model`` (its current weights are the first good ones)."""
        self.model, self.steps = model, 0
        self._snapshot()

    def check(self, opt: torch.optim.Optimizer | None) -> bool:
        """Measure now. Good: keep these weights. Past ``wreck`` mid-training (``opt`` given), or past
        ``tolerance`` at the end (``opt`` None): put back the last good weights (mid-training also reset and
        slow the optimiser) and return False."""
        self.checks += 1
        err = self.error(self.model)
        rise = err - self.base_error
        if rise <= self.tolerance:
            self._snapshot()
            self.progressed = self.progressed or self.steps > 0
            return True
        if opt is not None and rise <= self.wreck:
            return True       # a transient rise: let it run, keep the last good weights as the fallback
        self.model.load_state_dict(self.good)
        self.backoffs += opt is not None
        what = (f"the retain error on a probe of D_r rose from {100 * self.base_error:.1f} % to {100 * err:.1f} % "
                f"(step {self.steps}); the weights of the last good check were put back")
        if opt is not None and self.backoffs <= self.max_backoffs:
            opt.state.clear()
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.5
            self.events.append(what + ", the step size halved")
        else:
            self.stopped = True
            self.events.append(what + (", the training stopped there" if opt is not None else " at the end"))
        return False

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """Count a step; check every ``check_every``; :class:`GuardStop` once the back-offs are spent."""
        self.steps += 1
        if self.steps % self.check_every == 0 and not self.check(opt) and self.stopped:
            raise GuardStop()


_ACTIVE: ContextVar[RetainGuard | None] = ContextVar("scrubnet_retain_guard", default=None)


@contextlib.contextmanager
def active_guard(guard: RetainGuard | None) -> Iterator[RetainGuard | None]:
    """Activate ``guard`` (None: none) for the loops run inside the block.

    Parameters
    ----------
    guard : RetainGuard or None

    Returns
    -------
    context manager
        Yields ``guard``.
    """
    token = _ACTIVE.set(guard)
    try:
        yield guard
    finally:
        _ACTIVE.reset(token)


def current_guard() -> RetainGuard | None:
    """The active guard, or None."""
    return _ACTIVE.get()


@contextlib.contextmanager
def guard_scope(model: nn.Module) -> Iterator[None]:
    """The active guard (if any) watches ``model`` inside the block; :class:`GuardStop` ends the block quietly,
    and at its end the last steps are checked (the weights of the last good check put back when they fail)."""
    guard = _ACTIVE.get()
    if guard is None or guard.model is not None:   # no guard, or an outer loop is already watched
        yield
        return
    guard.watch(model)
    try:
        yield
    except GuardStop:
        pass
    finally:
        if not guard.stopped:
            guard.check(None)
        guard.model = None


def guard_after_step(opt: torch.optim.Optimizer) -> None:
    """Tell the active guard (if any, and watching) that ``opt`` took a step."""
    guard = _ACTIVE.get()
    if guard is not None and guard.model is not None:
        guard.after_step(opt)
