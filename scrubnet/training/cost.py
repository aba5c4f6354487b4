"""What a forgetting method will cost, before it runs: FLOPs, seconds, peak memory, passes over the data.

The shared cost engine. Each method declares its own estimate on its class (``ForgettingMethod.cost``);
``scrubnet.estimate`` (:func:`scrubnet.cost_guard.estimate`) dispatches to it. A method's estimate counts, from
the model (one probe sample through :class:`torch.utils.flop_counter.FlopCounterMode`), N and c and the
method's options, with the helpers here (:func:`train_cost`, :func:`fisher_diagonal_cost`, :func:`copy_cost`,
:func:`seconds_at`):

* ``flops``       — FLOPs (FLOP = 2 multiply-adds) of the passes and contractions the method runs;
* ``seconds``     — flops / (measured float32 GEMM rate of this process × the method's calibrated efficiency):
                    the rate is timed once per process and device (:func:`matmul_rate`; CPU: process CPU time; median of 3
                    1024³ products); the efficiencies (:data:`EFFICIENCY`) are measured ratios of achieved to
                    GEMM rate ("Cost model" in docs/decisions/index.md);
* ``peak_bytes``  — working memory above the model and the data (the method's buffers under its budget);
* ``passes``      — forward+backward passes over the data (per-sample units: one forward and one backward of
                    every sample of the set it runs on count as one).

:func:`check_budget` refuses (``BudgetExceeded``, a ``ValueError``) an estimate over ``max_seconds`` or
``max_bytes`` with the estimate in the message; the CLI's ``--max-seconds`` / ``--memory`` and ``--dry-run``
use these before any work. Open-ended methods are estimated at their caps (upper bounds): ``retrain`` at the
config's ``max_epochs``, Newton at ``max_iter`` CG iterations, NTK-CG at ``cg_max_iter``; the fine-tuning
baselines run a fixed number of epochs (``epochs``, default the protocol's 10). ``benchmarks/cost_check.py``
measures each estimate at a fixed amount of work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from scrubnet.curvature.fisher import DEFAULT_BUDGET_BYTES as FISHER_BUDGET, plan_fisher
from scrubnet.curvature.ntk import activation_numel_per_sample
from scrubnet.models import eval_mode
from scrubnet.models.flops import NONGEMM_FLOP_EQUIV, count_work

# achieved FLOP rate / float32 GEMM rate, one thread, fitted by least squared log-ratio on the cases of
# benchmarks/cost_check.py ("Cost model" in docs/decisions/index.md): "train" = SGD steps (forward + backward +
# optimiser, batch 128); "newton" = batched matrix-free passes (Newton's GGN products, NTK's VJP/JVP and CG
# products, no-grad evaluation forwards); "ntk" = the NTK Gram and its float64 Cholesky factorisations
EFFICIENCY = {"fisher": 0.7, "ntk": 0.31, "train": 0.58, "newton": 0.57}
# memory-bound elementwise work (BatchNorm, ReLU, sums, forward and backward) per activation element touched,
# in GEMM-FLOP equivalents: fitted with the Fisher efficiency on five ResNet-18 sizes (decisions.md). The
# batched-columns path (all K columns per backward, small nets) fits 775–850 on the first call in a fresh
# process (what tests/methods/test_cost.py and a CLI user measure; page faults of its K-fold larger tensors included),
# so one constant serves both paths; after a first call the batched path runs at ≈ 550.
ELEMENTWISE_FLOP_EQUIV = 800.0
# the same for networks without convolutions (no unfolding, no BatchNorm over positions): measured on the
# default experiment's MLP (N = 475 and 4,000) and a 40-512-512-10 MLP (N = 2,000), where 800 made the
# estimate 2.5–3× the measured CPU time; with 200 it is 1.3–1.5× (decisions.md, "Realistic sizes")
ELEMENTWISE_FLOP_EQUIV_DENSE = 200.0
# per-step overhead of the training loop (Python, the per-tensor optimiser update and L2 pull, autograd
# bookkeeping) per trainable parameter tensor per optimiser step, in GEMM-FLOP equivalents: measured at batch
# sizes 1–2 where the FLOPs are negligible, 0.14–0.23 ms per tensor per step at a 75 GFLOP/s GEMM rate on
# the MLP, a 2-D CNN and the ResNet-18 ×0.25 (decisions.md); half the MLP's time per step at batch 128
STEP_OVERHEAD_FLOP_EQUIV = 1.2e7


@dataclass
class CostEstimate:
    """The predicted cost of one call of a method (module docstring for how each field is counted).

    Parameters
    ----------
    method : str
        The registered method's name.
    flops : float
        FLOPs of the passes and contractions the method runs (1 multiply-add = 2 FLOPs).
    seconds : float
        Predicted wall time on this process and device (seconds).
    peak_bytes : int
        Working memory above the model and the data (bytes).
    passes : float
        Forward+backward passes over the data, in per-sample units.
    details : dict of str to float or str
        The method's own breakdown (e.g. per phase FLOPs, the solver chosen).
    retrain_flops, retrain_seconds : float or None
        The retraining reference's FLOPs and seconds (:meth:`against`), None until set.
    cost_vs_retrain : float or None
        ``seconds / retrain_seconds``, None until the reference is set.
    seconds_upper : float or None
        A true upper bound when ``seconds`` is a typical case (Newton at its defaults), else None; the refusal
        ceilings (:func:`check_budget`, the budgeted modes) use it (:attr:`ceiling`).
    cost_vs_retrain_upper : float or None
        ``seconds_upper / retrain_seconds`` (set with the reference when ``seconds_upper`` is).

    Returns
    -------
    CostEstimate
        What :func:`scrubnet.estimate` returns; :func:`check_budget` compares it with ``max_seconds`` /
        ``max_bytes``.
    """

    method: str
    flops: float
    seconds: float
    peak_bytes: int
    passes: float
    details: dict[str, float | str] = field(default_factory=dict)
    # the reference every cost is compared with: retraining from the model's initialisation with the recipe
    # (:func:`retrain_reference_cost`), and this estimate's seconds as a multiple of it
    retrain_flops: float | None = None
    retrain_seconds: float | None = None
    cost_vs_retrain: float | None = None
    # a method whose ``seconds`` is a typical case (Newton at its defaults: CG stops early) keeps its true upper
    # bound here; the refusal ceilings (:func:`check_budget`, budgeted modes) use the bound (:attr:`ceiling`)
    seconds_upper: float | None = None
    cost_vs_retrain_upper: float | None = None

    @property
    def ceiling(self) -> float:
        """The seconds a refusal is decided on: ``seconds_upper`` when the method states one, else ``seconds``."""
        return self.seconds if self.seconds_upper is None else self.seconds_upper

    @property
    def ceiling_vs_retrain(self) -> float | None:
        """:attr:`ceiling` / ``retrain_seconds`` (None without a reference)."""
        return self.cost_vs_retrain if self.cost_vs_retrain_upper is None else self.cost_vs_retrain_upper

    def as_dict(self) -> dict:
        return asdict(self)

    def against(self, reference: "CostEstimate") -> "CostEstimate":
        """Set the retraining reference (``retrain_flops``, ``retrain_seconds``) and ``cost_vs_retrain`` =
        seconds / retrain_seconds; returns self."""
        self.retrain_flops, self.retrain_seconds = float(reference.flops), float(reference.seconds)
        self.cost_vs_retrain = self.seconds / max(self.retrain_seconds, 1e-12)
        if self.seconds_upper is not None:
            self.cost_vs_retrain_upper = self.seconds_upper / max(self.retrain_seconds, 1e-12)
        if "request_seconds" in self.details:   # a method with a one-time build prices its request apart
            self.details["request_vs_retrain"] = self.details["request_seconds"] / max(self.retrain_seconds, 1e-12)
        return self

    def summary(self) -> str:
        line = (f"{self.method}: {self.flops / 1e12:.3g} TFLOP ≈ {format_seconds(self.seconds)} on this machine "
                + (f" (at most {format_seconds(self.seconds_upper)})" if self.seconds_upper is not None else "")
                + f" (one thread), peak ≈ {format_bytes(self.peak_bytes)}, {self.passes:.4g} passes over the data")
        if self.cost_vs_retrain is not None:
            line += (f"; retraining ≈ {format_seconds(self.retrain_seconds)}, so {self.cost_vs_retrain:.3g}× "
                     "retraining")
        return line


class BudgetExceeded(ValueError):
    """An estimate over the caller's time or memory budget (raised before any work)."""


def format_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def format_bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{int(b)} B"


_RATE: dict[str, float] = {}


def measure_gemm_rate(device: torch.device | str = "cpu", size: int = 1024, reps: int = 3) -> float:
    """The float32 GEMM rate in FLOP/s on ``device``, measured now (CPU: this process's CPU time on the current
    thread count; CUDA: wall time after a synchronise): median of ``reps`` size³ products after a warm-up."""
    dev = torch.device(device)
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    cuda = dev.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    a @ b
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = clock()
        a @ b
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(max(clock() - t0, 1e-9))
    return 2.0 * size ** 3 / statistics.median(times)


def matmul_rate(device: torch.device | str = "cpu", size: int = 1024, reps: int = 3) -> float:
    """:func:`measure_gemm_rate`, measured once per process and device."""
    key = str(torch.device(device))
    if key not in _RATE:
        _RATE[key] = measure_gemm_rate(device, size, reps)
    return _RATE[key]


def forward_work(model: nn.Module, x1: Tensor, backward: bool = False) -> tuple[float, float]:
    """One sample's (GEMM FLOPs, non-GEMM elements) in eval mode, forward only or a training step
    (:func:`scrubnet.models.flops.count_work`)."""
    with eval_mode(model):
        return count_work(model, x1, backward=backward)


def forward_flops(model: nn.Module, x1: Tensor) -> float:
    """FLOPs of one sample's forward pass, eval mode: matmuls, convolutions and attention products, plus the
    non-GEMM elements (softmax, LayerNorm, GELU/SiLU) at :data:`NONGEMM_FLOP_EQUIV` GEMM-FLOP equivalents each
    (zero on nets without them: MLPs, convolutional nets)."""
    gemm, elements = forward_work(model, x1)
    return gemm + NONGEMM_FLOP_EQUIV * elements


def train_step_flops(model: nn.Module, x1: Tensor) -> float:
    """FLOPs of one sample's training step: the forward, and the backward of its cross-entropy to every
    trainable parameter (the input's gradient is not computed, as in training), eval mode, counted as
    :func:`forward_flops` counts (non-GEMM elements at their equivalents); ``.grad`` and buffers untouched."""
    gemm, elements = forward_work(model, x1, backward=True)
    return gemm + NONGEMM_FLOP_EQUIV * elements


_DEVICE: list[torch.device] = [torch.device("cpu")]   # the device of the model being estimated


def estimating_on(device: torch.device | str) -> None:
    """Set the device whose GEMM rate :func:`seconds_at` and :func:`gemm_seconds` use (the probe's device;
    :func:`scrubnet.cost_guard.estimate` sets it before calling a method's ``cost``)."""
    _DEVICE[0] = torch.device(device)


#: product passes (the JVPs and VJPs of Newton's and the NTK's CG) on a network with BatchNorm also run its
#: normalisation, ReLU and residual adds in every pass, memory-bound work the FLOP count leaves out; the factor
#: on their seconds was fitted on benchmarks/cost_check.py's ResNet Newton and NTK-CG cases (1.72–2.58× their
#: estimates without it, the MLP's 1.20–1.59×; docs/decisions/cost-transformers.md)
BATCHNORM_PRODUCT_FACTOR = 1.5


#: per-sample passes through ``nn.LSTM`` (the Fisher diagonal's per-sample gradients, the NTK Gram's Jacobian
#: rows): vmap has no batching rule for the fused oneDNN kernel, so they run sample by sample; the factors on
#: those passes' seconds were fitted on benchmarks/cost_check.py's LSTM cases (docs/decisions/cost-vs-retrain.md)
RECURRENT_PER_SAMPLE_FACTOR = {"fisher": 11.5, "ntk": 3.0}


def per_sample_factor(model: nn.Module, kind: str) -> float:
    """:data:`RECURRENT_PER_SAMPLE_FACTOR` ``[kind]`` for a network holding an ``nn.LSTM``, else 1."""
    return RECURRENT_PER_SAMPLE_FACTOR[kind] if any(isinstance(m, nn.LSTM) for m in model.modules()) else 1.0


def product_factor(model: nn.Module) -> float:
    """:data:`BATCHNORM_PRODUCT_FACTOR` for a network with BatchNorm layers, else 1."""
    bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return BATCHNORM_PRODUCT_FACTOR if bn else 1.0


def seconds_at(flops: float, kind: str) -> float:
    """Seconds for ``flops`` at the measured GEMM rate times the efficiency of ``kind`` (:data:`EFFICIENCY`)."""
    return flops / (matmul_rate(_DEVICE[0]) * EFFICIENCY[kind])


def gemm_seconds(flops_equiv: float) -> float:
    """Seconds for ``flops_equiv`` GEMM-FLOP equivalents at the measured GEMM rate (efficiency 1)."""
    return flops_equiv / matmul_rate(_DEVICE[0])


def trainable_numel(model: nn.Module) -> int:
    """Number of trainable parameters p."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_budget(est: CostEstimate, *, max_seconds: float | None = None, max_bytes: float | None = None,
                 max_cost_vs_retrain: float | None = None) -> None:
    """Raise :class:`BudgetExceeded` (with the estimate) when ``est`` is over any budget: ``max_seconds``
    (s), ``max_bytes`` (peak working memory) or ``max_cost_vs_retrain`` (a multiple of the retraining
    estimate). Time is judged on :attr:`CostEstimate.ceiling` (the upper bound where the estimate states one)
    and :attr:`CostEstimate.ceiling_vs_retrain`."""
    if max_cost_vs_retrain is not None:
        if not max_cost_vs_retrain > 0:
            raise ValueError(f"max_cost_vs_retrain must be > 0, got {max_cost_vs_retrain}")
        if est.cost_vs_retrain is None:
            raise ValueError("the estimate carries no retraining reference (estimate(..., recipe=...))")
        if est.ceiling_vs_retrain > max_cost_vs_retrain:
            raise BudgetExceeded(f"refused before any work: estimated {est.ceiling_vs_retrain:.3g}× retraining > the "
                                 f"{max_cost_vs_retrain:g}× allowed ({est.summary()})")
    if max_seconds is not None and est.ceiling > max_seconds:
        raise BudgetExceeded(f"refused before any work: estimated {format_seconds(est.ceiling)} > the "
                             f"{format_seconds(max_seconds)} allowed ({est.summary()})")
    if max_bytes is not None and est.peak_bytes > max_bytes:
        raise BudgetExceeded(f"refused before any work: estimated peak memory {format_bytes(est.peak_bytes)} > the "
                             f"{format_bytes(max_bytes)} allowed ({est.summary()})")


# --------------------------------------------------------------------------------------------------
# the shared pieces of the methods' estimates
# --------------------------------------------------------------------------------------------------

def fisher_diagonal_cost(model: nn.Module, x1: Tensor, n_r: int, kind: str = "true", batch_size: int | None = None,
                         budget_bytes: int = FISHER_BUDGET) -> CostEstimate:
    """The Fisher diagonal on ``n_r`` samples (:func:`~scrubnet.curvature.fisher.plan_fisher`): its GEMM work at
    the Fisher efficiency plus the elementwise work per activation element touched."""
    plan = plan_fisher(model, x1, n_r, kind=kind, budget_bytes=budget_bytes, batch_size=batch_size)
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    equiv = ELEMENTWISE_FLOP_EQUIV if conv else ELEMENTWISE_FLOP_EQUIV_DENSE
    seconds = per_sample_factor(model, "fisher") * (seconds_at(plan.flops, "fisher")
                                                    + gemm_seconds(equiv * plan.activation_elements))
    return CostEstimate("fisher", plan.flops, seconds, plan.peak_bytes, float(plan.passes),
                        {"batch": plan.batch, "budget_bytes": budget_bytes})


def train_cost(model: nn.Module, x1: Tensor, n_train: int, epochs: int, batch_size: int,
               eval_forwards: float = 0.0) -> CostEstimate:
    """``epochs`` SGD epochs over ``n_train`` samples, each a forward + backward (:func:`train_step_flops`) and
    an optimiser step, at the training efficiency, plus :data:`STEP_OVERHEAD_FLOP_EQUIV` per parameter tensor
    per optimiser step (batches of ``batch_size``); plus ``eval_forwards`` forward passes over them
    without autograd in large batches (the error checks), which run like Newton's batched products, at its
    efficiency."""
    steps = epochs * n_train * train_step_flops(model, x1)
    evals = eval_forwards * n_train * forward_flops(model, x1)
    batch = min(int(batch_size), max(n_train, 1))
    n_steps = epochs * -(-n_train // batch)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    overhead = gemm_seconds(STEP_OVERHEAD_FLOP_EQUIV * tensors * n_steps)
    peak = 4 * trainable_numel(model) * 3 + batch * 3 * 4 * activation_numel_per_sample(model, x1)
    return CostEstimate("train", steps + evals, seconds_at(steps, "train") + seconds_at(evals, "newton") + overhead,
                        int(peak), float(epochs), {"epochs": epochs, "train_samples": n_train, "eval_flops": evals,
                                                   "optimiser_steps": n_steps, "step_overhead_seconds": overhead})


def retrain_reference_cost(model: nn.Module, x1: Tensor, n_retain: int, epochs: int,
                           batch_size: int) -> CostEstimate:
    """Retraining from the model's initialisation with the recipe: ``epochs`` SGD epochs over D_r in batches of
    ``batch_size`` (:func:`train_cost`, no error checks: the recipe runs a fixed number of epochs). The
    reference that :attr:`CostEstimate.cost_vs_retrain` divides by.

    Parameters
    ----------
    model : nn.Module
        The model (its architecture fixes the FLOPs per sample).
    x1 : Tensor
        One probe input, shape (1, ...).
    n_retain : int
        |D_r|.
    epochs, batch_size : int
        The recipe's epochs and batch size.

    Returns
    -------
    CostEstimate
        ``method = "retrain (recipe)"``; ``flops`` = epochs · n_retain · (one sample's training step FLOPs).
    """
    est = train_cost(model, x1, int(n_retain), int(epochs), int(batch_size))
    est.method = "retrain (recipe)"
    return est


def copy_cost(model: nn.Module) -> CostEstimate:
    """A method that copies or edits the model without a pass over the data: O(p)."""
    p = trainable_numel(model)
    return CostEstimate("copy", float(p), seconds_at(float(p), "train"), 4 * p, 0.0)
