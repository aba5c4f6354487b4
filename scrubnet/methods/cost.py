"""What a forgetting method will cost, before it runs: FLOPs, seconds, peak memory, passes over the data.

:func:`estimate` ``(model, n_retain, n_forget, method=..., num_classes=..., **options)`` returns a
:class:`CostEstimate` from the method's registered cost function (:func:`register_cost`, keyed by method name,
so the methods' own modules stay untouched). Each cost function counts, from the model (one probe sample
through :class:`torch.utils.flop_counter.FlopCounterMode`), N and c and the method's options:

* ``flops``       — FLOPs (FLOP = 2 multiply-adds) of the passes and contractions the method runs;
* ``seconds``     — flops / (measured float32 GEMM rate of this process × the method's calibrated efficiency):
                    the rate is timed once per process and device (:func:`matmul_rate`; CPU: process CPU time; median of 3
                    1024³ products); the efficiencies (:data:`EFFICIENCY`) are measured ratios of achieved to
                    GEMM rate ("Cost model" in docs/decisions.md);
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.curvature.fisher import DEFAULT_BUDGET_BYTES as FISHER_BUDGET, plan_fisher
from scrubnet.curvature.ntk import DEFAULT_BUDGET as NTK_BUDGET, activation_numel_per_sample, gram_bytes, \
    ntk_gram_flops, ntk_gram_schedule
from scrubnet.models import eval_mode
from scrubnet.models.call import call_model
from scrubnet.recipe import PROTOCOL_BASELINE_EPOCHS
from scrubnet.training import DEFAULT_RETRAIN_MODE, TrainConfig

# achieved FLOP rate / float32 GEMM rate, one thread, fitted by least squared log-ratio on the cases of
# benchmarks/cost_check.py ("Cost model" in docs/decisions.md): "train" = SGD steps (forward + backward +
# optimiser, batch 128); "newton" = batched matrix-free passes (Newton's GGN products, NTK's VJP/JVP and CG
# products, no-grad evaluation forwards); "ntk" = the NTK Gram and its float64 Cholesky factorisations
EFFICIENCY = {"fisher": 0.7, "ntk": 0.31, "train": 0.58, "newton": 0.57}
# memory-bound elementwise work (BatchNorm, ReLU, sums, forward and backward) per activation element touched,
# in GEMM-FLOP equivalents: fitted with the Fisher efficiency on five ResNet-18 sizes (decisions.md). The
# batched-columns path (all K columns per backward, small nets) fits 775–850 on the first call in a fresh
# process (what tests/test_cost.py and a CLI user measure; page faults of its K-fold larger tensors included),
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
# memory-bound work per entry of the NTK's float64 Grams (Θ over D and its block over D_r) in the Cholesky
# solves, in GEMM-FLOP equivalents: the identity and ridge-shifted copy, the factor's allocation, the two
# triangular solves and the residual product. Measured by profiling the MLP at N = 1,000 (5,000 Gram rows):
# 1.0 s of the solves' 3.2 s CPU time outside the factorisations (decisions.md)
GRAM_ENTRY_FLOP_EQUIV = 1800.0


@dataclass
class CostEstimate:
    """The predicted cost of one call of a method (see the module docstring for each field)."""

    method: str
    flops: float
    seconds: float
    peak_bytes: int
    passes: float
    details: dict[str, float | str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.method}: {self.flops / 1e12:.3g} TFLOP ≈ {format_seconds(self.seconds)} on this machine "
                f"(one thread), peak ≈ {format_bytes(self.peak_bytes)}, {self.passes:.4g} passes over the data")


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


CostFn = Callable[..., CostEstimate]
_COSTS: dict[str, CostFn] = {}


def register_cost(*names: str) -> Callable[[CostFn], CostFn]:
    """Register a cost function ``fn(model, x1, n_retain, n_forget, num_classes, config, **options)``."""
    def deco(fn: CostFn) -> CostFn:
        for n in names:
            _COSTS[n] = fn
        return fn
    return deco


def costed_methods() -> list[str]:
    return sorted(_COSTS)


def forward_flops(model: nn.Module, x1: Tensor) -> float:
    """FLOPs of one sample's forward pass (matmuls and convolutions), eval mode."""
    with eval_mode(model), torch.no_grad(), FlopCounterMode(display=False) as counter:
        call_model(model, x1[:1])
    return float(counter.get_total_flops())


def train_step_flops(model: nn.Module, x1: Tensor) -> float:
    """FLOPs of one sample's training step: the forward, and the backward of its cross-entropy to every
    trainable parameter (matmuls and convolutions; the input's gradient is not computed, as in training),
    eval mode; the model's ``.grad`` and buffers are left untouched."""
    params = [p for p in model.parameters() if p.requires_grad]
    with eval_mode(model), torch.enable_grad(), FlopCounterMode(display=False) as counter:
        out = call_model(model, x1[:1])
        target = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
        torch.autograd.grad(F.cross_entropy(out, target), params, allow_unused=True)
    return float(counter.get_total_flops())


_DEVICE: list[torch.device] = [torch.device("cpu")]   # the device of the model being estimated


def _seconds(flops: float, kind: str) -> float:
    return flops / (matmul_rate(_DEVICE[0]) * EFFICIENCY[kind])


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate(model: nn.Module, n_retain: int, n_forget: int, *, method: str, num_classes: int | None = None,
             x_probe: Tensor | None = None, in_shape: tuple[int, ...] | None = None,
             config: TrainConfig | None = None, **options) -> CostEstimate:
    """Predicted cost of ``method`` on ``model`` with |D_r| = ``n_retain``, |D_f| = ``n_forget``.

    One probe sample fixes the input shape: ``x_probe`` (a batch; its first sample is used) or ``in_shape``
    (zeros of that shape). ``num_classes`` defaults to the model's output width; ``config`` (fine-tuning
    hyperparameters) is used by the training-based methods; ``options`` are the method's own options (the
    same keywords as ``get_method(method, **options)``)."""
    if method not in _COSTS:
        raise ValueError(f"no cost model for method {method!r}; methods with one: {', '.join(costed_methods())}")
    if int(n_retain) < 1 or int(n_forget) < 0:
        raise ValueError(f"need n_retain ≥ 1 and n_forget ≥ 0, got {n_retain} and {n_forget}")
    if x_probe is None:
        if in_shape is None:
            raise ValueError("estimate needs x_probe (a batch of inputs) or in_shape")
        param = next(model.parameters())
        x_probe = torch.zeros((1, *in_shape), dtype=param.dtype, device=param.device)
    x1 = x_probe[:1]
    if num_classes is None:
        with eval_mode(model), torch.no_grad():
            num_classes = int(call_model(model, x1).shape[-1])
    _DEVICE[0] = x1.device
    est = _COSTS[method](model, x1, int(n_retain), int(n_forget), int(num_classes), config or TrainConfig(),
                         **options)
    est.method = method
    return est


def check_budget(est: CostEstimate, *, max_seconds: float | None = None, max_bytes: float | None = None) -> None:
    """Raise :class:`BudgetExceeded` (with the estimate) when ``est`` is over either budget."""
    if max_seconds is not None and est.seconds > max_seconds:
        raise BudgetExceeded(f"refused before any work: estimated {format_seconds(est.seconds)} > the "
                             f"{format_seconds(max_seconds)} allowed ({est.summary()})")
    if max_bytes is not None and est.peak_bytes > max_bytes:
        raise BudgetExceeded(f"refused before any work: estimated peak memory {format_bytes(est.peak_bytes)} > the "
                             f"{format_bytes(max_bytes)} allowed ({est.summary()})")


# --------------------------------------------------------------------------------------------------
# cost functions
# --------------------------------------------------------------------------------------------------

def _fisher_cost(model, x1, n_r, kind="true", batch_size=None, budget_bytes=FISHER_BUDGET) -> CostEstimate:
    plan = plan_fisher(model, x1, n_r, kind=kind, budget_bytes=budget_bytes, batch_size=batch_size)
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    equiv = ELEMENTWISE_FLOP_EQUIV if conv else ELEMENTWISE_FLOP_EQUIV_DENSE
    seconds = _seconds(plan.flops, "fisher") + equiv * plan.activation_elements / matmul_rate(_DEVICE[0])
    return CostEstimate("fisher", plan.flops, seconds, plan.peak_bytes, float(plan.passes),
                        {"batch": plan.batch, "budget_bytes": budget_bytes})


@register_cost("fisher")
def fisher_cost(model, x1, n_r, n_f, c, config, *, kind: str = "true", batch_size: int | None = None,
                **_options) -> CostEstimate:
    """Fisher forgetting: the Fisher diagonal on D_r (:func:`~scrubnet.curvature.fisher.plan_fisher`) and
    one noise draw (O(p))."""
    est = _fisher_cost(model, x1, n_r, kind=kind, batch_size=batch_size)
    est.method = "fisher"
    return est


def ntk_solver(n_rows: int, memory_budget_bytes: int, solver: str = "auto") -> str:
    """Cholesky when the float64 Gram fits in half the budget (the method's own rule), else CG."""
    if solver != "auto":
        return solver
    return "cholesky" if gram_bytes(n_rows) <= memory_budget_bytes // 2 else "cg"


@register_cost("ntk")
def ntk_cost(model, x1, n_r, n_f, c, config, *, memory_budget_bytes: int = NTK_BUDGET, solver: str = "auto",
             cg_max_iter: int = 1000, pull: str = "w0", **_options) -> CostEstimate:
    """NTK scrub: Gram Θ over D = D_r ⊔ D_f (every Jacobian row once + per-layer contraction,
    :func:`~scrubnet.curvature.ntk.ntk_gram_flops`), two float64 Cholesky factorisations ((Nc)³/3 and
    (N_r c)³/3), the JVP of the w_0 pull and two VJPs (≈ 3 forwards each over D). With CG (Gram over half
    the budget) every iteration is one VJP + one JVP over D and over D_r, ``cg_max_iter`` at most (upper
    bound; exactly that many when the tolerance is not reached). The Gram and the factorisations run at the
    NTK efficiency, plus :data:`GRAM_ENTRY_FLOP_EQUIV` per Gram entry for the solves' memory-bound work; the
    VJP/JVP passes are batched forward/backward products like Newton's and run at its efficiency. Peak: the
    float64 Gram, its Cholesky copy and factor (3·8·(Nc)²) plus the Gram's buffer budget (an upper bound: the
    solves hold ≈ 5 Grams at once, fewer than 3 Grams + the budget since a Gram is at most half the budget on
    this path). ntk-fisher adds the Fisher diagonal at the scrubbed point."""
    n = n_r + n_f
    rows, rows_r = n * c, n_r * c
    fwd = forward_flops(model, x1)
    solver = ntk_solver(rows, memory_budget_bytes, solver)
    vjp = 3.0 * fwd
    passes = 3.0 + (1.0 if pull == "w0" else 0.0)
    products = n * vjp * (passes - 1.0) + n * fwd
    gram = 0.0
    schedule: dict = {}
    if solver == "cholesky":
        g = ntk_gram_flops(model, x1, n)
        # when the factors do not fit: layer groups or chunks capture (and rebuild) more than once
        schedule = ntk_gram_schedule(model, x1, n, memory_budget_bytes=memory_budget_bytes)
        gram = g["total"] + (rows ** 3 + rows_r ** 3) / 3.0
        passes += c
        peak = 3 * gram_bytes(rows) + memory_budget_bytes
    else:
        products += cg_max_iter * 2.0 * vjp * (n + n_r)
        passes += 2.0 * cg_max_iter * 2
        peak = memory_budget_bytes // 4 + 8 * 4 * _params(model)
    extra = schedule.get("extra_flops", 0.0)
    flops = gram + extra + products
    # the schedule's extra work (captures again, per-row gradients rebuilt: batched GEMMs) at the GEMM rate:
    # at the NTK efficiency it made the estimate 2.3× the measured time of ResNet-18 ×1.0 (11 layer groups)
    seconds = _seconds(gram, "ntk") + extra / matmul_rate(_DEVICE[0]) + _seconds(products, "newton")
    if solver == "cholesky":
        seconds += GRAM_ENTRY_FLOP_EQUIV * (rows ** 2 + rows_r ** 2) / matmul_rate(_DEVICE[0])
    return CostEstimate("ntk", flops, seconds, int(peak), passes,
                        {"solver": solver, "gram_rows": rows, "gram_bytes": gram_bytes(rows),
                         "gram_flops": gram, "schedule_extra_flops": extra, "product_flops": products,
                         **({"gram_schedule": schedule["schedule"], "gram_groups": schedule["groups"]}
                            if schedule else {})})


@register_cost("ntk-fisher")
def ntk_fisher_cost(model, x1, n_r, n_f, c, config, **options) -> CostEstimate:
    est = ntk_cost(model, x1, n_r, n_f, c, config, **options)
    fis = _fisher_cost(model, x1, n_r)
    return CostEstimate("ntk-fisher", est.flops + fis.flops, est.seconds + fis.seconds,
                        max(est.peak_bytes, fis.peak_bytes), est.passes + fis.passes, est.details)


@register_cost("newton")
def newton_cost(model, x1, n_r, n_f, c, config, *, max_iter: int = 300, alpha: float = 0.0,
                batch_size: int = 512, **_options) -> CostEstimate:
    """Newton step by CG on the Gauss–Newton/Hessian of the retain loss: one gradient pass, then at most
    ``max_iter`` GGN-vector products over D_r (each ≈ a JVP + a VJP ≈ 2 forward+backward passes; exactly
    ``max_iter`` when CG does not reach its tolerance), plus the Fisher diagonal when ``alpha`` > 0 (noise).
    One solve: the default "lm" safeguard re-solves with more damping when the step fails its ratio test (at
    most 6 more solves), which this bound does not count."""
    fwd = forward_flops(model, x1)
    fb = 3.0 * fwd
    flops = n_r * fb * (1 + 2.0 * max_iter)
    peak = 10 * 8 * _params(model) + min(batch_size, n_r) * 3 * 4 * activation_numel_per_sample(model, x1)
    passes = 1.0 + 2.0 * max_iter
    if alpha > 0:
        fis = _fisher_cost(model, x1, n_r)
        flops += fis.flops
        passes += fis.passes
        peak = max(peak, fis.peak_bytes)
    return CostEstimate("newton", flops, _seconds(flops, "newton"), int(peak), passes, {"max_iter": max_iter})


def _train_cost(model, x1, n_train: int, epochs: int, config, eval_forwards: float = 0.0) -> CostEstimate:
    """``epochs`` SGD epochs over ``n_train`` samples, each a forward + backward (:func:`train_step_flops`) and
    an optimiser step, at the training efficiency, plus :data:`STEP_OVERHEAD_FLOP_EQUIV` per parameter tensor
    per optimiser step (batches of ``config.batch_size``); plus ``eval_forwards`` forward passes over them
    without autograd in large batches (the error checks), which run like Newton's batched products, at its
    efficiency."""
    steps = epochs * n_train * train_step_flops(model, x1)
    evals = eval_forwards * n_train * forward_flops(model, x1)
    batch = min(int(config.batch_size), max(n_train, 1))
    n_steps = epochs * -(-n_train // batch)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    overhead = STEP_OVERHEAD_FLOP_EQUIV * tensors * n_steps / matmul_rate(_DEVICE[0])
    peak = 4 * _params(model) * 3 + batch * 3 * 4 * activation_numel_per_sample(model, x1)
    return CostEstimate("train", steps + evals, _seconds(steps, "train") + _seconds(evals, "newton") + overhead,
                        int(peak), float(epochs), {"epochs": epochs, "train_samples": n_train, "eval_flops": evals,
                                                   "optimiser_steps": n_steps, "step_overhead_seconds": overhead})


@register_cost("retrain")
def retrain_cost(model, x1, n_r, n_f, c, config, *, mode: str | None = None, **_options) -> CostEstimate:
    """Retrain from w_0 (:func:`scrubnet.training.retrain`): at the config's epoch cap ``max_epochs`` (upper
    bound: training stops ``extra_epochs`` after zero training error), over D (mode "replace", the default:
    forgotten samples replaced by retained ones) or D_r ("remove"); the stopping rule evaluates the training
    error after every epoch (one forward over the set), and the final loss is one more forward."""
    ep = int(config.max_epochs)
    n = n_r if (mode or DEFAULT_RETRAIN_MODE) == "remove" else n_r + n_f
    return _train_cost(model, x1, n, ep, config, eval_forwards=ep + 1.0)


@register_cost("finetune")
def finetune_cost(model, x1, n_r, n_f, c, config, *, epochs: int | None = None, **_options) -> CostEstimate:
    """Finetune: ``epochs`` epochs on D_r (default the protocol recipe's :data:`PROTOCOL_BASELINE_EPOCHS`, the
    number the method runs: a fixed count, not a cap)."""
    return _train_cost(model, x1, n_r, int(PROTOCOL_BASELINE_EPOCHS if epochs is None else epochs), config)


@register_cost("neggrad", "randomlabels")
def relabel_cost(model, x1, n_r, n_f, c, config, *, epochs: int | None = None, **_options) -> CostEstimate:
    """NegGrad / Random labels: ``epochs`` epochs (default :data:`PROTOCOL_BASELINE_EPOCHS`) on all of D."""
    return _train_cost(model, x1, n_r + n_f, int(PROTOCOL_BASELINE_EPOCHS if epochs is None else epochs), config)


@register_cost("original", "hiding")
def trivial_cost(model, x1, n_r, n_f, c, config, **_options) -> CostEstimate:
    """Methods that copy or edit the model without a pass over the data: O(p)."""
    p = _params(model)
    return CostEstimate("copy", float(p), _seconds(float(p), "train"), 4 * p, 0.0)
