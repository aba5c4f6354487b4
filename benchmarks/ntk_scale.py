"""How far the matrix-free NTK scrub scales: wall time and peak memory on synthetic 32×32 images.

    python benchmarks/ntk_scale.py --model resnet18 --width 0.4 --n 500 --classes 5

One run measures, in this order and each with its own resident-memory high-water mark (a thread samples
/proc/self/statm every 5 ms; the process-lifetime maximum from getrusage is printed too):

1. the NTK scrub (``ntk`` method: Gram Θ over D, two Cholesky ridge solves, two VJPs), with the
   ``--memory-budget-mb`` given to the Gram;
2. one pass over every per-(sample, class) Jacobian row, computed once with the same layerwise engine
   (forward + c batched backward passes + per-row weight gradients, one layer at a time, discarded): the
   floor for any exact method that needs the Gram;
3. the yardstick, retraining on D_r with the protocol's optimiser (SGD lr 0.01, momentum 0.9, batch 128,
   (wd/2)‖w − w_0‖² pull, BatchNorm frozen), on the same thread count: one warm-up epoch, then
   ``--retrain-measure-epochs`` epochs timed one by one; the median epoch is projected to
   ``--retrain-epochs`` epochs (the protocol trains to zero training error + 5 epochs; 30 is the count for
   small CIFAR-5-like sets, pass the observed count when known). The retrain epochs alternate with repeats of
   the Jacobian pass when ``--reps`` > 1;
4. the FLOP floor of the exact scrub for this model (``scrubnet.curvature.ntk.ntk_gram_flops``: every Jacobian
   row once — one forward and c backward passes per sample — plus, per layer, the cheaper of the explicit and
   ghost contractions of the symmetric Gram, plus the two Cholesky factorisations and the two VJPs), turned
   into seconds at this machine's measured single-thread float32 GEMM rate (median of 5 2048³ products,
   measured right before and right after the scrub; the floor uses their mean).

Times are CPU seconds of the process (``time.process_time``): with one thread that is the work done, whatever
other jobs share the cores (wall-clock ratios swung ×3 on the shared 2-core machine); the scrub's wall time is
printed too. It prints the times, the memory the dense-Jacobian approach of the authors' code would need (p × N·c float32
values), and ends with ``ratio_to_jacobian:`` (scrub / Jacobian pass), ``ratio_to_floor:`` (scrub / FLOP
floor; aim ≤ 2) and ``ratio_to_retrain:`` (scrub / projected retrain; aim < 1). Inputs are Gaussian pixels:
the cost does not depend on the content.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.curvature.ntk import DEFAULT_BUDGET, iter_jacobian_rows, ntk_gram_flops
from scrubnet.methods import get_method, protocol_context
from scrubnet.training.cost import measure_gemm_rate
from scrubnet.models import build_model
from scrubnet.training import TrainConfig, train_epochs

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Context manager sampling the resident set size in a thread; ``.peak`` in bytes."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return False


def gb(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=float, default=0.4)
    ap.add_argument("--n", type=int, default=500, help="|D| (samples)")
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--forget", type=int, default=25, help="|D_f| (the last samples of D)")
    ap.add_argument("--size", type=int, default=32, help="image side")
    ap.add_argument("--memory-budget-mb", type=float, default=DEFAULT_BUDGET / 2**20,
                    help="budget for the Gram buffers (default: the library's default, 1024 MB)")
    ap.add_argument("--retrain-epochs", type=int, default=30)
    ap.add_argument("--retrain-measure-epochs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="repeats of the Jacobian pass (median)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core box two threads spin against other jobs)")
    ap.add_argument("--skip-retrain", action="store_true")
    args = ap.parse_args(argv)
    if args.n <= args.forget or args.forget < 0:
        ap.error("need 0 <= --forget < --n")
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    kw = {"width": args.width} if args.model in ("resnet18", "allcnn") else {}
    model = build_model(args.model, (3, args.size, args.size), args.classes, seed=0, **kw).eval()
    start = build_model(args.model, (3, args.size, args.size), args.classes, seed=0, **kw).eval()
    with torch.no_grad():  # "trained" weights: w_0 plus a small perturbation (cost does not depend on it)
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    x = torch.randn(args.n, 3, args.size, args.size, generator=g)
    y = torch.randint(0, args.classes, (args.n,), generator=g)
    n_r = args.n - args.forget
    p = sum(t.numel() for t in model.parameters() if t.requires_grad)
    rows = args.n * args.classes
    budget = int(args.memory_budget_mb * 2**20)
    print(f"model {args.model} width {args.width}: p = {p:,} parameters; N = {args.n}, c = {args.classes}, "
          f"N·c = {rows} rows; threads {torch.get_num_threads()}; Gram budget {gb(budget)}")
    print(f"dense Jacobian (authors' code, float32): p × N·c × 4 B = {gb(4.0 * p * rows)}")
    flops = ntk_gram_flops(model, x[:2], args.n)
    n_r_rows = (args.n - args.forget) * args.classes
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x[:1])
    fwd_bwd = 3.0 * counter.get_total_flops()   # a VJP: forward + backward to inputs and weights ≈ 3 forwards
    solve = (rows ** 3 + n_r_rows ** 3) / 3.0 + 2 * args.n * fwd_bwd
    floor_flops = flops["total"] + solve
    gflops_before = measure_gemm_rate(size=2048, reps=5) / 1e9
    print(f"FLOP floor: Jacobian pass {flops['jacobian_pass'] / 1e12:.3f} TFLOP, Gram (cheaper contraction per "
          f"layer, symmetric) {flops['gram'] / 1e12:.3f} TFLOP, Cholesky + VJPs {solve / 1e12:.3f} TFLOP; "
          f"total {floor_flops / 1e12:.3f} TFLOP; float32 GEMM {gflops_before:.1f} GFLOP/s before the scrub")
    base = rss_bytes()
    print(f"resident before the runs: {gb(base)}")
    sys.stdout.flush()

    # 1. the NTK scrub
    ctx = protocol_context(start, TrainConfig(wd=0.1), num_classes=args.classes, seed=0)
    method = get_method("ntk", memory_budget_bytes=budget, solver="cholesky")
    with PeakRSS() as mem_scrub:
        t0, c0 = time.perf_counter(), time.process_time()
        res = method(model, (x[:n_r], y[:n_r]), (x[n_r:], y[n_r:]), ctx)
        wall_scrub, t_scrub = time.perf_counter() - t0, time.process_time() - c0
    info = res.info
    # the GEMM rate again right after the scrub: on a shared machine the rate moves with the load, and the
    # floor is meant for the conditions the scrub ran under
    gflops_after = measure_gemm_rate(size=2048, reps=5) / 1e9
    gflops = 0.5 * (gflops_before + gflops_after)
    floor_s = floor_flops / (gflops * 1e9)
    print(f"float32 GEMM {gflops_after:.1f} GFLOP/s after the scrub; floor at the mean {gflops:.1f} GFLOP/s "
          f"= {floor_s:.1f} s")
    print(f"scrub: {t_scrub:.1f} CPU s, {wall_scrub:.1f} wall s (wall: Gram {info.get('gram_seconds', float('nan')):.1f} s, solves "
          f"{info['solve_seconds']:.1f} s), peak RSS {gb(mem_scrub.peak)}, jitter {info['solve_full_jitter']:.3g}"
          f"/{info['solve_retain_jitter']:.3g}, scale {info['scale']:.3f}")
    sys.stdout.flush()
    del res

    # 2. every Jacobian row once, alternated with 3. retrain epochs (after one warm-up epoch)
    def jacobian_pass() -> float:
        c0 = time.process_time()
        count = 0
        for _, _, r in iter_jacobian_rows(model, x, memory_budget_bytes=budget):
            count += r.numel()
        if count != p * rows:
            raise RuntimeError(f"Jacobian pass produced {count} entries, expected {p * rows}")
        return time.process_time() - c0

    cfg = TrainConfig(wd=0.1)
    net = build_model(args.model, (3, args.size, args.size), args.classes, seed=0, **kw)
    w0 = {k: v.detach().clone() for k, v in net.named_parameters()}
    gen = torch.Generator().manual_seed(1)

    def retrain_epoch() -> float:
        c0 = time.process_time()
        train_epochs(net, x[:n_r], y[:n_r], lr=cfg.lr, momentum=cfg.momentum, batch_size=cfg.batch_size,
                     epochs=1, generator=gen, w0=w0, wd_pull=cfg.wd, freeze_bn=True)
        return time.process_time() - c0

    jac_times, epoch_times = [], []
    with PeakRSS() as mem_jac:
        if not args.skip_retrain:
            retrain_epoch()  # warm-up
        for rep in range(max(args.reps, args.retrain_measure_epochs)):
            if rep < args.reps:
                jac_times.append(jacobian_pass())
            if not args.skip_retrain and rep < args.retrain_measure_epochs:
                epoch_times.append(retrain_epoch())
    t_jac = statistics.median(jac_times)
    print(f"Jacobian rows once: {t_jac:.1f} s (median of {len(jac_times)}), peak RSS {gb(mem_jac.peak)}")
    t_retrain = float("nan")
    if epoch_times:
        t_epoch = statistics.median(epoch_times)
        t_retrain = t_epoch * args.retrain_epochs
        print(f"retrain: {t_epoch:.2f} s/epoch (median of {len(epoch_times)} after a warm-up epoch) × "
              f"{args.retrain_epochs} epochs = {t_retrain:.1f} s")
    sys.stdout.flush()

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"process peak RSS (getrusage): {gb(maxrss)}")
    print(f"scrub_seconds: {t_scrub:.2f}")
    print(f"jacobian_pass_seconds: {t_jac:.2f}")
    print(f"retrain_seconds: {t_retrain:.2f}")
    print(f"scrub_peak_rss_gb: {mem_scrub.peak / 2**30:.3f}")
    print(f"dense_jacobian_gb: {4.0 * p * rows / 2**30:.2f}")
    print(f"floor_seconds: {floor_s:.2f}")
    print(f"ratio_to_jacobian: {t_scrub / t_jac:.2f}")
    print(f"ratio_to_floor: {t_scrub / floor_s:.2f}")
    print(f"ratio_to_retrain: {t_scrub / t_retrain:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
