"""Outputs of the synthetic-TOFU bench: ``tofu.json`` (everything), ``tofu.md`` (the table) and ``tofu.png``
(forget quality and model utility per model, every seed a point)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from scrubnet.atomic_io import atomic_write_text
from scrubnet.experiments.tofu import KS_PASS, summary_line

TOFU_OUTPUTS = ("tofu.json", "tofu.md", "tofu.png")
ROLES = {"original": "ordinary LoRA, never unlearned", "retain": "retrained without the people (gold)",
         "retain-seed2": "retrained, second seed (the benchmark's noise)"}


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.2g}" if abs(x) < 0.01 and x != 0 else f"{x:.3f}"


def render_tofu(result: dict) -> str:
    """The markdown table of a :func:`~scrubnet.experiments.tofu.run_tofu` result: means over seeds (FQ also its
    minimum), leak probes as "inside the retain model's 95 % interval in k of n seed × probe cases"."""
    s, cfg = result["summary"], result["config"]
    n = s["n_seeds"]
    exact = f"exact ({result['seeds'][0]['models']['exact'].get('engine', cfg['exact'])})"
    lines = [f"Synthetic TOFU, {cfg['split']} ({len(result['forget_people'])} of {cfg['n_private']} people, "
             f"{result['n_forget_questions']} questions), model size `{cfg['size']}`, {n} seed(s) "
             f"{', '.join(str(x) for x in cfg['seeds'])}; FQ against the retain model of the same seed.", "",
             "| model | FQ (mean) | FQ (min) | FQ paraphrase | utility | forget ROUGE-L | ES | EM | "
             "probe recall (paraphrase / cloze) | probes inside retain interval | U-LiRA acc | tuned lr (trials) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in s["mean"].items():
        fqs = [r["models"][name]["forget_quality"] for r in result["seeds"]]
        label = exact if name == "exact" else name
        role = ROLES.get(name, "")
        tune = result["tuning"].get(name)
        lr = (f"{tune['lr']:g} ({tune['budget']})" if tune else
              (f"{result['seeds'][0]['models'][name].get('lr'):g} (default)"
               if result["seeds"][0]["models"][name].get("lr") is not None else "–"))
        lines.append(f"| {label}{' — ' + role if role else ''} | {_fmt(m['forget_quality'])} | {_fmt(min(fqs))} | "
                     f"{_fmt(m['forget_quality_paraphrase'])} | {_fmt(m['model_utility'])} | {_fmt(m['forget/rouge'])} | "
                     f"{_fmt(m['extraction_strength'])} | {_fmt(m['exact_memorisation'])} | "
                     f"{_fmt(m['probe/paraphrase/recall'])} / {_fmt(m['probe/format/recall'])} | "
                     f"{m['probes_within']}/{s['probes_total']} | {_fmt(result['ulira'].get(name))} | {lr} |")
    lines += ["", "```", summary_line(result), "```", "",
              f"Exact passes: KS p ≥ {KS_PASS} in {s['exact_passes']}/{n} seeds. U-LiRA accuracy 0.5 = the forget "
              "questions' log-likelihoods cannot be told from retrained models' (one seed held out in turn). "
              f"request_vs_refinetune = sample passes of the deletion request / of re-fine-tuning on the retain people."]
    return "\n".join(lines) + "\n"


def plot_tofu(result: dict, path: Path) -> None:
    """Two panels: log10 forget quality per model (the KS 0.05 line) and model utility; one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"]["mean"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, nme in enumerate(names):
        fq = [max(r["models"][nme]["forget_quality"], 1e-30) for r in result["seeds"]]
        u = [r["models"][nme]["model_utility"] for r in result["seeds"]]
        a.scatter(np.full(len(fq), i), np.log10(fq), color="C0")
        b.scatter(np.full(len(u), i), u, color="C1")
    a.axhline(math.log10(KS_PASS), color="grey", ls="--", lw=1)
    for ax, title in ((a, "log10 forget quality (KS p vs retain)"), (b, "model utility")):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_title(title)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_tofu(result: dict, out: Path) -> None:
    """``tofu.json``, ``tofu.md`` and ``tofu.png`` in ``out`` (each written to a temporary file, then renamed)."""
    out = Path(out)
    atomic_write_text(out / "tofu.json", json.dumps(result, indent=1, default=float))
    atomic_write_text(out / "tofu.md", render_tofu(result))
    plot_tofu(result, out / "tofu.png")
