"""Benchmark: K fine-tunings of the default experiment trained vmapped (``scrubnet.training.pool``) against one
at a time (``scrubnet.training.finetune``), measured side by side in one run.

The models are those of an audit pool of the embedded experiment: the MLP 40-256-256-5 from one pre-trained
backbone, each with its own fresh head (seed k) and its own random half of D (250 samples), the protocol's
stopping rule as the audit pool applies it (zero training error, then 5 more epochs at zero error, cap 200), wd = 0.03. Each repetition trains the K models both
ways, alternating which goes first; the times are the medians over repetitions. One torch thread by default
(the audit's setting). Also prints the largest weight difference between the two ways.

    python benchmarks/pool_train.py [--k 32] [--reps 3] [--threads 1]

Also measures the machine's matmul rate (``torch.mm`` of a [batch, 256] × [256, 256] product, the MLP's
largest layer, same threads, warmed up) and prints ``ratio_to_floor:`` = measured time / floor, the floor being
the pool's training FLOPs at that rate: per model and epoch, n·6·MACs for the SGD steps (forward 2·MACs,
backward 4·MACs per sample) plus n·2·MACs for the epoch's training-error check; MACs = Σ in·out of the Linear
layers. A ratio of 10 means the training runs at a tenth of the machine's dense-matmul rate.

The last lines are ``speedup: X`` (median loop time / median vmapped time) and ``ratio_to_floor: Y`` (of the
faster path).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from scrubnet.data import DataConfig, load_split
from scrubnet.models import build_model
from scrubnet.training import TrainConfig, finetune, finetune_start, pretrain
from scrubnet.training.pool import finetune_many


def setup(k: int):
    split = load_split(DataConfig())
    cfg = TrainConfig(wd=0.03)
    pre = pretrain(build_model("mlp", split.input_shape, split.num_core_classes, seed=0), *split.core, cfg, seed=0)
    starts = [finetune_start(pre, split.num_classes, seed=s) for s in range(k)]
    g = torch.Generator().manual_seed(0)
    halves = [torch.sort(torch.randperm(len(split.y), generator=g)[: len(split.y) // 2]).values for _ in range(k)]
    return cfg, starts, [split.x[h] for h in halves], [split.y[h] for h in halves]


def linear_macs(model: nn.Module) -> int:
    """Multiply-accumulates of one forward pass per sample: Σ in·out over the Linear layers (others refused)."""
    macs = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            macs += m.in_features * m.out_features
        elif isinstance(m, (nn.Conv1d, nn.Conv2d)):
            raise ValueError("linear_macs counts Linear layers only")
    return macs


def matmul_rate(batch: int, width: int = 256, seconds: float = 1.0) -> float:
    """FLOP/s of ``torch.mm`` on [batch, width] × [width, width] float32 (warmed up, median of 5 timings)."""
    a, b = torch.randn(batch, width), torch.randn(width, width)
    for _ in range(20):
        a @ b
    n = 1
    while True:  # calibrate to ~seconds/5 per timing
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        dt = time.perf_counter() - t0
        if dt > seconds / 5:
            break
        n *= 2
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        times.append((time.perf_counter() - t0) / n)
    return 2.0 * batch * width * width / statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=32, help="models per stack")
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.k < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--k, --reps and --threads must be positive")
    torch.set_num_threads(args.threads)
    cfg, starts, xs, ys = setup(args.k)
    seeds = list(range(args.k))
    t_loop, t_vmap, diff, epochs = [], [], 0.0, []
    for rep in range(args.reps):
        order = ("vmap", "loop") if rep % 2 == 0 else ("loop", "vmap")
        for way in order:
            t0 = time.perf_counter()
            if way == "vmap":
                fast = finetune_many(starts, xs, ys, cfg, seeds, sustained=True)
                t_vmap.append(time.perf_counter() - t0)
            else:
                slow = [finetune(starts[k], xs[k], ys[k], cfg, seeds[k], sustained=True) for k in range(args.k)]
                t_loop.append(time.perf_counter() - t0)
        with torch.no_grad():
            for (a, _), (b, h) in zip(fast, slow):
                diff = max(diff, max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters())))
                epochs.append(h.epochs)
        print(f"rep {rep}: vmapped {t_vmap[-1]:.2f} s, one at a time {t_loop[-1]:.2f} s")
    mv, ml = statistics.median(t_vmap), statistics.median(t_loop)
    print(f"K = {args.k} models, {args.threads} thread(s), epochs per model {min(epochs)}–{max(epochs)}")
    print(f"vmapped: {mv:.2f} s ({mv / args.k:.3f} s per model); one at a time: {ml:.2f} s "
          f"({ml / args.k:.3f} s per model)")
    print(f"max |Δw| between the two: {diff:.2e}")
    macs = linear_macs(starts[0])
    hist = [h for _, h in fast]
    flops = sum(h.epochs * len(y) * 8 * macs for h, y in zip(hist, ys))
    rate = matmul_rate(cfg.batch_size)
    floor = flops / rate
    best = min(mv, ml)
    print(f"training FLOPs {flops:.3e} ({macs} MACs per sample); matmul rate {rate / 1e9:.2f} GFLOP/s "
          f"({args.threads} thread(s)) → floor {floor:.3f} s")
    print(f"vmapped / floor: {mv / floor:.1f}; one at a time / floor: {ml / floor:.1f}")
    print(f"speedup: {ml / mv:.2f}")
    print(f"ratio_to_floor: {best / floor:.1f}")


if __name__ == "__main__":
    main()
