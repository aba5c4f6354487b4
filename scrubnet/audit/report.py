"""audit.json, audit.md, the ROC figure (log-scaled FPR, one curve per method) and the per-example ε histogram."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from matplotlib import colormaps

from scrubnet.experiments.io import atomic_savefig, atomic_write_json, atomic_write_text, subplots


def render_markdown(results: dict) -> str:
    a = results["config"]["audit"]
    plan = a["plan"]
    ms = results["methods"]
    lines = ["# scrubnet audit: per-example forgetting", "",
             f"Pool: {a['n_pool']} training samples; {plan['splits']} originals on random halves "
             f"({plan['shadow_splits']} shadow splits, {plan['splits'] - plan['shadow_splits']} target splits), "
             f"forget sets of {a['forget_set_size']} samples, audit seed {a['seed']}, engine {a['engine']}; "
             f"{results.get('seconds', float('nan')):.0f} s.", "",
             "**U-LiRA** (Hayes et al. 2024): per-example Gaussians of the logit-scaled confidence for models that "
             "unlearned x (IN) and models that never trained on x (OUT), fitted on the shadow splits, a "
             "likelihood-ratio test on the target splits. Balanced accuracy 50 % = indistinguishable from "
             "never having trained on x (the ideal); the original model gives plain LiRA membership.",
             "**ε-score** (NeurIPS-2023 unlearning challenge): per forget example of one original, ε from U "
             "unlearned vs R retrained models over single and two-sided thresholds (δ = 1e-5, cap 50), "
             "bucketed (width 0.5, points 1, ½, ¼, … up to ceil(ln(U−1))); the final score multiplies by "
             "retain and test accuracy relative to retraining. Higher is better; U is given per row, the "
             "buckets depend on it.", "",
             "Units: balanced accuracies and true-positive rates in %, AUC and the ε scores from 0 to 1, ε in "
             "nats of the privacy-loss bound (audit.json keeps every rate as a fraction).", "",
             "| method | U-LiRA bal. acc. % | (fixed var.) % | AUC (0–1) | TPR @1% FPR % | TPR @0.1% FPR % | "
             "per-example acc. p10–p90 % | IN/OUT models | ε forget score (0–1) | ε score (0–1) | median ε | U / R |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, d in ms.items():
        sp = d["ulira_spread"]
        um = d["ulira_models"]
        em = d["epsilon_models"]
        pc = 100.0  # rates in %, as the header says
        lines.append(f"| {m} | {pc * d['ulira_balanced_accuracy']:.1f} "
                     f"| {pc * d['ulira_fixed_variance']['balanced_accuracy']:.1f} "
                     f"| {d['ulira_auc']:.3f} | {pc * d['ulira_tpr_at_1pct_fpr']:.1f} "
                     f"| {pc * d['ulira_tpr_at_01pct_fpr']:.1f} "
                     f"| {pc * sp['p10']:.0f}–{pc * sp['p90']:.0f} | {um['in']}/{um['out']} | {d['epsilon_forget_score']:.3f} "
                     f"| {d['epsilon_score']:.3f} | {d['epsilon_median']:.2f} | {em['unlearned']} / {em['retrained']} |")
    slow = sorted(m for m, p in plan["pairs"].items() if p < plan["forget_sets"])
    lines += ["", "Pool size per method: every method runs on "
              + ", ".join(f"{m}: {plan['pairs'][m]}" for m in ms if m in plan["pairs"])
              + f" forget set(s) per split (of {plan['forget_sets']}); the ε-score uses U = "
              + ", ".join(f"{m}: {plan['eps_models'].get(m, '–')}" for m in ms) + " unlearned models."]
    if slow:
        lines.append(f"The slow methods ({', '.join(slow)}) run on a smaller pool to fit the time budget: their "
                     "U-LiRA rows have fewer IN models and their ε buckets stop earlier.")
    refs = {m: d["ulira_out_reference"] for m, d in ms.items() if d["ulira_out_reference"] != "retrain"}
    if refs:
        lines.append("OUT reference other than retraining: " + ", ".join(f"{m} → {r}" for m, r in refs.items())
                     + " (the method's own retrained family, as in `scrubnet run`).")
    lines += ["", "A deterministic method applied to a fixed original gives one point per example: the ε-score's "
              "range rule then returns the cap (a point mass cannot be (ε, δ)-close to a retrain distribution), "
              "so its forget score is 0 by definition; U-LiRA, over many originals, still grades it.", "",
              "Figures: `roc.png` (U-LiRA ROC on target models, log-scaled FPR), `epsilon_hist.png` "
              "(per-example ε by method). Per-example numbers are in `audit.json`."]
    return "\n".join(lines) + "\n"


def write_figures(results: dict, out_dir: Path) -> None:
    ms = results["methods"]
    colors = colormaps["tab20"].colors if len(ms) > 10 else colormaps["tab10"].colors
    fig, ax = subplots(figsize=(6, 5))
    for i, (m, d) in enumerate(ms.items()):
        fpr, tpr = np.asarray(d["ulira_roc"]["fpr"]), np.asarray(d["ulira_roc"]["tpr"])
        ok = fpr > 0
        ax.plot(fpr[ok], tpr[ok], label=f"{m} ({d['ulira_balanced_accuracy']:.2f})", color=colors[i % len(colors)])
    chance = np.logspace(-3, 0, 50)
    ax.plot(chance, chance, "k:", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlim(1e-3, 1)
    ax.set_xlabel("false positive rate (log)")
    ax.set_ylabel("true positive rate")
    ax.set_title("U-LiRA: unlearned vs never trained (target models)")
    ax.legend(fontsize=7)
    atomic_savefig(fig, out_dir / "roc.png", dpi=110, bbox_inches="tight")

    fig, ax = subplots(figsize=(7, 4))
    eps = {m: [p["epsilon"] for p in d["per_example"] if p["epsilon"] is not None] for m, d in ms.items()}
    ax.hist([np.minimum(v, 7.4) for v in eps.values()], bins=np.arange(0, 8.0, 0.5), label=list(eps),
            color=[colors[i % len(colors)] for i in range(len(eps))])
    ax.set_xlabel("per-example ε (≥ 7 drawn at 7.25; the cap is 50)")
    ax.set_ylabel("forget examples")
    ax.set_title("NeurIPS-2023 per-example ε")
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, out_dir / "epsilon_hist.png", dpi=110, bbox_inches="tight")


def write_audit(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_figures(results, out_dir)
    atomic_write_text(out_dir / "audit.md", render_markdown(results))
    atomic_write_json(out_dir / "audit.json", results)
