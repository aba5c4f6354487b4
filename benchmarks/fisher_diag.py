"""Benchmark: the vectorised true-Fisher diagonal against the authors' batch-size-1 loop.

For each model, on the same model and data, side by side in one run: ``fisher_diag`` with its default
(layerwise kernels, method="auto") and with method="vmap" (pure torch.func), and ``fisher_diag_loop``
(batch size 1, one backward per class per sample). Prints wall time and peak resident memory of each, the
max relative difference of each vectorised diagonal to the loop (elementwise over entries above 1e-6 of
their tensor's maximum, and normwise per tensor), and the speed-ups. Models:

* ``mlp``   — the embedded default experiment's MLP (40-256-256-5), N = 475 (its |D_r|), 5 classes;
* ``cnn2d`` — the small 2-D CNN with BatchNorm (eval mode, non-trivial running statistics), 1×8×8 inputs
  (digits-sized), N = 300, 10 classes.

The final line ``speedup: X`` is the default path against the loop on the first model listed.

    python benchmarks/fisher_diag.py [--models mlp,cnn2d] [--threads 2] [--dtype float32]

Peak memory is the process's VmHWM (Linux; reset through /proc/self/clear_refs before each run) minus the
resident size at the start, falling back to ``resource.getrusage`` max RSS.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag, fisher_diag_loop
from scrubnet.models import build_model

MODELS = {"mlp": dict(shape=(40,), classes=5, n=475, options={}),
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
    """(result, seconds, peak MiB above the resident size at the start)."""
    _reset_peak()
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = max(0, _rss_kib("VmHWM") - base) / 1024
    return out, dt, peak


def build(model: str, dtype: torch.dtype, n: int | None = None, seed: int = 0):
    spec = MODELS[model]
    shape = spec["shape"]
    m = build_model(model, shape, spec["classes"], seed=seed, **spec["options"]).to(dtype)
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


def bench(model_name: str, dtype: torch.dtype, n: int | None) -> float:
    model, x = build(model_name, dtype, n)
    p = sum(t.numel() for t in model.parameters())
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    print(f"\n== {model_name}: {p} parameters{' (BatchNorm, eval mode)' if has_bn else ''}, N={len(x)}, "
          f"classes={MODELS[model_name]['classes']}, {str(dtype).replace('torch.', '')}")
    fisher_diag(model, x[:4])                  # warm-up (first vmap trace, allocator)
    fisher_diag(model, x[:4], method="vmap")
    rows = []
    slow, t_loop, m_loop = measure(lambda: fisher_diag_loop(model, x))
    for label, method in (("vectorised (default)", "auto"), ("vectorised (vmap only)", "vmap")):
        fast, t, mem = measure(lambda: fisher_diag(model, x, method=method))
        rows.append((label, t, mem, *rel_diff(fast, slow)))
    rows.append(("loop (batch 1, K backwards)", t_loop, m_loop, 0.0, 0.0))
    print(f"{'':<30}{'time (s)':>10}{'peak MiB':>10}{'speed-up':>10}{'max rel diff':>14}{'normwise':>10}")
    for label, t, mem, e, nw in rows:
        print(f"{label:<30}{t:>10.3f}{mem:>10.1f}{t_loop / t:>10.1f}{e:>14.2e}{nw:>10.2e}")
    return t_loop / rows[0][1], max(rows[0][3], rows[1][3])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn2d", help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--n", type=int, default=None, help="number of samples (default: per model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        ap.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    print(f"true Fisher diagonal, torch {torch.__version__}, {args.threads} thread(s)")
    results = [bench(m, getattr(torch, args.dtype), args.n) for m in names]
    print(f"\nmax relative difference (all models, both vectorised paths): {max(r[1] for r in results):.2e}")
    print(f"speedup: {results[0][0]:.1f}")


if __name__ == "__main__":
    main()
