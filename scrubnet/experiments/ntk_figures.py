"""Line plots of the NTK scrub ("Forgetting Outside the Box", Figures 4 and 6 / thesis Figs. 3.4, 3.6).

* ``ntk_activation_line.png`` (Figure 4): E_x ‖softmax f_{w_α}(x) − softmax f_{w(D_r)}(x)‖₁ on D_f and D_r
  along w_α = w(D) + α·(w_scrubbed − w(D)), α ∈ [0, α_max] (α = 0: the original, α = 1: the NTK scrub;
  α_max = 2 by default, to show whether the minimum lies at the scrubbed point, i.e. whether the step length
  is right).
* ``ntk_loss_line.png`` (Figure 6): mean cross-entropy on D_f, D_r and D_test along
  w_β = w(D) + β·(w(D_r) − w(D)), β ∈ [0, 1] (β = 1: the retrained model).

Both curves are also written to ``ntk_lines.json``. All files are written atomically.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch.nn.functional as F
from torch import nn

from scrubnet.curvature.params import get_flat, set_flat
from scrubnet.experiments.io import atomic_savefig, atomic_write_json, subplots
from scrubnet.readouts.basic import activation_l1
from scrubnet.training import predict_logits


def _along(model: nn.Module, start, direction, t: float) -> nn.Module:
    return set_flat(model, start + t * direction)


def ntk_line_data(original: nn.Module, scrubbed: nn.Module, retrain: nn.Module, split, *,
                  alphas=None, betas=None) -> dict:
    """The two curves as lists: {"alpha", "l1_forget", "l1_retain", "beta", "loss_forget", "loss_retain",
    "loss_test"}. ``split`` provides ``.forget``, ``.retain``, ``.test`` as (x, y)."""
    alphas = np.linspace(0.0, 2.0, 21) if alphas is None else np.asarray(alphas, dtype=float)
    betas = np.linspace(0.0, 1.0, 11) if betas is None else np.asarray(betas, dtype=float)
    w_d = get_flat(original)
    to_scrub = get_flat(scrubbed) - w_d
    to_retrain = get_flat(retrain) - w_d
    work = copy.deepcopy(original).eval()
    out: dict = {"alpha": alphas.tolist(), "l1_forget": [], "l1_retain": [], "beta": betas.tolist(),
                 "loss_forget": [], "loss_retain": [], "loss_test": []}
    xf, _ = split.forget
    xr, _ = split.retain
    for a in alphas:
        m = _along(work, w_d, to_scrub, float(a))
        out["l1_forget"].append(activation_l1(m, retrain, xf))
        out["l1_retain"].append(activation_l1(m, retrain, xr))
    for b in betas:
        m = _along(work, w_d, to_retrain, float(b))
        for part, (x, y) in (("forget", split.forget), ("retain", split.retain), ("test", split.test)):
            out[f"loss_{part}"].append(float(F.cross_entropy(predict_logits(m, x), y)) if len(y) else float("nan"))
    return out


def _finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> str:
    """Label one line plot, write it to ``path`` (PNG, 110 dpi) and return the path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    return str(path)


def plot_ntk_lines(original: nn.Module, scrubbed: nn.Module, retrain: nn.Module, split, out_dir, *,
                   seed: int = 0, method: str = "ntk", alphas=None, betas=None) -> dict:
    """Write the Figure-4 and Figure-6 line plots for one seed of the protocol.

    ``original`` = w(D), ``scrubbed`` = the output of ``method`` (named in the titles and the JSON),
    ``retrain`` = w(D_r); ``split`` provides ``.forget``, ``.retain``, ``.test`` as (x, y).
    Returns {"data": curves, "files": [paths]}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = ntk_line_data(original, scrubbed, retrain, split, alphas=alphas, betas=betas)
    data.update({"seed": int(seed), "method": method})
    files = []

    fig, ax = subplots(figsize=(5.2, 3.6))
    ax.plot(data["alpha"], data["l1_forget"], "o-", ms=3, label="D_f (forget)")
    ax.plot(data["alpha"], data["l1_retain"], "s-", ms=3, label="D_r (retain)")
    ax.axvline(0.0, color="grey", lw=0.8, ls=":")
    ax.axvline(1.0, color="green", lw=0.8, ls="--", label="scrubbed (α = 1)")
    files.append(_finish(fig, ax, out_dir / "ntk_activation_line.png", "α  (w(D) + α·(w_scrub − w(D)))",
                         "L1 distance of softmax to retrain", f"NTK scrub direction, seed {seed}"))

    fig, ax = subplots(figsize=(5.2, 3.6))
    for part, mk in (("forget", "o-"), ("retain", "s-"), ("test", "^-")):
        ax.plot(data["beta"], data[f"loss_{part}"], mk, ms=3, label=f"D_{part[0] if part != 'test' else 'test'}")
    files.append(_finish(fig, ax, out_dir / "ntk_loss_line.png", "β  (w(D) + β·(w(D_r) − w(D)))",
                         "cross-entropy (nats)", f"loss from original (β = 0) to retrain (β = 1), seed {seed}"))

    p3 = out_dir / "ntk_lines.json"
    atomic_write_json(p3, data)
    files.append(str(p3))
    return {"data": data, "files": files}
