"""The measurement behind the stationarity check's threshold (docs/decisions/own-model.md, "Stationarity check").

Ratio Δ/L_r (:mod:`scrubnet.recipe.objective`) for models that do and do not match the recipe they are judged
with:

1. the default experiment's original model (seed 0), judged with scrubnet's protocol (pull toward w_0): matches;
2. the same architecture and data trained from the same start by plain SGD with ordinary weight decay 5e-4
   (no pull), judged with the right recipe (wd 5e-4 toward 0): matches;
3. that model judged with the old quick-start context (pull 0.03 toward its start w_0): does not match;
4. that model judged as if trained without any decay while it had 5e-4 toward 0 — a small mismatch;
5. a model stopped after 1 epoch, judged with its recipe: not at a minimum.

    PYTHONPATH=. python benchmarks/stationarity_threshold.py
"""
from __future__ import annotations

import copy

import torch

from scrubnet.data.stream import as_stream
from scrubnet.device import seeded_generator
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.runner import prepare_seed
from scrubnet.recipe.objective import STATIONARITY_THRESHOLD, stationarity
from scrubnet.models import build_model
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import sgd_loop

torch.set_num_threads(1)


def main() -> None:
    cfg = ExperimentConfig()
    rows = []
    for seed in (0,):
        sr = prepare_seed(cfg, seed)
        retain = as_stream(sr.split.retain)
        proto = sr.ctx.recipe
        rows.append((f"seed {seed}: protocol model, protocol recipe", stationarity(sr.original, retain, proto, sr.ctx.center(sr.original))))
        plain = copy.deepcopy(sr.start)
        sgd_loop(plain, sr.split.x, sr.split.y, lr=cfg.train.lr, momentum=0.9, batch_size=128, max_epochs=60,
                 generator=seeded_generator(seed, "cpu"), weight_decay=5e-4)
        right = TrainingRecipe(wd=5e-4)
        rows.append((f"seed {seed}: plain SGD + wd 5e-4, right recipe",
                     stationarity(plain, retain, right, right.center_for(plain))))
        rows.append((f"seed {seed}: plain SGD + wd 5e-4, quick-start pull to w_0",
                     stationarity(plain, retain, proto, sr.ctx.center(sr.original))))
        nodecay = TrainingRecipe(wd=0.0)
        rows.append((f"seed {seed}: plain SGD + wd 5e-4, recipe says wd 0",
                     stationarity(plain, retain, nodecay, nodecay.center_for(plain))))
        short = copy.deepcopy(sr.start)
        sgd_loop(short, sr.split.x, sr.split.y, lr=cfg.train.lr, momentum=0.9, batch_size=128, max_epochs=1,
                 generator=seeded_generator(seed, "cpu"), weight_decay=5e-4)
        rows.append((f"seed {seed}: 1 epoch of SGD, right recipe", stationarity(short, retain, right,
                                                                              right.center_for(short))))
        fresh = build_model(cfg.model, sr.split.input_shape, sr.split.num_classes, seed=seed, **cfg.model_options)
        init = {k: v.detach().clone() for k, v in fresh.named_parameters()}
        sgd_loop(fresh, sr.split.x, sr.split.y, lr=cfg.train.lr, momentum=0.9, batch_size=128, max_epochs=100,
                 generator=seeded_generator(seed, "cpu"), weight_decay=5e-4)
        rows.append((f"seed {seed}: from random init, plain SGD + wd 5e-4, right recipe",
                     stationarity(fresh, retain, right, right.center_for(fresh))))
        rows.append((f"seed {seed}: from random init, plain SGD + wd 5e-4, pull to init",
                     stationarity(fresh, retain, proto, init)))
    # a model that fits its data (the situation of a user's network): 3 Gaussian clusters in 20-D, an MLP with
    # LayerNorm/GELU trained from random init by plain SGD to ≈ zero training loss
    g = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(3, 20, generator=g)
    y = torch.arange(600) % 3
    x = centers[y] + torch.randn(600, 20, generator=g)
    retain = as_stream((x, y))
    for wd in (5e-4, 0.0):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                  torch.nn.Linear(64, 3))
        init = {k: v.detach().clone() for k, v in net.named_parameters()}
        sgd_loop(net, x, y, lr=0.05, momentum=0.9, batch_size=64, max_epochs=100, generator=g, weight_decay=wd)
        right = TrainingRecipe(wd=wd)
        rows.append((f"clusters MLP, SGD wd {wd:g}, right recipe", stationarity(net, retain, right, right.center_for(net))))
        pull = TrainingRecipe(wd=0.03, wd_center=init)
        rows.append((f"clusters MLP, SGD wd {wd:g}, pull 0.03 to init", stationarity(net, retain, pull, init)))
    print(f"threshold {STATIONARITY_THRESHOLD}")
    print(f"{'case':58s} {'L_r':>9s} {'|g|':>9s} {'Δ':>10s} {'Δ/L_r':>9s} {'balance':>8s}")
    for name, st in rows:
        print(f"{name:58s} {st.objective:9.4g} {st.grad_norm:9.3g} {st.cauchy_decrease:10.3g} {st.ratio:9.3g} {st.balance:8.3g}")


if __name__ == "__main__":
    main()
