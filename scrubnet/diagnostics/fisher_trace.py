"""Trace of the Fisher information over training: a plain function and a monitor for any training loop.

For a classifier with p_w(y|x) = softmax(f_w(x))_y the Fisher information on a probe set {x_1..x_M} is

    F = (1/M) Σ_i E_{y∼p_w(·|x_i)} [∇_w log p_w(y|x_i) ∇_w log p_w(y|x_i)ᵀ],

so its trace is tr(F) = (1/M) Σ_i E_{y∼p_w(·|x_i)} ‖∇_w log p_w(y|x_i)‖² — the true Fisher: labels come from
the model, never from the data set. Two estimators:

* ``mode="sampled"`` (the critical-periods chapter): S labels ŷ_is ∼ p_w(·|x_i) per probe input, drawn from a
  seeded generator, and tr(F) ≈ (1/(M·S)) Σ_{i,s} ‖∇_w log p_w(ŷ_is|x_i)‖²;
* ``mode="exact"``: the expectation over the K classes in closed form,
  tr(F) = (1/M) Σ_i Σ_k p_w(k|x_i) ‖∇_w log p_w(k|x_i)‖².

Per layer (module) the same sums over that module's own parameters; the total is their sum. Both are the
Fisher *diagonal* summed, so they come from :func:`scrubnet.curvature.fisher.fisher_diag` — the per-layer
per-sample-gradient kernels of :mod:`scrubnet.curvature.kernels` (closed forms for Linear, Conv1d/Conv2d and
eval-mode BatchNorm, ``torch.func`` for any other module) — with the sampled labels as its "empirical"
labels (sampled mode) or its own class expectation (exact mode). No second per-sample-gradient code here.

Evaluated in eval mode (BatchNorm with its running statistics: samples independent, per-sample gradients
defined; the model's modes are restored), on a fixed probe subset without augmentation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from scrubnet.curvature.fisher import fisher_diag
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model

FISHER_TRACE_MODES = ("sampled", "exact")


@dataclass
class FisherTrace:
    """tr(F) in total and per layer ({module name: trace over its parameters}, "" = the root module)."""

    total: float
    per_layer: dict[str, float]


def layer_of(param_name: str) -> str:
    """The module that owns a parameter: ``"features.0.weight"`` → ``"features.0"``."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def sample_model_labels(model: nn.Module, x: Tensor, generator: torch.Generator, label_samples: int = 1
                        ) -> Tensor:
    """ŷ (M·S,) ∼ p_w(·|x_i), S = ``label_samples`` per input, in the order x_1 (S times), x_2, …; eval mode."""
    with eval_mode(model), torch.no_grad():
        probs = torch.softmax(call_model(model, x).double(), dim=-1)
    draws = torch.multinomial(probs.to(generator.device), label_samples, replacement=True, generator=generator)
    return draws.reshape(-1).to(x.device)


def fisher_trace(model: nn.Module, x: Tensor, *, mode: str = "sampled", generator: torch.Generator | None = None,
                 label_samples: int = 1, batch_size: int | None = None) -> FisherTrace:
    """tr(F) of ``model`` on the probe inputs ``x`` (M, ...), per layer and in total (module docstring).

    ``mode="sampled"`` needs ``generator`` (the labels' randomness) and draws ``label_samples`` labels per
    input; ``mode="exact"`` takes the expectation over classes. ``batch_size``: passed to ``fisher_diag``."""
    if mode not in FISHER_TRACE_MODES:
        raise ValueError(f"unknown Fisher-trace mode {mode!r}; choose one of {', '.join(FISHER_TRACE_MODES)}")
    if len(x) == 0:
        raise ValueError("the probe set is empty")
    if mode == "exact":
        diag = fisher_diag(model, x, kind="true", batch_size=batch_size)
    else:
        if generator is None:
            raise ValueError("the sampled Fisher trace needs a torch.Generator for the model's labels")
        if label_samples < 1:
            raise ValueError(f"label_samples must be ≥ 1, got {label_samples}")
        y_hat = sample_model_labels(model, x, generator, label_samples)
        xs = x.repeat_interleave(label_samples, dim=0) if label_samples > 1 else x
        diag = fisher_diag(model, xs, y_hat, kind="empirical", batch_size=batch_size)
    per_layer: dict[str, float] = {}
    for name, f in diag.items():
        layer = layer_of(name)
        per_layer[layer] = per_layer.get(layer, 0.0) + float(f.double().sum())
    return FisherTrace(sum(per_layer.values()), per_layer)


def probe_subset(n_total: int, size: int, seed: int) -> Tensor:
    """Sorted positions of a fixed probe subset: ``size`` of ``n_total`` without replacement (seeded)."""
    if size < 1:
        raise ValueError(f"probe size must be ≥ 1, got {size}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.sort(torch.randperm(n_total, generator=g)[:min(size, n_total)]).values


@dataclass
class FisherTraceMonitor:
    """Records tr(F) of ``model`` on the fixed probe inputs ``x_probe`` every ``every`` epochs (or steps).

    Use with scrubnet's loop — ``sgd_loop(..., on_epoch=monitor.on_epoch)`` (or ``on_step=monitor.on_step``
    with ``unit="step"``) — or call :meth:`record` from your own loop with the epoch/step number. The model's
    labels are drawn from the monitor's own generator (seeded by ``seed``), so monitoring never changes the
    training run's random stream nor its weights.

    ``history``: [(t, total, per_layer)]; :attr:`peak`, :attr:`peak_at`, :attr:`final`, :meth:`summary`.
    """

    model: nn.Module
    x_probe: Tensor
    every: int = 1
    unit: str = "epoch"
    mode: str = "sampled"
    label_samples: int = 1
    seed: int = 0
    history: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"every must be ≥ 1, got {self.every}")
        if self.unit not in ("epoch", "step"):
            raise ValueError(f"unit must be 'epoch' or 'step', got {self.unit!r}")
        if self.mode not in FISHER_TRACE_MODES:
            raise ValueError(f"unknown Fisher-trace mode {self.mode!r}; choose one of {', '.join(FISHER_TRACE_MODES)}")
        self.generator = torch.Generator(device=self.x_probe.device).manual_seed(int(self.seed))

    def record(self, t: int) -> FisherTrace:
        """Measure tr(F) now and store it under time ``t`` (epoch or step)."""
        tr = fisher_trace(self.model, self.x_probe, mode=self.mode, generator=self.generator,
                          label_samples=self.label_samples)
        self.history.append((int(t), tr.total, tr.per_layer))
        return tr

    def on_epoch(self, epoch: int) -> None:
        if self.unit == "epoch" and epoch % self.every == 0:
            self.record(epoch)

    def on_step(self, step: int) -> None:
        if self.unit == "step" and step % self.every == 0:
            self.record(step)

    @property
    def times(self) -> list[int]:
        return [t for t, _, _ in self.history]

    @property
    def totals(self) -> list[float]:
        return [v for _, v, _ in self.history]

    @property
    def peak(self) -> float:
        return max(self.totals) if self.history else float("nan")

    @property
    def peak_at(self) -> int | None:
        """The epoch (or step) of the running peak (the first one on ties)."""
        if not self.history:
            return None
        vals = self.totals
        return self.history[vals.index(max(vals))][0]

    @property
    def final(self) -> float:
        return self.history[-1][1] if self.history else float("nan")

    def summary(self) -> dict:
        """{"unit", "mode", "times", "trace", "per_layer": {layer: [...]}, "peak", "peak_at", "final"}."""
        layers = list(self.history[0][2]) if self.history else []
        return {"unit": self.unit, "mode": self.mode, "times": self.times, "trace": self.totals,
                "per_layer": {k: [h[2][k] for h in self.history] for k in layers},
                "peak": self.peak, "peak_at": self.peak_at, "final": self.final}
