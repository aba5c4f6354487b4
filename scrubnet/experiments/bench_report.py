"""What ``scrubnet bench`` writes from its runs: each setting's rows with 95 % intervals, the paired comparison
with the best and the tie groups (:func:`summarise_setting`), ``bench.md`` (:func:`render_bench`, whose tables
:func:`bench_table_rows` also writes into the guide) and ``bench.png`` (:func:`plot_bench`)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from scrubnet.experiments.bench_stats import interval, paired, tie_groups
from scrubnet.experiments.io import atomic_savefig, subplots
from scrubnet.readouts.standard import GAP_METRICS

ANCHORS = ("original", "retrain")


def _unit(r: dict) -> tuple[int, int]:
    return (int(r.get("forget_set", 0)), int(r["seed"]))


def summarise_setting(runs: list[dict], tuning: dict, family) -> dict:
    """One setting's rows, ordered by mean Avg. Gap, with intervals, the paired comparison and the ties.

    Parameters
    ----------
    runs : list of dict
        The setting's evaluation jobs (one per method and unit).
    tuning : dict
        The setting's tuning records by method.
    family : callable
        Method name → ``anchor``, ``seed`` or ``field``.

    Returns
    -------
    dict
        ``rows`` (each metric and ``time_s`` as :func:`~scrubnet.experiments.bench_stats.interval` over the
        units; ``vs_best``: the paired interval of its Avg. Gap minus the best's; ``tie_group``: 1-based),
        ``best``, ``ties`` (the groups, best first), ``closest`` / ``closest_seed`` / ``closest_field`` (the
        best non-anchor method overall and per family) and ``units`` (the (forget set, seed) pairs).
    """
    rows, gaps, errored = [], {}, {}
    for m in dict.fromkeys(r["method"] for r in runs):
        every = [r for r in runs if r["method"] == m]
        rs = [r for r in every if r["metrics"] is not None]     # a scrub that raised has no metrics
        if len(rs) < len(every):
            errored[m] = [u for r in every if r["metrics"] is None for u in [list(_unit(r))]]
        if not rs:
            continue
        gaps[m] = {_unit(r): float(r["metrics"]["avg_gap"]) for r in rs}
        row = {"method": m, "family": family(m), "options": rs[0]["options"], "tuned": m in tuning,
               "units": [list(_unit(r)) for r in rs], "failed": sum(not r["ok"] for r in every),
               "mia_degenerate": sum(bool(r["metrics"].get("mia_efficacy_degenerate")) for r in rs)}
        for k in list(GAP_METRICS) + ["avg_gap"]:
            row[k] = interval([float(r["metrics"][k]) for r in rs])
        row["time_s"] = interval([float(r["time_s"]) for r in rs])
        rows.append(row)
    rows.sort(key=lambda r: (r["method"] != "retrain", r["avg_gap"]["mean"], r["method"]))
    cands = [r["method"] for r in rows if r["family"] != "anchor"]
    out = {"rows": rows, "best": cands[0] if cands else None, "ties": tie_groups(cands, gaps) if cands else [],
           "units": sorted({u for g in gaps.values() for u in g}), "errored": errored}
    out["units"] = [list(u) for u in out["units"]]
    group_of = {m: i + 1 for i, g in enumerate(out["ties"]) for m in g}
    for r in rows:
        r["tie_group"] = group_of.get(r["method"])
        r["vs_best"] = paired(gaps[r["method"]], gaps[out["best"]]) if out["best"] else None
    for name, fam in (("closest", ("seed", "field")), ("closest_seed", ("seed",)), ("closest_field", ("field",))):
        cand = [r for r in rows if r["family"] in fam]
        out[name] = cand[0]["method"] if cand else None
    return out


def cell(s: dict, scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± half`` (the 95 % half-width) scaled, or ``mean (n = 1)`` when there is no interval."""
    if s.get("half") is None:
        return f"{scale * s['mean']:.{digits}f} (n = 1)"
    return f"{scale * s['mean']:.{digits}f} ± {scale * s['half']:.{digits}f}"


def _vs_best(r: dict) -> str:
    v = r.get("vs_best")
    if v is None or v["lo"] is None:
        return "–"
    return f"{100 * v['mean']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}]"


def bench_table_rows(rows: list[dict], variants: dict | None = None) -> list[str]:
    """One markdown table of a setting's rows (metrics in %, mean ± 95 % half-width; time in s)."""
    out = ["| method | tie group | UA % | RA % | TA % | MIA-eff. % | Avg. Gap % | Δ gap vs best % [95 %] | "
           "time (s) | options |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['failed']} failed)" if r["failed"] else ""
        note += " †" if r["method"] in (variants or {}) else ""
        opts = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
        group = r.get("tie_group") or ("anchor" if r["family"] == "anchor" else "–")
        out.append(f"| {r['method']}{note} ({r['family']}) | {group} | {cell(r['ua'])} | {cell(r['ra'])} | "
                   f"{cell(r['ta'])} | {cell(r['mia_efficacy'])} | {cell(r['avg_gap'])} | {_vs_best(r)} | "
                   f"{r['time_s']['mean']:.2f} | {opts or 'defaults'} |")
    return out


def _tuning_line(tuned: dict) -> str:
    parts = []
    for m, t in tuned.items():
        edge = " (on the edge of the values tried)" if t.get("on_edge") else ""
        parts.append(f"{m} {t['option']} ∈ {t['grid']} → **{t['chosen']}**{edge}")
    return "Tuning (" + f"{len(next(iter(tuned.values()))['grid'])} trials each): " + "; ".join(parts) + "."


def render_bench(results: dict) -> str:
    """``bench.md``: per setting, a table ordered by Avg. Gap with 95 % intervals, the tie groups and the
    tuning; then the variants and the untuned methods."""
    cfg = results["config"]
    n_units = len(results["seeds"]) * results.get("forget_sets", 1)
    lines = ["# scrubnet bench", "",
             f"Dataset `{cfg['data']['dataset']}`, model `{cfg['model']}`; {results.get('forget_sets', 1)} forget "
             f"sets × seeds {results['seeds']} (up to {n_units} units per cell); "
             + ("each method's knob tuned on a validation split (Avg. Gap to its retrain)." if results["tune"]
                else "defaults (as released for the field's methods; no tuning)."), "",
             "UA = error on D_f, RA / TA = accuracy on D_r / D_test, MIA-eff. = share of D_f the confidence "
             "attack calls non-member, Avg. Gap = mean |metric − retrain's| over the four (lower is better); "
             "mean ± the half-width of its 95 % t-interval over the (forget set, seed) units, in %. Δ gap vs "
             "best: the paired difference with the best method, unit by unit, and its 95 % interval. Tie group 1: "
             "the methods the bench cannot tell apart from the best (the interval contains 0); group 2 the same "
             "among the rest, and so on. Time: the scrub's wall time (s).", ""]
    for s, summ in results["summary"].items():
        info = results["settings"][s]
        lines += [f"## {s} (|D_f| = {info['n_forget']}, |D_r| = {info['n_retain']}, "
                  f"{len(summ.get('units', []))} units)", ""]
        ties = summ.get("ties") or []
        if ties:
            lines += [f"Best: **{summ['best']}**; not distinguishable from it: "
                      f"{', '.join(ties[0][1:]) or 'none'} (tie group 1 of {len(ties)}).", ""]
        lines += bench_table_rows(summ["rows"], results.get("variants")) + [""]
        for m, units in (summ.get("errored") or {}).items():
            lines += [f"{m}: the scrub raised on {len(units)} unit(s) {units} (no metrics; left out of its row).", ""]
        tuned = results["tuning"].get(s, {})
        if tuned:
            lines += [_tuning_line(tuned), ""]
    for m, why in (results.get("variants") or {}).items():
        lines.append(f"† {m}: {why}.")
    if results.get("untuned"):
        lines.append(f"No knob to tune: {', '.join(results['untuned'])}.")
    lines.append(f"Jobs: {results['jobs']['run']} run, {results['jobs']['reused']} reused from an earlier run; "
                 f"{results['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def plot_bench(results: dict, path: Path) -> None:
    """UA against TA (%, means with 95 % intervals) per setting; retrain a star, the original a cross. Points
    carry numbers, listed beside each panel (names next to points overlap)."""
    settings = list(results["summary"])
    fig, axes = subplots(1, len(settings), figsize=(6.2 * len(settings), 5.6), squeeze=False)
    for ax, s in zip(axes[0], settings):
        legend = []
        for i, r in enumerate(results["summary"][s]["rows"], 1):
            x, y = 100 * r["ta"]["mean"], 100 * r["ua"]["mean"]
            xe = 100 * (r["ta"].get("half") or 0.0)
            ye = 100 * (r["ua"].get("half") or 0.0)
            colour = {"retrain": "k", "original": "gray"}.get(
                r["method"], "tab:blue" if r["family"] == "seed" else "tab:orange")
            marker = {"retrain": "*", "original": "x"}.get(r["method"], "o")
            ax.errorbar([x], [y], xerr=[xe], yerr=[ye], fmt=marker, color=colour, ms=9 if marker == "*" else 5,
                        elinewidth=0.7, capsize=2, zorder=3)
            ax.annotate(str(i), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            legend.append(f"{i:>2} {r['method']}" + (f" (tie {r['tie_group']})" if r.get("tie_group") else ""))
        ax.set_title(f"{s}: UA vs TA", fontsize=10)
        ax.set_xlabel("TA: test accuracy (%)")
        ax.set_ylabel("UA: error on D_f (%)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
        ax.text(1.02, 1.0, "\n".join(legend), transform=ax.transAxes, fontsize=6.5, va="top", family="monospace")
    title = ("scrubnet bench: means with 95 % intervals over (forget set, seed) units; star: retrain, cross: "
             "original, blue: seed methods, orange: field methods")
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    atomic_savefig(fig, path)
