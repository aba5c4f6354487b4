"""The measurement behind the stationarity check's threshold (docs/decisions/recipes.md).

Ratio = Newton decrement ½gᵀH⁻¹g / max(L_r, 0.1) (:mod:`scrubnet.recipe.objective`, CG to 1e-3 relative residual,
no early stop) on three small architectures of the kinds users bring (tests/user_models.py: an MLP with
LayerNorm/GroupNorm, a BatchNorm residual CNN, a tiny ViT), trained on 240 8×8 images of 3 overlapping
classes (extra noise 1.5):

* converged (SGD + momentum, cosine lr to 0, 60 epochs) with wd 5e-4, judged with the right recipe;
* trained with wd 0.1 judged as 1e-3 and 1e-2 (under-stated 100×, 10×); trained with 1e-3 judged as 1e-2 and
  0.1 (over-stated 10×, 100×);
* stopped after 15 and 40 SGD steps (of the 480), judged with the right recipe;
* label smoothing 0.1 judged with and without it; AdamW(weight_decay=0.05) judged with wd = 0.05 and with
  TrainingRecipe.from_adamw.

    PYTHONPATH=. python benchmarks/recipe_check.py [--quick]
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from scrubnet.data.stream import as_stream
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.objective import stationarity
from tests.user_models import NormMLP, ResCNN, TinyViT, images

torch.set_num_threads(1)
ARCHS = {"mlp": NormMLP, "bn-cnn": ResCNN, "vit": TinyViT}


def train(arch, x, y, *, wd=5e-4, steps=None, epochs=60, lr=0.05, smoothing=0.0, adamw=None, seed=0):
    """SGD (momentum 0.9, cosine to 0 over ``epochs``) or AdamW (lr ``adamw``); stop after ``steps`` if given."""
    torch.manual_seed(seed)
    model = ARCHS[arch]()
    opt = (torch.optim.AdamW(model.parameters(), lr=adamw, weight_decay=wd) if adamw else
           torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd))
    total = epochs * math.ceil(len(y) / 32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    g, done = torch.Generator().manual_seed(seed), 0
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(y), generator=g).split(32):
            loss = F.cross_entropy(model(x[idx]), y[idx], label_smoothing=smoothing)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if steps is not None and done >= steps:
                return model.eval(), opt
    return model.eval(), opt


def ratio(model, data, recipe):
    st = stationarity(model, data, recipe, recipe.center_for(model), early_stop=False, max_iter=300)
    return st


def main(archs) -> None:
    x, y, _ = images(240, seed=0)
    x = x + 1.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))  # classes overlap: L_r > 0
    data = as_stream((x, y))
    print(f"{'arch':7s} {'case':44s} {'L_r':>8s} {'ratio':>9s} {'impl_wd':>9s} {'align':>6s} {'cg':>4s}")
    for arch in archs:
        rows = []
        m, _ = train(arch, x, y, wd=5e-4)
        rows.append(("converged wd 5e-4, right recipe", m, TrainingRecipe(wd=5e-4)))
        m1, _ = train(arch, x, y, wd=0.1)
        rows.append(("converged wd 0.1, right recipe", m1, TrainingRecipe(wd=0.1)))
        rows.append(("wd 0.1 stated 1e-2 (under 10x)", m1, TrainingRecipe(wd=1e-2)))
        rows.append(("wd 0.1 stated 1e-3 (under 100x)", m1, TrainingRecipe(wd=1e-3)))
        m2, _ = train(arch, x, y, wd=1e-3)
        rows.append(("converged wd 1e-3, right recipe", m2, TrainingRecipe(wd=1e-3)))
        rows.append(("wd 1e-3 stated 1e-2 (over 10x)", m2, TrainingRecipe(wd=1e-2)))
        rows.append(("wd 1e-3 stated 0.1 (over 100x)", m2, TrainingRecipe(wd=0.1)))
        for k in (15, 40):
            mk, _ = train(arch, x, y, wd=5e-4, steps=k)
            rows.append((f"stopped after {k} SGD steps, right recipe", mk, TrainingRecipe(wd=5e-4)))
        ms, _ = train(arch, x, y, wd=5e-4, smoothing=0.1)
        rows.append(("label smoothing 0.1, right recipe", ms, TrainingRecipe(wd=5e-4, label_smoothing=0.1)))
        rows.append(("label smoothing 0.1, stated without", ms, TrainingRecipe(wd=5e-4)))
        ma, opt = train(arch, x, y, wd=0.05, adamw=3e-3)
        rows.append(("AdamW wd 0.05 stated as wd = 0.05", ma, TrainingRecipe(wd=0.05)))
        ra = TrainingRecipe.from_adamw(ma, opt)
        rows.append((f"AdamW wd 0.05, from_adamw (wd {ra.wd:.2g})", ma, ra))
        for name, model, recipe in rows:
            st = ratio(model, data, recipe)
            print(f"{arch:7s} {name:44s} {st.objective:8.4f} {st.ratio:9.3g} {st.implied_wd:9.3g} "
                  f"{st.alignment:6.2f} {st.cg_steps:4d}{'' if st.converged else ' (cap)'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(ARCHS))
