"""Render the README's result tables from the results files of the documented commands.

    python scripts/readme_tables.py                       # print the tables (runs/default, runs/audit, runs/dp)
    python scripts/readme_tables.py --check README.md     # exit 1 if a README table differs from its results file
    python scripts/readme_tables.py --update README.md    # rewrite those tables in place

A README table rendered by this script follows a marker line ``<!-- readme-table: KIND PATH -->`` (KIND: ``run``,
``audit``, ``dp`` or ``bench``; PATH: the results file the documented command writes, relative to the repository root),
and ends at the first line that does not start with ``|``. Units: errors, attack rates and balanced
accuracies in %, losses in nats, re-learn time in epochs, AUC and ε scores from 0 to 1 (the results files
keep fractions).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MARKER = re.compile(r"^<!-- readme-table: (\w+) (\S+) -->\s*$")
DEFAULTS = {"run": "runs/default/results.json", "audit": "runs/audit/audit.json", "dp": "runs/dp/results.json",
            "bench": "runs/bench/bench.json"}


def _pm(s: dict, scale: float = 1.0, digits: int = 1) -> str:
    return f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}"


def run_table(results: dict) -> list[str]:
    """`scrubnet run`'s readouts, mean ± std over seeds (std with ddof = 0), one row per method."""
    cols = [("error_retain", "error D_r %", 100, 1), ("error_forget", "error D_f %", 100, 1),
            ("error_test", "error test %", 100, 1), ("loss_forget", "loss D_f (nats)", 1, 3),
            ("mia_forget", "MIA on D_f %", 100, 1), ("relearn_epochs", "re-learn (epochs)", 1, 0)]
    lines = ["| method | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, d in results["methods"].items():
        s = d["summary"]
        lines.append(f"| {m} | " + " | ".join(_pm(s[k], f, n) if k in s else "–" for k, _, f, n in cols) + " |")
    return lines


def audit_table(results: dict) -> list[str]:
    """`scrubnet audit`'s headline numbers, one row per method: the U-MIA game with its 95 % interval, AUC,
    TPR at 1 % FPR, today's retrain-OUT statistic, retain-set leakage, KLoM on D_f and the ε forget score."""
    def pct(v, spec=".1f"):
        return "–" if v is None else format(100 * v, spec)
    lines = ["| method | game bal. acc. % [95 % CI] | AUC (0–1) | TPR @1 % FPR % | retrain-OUT bal. acc. % | "
             "retain leakage (points) | KLoM forget (nats) | ε forget score, 0–1 (U = R) |",
             "|---|---|---|---|---|---|---|---|"]
    for m, d in results["methods"].items():
        ci = d.get("ulira_game_balanced_accuracy_ci95")
        ci_s = f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else ""
        leak = d.get("retain_leakage")
        lines.append(f"| {m} | {pct(d['ulira_game_balanced_accuracy'])}{ci_s} | {d['ulira_game_auc']:.3f} | "
                     f"{pct(d.get('ulira_game_tpr_at_1pct_fpr'))} | {pct(d.get('ulira_retrain_out_balanced_accuracy'))} | "
                     f"{pct(leak, '+.1f')} | {d['klom_forget']:.2f} | "
                     f"{d['epsilon_forget_score']:.3f} ({d.get('epsilon_u', '?')}) |")
    return lines


def dp_table(results: dict) -> list[str]:
    """`scrubnet dp`'s test error (%, mean ± std over seeds) per ε; the lowest private method in bold."""
    s = results["summary"]
    eps = results["config"]["epsilons"]
    private = ("adamix", "noisygd", "public-init-dp")
    lines = ["| | Only-Public % | paragon % | AdaMix % | NoisyGD % | public-init DP % | AdaMix membership AUC (0–1) |",
             "|---|---|---|---|---|---|---|"]
    for i, e in enumerate(eps):
        rows = {m: s[f"{m}@{e:g}"] for m in private}
        best = min(private, key=lambda m: rows[m]["test_error"]["mean"])
        cells = [f"**{_pm(rows[m]['test_error'], 100)}**" if m == best else _pm(rows[m]["test_error"], 100)
                 for m in private]
        first = [_pm(s["only-public"]["test_error"], 100), _pm(s["paragon"]["test_error"], 100)] if i == 0 else ["", ""]
        lines.append(f"| ε = {e:g} | " + " | ".join(first + cells) + f" | {rows['adamix']['mia_auc']['mean']:.3f} |")
    return lines


def bench_table(results: dict) -> list[str]:
    """`scrubnet bench`: per setting, the methods ordered by Avg. Gap to retrain (UA, RA, TA, MIA-efficacy and
    Avg. Gap in %, mean ± std over seeds; time of the scrub in s); the closest method in each setting in bold."""
    lines = ["| setting | method | family | UA % | RA % | TA % | MIA-eff. % | Avg. Gap % | time (s) | options |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, summ in results["summary"].items():
        for r in summ["rows"]:
            name = f"**{r['method']}**" if r["method"] == summ.get("closest") else r["method"]
            if r.get("failed"):
                name += f" ({r['failed']} failed)"
            opts = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
            lines.append(f"| {setting} | {name} | {r['family']} | {_pm(r['ua'], 100)} | {_pm(r['ra'], 100)} | "
                         f"{_pm(r['ta'], 100)} | {_pm(r['mia_efficacy'], 100)} | {_pm(r['avg_gap'], 100)} | "
                         f"{r['time_s']['mean']:.2f} | {opts or 'defaults'} |")
    return lines


RENDER = {"run": run_table, "audit": audit_table, "dp": dp_table, "bench": bench_table}


def render(kind: str, path: Path) -> list[str]:
    if kind not in RENDER:
        raise ValueError(f"unknown table kind {kind!r}; choose one of {', '.join(RENDER)}")
    try:
        return RENDER[kind](json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ValueError(f"{path} not found: run the README's command that writes it first") from None


def replace_tables(readme: str, root: Path, missing: list[str] | None = None) -> tuple[str, list[str]]:
    """(README text with every marked table re-rendered, list of the markers whose table changed). A table
    whose results file does not exist is kept as it is and its marker appended to ``missing``."""
    lines, out, changed, i = readme.split("\n"), [], [], 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        if not (root / m.group(2)).is_file() and missing is not None:
            missing.append(f"{m.group(1)} {m.group(2)}")
            new = lines[i:j]
        else:
            new = render(m.group(1), root / m.group(2))
        if lines[i:j] != new:
            changed.append(f"{m.group(1)} {m.group(2)}")
        out.extend(new)
        i = j
    return "\n".join(out), changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", type=Path, help="README to compare with the results files (exit 1 on a difference)")
    g.add_argument("--update", type=Path, help="README whose marked tables are rewritten in place")
    ap.add_argument("--root", type=Path, default=Path("."), help="directory the results paths are relative to")
    a = ap.parse_args(argv)
    try:
        if a.check or a.update:
            readme = a.check or a.update
            missing: list[str] = []
            text, changed = replace_tables(readme.read_text(), a.root, missing)
            for m in missing:
                print(f"{readme}: the table of {m} was not checked: its results file does not exist", file=sys.stderr)
            if a.update:
                readme.write_text(text)
                print(f"updated {len(changed)} table(s) of {readme}: {', '.join(changed) or 'none changed'}")
                return 0
            for c in changed:
                print(f"{readme}: the table of {c} differs from its results file", file=sys.stderr)
            return 1 if changed else 0
        for kind, path in DEFAULTS.items():
            if (a.root / path).is_file():
                print(f"<!-- readme-table: {kind} {path} -->")
                print("\n".join(render(kind, a.root / path)) + "\n")
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
