"""Benchmark: the vectorised true-Fisher diagonal against the best exact library (BackPACK) and the authors' loop.

Yardstick: BackPACK's ``DiagGGNExact`` (``backpack-for-pytorch==1.7.1``), the exact GGN diagonal, which for
softmax cross-entropy is the true Fisher diagonal (divided by N for the mean). BackPACK is not a scrubnet
dependency: the benchmark installs it (``pip install --no-deps``, with its two small pure-Python
dependencies) only when it is missing, without touching the pinned torch; ``--no-backpack`` skips it.

For each model, on the same model and data: ``fisher_diag`` with its default (layerwise kernels,
method="auto") and with method="vmap" (pure torch.func), BackPACK's DiagGGNExact, and ``fisher_diag_loop``
(batch size 1, one backward per class per sample, the authors' protocol). After one warm-up call of each,
the contenders are timed ``--reps`` times (≥ 3) in alternation (default, vmap, BackPACK, loop, default, …)
and the median is reported, on one torch thread by default. Prints the median times, the peak resident
memory of each, the max relative difference of every diagonal to the loop's (elementwise over entries above
1e-6 of their tensor's maximum, and normwise per tensor), and the ratios. Models:

* ``mlp``   — the embedded default experiment's MLP (40-256-256-5), N = 475 (its |D_r|), 5 classes;
* ``resnet18`` — the CIFAR ResNet-18 (``--width``, default 1.0: 11.2 M parameters, BatchNorm in eval mode),
  3×32×32 inputs, N = 256, 10 classes; the batch-size-1 loop is skipped (hours) and every diagonal is
  compared with BackPACK's instead;
* ``cnn2d`` — the small 2-D CNN with BatchNorm (eval mode, non-trivial running statistics), 1×8×8 inputs
  (digits-sized), N = 300, 10 classes.

Each model also prints its FLOP floor (``plan_fisher``'s FLOPs at this thread's measured float32 GEMM rate)
and ``ratio_to_floor`` (scrubnet's default time over it). The last lines are ``speedup_vs_loop: X``, ``ratio_to_floor: Z`` and ``speedup: Y`` — Y is
BackPACK's median time over scrubnet's default path on the first model listed (> 1: scrubnet is faster).
Times are CPU seconds of the process (``time.process_time``): with one thread that is the work done, whatever
other jobs share the machine.

    python benchmarks/fisher_diag.py [--models mlp,cnn2d] [--threads 1] [--reps 3] [--dtype float32]
    python benchmarks/fisher_diag.py --model resnet18 --width 1.0 --n 256

Peak memory is the process's VmHWM (Linux; reset through /proc/self/clear_refs before each run) minus the
resident size at the start, falling back to ``resource.getrusage`` max RSS.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import statistics
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag, fisher_diag_loop, plan_fisher
from scrubnet.training.cost import measure_gemm_rate
from scrubnet.models import build_model

MODELS = {"resnet18": dict(shape=(3, 32, 32), classes=10, n=256, options={"width": 1.0}),
          "mlp": dict(shape=(40,), classes=5, n=475, options={}),
          "cnn2d": dict(shape=(1, 8, 8), classes=10, n=300, options={}),
          "cnn1d": dict(shape=(40,), classes=5, n=300, options={})}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass  # no /proc (not Linux): fall back to getrusage's high-water mark
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def measure(fn):
    """(result, CPU seconds of the process, peak MiB above the resident size at the start)."""
    _reset_peak()
    base = _rss_kib("VmRSS")
    t0 = time.process_time()   # CPU time of the process: the work done, whatever else shares the cores
    out = fn()
    dt = time.process_time() - t0
    peak = max(0, _rss_kib("VmHWM") - base) / 1024
    return out, dt, peak


def build(model: str, dtype: torch.dtype, n: int | None = None, seed: int = 0, width: float | None = None):
    spec = MODELS[model]
    shape = spec["shape"]
    options = dict(spec["options"])
    if width is not None and "width" in options:
        options["width"] = width
    m = build_model(model, shape, spec["classes"], seed=seed, **options).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # BatchNorm with non-trivial running statistics (eval mode is what is measured)
        for mod in m.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean.copy_(0.1 * torch.randn(mod.running_mean.shape, generator=g))
                mod.running_var.copy_(0.5 + torch.rand(mod.running_var.shape, generator=g))
    x = torch.randn(n or spec["n"], *shape, generator=g, dtype=dtype)
    return m.eval(), x


def rel_diff(fast: dict, slow: dict) -> tuple[float, float]:
    """(max elementwise relative difference over entries > 1e-6·max of their tensor, max normwise)."""
    elem, norm = 0.0, 0.0
    for k in slow:
        a, b = fast[k].double(), slow[k].double()
        scale = float(b.abs().max())
        if scale == 0.0:
            elem = max(elem, float(a.abs().max()))
            continue
        big = b.abs() > 1e-6 * scale
        elem = max(elem, float(((a - b).abs() / b.abs())[big].max()))
        norm = max(norm, float((a - b).abs().max()) / scale)
    return elem, norm


BACKPACK_PINS = ("backpack-for-pytorch==1.7.1", "einops==0.8.2", "unfoldNd==0.2.3")


def load_backpack():
    """The backpack module, installed (``--no-deps``, pinned torch untouched) if missing; None if that fails."""
    try:
        return importlib.import_module("backpack")
    except ImportError:
        pass
    print(f"installing {', '.join(BACKPACK_PINS)} for the yardstick (not a scrubnet dependency)")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *BACKPACK_PINS],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(f"could not install BackPACK: {res.stderr.strip().splitlines()[-1:]}")
        return None
    importlib.invalidate_caches()
    try:
        return importlib.import_module("backpack")
    except ImportError as e:
        print(f"could not import BackPACK: {e}")
        return None


def backpack_fisher(backpack_mod, model: nn.Module, batch: int = 256):
    """A function x → {name: true-Fisher diagonal} by BackPACK's DiagGGNExact on a converted copy of ``model``
    (eval mode), ``batch`` samples per backward (float64 sums across batches). The GGN of Σ_i CE equals Σ_i Jᵀ(diag p − p pᵀ)J, so the mean true Fisher is it / N; the labels
    do not enter the GGN (any label gives the same diagonal)."""
    diag_ggn_exact = importlib.import_module("backpack.extensions").DiagGGNExact  # optional dependency
    ext = backpack_mod.extend(copy.deepcopy(model).eval(), use_converter=True)
    loss_fn = backpack_mod.extend(nn.CrossEntropyLoss(reduction="sum"))
    names = [k for k, _ in model.named_parameters()]

    def run(x):
        acc = None
        for s in range(0, len(x), batch):   # BackPACK holds c columns × batch × activations: mini-batches
            ext.zero_grad()
            xb = x[s:s + batch]
            y = torch.zeros(len(xb), dtype=torch.long)
            with backpack_mod.backpack(diag_ggn_exact()), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")  # BackPACK's own hooks
                loss_fn(ext(xb), y).backward()
            part = [p.diag_ggn_exact.detach().double() for p in ext.parameters()]
            acc = part if acc is None else [a + b for a, b in zip(acc, part)]
        return {k: (a / len(x)).to(p.dtype) for k, a, p in zip(names, acc, ext.parameters())}
    return run


def floor_seconds(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(FLOP floor of the exact true-Fisher diagonal, seconds at this thread's measured float32 GEMM rate).

    Floor: one forward and K backward passes to the layer inputs per sample (each ≈ the forward's FLOPs,
    counted by ``torch.utils.flop_counter``) plus, per layer and per sample, the cheaper exact squared
    per-sample-gradient contraction (K per-sample gradients, or the position Gram for few-position layers) —
    the FLOPs of ``scrubnet.curvature.fisher.plan_fisher``."""
    flops = plan_fisher(model, x[:1], len(x)).flops
    return flops, flops / measure_gemm_rate(size=2048, reps=5)


def bench(model_name: str, dtype: torch.dtype, n: int | None, reps: int, backpack_mod,
          width: float | None = None, loop: bool = True) -> dict:
    model, x = build(model_name, dtype, n, width=width)
    p = sum(t.numel() for t in model.parameters())
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    print(f"\n== {model_name}: {p} parameters{' (BatchNorm, eval mode)' if has_bn else ''}, N={len(x)}, "
          f"classes={MODELS[model_name]['classes']}, {str(dtype).replace('torch.', '')}")
    contenders = {"scrubnet (default)": lambda: fisher_diag(model, x)}
    if loop:   # the pure torch.func path holds B·K·p per-sample gradients: batch 1 on a ResNet (hours)
        contenders["scrubnet (vmap only)"] = lambda: fisher_diag(model, x, method="vmap")
    if backpack_mod is not None:
        # BackPACK's mini-batch: the same working set as scrubnet's plan (its batch), at most 256
        bp = backpack_fisher(backpack_mod, model, batch=plan_fisher(model, x[:1], len(x)).batch)
        contenders["BackPACK DiagGGNExact"] = lambda: bp(x)
    if loop:
        contenders["loop (batch 1, K backwards)"] = lambda: fisher_diag_loop(model, x)
    ref = "loop (batch 1, K backwards)" if loop else "BackPACK DiagGGNExact"
    if ref not in contenders:
        raise SystemExit("error: without the loop (--no-loop) the reference is BackPACK, which is missing")
    results, times, peaks = {}, {k: [] for k in contenders}, {k: 0.0 for k in contenders}
    for label, fn in contenders.items():   # warm-up (first vmap trace, allocator, BackPACK hooks)
        results[label] = fn()
    for _ in range(reps):                  # alternated repetitions
        for label, fn in contenders.items():
            _, t, mem = measure(fn)
            times[label].append(t)
            peaks[label] = max(peaks[label], mem)
    slow = results[ref]
    med = {k: statistics.median(v) for k, v in times.items()}
    t_default = med["scrubnet (default)"]
    print(f"{'':<30}{'median s':>10}{'peak MiB':>10}{'÷ default':>10}{'max rel diff':>14}{'normwise':>10}"
          f"   (differences to: {ref})")
    worst = 0.0
    for label in contenders:
        e, nw = rel_diff(results[label], slow)
        if label != ref:
            worst = max(worst, e)
        print(f"{label:<30}{med[label]:>10.4f}{peaks[label]:>10.1f}{med[label] / t_default:>10.2f}{e:>14.2e}{nw:>10.2e}")
    flops, floor = floor_seconds(model, x)
    out = {"vs_loop": med[ref] / t_default if loop else float("nan"), "rel_diff": worst,
           "to_floor": t_default / floor}
    print(f"FLOP floor {flops / 1e12:.3f} TFLOP = {floor:.2f} s at the measured GEMM rate; "
          f"ratio_to_floor ({model_name}): {out['to_floor']:.2f}")
    if "BackPACK DiagGGNExact" in med:
        out["vs_backpack"] = med["BackPACK DiagGGNExact"] / t_default
        print(f"speedup_vs_backpack ({model_name}): {out['vs_backpack']:.2f}")
    if loop:
        print(f"speedup_vs_loop ({model_name}): {out['vs_loop']:.1f}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn2d", help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--model", default=None, help="one model (same as --models MODEL)")
    ap.add_argument("--width", type=float, default=None, help="width multiplier of resnet18 (default 1.0)")
    ap.add_argument("--no-loop", action="store_true",
                    help="skip the batch-size-1 loop (default for resnet18: values are compared with BackPACK's)")
    ap.add_argument("--n", type=int, default=None, help="number of samples (default: per model)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: timings on a shared machine are stable only on one)")
    ap.add_argument("--reps", type=int, default=3, help="alternated timed repetitions (≥ 3), median reported")
    ap.add_argument("--no-backpack", action="store_true", help="skip the BackPACK yardstick")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args(argv)
    names = [m.strip() for m in (args.model or args.models).split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        ap.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    if args.reps < 3:
        ap.error("--reps must be ≥ 3")
    torch.set_num_threads(args.threads)
    backpack_mod = None if args.no_backpack else load_backpack()
    print(f"true Fisher diagonal, torch {torch.__version__}, {args.threads} thread(s), median of {args.reps} "
          f"alternated repetitions; yardstick: "
          f"{'BackPACK ' + importlib.metadata.version('backpack-for-pytorch') + ' DiagGGNExact' if backpack_mod else 'none (BackPACK missing)'}")
    results = [bench(m, getattr(torch, args.dtype), args.n, args.reps, backpack_mod, width=args.width,
                     loop=not (args.no_loop or m == "resnet18")) for m in names]
    print(f"\nmax relative difference to the reference (all models): {max(r['rel_diff'] for r in results):.2e}")
    print(f"speedup_vs_loop: {results[0]['vs_loop']:.1f}")
    print(f"ratio_to_floor: {results[0]['to_floor']:.2f}")
    if "vs_backpack" in results[0]:
        print(f"speedup: {results[0]['vs_backpack']:.2f}")


if __name__ == "__main__":
    main()
