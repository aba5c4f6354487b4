"""Every method's cost against retraining, at a realistic size, through ``scrubnet.forget``.

    python benchmarks/cost_vs_retrain.py [--n 5000] [--families resnet,transformer] [--methods fisher,newton]
                                         [--measure-below 1.0] [--small 500] [--json out.json]

Two models trained by an ordinary recipe (SGD lr 0.05, momentum 0.9, weight decay 5e-4 toward 0, batch 128,
``--epochs`` epochs) on CIFAR-shaped data (3×32×32, 10 classes, a learnable synthetic task: class means plus
noise): a BatchNorm ResNet-18 at width 0.25 and a small transformer (8×8 patches → 16 tokens of width 64,
two encoder layers). D_r has ``--n`` samples, D_f 1 % more.

For every method in its default mode (budgeted where the full method would cost more than one retraining) the
call runs with ``max_cost_vs_retrain=1.0``: a method whose estimate is above one retraining is refused before
any work, and the line prints the estimated ratio. A method whose estimate is at most ``--measure-below``
retrainings (default: every one that is not refused) runs at full size: the line prints the measured ratio
``result.cost["cost_vs_retrain"]`` (measured CPU seconds over the *estimate* of retraining, what a user's
result records) and ``vs_measured_retrain`` (over the retraining measured here: the model's own training with
the recipe, scaled to D_r); others are estimated at full size and checked against a measured run at
``--small`` samples (``est_small`` vs ``measured_small``). The verdict is the result's ``ok`` and reasons.

One line per (family, method): ``cost_vs_retrain: <ratio> (<measured|estimated|refused>) verdict: …``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's scrubnet

import torch  # noqa: E402
from torch import nn  # noqa: E402

import scrubnet  # noqa: E402
from scrubnet.methods.base import available_methods, method_class  # noqa: E402
from scrubnet.recipe import TrainingRecipe  # noqa: E402
from scrubnet.training.cost import BudgetExceeded  # noqa: E402


class SmallTransformer(nn.Module):
    """8×8 patches of a 3×32×32 image → 16 tokens of width ``d``, ``layers`` encoder layers, mean-pooled head."""

    def __init__(self, num_classes: int = 10, d: int = 64, layers: int = 2):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 8, stride=8)
        self.pos = nn.Linear(16, d, bias=False)   # a learned position table as a layer (it re-initialises)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.fc = nn.Linear(d, num_classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)                     # (n, 16, d)
        t = t + self.pos.weight.t().unsqueeze(0)
        return self.fc(self.encoder(t).mean(1))


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "resnet":
        return scrubnet.models.build_model("resnet18", (3, 32, 32), 10, seed=0, width=0.25)
    return SmallTransformer()


def data(n: int, seed: int = 0):
    """n CIFAR-shaped samples of a learnable 10-class task (class means of unit scale plus noise)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(123))
    y = torch.randint(0, 10, (n,), generator=g)
    return means[y] + 1.5 * torch.randn(n, 3, 32, 32, generator=g), y


def train(model: nn.Module, x, y, recipe: TrainingRecipe) -> float:
    """Train with the recipe's SGD; returns the process CPU seconds it took."""
    opt = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum, weight_decay=recipe.wd)
    g = torch.Generator().manual_seed(1)
    t0 = time.process_time()
    model.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), recipe.batch_size):
            b = order[i:i + recipe.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
    return time.process_time() - t0


def call(model, x, y, n_r, method, recipe, ceiling):
    retain, forget = (x[:n_r], y[:n_r]), (x[n_r:], y[n_r:])
    return scrubnet.forget(model, retain, forget, method=method, recipe=recipe, on_failure="return", force=True,
                           max_cost_vs_retrain=ceiling)[1]


def one(family: str, method: str, model, x, y, n_r: int, recipe, args) -> dict:
    from scrubnet.cost_guard import budgeted_options, price_call
    from scrubnet.data.stream import as_stream
    from scrubnet.methods.base import ForgetContext
    ctx = ForgetContext.from_recipe(model, recipe, num_classes=10)
    ctx.force = True
    r_s, f_s = as_stream((x[:n_r], y[:n_r])), as_stream((x[n_r:], y[n_r:]))
    est, _ = price_call(method, {}, model, r_s, f_s, ctx)
    b = budgeted_options(method, {}, model, r_s, f_s, ctx, est)
    if b is not None:
        est = b[1]
    row = {"family": family, "method": method, "est_cost_vs_retrain": est.cost_vs_retrain,
           "budgeted": est.details.get("budgeted", "")}
    if est.cost_vs_retrain > 1.0:
        row.update(kind="refused", cost_vs_retrain=est.cost_vs_retrain,
                   verdict=f"refused before any work: {est.cost_vs_retrain:.3g}× retraining")
        return row
    if est.cost_vs_retrain <= args.measure_below:
        res = call(model, x, y, n_r, method, recipe, 1.0)
        row.update(kind="measured", cost_vs_retrain=res.cost["cost_vs_retrain"], cost=res.cost)
    else:
        small = min(args.small, n_r)
        res = call(model, x[:small + (len(y) - n_r)], torch.cat([y[:small], y[n_r:]]), small, method, recipe,
                   None)
        row.update(kind="estimated", cost_vs_retrain=est.cost_vs_retrain,
                   measured_small=res.cost["cost_vs_retrain"], est_small=res.cost.get("estimate_cost_vs_retrain"))
    row["verdict"] = "ok" if res.ok else "failed: " + "; ".join(res.reasons)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="|D_r|")
    ap.add_argument("--epochs", type=int, default=4, help="the recipe's epochs (training and retraining)")
    ap.add_argument("--families", default="resnet,transformer")
    ap.add_argument("--methods", default="", help="comma-separated (default: every method for a user's model)")
    ap.add_argument("--measure-below", type=float, default=1.01, help="measure at full size below this ratio")
    ap.add_argument("--small", type=int, default=500, help="|D_r| of the check of an estimated ratio")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    methods = [m for m in (args.methods.split(",") if args.methods else available_methods())
               if m and not method_class(m).own_retrain_family and not method_class(m).class_only
               and method_class(m).anchor is None]
    recipe = TrainingRecipe(lr=0.05, momentum=0.9, wd=5e-4, batch_size=128, epochs=args.epochs)
    n_f = max(1, args.n // 100)
    x, y = data(args.n + n_f)
    rows = []
    for family in args.families.split(","):
        model = build(family)
        secs = train(model, x, y, recipe)
        model.eval()
        with torch.no_grad():
            err = float((model(x[:1000]).argmax(1) != y[:1000]).float().mean())
        print(f"{family}: trained {args.epochs} epochs in {secs:.1f} CPU-s, training error {100 * err:.1f} %",
              flush=True)
        retrain_s = secs * args.n / (args.n + n_f)   # the recipe on D_r, measured (the training above, scaled)
        for method in methods:
            try:
                row = one(family, method, model, x, y, args.n, recipe, args)
                if row["kind"] == "measured":
                    row["vs_measured_retrain"] = row["cost"]["seconds"] / retrain_s
            except (ValueError, RuntimeError, BudgetExceeded) as e:
                row = {"family": family, "method": method, "kind": "error", "cost_vs_retrain": float("nan"),
                       "verdict": f"error: {e}"[:200]}
            rows.append(row)
            extra = (f" [est_small {row['est_small']:.3g}, measured_small {row['measured_small']:.3g}]"
                     if row["kind"] == "estimated" else "")
            if "vs_measured_retrain" in row:
                extra += f" [vs_measured_retrain {row['vs_measured_retrain']:.3g}]"
            print(f"{family:11s} {method:14s} cost_vs_retrain: {row['cost_vs_retrain']:.3g} ({row['kind']}"
                  f"{', ' + row['budgeted'] if row.get('budgeted') else ''}){extra} verdict: {row['verdict']}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
