"""The README table "what each method costs", printed from the cost model (``scrubnet.estimate``).

    python benchmarks/cost_table.py [--minutes 30] [--forget-fraction 0.01]

For each model (the CIFAR ResNet-18 at width 1.0 on 3×32×32 inputs with 10 classes, and the default
experiment's MLP 40-256-256-5) and each method, on one torch thread of this machine (the GEMM rate is
measured at start): the estimated seconds per retain sample and peak memory at N = 1,000 (|D_f| = 1 %), and
the largest N whose estimate fits in ``--minutes`` (bisection on N; "—" when even N = 100 does not fit).
Training-based methods are estimated at the configuration's epoch cap (200: an upper bound); Newton at its
CG cap (300 iterations) and NTK with CG at its cap (1,000): upper bounds too.
"""
from __future__ import annotations

import argparse

import torch

from scrubnet.training.cost import estimate, format_bytes, format_seconds, matmul_rate
from scrubnet.models import build_model

MODELS = {"resnet18 ×1.0 (3×32×32, c = 10)": ("resnet18", (3, 32, 32), 10, {"width": 1.0}),
          "mlp 40-256-256-5 (default experiment)": ("mlp", (40,), 5, {})}
METHODS = [("fisher", {}), ("fisher", {"kind": "mc"}), ("ntk", {}), ("newton", {}), ("retrain", {})]


def largest_n(model, shape, c, method, options, seconds, frac) -> int:
    def fits(n: int) -> bool:
        n_f = max(1, int(round(frac * n)))
        return estimate(model, n - n_f, n_f, method=method, in_shape=shape, num_classes=c, **options).seconds <= seconds
    if not fits(100):
        return 0
    lo, hi = 100, 200
    while fits(hi) and hi < 10 ** 9:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--forget-fraction", type=float, default=0.01)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"cost model on one thread: float32 GEMM {matmul_rate() / 1e9:.1f} GFLOP/s measured; N = 1,000 for the "
          f"per-sample column; largest N in {args.minutes:g} min")
    print()
    print("| model | method | per retain sample | peak memory (N = 1,000) | passes | largest N in "
          f"{args.minutes:g} min |")
    print("|---|---|---|---|---|---|")
    for label, (name, shape, c, opts) in MODELS.items():
        model = build_model(name, shape, c, seed=0, **opts).eval()
        for method, options in METHODS:
            n_f = max(1, int(round(args.forget_fraction * 1000)))
            est = estimate(model, 1000 - n_f, n_f, method=method, in_shape=shape, num_classes=c, **options)
            tag = method + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")
            extra = f" ({est.details['solver']})" if "solver" in est.details else ""
            big = largest_n(model, shape, c, method, options, 60 * args.minutes, args.forget_fraction)
            print(f"| {label} | {tag}{extra} | {format_seconds(est.seconds / (1000 - n_f))} | "
                  f"{format_bytes(est.peak_bytes)} | {est.passes:.4g} | {f'{big:,}' if big else '—'} |")


if __name__ == "__main__":
    main()
