"""audit.json, audit.md, the ROC figure (log-scaled FPR, one curve per method) and the per-example ε histogram."""
from __future__ import annotations

from pathlib import Path

import numpy as np


from scrubnet.experiments.io import atomic_savefig, atomic_write_json, atomic_write_text, subplots


def _f(v, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _ci(v, digits: int = 3) -> str:
    return "–" if not v else f"[{v[0]:.{digits}f}, {v[1]:.{digits}f}]"


#: the statistics compared pairwise (``results["comparisons"]``) and how audit.md names them
COMPARED = {"ulira_game_balanced_accuracy": "the U-MIA game's balanced accuracy", "klom_forget": "KLoM (forget)"}


def game_power(results: dict, original: str = "original", retrain: str = "retrain") -> dict | None:
    """Whether the U-MIA game can rank methods: its 95 % interval of the original − retrain difference
    excludes 0. None when the audit holds no such comparison (an anchor missing).

    Returns
    -------
    dict or None
        ``can_rank`` (bool), ``difference_ci95`` (the game's interval) and ``separating``: the compared
        statistics whose interval does separate the original from retrain (keys of :data:`COMPARED`).
    """
    found = {}
    for key, rows in (results.get("comparisons") or {}).items():
        for r in rows:
            if {r["a"], r["b"]} == {original, retrain}:
                found[key] = r
    game = found.get("ulira_game_balanced_accuracy")
    if game is None:
        return None
    return {"can_rank": bool(game["distinguishable"]), "difference_ci95": game["difference_ci95"],
            "separating": [k for k, r in found.items() if r["distinguishable"] and k != "ulira_game_balanced_accuracy"]}


def audit_warnings(results: dict) -> list[str]:
    """What the reader must know before ranking methods by the audit, one sentence each (audit.md and the
    terminal): the game that cannot tell the original from retrain, and the statistic that can."""
    p = results.get("power") or game_power(results)
    if p is None or p["can_rank"]:
        return []
    ci = p["difference_ci95"]
    msg = ("the U-MIA game cannot rank methods: it cannot tell the original from retrain at 95 % (interval of "
           f"the difference {_ci(ci)} contains 0), so a method it finds indistinguishable from retrain is also "
           "indistinguishable from the untouched original")
    if p["separating"]:
        msg += "; " + " and ".join(COMPARED.get(k, k) for k in p["separating"]) + " separate(s) them: rank by it"
    else:
        msg += "; no compared statistic separates them on this pool (a larger pool or more models may)"
    return [msg]


def _standard_table(ms: dict) -> list[str]:
    """The standard-metrics table (percent) of the methods that have them; empty when none has."""
    std = [(m, d["standard"]) for m, d in ms.items() if d.get("standard")]
    if not std:
        return []
    lines = ["", "**Standard metrics** (the field's, in %, mean over the method's (split, forget set) pairs): "
             "UA = error on D_f, RA / TA = accuracy on D_r / D_test, MIA-efficacy = share of D_f a "
             "confidence attack calls non-member, Avg. Gap = mean |metric − retrain's| over the four, "
             "against the retrain model of the same pair.", "",
             "| method | UA | RA | TA | MIA-efficacy | Avg. Gap | pairs |", "|---|---|---|---|---|---|---|"]
    return lines + [f"| {m} | {100 * t['ua']:.1f} | {100 * t['ra']:.1f} | {100 * t['ta']:.1f} | "
                    f"{100 * t['mia_efficacy']:.1f} | {100 * t['avg_gap']:.1f} | {t['pairs']} |" for m, t in std]


def render_markdown(results: dict) -> str:
    a = results["config"]["audit"]
    plan = a["plan"]
    ms = results["methods"]
    lines = ["# scrubnet audit: per-example forgetting", "",
             f"Pool: {a['n_pool']} training samples; {plan['splits']} originals on random halves "
             f"({plan['shadow_splits']} shadow splits, {plan['splits'] - plan['shadow_splits']} target splits), "
             f"forget sets of {a['forget_set_size']} samples, audit seed {a['seed']}, engine {a['engine']}; "
             f"{results.get('seconds', float('nan')):.0f} s.", ""]
    fit = results.get("pool_fit") or {}
    if fit:
        lines += ["Pool models trained to the stopping rule as stated (zero training error, then 5 more epochs "
                  "at zero error; cap max_epochs): " + "; ".join(
                      f"{k}: {d['rule_not_met']} of {d['models']} did not fit (max final training error "
                      f"{100 * d['max_final_error']:.1f} %)" for k, d in fit.items()) + ".", ""]
    warns = audit_warnings(results)
    if warns:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    lines += ["**U-MIA game** (Hayes et al. 2024, the default): the attacker holds one of the method's unlearned "
              "models and must tell an example it unlearned (IN) from one it never trained on (OUT); per-example "
              "Gaussians of the logit-scaled confidence fitted on the shadow splits, a likelihood-ratio test on "
              "the target splits. 0.5 = no trace of x is left. For `original` it is plain LiRA membership. "
              "**Retrain-OUT** (`ulira_retrain_out_*`): the same test with OUT from retrained models: distance to "
              "retraining, which also counts a method's signature on every example. **Retain leakage**: LiRA "
              "balanced accuracy on retained examples after the method minus the original's (> 0: unlearning "
              "exposed the retained data). **KLoM**: per-example KL divergence of the margin distributions of "
              "U unlearned vs U retrained models (20 bins, 0 = identical). **ε forget score** (NeurIPS-2023): "
              "U = R models, higher is better. Intervals: 95 % two-way bootstrap over examples and models.", "",
              "| method | game bal. acc. [95 % CI] | AUC | TPR @1 % FPR | TPR @0.1 % FPR | retrain-OUT bal. acc. "
              "| retain leakage [95 % CI] | KLoM forget [95 % CI] | KLoM retain / val. | ε forget score [95 % CI] "
              "| ε score | U = R |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, d in ms.items():
        k = d["klom"]
        lines.append(f"| {m} | {_f(d['ulira_game_balanced_accuracy'])} {_ci(d['ulira_game_balanced_accuracy_ci95'])} "
                     f"| {_f(d['ulira_game_auc'])} | {_f(d['ulira_game_tpr_at_1pct_fpr'])} "
                     f"| {_f(d['ulira_game_tpr_at_01pct_fpr'])} | {_f(d['ulira_retrain_out_balanced_accuracy'])} "
                     f"| {d['retain_leakage']:+.3f} {_ci(d['retain_leakage_ci95'])} "
                     f"| {_f(d['klom_forget'], 2)} {_ci(d['klom_forget_ci95'], 2)} "
                     f"| {_f(k['retain']['mean'], 2)} / {_f(k['validation']['mean'], 2)} "
                     f"| {_f(d['epsilon_forget_score'])} {_ci(d['epsilon_forget_score_ci95'])} "
                     f"| {_f(d['epsilon_score'])} | {d['epsilon_u']} |")
    lines += _standard_table(ms)
    negs = sorted({d["ulira_game_negatives"] for d in ms.values()})
    lines += ["", "A TPR at FPR α is given only with ≥ 5/α target negatives (5 false positives at that rate: ≥ 500 "
              "for 1 %, ≥ 5,000 for 0.1 %); the game scores the examples that were forgotten in some shadow model "
              f"(plain LiRA: every example), so the methods have {negs[0]}–{negs[-1]} target negatives."
              if negs else ""]
    comp = results.get("comparisons") or {}
    for key, label in (("ulira_game_balanced_accuracy", "game balanced accuracy"), ("klom_forget", "KLoM (forget)")):
        same = [f"{r['a']} ≈ {r['b']}" for r in comp.get(key, []) if not r["distinguishable"]]
        if same:
            lines += ["", f"Cannot be told apart at 95 % on the {label} (the bootstrap interval of the "
                      f"difference contains 0): " + ", ".join(same) + "."]
    slow = sorted(m for m, p in plan["pairs"].items() if p < plan["forget_sets"])
    lines += ["", "Pool size per method: every method runs on "
              + ", ".join(f"{m}: {plan['pairs'][m]}" for m in ms if m in plan["pairs"])
              + f" forget set(s) per split (of {plan['forget_sets']}); the ε-score and KLoM use U = R = "
              + ", ".join(f"{m}: {plan['eps_models'].get(m, '–')}" for m in ms) + " models."]
    if slow:
        lines.append(f"The slow methods ({', '.join(slow)}) run on a smaller pool to fit the time budget: their "
                     "game has fewer IN models and their ε buckets stop earlier.")
    refs = {m: d["ulira_retrain_out_reference"] for m, d in ms.items() if d["ulira_retrain_out_reference"] != "retrain"}
    if refs:
        lines.append("Retrain-OUT reference other than retraining: " + ", ".join(f"{m} → {r}" for m, r in refs.items())
                     + " (the method's own retrained family, as in `scrubnet run`).")
    lines += ["", "A deterministic method applied to a fixed original gives one point per example: the ε-score's "
              "range rule then returns the cap, so its forget score is 0 by definition, and KLoM sees a point mass; "
              "the game, over many originals, still grades it.", "",
              "Figures: `roc.png` (the game's ROC on target models, log-scaled FPR), `epsilon_hist.png` "
              "(per-example ε by method). Per-example numbers, the estimators' variants and every interval are in "
              "`audit.json`."]
    return "\n".join(lines) + "\n"


def render_logits_markdown(results: dict) -> str:
    """audit.md for ``scrubnet audit --logits``: the game with its interval, KLoM and ε where the files hold
    the oracle block."""
    lines = ["# scrubnet audit: per-example forgetting (pools read from logits files)", "",
             "Files: " + ", ".join(f"`{f}`" for f in results["config"]["logits_files"]) + ".", "",
             "| method | test | models | game bal. acc. [95 % CI] | AUC | TPR @1 % FPR | KLoM forget | ε forget score (U = R) |",
             "|---|---|---|---|---|---|---|---|"]
    for m, d in results["methods"].items():
        eps = d.get("epsilon_forget_score")
        u = f" ({d['epsilon_u']})" if eps is not None else ""
        lines.append(f"| {m} | {d['ulira_game_kind']} | {d['models']} | {_f(d['ulira_game_balanced_accuracy'])} "
                     f"{_ci(d['ulira_game_balanced_accuracy_ci95'])} | {_f(d['ulira_game_auc'])} "
                     f"| {_f(d['ulira_game_tpr_at_1pct_fpr'])} | {_f(d.get('klom_forget'), 2)} "
                     f"| {_f(eps)}{u} |")
    return "\n".join(lines) + "\n"


def write_logits_audit(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "audit.md", render_logits_markdown(results))
    atomic_write_json(out_dir / "audit.json", results)


def write_figures(results: dict, out_dir: Path) -> None:
    ms = results["methods"]
    from matplotlib import colormaps  # imported where used: matplotlib slows every command's start-up

    colors = colormaps["tab20"].colors if len(ms) > 10 else colormaps["tab10"].colors
    fig, ax = subplots(figsize=(6, 5))
    for i, (m, d) in enumerate(ms.items()):
        fpr, tpr = np.asarray(d["ulira_game_roc"]["fpr"]), np.asarray(d["ulira_game_roc"]["tpr"])
        ok = fpr > 0
        ax.plot(fpr[ok], tpr[ok], label=f"{m} ({d['ulira_game_balanced_accuracy']:.2f})", color=colors[i % len(colors)])
    chance = np.logspace(-3, 0, 50)
    ax.plot(chance, chance, "k:", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlim(1e-3, 1)
    ax.set_xlabel("false positive rate (log)")
    ax.set_ylabel("true positive rate")
    ax.set_title("U-MIA game: unlearned x vs never trained on x (target models)")
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
