"""Benchmark: the vectorised true-Fisher diagonal against the authors' batch-size-1 loop.

Same model (a small 2-D CNN with BatchNorm, eval mode, non-trivial running statistics) and the same data
(a few hundred 8×8 inputs, 10 classes), side by side in one run. Prints for each: wall time, peak resident
memory above the starting point, then the speed-up, the max relative difference between the two diagonals
(elementwise, over entries above 1e-6 of their tensor's maximum, and normwise per tensor) and a final line
``speedup: X``.

    python benchmarks/fisher_diag.py [--model cnn2d|mlp|cnn1d] [--n 300] [--threads 2] [--dtype float32]

Peak memory is the process's VmHWM (Linux; reset through /proc/self/clear_refs before each run), falling
back to ``resource.getrusage`` max RSS (not resettable: then only the first figure is meaningful).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag, fisher_diag_loop
from scrubnet.models import build_model

SHAPES = {"cnn2d": (1, 8, 8), "mlp": (40,), "cnn1d": (40,)}


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
        pass
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


def build(model: str, n: int, classes: int, dtype: torch.dtype, seed: int = 0):
    shape = SHAPES[model]
    m = build_model(model, shape, classes, seed=seed).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # BatchNorm with non-trivial running statistics (eval mode is what is measured)
        for mod in m.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean.copy_(0.1 * torch.randn(mod.running_mean.shape, generator=g))
                mod.running_var.copy_(0.5 + torch.rand(mod.running_var.shape, generator=g))
    x = torch.randn(n, *shape, generator=g, dtype=dtype)
    return m.eval(), x


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="cnn2d")
    ap.add_argument("--n", type=int, default=300, help="number of samples")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="vectorised batch (default: automatic)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, x = build(args.model, args.n, args.classes, dtype)
    p = sum(t.numel() for t in model.parameters())
    print(f"model {args.model} ({p} parameters, BatchNorm eval), N={args.n}, classes={args.classes}, "
          f"{args.dtype}, threads={args.threads}")
    fisher_diag(model, x[:4], batch_size=args.batch_size)  # warm-up (first vmap trace)
    fast, t_fast, m_fast = measure(lambda: fisher_diag(model, x, batch_size=args.batch_size))
    slow, t_slow, m_slow = measure(lambda: fisher_diag_loop(model, x))
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
    print(f"{'':<28}{'time (s)':>10}{'peak MiB':>10}")
    print(f"{'vectorised (vmap, torch.func)':<28}{t_fast:>10.3f}{m_fast:>10.1f}")
    print(f"{'loop (batch 1, K backwards)':<28}{t_slow:>10.3f}{m_slow:>10.1f}")
    print(f"max relative difference: elementwise {elem:.2e}, normwise {norm:.2e}")
    print(f"speedup: {t_slow / t_fast:.1f}")


if __name__ == "__main__":
    main()
