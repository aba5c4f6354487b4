"""The measured retraining price on a clock that ticks coarser than a training step: a total over a minimum
duration, never a median of per-step deltas, and never zero (a fake clock: no real sleeps)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.retrain import measure_retraining

TICK = 0.0156          # a Windows-like process clock


class CoarseClock:
    """A clock whose hidden time advances by ``per_read`` at every read (a step's work between two reads) and
    by whatever the fake training ``sleep``s, and which shows it rounded down to ``TICK``."""

    resolution = TICK

    def __init__(self, per_read: float = 0.0):
        self.t, self.per_read = 0.0, per_read

    def sleep(self, s: float) -> None:
        self.t += s

    def __call__(self) -> float:
        self.t += self.per_read
        return math.floor(self.t / TICK) * TICK


def _setup(n: int = 200):
    torch.manual_seed(0)
    x, y = torch.randn(n, 5), torch.randint(3, (n,))
    return nn.Linear(5, 3), (x, y)


def test_a_recipe_step_faster_than_the_tick_is_priced_at_its_true_rate():
    model, data = _setup()
    clock = CoarseClock(per_read=0.003)        # a step takes 3 ms; the clock ticks every 15.6 ms
    recipe = TrainingRecipe(epochs=4, batch_size=20)
    est = measure_retraining(model, data, recipe=recipe, clock=clock)
    # the median of per-step deltas reads 0 on this clock (4 of 5 deltas are 0); the total over ≥ 0.1 s is
    # within a tick of 3 ms per step
    assert est.seconds > 0
    assert est.details["step_seconds"] == pytest.approx(0.003, rel=0.25)
    assert est.seconds == pytest.approx(0.003 * 4 * 10, rel=0.25)


def test_a_user_training_that_sleeps_less_than_the_tick_never_gets_a_zero_price():
    model, data = _setup()
    clock = CoarseClock()

    def train(m, d):                               # a very fast user's training: 4 ms, under one tick
        clock.sleep(0.004)
        return m
    est = measure_retraining(model, data, train=train, clock=clock, probe_samples=50)
    assert est.seconds > 0 and math.isfinite(est.seconds)
    # repeated until ≥ 50 ms were timed: each probe is priced within a tick of its 4 ms
    times = [float(t) for t in est.details["probe_times"].strip("[]").split(",")]
    assert all(t == pytest.approx(0.004, abs=TICK / 2) for t in times)

    frozen = CoarseClock()
    frozen.resolution = 0.5                        # a clock that never ticks over the whole probe
    est = measure_retraining(model, data, train=lambda m, d: m, clock=frozen, probe_samples=50)
    assert est.seconds > 0                         # at most one tick per run: an upper bound, never zero
    est = measure_retraining(model, data, recipe=TrainingRecipe(epochs=2, batch_size=50), clock=frozen)
    assert est.seconds > 0 and est.details["step_seconds"] == pytest.approx(0.5 / 1000)
