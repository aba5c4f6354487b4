"""The cost model (``scrubnet.estimate``) against measured CPU time and memory, per method, on small sizes.

    python benchmarks/cost_check.py [--only retrain,newton] [--family mlp] [--timeout 170]

For each method (retrain, finetune, newton, ntk with Cholesky, ntk with CG, and the Fisher diagonal — the
reference the Fisher constants were fitted on) on four model families (the default experiment's MLP
40-256-256-5, a BatchNorm ResNet-18 at width 0.25 on 3×16×16 inputs with 10 classes, a two-layer attention
encoder on 8×8 patches, and an embedding + LSTM + head on 24 tokens) and two sizes N each, one fresh process
per case: build the model and random data (|D_f| = N/10), run the method once on a few samples (first-call
set-up: thread pools, allocator, autograd kernels), then run it on the full data and
report its process CPU time (one torch thread) and the growth of the resident high-water mark over the
resident size just before it (``/proc/self/clear_refs``). The estimate is made in the same process just before
the measured run, so the GEMM rate it divides by was measured under the same machine load.

Open-ended methods are estimated at their caps, so each case fixes the amount of work and gives the estimate
the same count: training at a fixed number of epochs (retrain: ``max_epochs`` with a stopping rule that cannot
fire on random labels; finetune: ``epochs``), Newton at ``max_iter`` CG iterations with a tolerance it cannot
reach and no safeguard (one solve; the measured run checks the iteration count), NTK-CG at ``cg_max_iter``.

The ``user-retrain`` cases check the reference every cost of a user's model is divided by: the user's
retraining as :func:`scrubnet.recipe.retrain.measure_retraining` prices it (``user-retrain``: the recipe's
AdamW + cosine step timed on one batch × the training's steps; ``user-retrain-fn``: the user's own training
function timed on probes of 256 and 512 samples) against the whole retraining, run and timed. The
``budgeted-*`` cases run a user's call at its defaults (the budgeted mode when the full method costs more than
one retraining) against the retraining, run and timed: the ratio printed is the call's cost in retrainings.

Prints one line per case (measured, estimated, ratio measured/estimated for seconds and for peak memory) and
per method ``ratio_<method>: <median over its cases of measured/estimated seconds>``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {"mlp": ("mlp", (40,), 5, {}),
            "resnet": ("resnet18", (3, 16, 16), 10, {"width": 0.25}),
            "transformer": ("transformer", (3, 32, 32), 10, {}),   # benchmarks/cost_vs_retrain.SmallTransformer
            "lstm": ("lstm", (24,), 5, {})}          # lstm_net below: 24 tokens of a 200-word vocabulary

# which EFFICIENCY constant each case's time mostly depends on (NTK-CG: its VJP/JVP products run at Newton's)
KIND = {"user-retrain": "measured", "user-retrain-fn": "measured", "budgeted-newton": "budget",
        "budgeted-fisher": "budget", "budgeted-ntk": "budget", "retrain": "train", "finetune": "train",
        "newton": "newton", "ntk-cg": "newton", "ntk": "ntk",
        "fisher": "fisher", "fisher-default": "fisher", "newton-default": "newton"}

# (method, family, N, fixed work): two sizes per method and family, each run well under a minute
CASES = [
    ("retrain", "mlp", 2000, {"epochs": 10}), ("retrain", "mlp", 8000, {"epochs": 10}),
    ("retrain", "resnet", 64, {"epochs": 4}), ("retrain", "resnet", 256, {"epochs": 4}),
    ("finetune", "mlp", 2000, {"epochs": 10}), ("finetune", "mlp", 8000, {"epochs": 10}),
    ("finetune", "resnet", 64, {"epochs": 4}), ("finetune", "resnet", 256, {"epochs": 4}),
    ("newton", "mlp", 1000, {"max_iter": 10}), ("newton", "mlp", 4000, {"max_iter": 10}),
    ("newton", "resnet", 64, {"max_iter": 5}), ("newton", "resnet", 128, {"max_iter": 5}),
    ("ntk", "mlp", 300, {}), ("ntk", "mlp", 1000, {}),
    ("ntk", "resnet", 32, {}), ("ntk", "resnet", 96, {}),
    ("ntk-cg", "mlp", 1000, {"cg_max_iter": 5}), ("ntk-cg", "mlp", 4000, {"cg_max_iter": 5}),
    ("ntk-cg", "resnet", 32, {"cg_max_iter": 3}), ("ntk-cg", "resnet", 96, {"cg_max_iter": 3}),
    ("fisher", "mlp", 2000, {}), ("fisher", "mlp", 8000, {}),
    ("fisher", "resnet", 32, {}), ("fisher", "resnet", 64, {}),
    # the transformer; and fisher / newton at their defaults (a user's call: the α search; Newton's "lm"
    # safeguard, 300 iterations, estimated as its true upper bound of 7 solves)
    ("retrain", "transformer", 256, {"epochs": 2}), ("finetune", "transformer", 256, {"epochs": 2}),
    ("newton", "transformer", 128, {"max_iter": 5}), ("fisher", "transformer", 64, {}),
    ("ntk-cg", "transformer", 64, {"cg_max_iter": 3}),
    ("fisher-default", "mlp", 2000, {}), ("fisher-default", "resnet", 64, {}),
    ("fisher-default", "transformer", 64, {}),
    ("newton-default", "mlp", 1000, {}), ("newton-default", "resnet", 32, {}),
    ("newton-default", "transformer", 64, {}),
    # the recurrent family: its fused LSTM kernel counted (scrubnet.models.flops)
    ("retrain", "lstm", 512, {"epochs": 2}), ("retrain", "lstm", 2048, {"epochs": 2}),
    ("newton", "lstm", 256, {"max_iter": 5}), ("newton", "lstm", 1024, {"max_iter": 5}),
    ("fisher", "lstm", 64, {}), ("fisher", "lstm", 256, {}),
    ("ntk", "lstm", 100, {}), ("ntk", "lstm", 300, {}),
    # the user's retraining as the reference prices it (scrubnet.recipe.retrain.measure_retraining): the recipe's
    # step timed on one batch × the training's steps (AdamW + cosine), and the user's own function timed on
    # probes of 256 and 512 samples, against the whole retraining run
    ("user-retrain", "mlp", 8000, {"epochs": 5}), ("user-retrain", "resnet", 512, {"epochs": 2}),
    ("user-retrain", "transformer", 512, {"epochs": 2}), ("user-retrain", "lstm", 2048, {"epochs": 2}),
    ("user-retrain-fn", "mlp", 8000, {"epochs": 5}), ("user-retrain-fn", "resnet", 1024, {"epochs": 2}),
    ("user-retrain-fn", "transformer", 1024, {"epochs": 2}), ("user-retrain-fn", "lstm", 2048, {"epochs": 2}),
    # a user's call (a 20-epoch SGD recipe): the budgeted mode when the full method costs more than one retraining;
    # "measured" is the call's CPU seconds, "estimate" the whole retraining run and timed (ratio ≤ 1 wanted)
    *[(f"budgeted-{m}", f, n, {"epochs": 20}) for m in ("newton", "fisher", "ntk")
      for f, n in (("mlp", 4000), ("resnet", 256), ("transformer", 512), ("lstm", 1024))],
]


def lstm_net(num_classes: int, vocab: int = 200, d: int = 32, hidden: int = 64):
    """An embedding, one LSTM layer and a linear head on the last step's state."""
    import torch
    from torch import nn

    class LSTMNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.rnn = nn.LSTM(d, hidden, batch_first=True)
            self.head = nn.Linear(hidden, num_classes)

        def forward(self, x):
            out, _ = self.rnn(self.emb(x))
            return self.head(out[:, -1])
    torch.manual_seed(0)
    return LSTMNet()


def users_training(epochs: int):
    """A user's own training function: AdamW, cosine annealing per step, batches of 64."""
    import torch

    def train(model, data):
        x, y = data
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        steps = epochs * -(-len(y) // 64)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        model.train()
        for _ in range(epochs):
            perm = torch.randperm(len(y))
            for i in range(0, len(y), 64):
                idx = perm[i:i + 64]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], label_smoothing=0.1)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        return model
    return train


def budgeted_case(method: str, family: str, n: int, work: dict, model, retain, forget) -> dict:
    """A user's call of ``method`` with an SGD recipe of ``work["epochs"]`` epochs (its default: the budgeted
    mode when the full method costs more than one retraining) against that retraining, run and timed."""
    import scrubnet
    from scrubnet.recipe import TrainingRecipe
    from scrubnet.recipe.retrain import retrain_like_user
    from scrubnet.training.cost import matmul_rate

    recipe = TrainingRecipe(lr=0.05, momentum=0.9, wd=5e-4, batch_size=64, epochs=work["epochs"])
    retrain_like_user(model, (retain[0][:64], retain[1][:64]), recipe=recipe)       # warm-up
    t0 = time.process_time()
    retrain_like_user(model, retain, recipe=recipe)
    retrain_s = time.process_time() - t0
    _, res = scrubnet.forget(model, retain, forget, method=method, recipe=recipe, force=True, on_failure="return")
    return {"method": f"budgeted-{method}", "family": family, "n": n, "work": work, "count": None,
            "seconds": res.cost["seconds"], "bytes": 0, "est_seconds": retrain_s, "est_bytes": 1,
            "est_flops": 0.0, "passes": 0.0, "gemm_gflops": matmul_rate() / 1e9,
            "details": {**{k: v for k, v in res.cost.items()}, "ok": res.ok}}


def build_case(family: str, n: int):
    """(model in eval mode, x (n, ...), y (n,), c) of a family: random inputs (token ids for the LSTM)."""
    import torch
    from scrubnet.models import build_model

    name, shape, c, kw = FAMILIES[family]
    if name == "transformer":
        from benchmarks.cost_vs_retrain import SmallTransformer
        torch.manual_seed(0)
        model = SmallTransformer(c).eval()
    elif name == "lstm":
        model = lstm_net(c).eval()
    else:
        model = build_model(name, shape, c, seed=0, **kw).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(200, (n, *shape), generator=g) if name == "lstm" else torch.randn(n, *shape, generator=g)
    return model, x, torch.randint(c, (n,), generator=g), c


def user_retrain_case(method: str, model, retain, work: dict) -> tuple[float, object]:
    """(measured seconds of the whole retraining, the reference's estimate made just before it)."""
    from dataclasses import replace

    from scrubnet.cost_guard import retrain_estimate
    from scrubnet.recipe import TrainingRecipe
    from scrubnet.recipe.retrain import measure_retraining, retrain_like_user

    fn = users_training(work["epochs"]) if method == "user-retrain-fn" else None
    recipe = TrainingRecipe(optimizer="adamw", lr=1e-3, adamw_weight_decay=0.05, schedule="cosine",
                            label_smoothing=0.1, batch_size=64, epochs=work["epochs"])
    small = (retain[0][:64], retain[1][:64])
    retrain_like_user(model, small, train=fn, recipe=recipe)          # warm-up
    est = measure_retraining(model, retain, train=fn, recipe=recipe)
    est.details = {**{k: str(v) for k, v in est.details.items()},     # the FLOP model's price beside it
                   "flop_model_seconds": retrain_estimate(model, len(retain[1]), x_probe=retain[0][:1],
                                                          recipe=replace(recipe, batch_size=64)).seconds}
    t0 = time.process_time()
    retrain_like_user(model, retain, train=fn, recipe=recipe)
    return time.process_time() - t0, est


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_case(method: str, family: str, n: int, work: dict) -> dict:
    """One case in this process: warm-up, estimate, measured run. Returns measured and estimated figures."""
    import torch
    torch.set_num_threads(1)
    from scrubnet.curvature.fisher import fisher_diag
    from scrubnet.methods import get_method
    from scrubnet.cost_guard import estimate
    from scrubnet.methods.base import protocol_context
    from scrubnet.training.cost import matmul_rate
    from scrubnet.training import TrainConfig

    model, x, y, c = build_case(family, n)
    n_f = max(1, n // 10)
    n_r = n - n_f
    retain, forget = (x[:n_r], y[:n_r]), (x[n_r:], y[n_r:])
    if method.startswith("budgeted-"):
        return budgeted_case(method.split("-", 1)[1], family, n, work, model, retain, forget)
    if method.startswith("user-retrain"):
        seconds, est = user_retrain_case(method, model, retain, work)
        return {"method": method, "family": family, "n": n, "work": work, "count": None, "seconds": seconds,
                "bytes": 0, "est_seconds": est.seconds, "est_bytes": 1, "est_flops": 0.0, "passes": est.passes,
                "gemm_gflops": matmul_rate() / 1e9, "details": est.details}
    def job(ret, fgt, warm: bool):
        """The method's work on (ret, fgt); returns the count of iterations/epochs it ran (None: fixed)."""
        if method == "fisher":
            fisher_diag(model, ret[0])
            return None
        if method == "retrain":
            # random labels: the zero-error stopping rule never fires, so exactly max_epochs epochs run
            cfg = TrainConfig(max_epochs=1 if warm else work["epochs"])
            ctx = protocol_context(model, cfg, num_classes=c, retrain_mode="remove")
            get_method("retrain", mode="remove")(model, ret, fgt, ctx)
            return cfg.max_epochs
        ctx = protocol_context(model, TrainConfig(), num_classes=c)
        if method in ("fisher-default", "newton-default"):   # the class defaults, as a user's call runs them
            res = get_method(method.split("-")[0])(model, ret, fgt, ctx)
            return int(res.info.get("newton_cg_iterations_total", res.info.get("alpha_halvings", 0)))
        if method == "finetune":
            ep = 1 if warm else work["epochs"]
            get_method("finetune", epochs=ep)(model, ret, fgt, ctx)
            return ep
        if method == "newton":
            it = 1 if warm else work["max_iter"]
            res = get_method("newton", max_iter=it, tol=1e-30, safeguard="none", retain_loss_tolerance=None,
                             retain_error_tolerance=None)(model, ret, fgt, ctx)
            return int(res.info["newton_cg_iterations"])
        if method == "ntk":
            res = get_method("ntk")(model, ret, fgt, ctx)
            assert res.info["solver_cg"] == 0.0, "expected the Cholesky path"
            return None
        if method == "ntk-cg":
            it = 1 if warm else work["cg_max_iter"]
            res = get_method("ntk", solver="cg", cg_max_iter=it, cg_tol=1e-30)(model, ret, fgt, ctx)
            return int(res.info["solve_full_iterations"])
        raise ValueError(method)

    k = min(n_r, 8)
    job((retain[0][:k], retain[1][:k]), (forget[0][:1], forget[1][:1]), warm=True)
    cfg = TrainConfig(max_epochs=work.get("epochs", TrainConfig.max_epochs))
    est_method, opts = method, dict(work)
    if method == "ntk-cg":
        est_method, opts = "ntk", {"solver": "cg", **work}
    if method == "retrain":
        opts = {"mode": "remove"}                       # at the config's epoch cap, over D_r
    if method == "newton":                              # priced as it runs: one solve, no safeguard
        opts = {**work, "safeguard": "none", "retain_loss_tolerance": None}
    if method in ("fisher-default", "newton-default"):
        est_method, opts = method.split("-")[0], {}
    est = estimate(model, n_r, n_f, method=est_method, num_classes=c, x_probe=x[:1], config=cfg, **opts)
    rate = matmul_rate()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _kib("VmRSS")
    t0 = time.process_time()
    count = job(retain, forget, warm=False)
    seconds = time.process_time() - t0
    grown = (_kib("VmHWM") - base) * 1024
    return {"method": method, "family": family, "n": n, "work": work, "count": count, "seconds": seconds,
            "bytes": grown, "est_seconds": est.seconds, "est_bytes": est.peak_bytes, "est_flops": est.flops,
            "passes": est.passes, "gemm_gflops": rate / 1e9, "details": est.details}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated methods (default: all)")
    ap.add_argument("--family", default="", help="mlp or resnet (default: both)")
    ap.add_argument("--timeout", type=float, default=170.0, help="seconds per case")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("--case", nargs=3, metavar=("METHOD", "FAMILY", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        method, family, n = args.case[0], args.case[1], int(args.case[2])
        work = next(w for m, f, nn, w in CASES if (m, f, nn) == (method, family, n))
        print(json.dumps(run_case(method, family, n, work)))
        return
    only = set(filter(None, args.only.split(",")))
    rows = []
    print(f"{'case':32s} {'work':18s} {'measured':>9s} {'estimate':>9s} {'ratio':>6s}   "
          f"{'RSS growth':>10s} {'est. peak':>10s} {'ratio':>6s}  GEMM")
    for method, family, n, work in CASES:
        if (only and method not in only) or (args.family and family != args.family):
            continue
        out = subprocess.run([sys.executable, __file__, "--case", method, family, str(n)], capture_output=True,
                             text=True, cwd=ROOT, timeout=args.timeout,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode != 0:
            print(f"{method} {family} N={n}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["ratio"] = r["seconds"] / r["est_seconds"]
        r["ratio_bytes"] = r["bytes"] / max(r["est_bytes"], 1)
        rows.append(r)
        w = ",".join(f"{k}={v}" for k, v in work.items()) + (f" ran {r['count']}" if r["count"] is not None else "")
        print(f"{method + ' ' + family + ' N=' + str(n):32s} {w:18s} {r['seconds']:8.3g}s {r['est_seconds']:8.3g}s "
              f"{r['ratio']:6.2f}   {r['bytes'] / 2**20:7.3g}MiB {r['est_bytes'] / 2**20:7.3g}MiB "
              f"{r['ratio_bytes']:6.2f}  {r['gemm_gflops']:.0f} GFLOP/s", flush=True)
    print()
    for method in dict.fromkeys(r["method"] for r in rows):
        ratios = [r["ratio"] for r in rows if r["method"] == method]
        print(f"ratio_{method}: {statistics.median(ratios):.3g}  (cases: {', '.join(f'{q:.2f}' for q in ratios)})")
    for r in rows:
        if r["method"].startswith("budgeted-"):
            print(f"{r['method']} {r['family']}: {r['details'].get('budgeted', 'full method')}, call / measured "
                  f"retraining {r['ratio']:.2f} (its own record: {r['details']['cost_vs_retrain']:.2f})")
        if r["method"].startswith("user-retrain"):
            flop = r["seconds"] / r["details"]["flop_model_seconds"]
            print(f"{r['method']} {r['family']}: measured / FLOP model's retraining {flop:.2f} "
                  f"(measured / measured price {r['ratio']:.2f})")
    print()
    from scrubnet.training.cost import EFFICIENCY
    for kind in dict.fromkeys(KIND[r["method"]] for r in rows if KIND[r["method"]] in EFFICIENCY):
        logs = [math.log(r["ratio"]) for r in rows if KIND[r["method"]] == kind]
        gm = math.exp(sum(logs) / len(logs))   # least squared log-ratio: divide the efficiency by the geometric mean
        spread = math.exp(max(abs(q - math.log(gm)) for q in logs))
        print(f"fit: EFFICIENCY[{kind!r}] = {EFFICIENCY[kind]:.3g} → {EFFICIENCY[kind] / gm:.3g} (geometric mean "
              f"ratio {gm:.3g}; after the fit every case within {spread:.2f}× of its estimate)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
