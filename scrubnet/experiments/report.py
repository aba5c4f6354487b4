"""report.md and figures from a results dict (see :mod:`scrubnet.experiments.runner`)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from scrubnet.experiments.io import atomic_savefig, atomic_write_json, atomic_write_text, subplots

#: readouts plotted as panels, with their display names
PANELS = [("error_retain", "error D_r (%)"), ("error_forget", "error D_f (%)"), ("error_test", "error D_test (%)"),
          ("loss_forget", "loss D_f (nats)"), ("mia_forget", "membership attack on D_f (%)"),
          ("relearn_epochs", "re-learn time (epochs)"), ("activation_l1_retain", "L1 to retrain, D_r"),
          ("activation_l1_forget", "L1 to retrain, D_f"), ("activation_l1_test", "L1 to retrain, D_test")]

#: the field's standard metrics (UA, RA, TA, MIA-efficacy, Avg. Gap): their own section of report.md
STANDARD = ["ua", "ra", "ta", "mia_efficacy", "avg_gap"]
PERCENT = {"error_retain", "error_forget", "error_test", "mia_forget", *STANDARD}
#: readouts stored as 0.0 / 1.0 in results.json (yes/no for a reader)
BOOLEAN = {"mia_degenerate", "mia_efficacy_degenerate"}


def readout_unit(r: str) -> str:
    """The unit a human-facing table or figure shows readout ``r`` in (the machine-readable files keep
    fractions, nats, epochs): ``%`` for errors and the attack, ``yes/no`` for flags, else the stored unit.
    A ``reference_`` readout (the same readout of the reference model) has the readout's unit."""
    r = r.removeprefix("reference_")
    if r in PERCENT or r.startswith("error_"):
        return "%"
    if r in BOOLEAN:
        return "yes/no"
    if r.startswith(("loss_", "info_")) or r.endswith("_nats"):
        return "nats"
    if r == "relearn_epochs" or r.endswith("_epochs"):
        return "epochs"
    if r.endswith(("_s", "_seconds")) or r == "time_s":
        return "s"
    return ""


def format_readout(r: str, v) -> str:
    """One value for a human-facing table, in :func:`readout_unit`'s unit (no unit sign: the header has it)."""
    if r in BOOLEAN or isinstance(v, bool):
        return "yes" if v and v == v else "no"
    if not isinstance(v, (int, float)):
        return str(v)
    if readout_unit(r) == "%":
        return f"{100 * v:.1f}"
    if v != 0 and (abs(v) >= 1000 or abs(v) < 1e-2):
        return f"{v:.4g}"
    return f"{v:.4f}"


def _fmt(r: str, s: dict) -> str:
    """``mean ± std`` in the readout's unit; the mean alone, marked, when one seed leaves no spread to show."""
    m, sd = s["mean"], s["std"]
    one = s.get("n") == 1
    if r in PERCENT:
        return f"{100 * m:.1f}" + (" (1 seed)" if one else f" ± {100 * sd:.1f}")
    if abs(m) >= 1000 or (m != 0 and abs(m) < 1e-2):
        return f"{m:.3g}" + (" (1 seed)" if one else f" ± {sd:.2g}")
    return f"{m:.3f}" + (" (1 seed)" if one else f" ± {sd:.3f}")


#: the readouts that measure forgetting (on D_f); those on D_r and D_test measure what must stay unchanged
FORGET_READOUTS = ("error_forget", "loss_forget", "mia_forget", "relearn_epochs", "activation_l1_forget")


def unranked_readouts(results: dict, band: str = "retrain") -> list[str]:
    """Forgetting readouts on which the original's mean ± std band and the ``band`` method's overlap
    (|Δmean| ≤ std_original + std_band): there an untouched original would itself look "inside the band",
    so such a readout cannot rank methods. (On D_r and D_test the two are meant to agree.)"""
    ms = results["methods"]
    so = ms.get("original", {}).get("summary", {})
    sb = ms.get(band, {}).get("summary", {})
    return [r for r in FORGET_READOUTS if r in so and r in sb
            and abs(so[r]["mean"] - sb[r]["mean"]) <= so[r]["std"] + sb[r]["std"]]


def _runs_where(d: dict, test) -> list:
    return [run["seed"] for run in d.get("runs", []) if test(run.get("readouts", {}))]


def mia_degenerate(results: dict) -> dict[str, list]:
    """Methods (→ seeds) whose membership attack predicted one class for every point: the readout
    ``mia_degenerate`` = 1 where the runner recorded it; for results without it, every run of every method
    at exactly 0 % or exactly 100 % (then the attack cannot have measured anything)."""
    ms = results["methods"]
    out = {m: _runs_where(d, lambda r: r.get("mia_degenerate", 0) >= 0.5) for m, d in ms.items()}
    out = {m: s for m, s in out.items() if s}
    if not out and not any("mia_degenerate" in run.get("readouts", {}) for d in ms.values() for run in d["runs"]):
        vals = [run["readouts"]["mia_forget"] for d in ms.values() for run in d["runs"] if "mia_forget" in
                run.get("readouts", {})]
        if vals and (all(v == 0.0 for v in vals) or all(v == 1.0 for v in vals)):
            out = {m: [run["seed"] for run in d["runs"]] for m, d in ms.items()}
    return out


def objective_raised(results: dict) -> dict[str, list]:
    """Methods (→ seeds) whose step ended above where it started on its own objective (the method reports
    ``objective_before``/``objective_after`` in its info; methods without them are not judged)."""
    out = {}
    for m, d in results["methods"].items():
        seeds = _runs_where(d, lambda r: "objective_before" in r and "objective_after" in r and
                            r["objective_after"] > r["objective_before"] + 1e-9 * (1 + abs(r["objective_before"])))
        if seeds:
            out[m] = seeds
    return out


_RUN_WARNING = re.compile(r"^seed (\S+): `([^`]+)`: (.*)$", re.S)


def group_warnings(warnings: list[str], width: int = 160) -> list[str]:
    """The terminal's form of :func:`report_warnings`: per-run warnings of one kind (the text up to its first
    colon, e.g. "the forgetting verdict could not judge this scrub") on one line naming the methods and seeds,
    every line cut to ``width`` characters; report.md keeps each warning in full."""
    groups: dict[str, dict[str, list[str]]] = {}
    out: list[tuple[str, str | None]] = []
    for w in warnings:
        m = _RUN_WARNING.match(w)
        if m is None:
            out.append((w, None))
            continue
        seed, method, text = m.groups()
        kind = text.split(":", 1)[0].split(" (", 1)[0].strip()
        if kind not in groups:
            groups[kind] = {}
            out.append((kind, kind))
        groups[kind].setdefault(method, []).append(seed)
    lines = []
    for text, kind in out:
        if kind is not None:
            who = groups[kind]
            n = sum(len(v) for v in who.values())
            names = ", ".join(f"`{m}` ({', '.join(s)})" for m, s in who.items())
            text = f"{kind}: {n} run{'s' if n > 1 else ''} — {names}" + (" (report.md has each)" if n > 1 else "")
        text = " ".join(text.split())
        lines.append(text if len(text) <= width else text[:width - 1] + "…")
    return lines


def report_warnings(results: dict) -> list[str]:
    """What the reader must know before trusting the tables, one sentence each (report.md and terminal)."""
    warn = []
    for seed, p in (results.get("protocol") or {}).items():
        for k in ("original", "retrain"):
            if f"{k}_zero_error_epoch" in p and p[f"{k}_zero_error_epoch"] is None:
                err = p.get(f"{k}_train_error")
                warn.append(f"seed {seed}: fine-tuning of the {k} model hit the epoch cap ({p.get(f'{k}_epochs')} "
                            "epochs) before zero training error"
                            + (f" ({100 * err:.1f} % left)" if isinstance(err, (int, float)) else "")
                            + "; the protocol's stopping rule did not fire (raise train.max_epochs or lower "
                            "train.wd)")
            elif k == "original" and (p.get("original_train_error") or 0) > 0:
                warn.append(f"seed {seed}: the original model stopped at {100 * p['original_train_error']:.1f} % "
                            "training error, not 0 % (it reached 0 % at epoch "
                            f"{p.get('original_zero_error_epoch')} and rose again): it is not the interpolating "
                            "minimum the curvature methods and the re-learn readout assume")
    added = (results["config"].get("resolved") or {}).get("anchors_added")
    if added:
        warn.append(f"the run named no {' and no '.join(added)}: added ({', '.join(added)}), since every "
                    "comparison of this report is with them")
    for m, d in results["methods"].items():
        for run in d.get("runs", []):
            if run.get("failed"):
                warn.append(f"seed {run['seed']}: method {m} failed: " + "; ".join(run["failed"]))
            warn.extend(f"seed {run['seed']}: `{m}`: {w}" for w in run.get("warnings") or [])
    bands = sorted({d.get("band", "retrain") for m, d in results["methods"].items() if m != "original"}
                   & set(results["methods"]))
    for b in bands:
        un = unranked_readouts(results, b)
        if un:
            warn.append(f"the original and `{b}` bands overlap on {', '.join(un)}: these readouts cannot rank "
                        "methods (an untouched original would pass them)")
    deg = mia_degenerate(results)
    if deg:
        warn.append("the membership attack is degenerate (its classifier predicts one class for every point) for "
                    + ", ".join(f"{m} (seeds {s})" for m, s in deg.items())
                    + ": mia_forget is not a measurement there")
    for m, seeds in objective_raised(results).items():
        warn.append(f"`{m}` raised its own objective (objective_after > objective_before) on seeds {seeds}")
    return warn


def verdict_lines(results: dict) -> list[str]:
    """The forgetting verdicts (D_f against the test set, no retrained model needed) as a table: a row per
    method with the verdicts' counts over seeds and the mean AUCs before and after; empty without verdicts."""
    rows = []
    for m, d in results["methods"].items():
        vs = [r["forgetting"] for r in d.get("runs", []) if r.get("forgetting")]
        if not vs:
            continue
        counts: dict[str, int] = {}
        for v in vs:
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
        cell = ", ".join(f"{k} ×{n}" for k, n in counts.items())
        def mean(k: str) -> str:
            xs = [v[k] for v in vs if v.get(k) is not None]
            return f"{sum(xs) / len(xs):.2f}" if xs else "n/a"
        rows.append(f"| {m} | {cell} | {mean('auc_before')} | {mean('auc_after')} | {mean('fraction_closed')} | "
                    f"{mean('auc_retain_heldout')} | {vs[0]['statistic']} |")
    if not rows:
        return []
    return ["## Forgetting verdict (no retrained model needed)", "",
            "Does D_f look like data the model never saw? AUC of D_f against the test examples of D_f's labels "
            "(0.5: like unseen data, 1: memorised) under the original (before) and the method's model (after), "
            "and the fraction of D_f's membership gap the scrub closed (1: all of it, 0: none); D_r vs test "
            "under the original says how much the model tells members apart at all. Means over seeds; the "
            "verdict per seed (forgot, partly, did_not_forget, moved_wrong_way, hidden, inconclusive, "
            "nothing_to_measure). The retrain comparison above remains the judge where both exist.", "",
            "| method | verdicts over seeds | AUC before | AUC after | distance closed | AUC D_r vs test | statistic |",
            "|---|---|---|---|---|---|---|"] + rows + [""]


def _readout_table(results: dict, cols: list[str], degenerate: set) -> list[str]:
    """One markdown table: a row per method (retrain marked as the target), a column per readout with its unit."""
    def cell(m: str, c: str, summary: dict) -> str:
        if c not in summary:
            return "–"
        if c == "mia_forget" and m in degenerate:
            return "degenerate"
        return _fmt(c, summary[c])

    heads = [f"{c} ({readout_unit(c)})" if readout_unit(c) else c for c in cols]  # the unit in every header
    out = ["| method | time (s) | " + " | ".join(heads) + " |", "|---" * (len(cols) + 2) + "|"]
    for m, d in results["methods"].items():
        name = f"**{m}** (target)" if m == "retrain" else m
        t = sum(r["time_s"] for r in d["runs"]) / max(len(d["runs"]), 1)
        cells = [cell(m, c, d.get("summary", {})) for c in cols]
        out.append(f"| {name} | {t:.2f} | " + " | ".join(cells) + " |")
    return out


def _check_lines(results: dict, degenerate: set) -> list[str]:
    """The protocol's separation checks, one bullet each."""
    lines = ["## Checks", ""]
    for k, v in results.get("checks", {}).items():
        if k.startswith("band_separated_"):
            r = k[len("band_separated_"):]
            lines.append(f"- original vs retrain on `{r}`: |Δmean| = {v['gap']:.4f}, 2·std(retrain) = "
                         f"{v['two_std_retrain']:.4f} → {'separated' if v['separated'] else 'NOT separated'}")
        elif k.endswith("_inside_band"):
            m = k[:-len("_inside_band")]
            un = set(unranked_readouts(results, v["band"]))
            if m in degenerate:
                un.add("mia_forget")
            ranked = {r: ok for r, ok in v["readouts"].items() if r not in un}
            inside = [r for r, ok in ranked.items() if ok]
            cannot = [r for r in v["readouts"] if r in un]
            lines.append(f"- `{m}` inside the `{v['band']}` band on {len(inside)}/{len(ranked)} readouts that "
                         "can rank methods" + (f": {', '.join(inside)}" if inside else "")
                         + (f"; cannot rank methods on {', '.join(cannot)}" if cannot else ""))
        else:
            lf_unranked = "loss_forget" in unranked_readouts(results, "retrain")
            lines.append(f"- `{k}`: distance to original {v['distance_to_original']:.4f}, to retrain "
                         f"{v['distance_to_retrain']:.4f} → closer to {v['closer_to']}"
                         + (" (loss_forget cannot rank methods: the original and retrain bands overlap)"
                            if lf_unranked else " (inside the retrain band)" if v["inside_retrain_band"] else ""))
    return lines + [""]


def _protocol_lines(proto: dict) -> list[str]:
    lines = ["## Protocol", "", "| seed | time (s) | original epochs | retrain epochs | original train error |",
             "|---|---|---|---|---|"]
    for s, p in proto.items():
        lines.append(f"| {s} | {p['time_s']:.1f} | {p.get('original_epochs')} | {p.get('retrain_epochs')} | "
                     f"{100 * p.get('original_train_error', float('nan')):.1f} % |")
    return lines + [""]


def render_report(results: dict) -> str:
    """Markdown: one table of mean ± std per readout (errors and attack in %), retrain marked as target."""
    ms = results["methods"]
    cfg = results["config"]
    res = cfg.get("resolved", {})
    readouts: list[str] = []
    for d in ms.values():
        for r in d.get("summary", {}):
            if r not in readouts:
                readouts.append(r)
    core = [p for p, _ in PANELS if p in readouts]
    extra = [r for r in readouts if r not in core and r not in STANDARD
             and r not in ("mia_degenerate", "mia_efficacy_degenerate")]
    seeds = cfg.get("seeds", [])
    lines = ["# scrubnet report", "",
             f"Dataset `{cfg['data']['dataset']}`, model `{cfg['model']}`, seeds {seeds}, retrain mode "
             f"`{cfg.get('retrain_mode')}`; |D_r| = {res.get('n_retain')}, |D_f| = {res.get('n_forget')}, "
             f"|D_test| = {res.get('n_test')}, |core| = {res.get('n_core')}.", "",
             "Mean ± std (ddof 0) over seeds; with one seed, the value alone. Errors and the membership attack in %, losses in nats, re-learn time in "
             "epochs of 500 samples, L1 = mean ‖softmax − softmax_retrain‖₁. **retrain** is the target: a "
             "method has forgotten when its readouts fall inside the retrain band.", ""]
    warnings = report_warnings(results)
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    degenerate = mia_degenerate(results)
    lines += ["## Readouts", ""] + _readout_table(results, core, degenerate) + [""]
    lines += verdict_lines(results)
    info = [r for r in extra if r.startswith("info_") or r in ("loss_retain", "loss_test")]
    if info:
        lines += ["## Losses and information (nats)", ""] + _readout_table(results, info, degenerate) + [""]
    other = [r for r in extra if r not in info]
    if other:
        lines += ["## What each method measured", ""]
        for m, d in ms.items():
            keys = [r for r in other if r in d.get("summary", {})]
            if keys:
                lines.append(f"- **{m}**: " + ", ".join(f"`{k}` {_fmt(k, d['summary'][k])}" for k in keys))
        lines.append("")
    standard = [r for r in STANDARD if r in readouts]
    if standard:
        lines += ["## Standard metrics", "",
                  "The field's readouts (in %): UA = error on D_f, RA / TA = accuracy on D_r / D_test, MIA-efficacy = "
                  "share of D_f a confidence attack calls non-member, Avg. Gap = mean |metric − retrain's| over the "
                  "four, against the same seed's retrain model (lower is better).", ""]
        lines += _readout_table(results, standard, degenerate) + [""]
    if results.get("checks"):
        lines += _check_lines(results, degenerate)
    if results.get("protocol"):
        lines += _protocol_lines(results["protocol"])
    lines += ["Figures: `readouts.png` (one panel per readout, retrain band shaded), `entropy.png` (softmax "
              "entropy histograms on D_r, D_f, D_test for the first seed).", "",
              "Per-example verdict (U-LiRA, NeurIPS-2023 ε-score over a pool of models): `scrubnet audit --out DIR`.",
              ""]
    return "\n".join(lines)


def plot_readouts(results: dict, path: Path) -> None:

    ms = results["methods"]
    panels = [(r, t) for r, t in PANELS if any(r in d.get("summary", {}) for d in ms.values())]
    ncol = 3
    nrow = max(1, math.ceil(len(panels) / ncol))
    fig, axes = subplots(nrow, ncol, figsize=(4.2 * ncol, 2.8 * nrow), squeeze=False)
    names = list(ms)
    for ax, (r, title) in zip(axes.flat, panels):
        k = 100.0 if r in PERCENT else 1.0  # the tables' units: errors and the attack in %
        ret = ms.get("retrain", {}).get("summary", {}).get(r)
        if ret is not None:
            ax.axhspan(k * (ret["mean"] - ret["std"]), k * (ret["mean"] + ret["std"]), color="tab:green", alpha=0.25,
                       label="retrain band")
            ax.axhline(k * ret["mean"], color="tab:green", lw=1)
        for i, m in enumerate(names):
            s = ms[m].get("summary", {}).get(r)
            if s is None:
                continue
            ax.errorbar([i], [k * s["mean"]], yerr=[k * s["std"]], fmt="o", capsize=3,
                        color="tab:green" if m == "retrain" else "tab:blue")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


def plot_entropies(hist_data: dict, path: Path) -> None:

    methods = list(hist_data)
    if not methods:
        return
    fig, axes = subplots(len(methods), 3, figsize=(10, 1.6 * len(methods) + 0.6), squeeze=False, sharex=True)
    for i, m in enumerate(methods):
        for j, part in enumerate(("retain", "forget", "test")):
            h = np.log(np.clip(np.array(hist_data[m][part]), 1e-12, None))
            ax = axes[i, j]
            # one filled outline per panel, not 30 bar patches: drawing ~1,000 patches took 3 s of a tiny run
            counts, edges = np.histogram(h, bins=30, range=(-12, 1))
            ax.stairs(counts, edges, fill=True, color="tab:green" if m == "retrain" else "tab:blue", alpha=0.8)
            if i == 0:
                ax.set_title(f"log entropy on D_{'r' if part == 'retain' else 'f' if part == 'forget' else 'test'}")
            if j == 0:
                ax.set_ylabel(m, fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)


def write_outputs(results: dict, hist_data: dict, out_dir: Path) -> None:
    """results.json, report.md, readouts.png, entropy.png (each written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "report.md", render_report(results))
    plot_readouts(results, out_dir / "readouts.png")
    if hist_data:
        atomic_write_json(out_dir / "entropies.json", hist_data)
        plot_entropies(hist_data, out_dir / "entropy.png")


def report_from_dir(run_dir: Path) -> str:
    """Re-render report.md and figures from ``run_dir/results.json``; returns the markdown."""
    p = Path(run_dir) / "results.json"
    if not p.is_file():
        raise FileNotFoundError(f"no results.json in {run_dir}")
    try:
        results = json.loads(p.read_text())
        results["methods"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{p} is not a scrubnet results file: {e}") from None
    hist = {}
    hp = Path(run_dir) / "entropies.json"
    if hp.is_file():
        hist = json.loads(hp.read_text())
    md = render_report(results)
    atomic_write_text(Path(run_dir) / "report.md", md)
    plot_readouts(results, Path(run_dir) / "readouts.png")
    if hist:
        plot_entropies(hist, Path(run_dir) / "entropy.png")
    return md
