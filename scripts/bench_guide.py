"""Render the results section of docs/guides/bench.md from the committed docs/guides/bench.json.

    python scripts/bench_guide.py                  # print the section
    python scripts/bench_guide.py --check          # exit 1 if the guide's section differs from bench.json
    python scripts/bench_guide.py --update         # rewrite the section in place
    python scripts/bench_guide.py --resummarise    # recompute bench.json's summary from its runs, then --update

The section lies between ``<!-- bench-guide: begin -->`` and ``<!-- bench-guide: end -->``. Each setting gets the
table of ``bench.md`` (:func:`scrubnet.experiments.bench_report.bench_table_rows`: metrics in %, mean ± the
half-width of the 95 % t-interval over the (forget set, seed) units, the paired difference with the best and
the tie groups), the tie groups spelled out and the tuning. To refresh the numbers: run the bench command the
guide names, copy its bench.json to docs/guides/bench.json, then ``--update``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scrubnet.atomic_io import atomic_write_json  # noqa: E402
from scrubnet.experiments.bench import family  # noqa: E402
from scrubnet.experiments.bench_report import bench_table_rows, summarise_setting  # noqa: E402

GUIDE, RESULTS = ROOT / "docs" / "guides" / "bench.md", ROOT / "docs" / "guides" / "bench.json"
BEGIN, END = "<!-- bench-guide: begin -->", "<!-- bench-guide: end -->"


def _tuning(tuned: dict) -> str:
    parts = [f"{m} {t['option']} → {t['chosen']:g}" + (" (edge)" if t.get("on_edge") else "")
             for m, t in tuned.items()]
    return "Tuned values: " + "; ".join(parts) + "."


def render(results: dict) -> list[str]:
    """The section's lines (between the markers) for ``results`` (a bench.json)."""
    cfg = results["config"]
    lines = [f"Dataset `{cfg['data']['dataset']}`, model `{cfg['model']}`, {results['forget_sets']} forget sets × "
             f"seeds {results['seeds']}, {results['tune_trials']} tuning trials per tuned method; "
             f"{results['jobs']['run'] + results['jobs']['reused']} jobs.", ""]
    for s, summ in results["summary"].items():
        info = results["settings"][s]
        lines += [f"### {s} (|D_f| = {info['n_forget']}, |D_r| = {info['n_retain']}, {len(summ['units'])} units)",
                  ""]
        groups = "; ".join(f"{i + 1}: {', '.join(g)}" for i, g in enumerate(summ["ties"]))
        lines += [f"Best: **{summ['best']}**. Tie groups: {groups}.", ""]
        lines += bench_table_rows(summ["rows"], results.get("variants")) + [""]
        if results["tuning"].get(s):
            lines += [_tuning(results["tuning"][s]), ""]
    for m, why in (results.get("variants") or {}).items():
        lines += [f"† {m}: {why}.", ""]
    for note in results.get("notes") or []:
        lines += [note, ""]
    return lines


def resummarise(results: dict) -> dict:
    """``results`` with each setting's summary recomputed from its recorded runs and tuning by the current
    statistics (:func:`~scrubnet.experiments.bench_report.summarise_setting`: intervals, paired differences,
    tie groups); the runs themselves are not touched."""
    runs = results["runs"]
    results["summary"] = {s: summarise_setting([r for r in runs if r["setting"] == s], results["tuning"][s], family)
                          for s in results["summary"]}
    return results


def replace(text: str, section: list[str]) -> str:
    """``text`` with the lines between the markers replaced by ``section``."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + "\n".join(section) + "\n" + END + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if the guide differs from bench.json")
    g.add_argument("--update", action="store_true", help="rewrite the guide's section")
    g.add_argument("--resummarise", action="store_true",
                   help="recompute bench.json's summary from its runs, then rewrite the guide's section")
    a = ap.parse_args(argv)
    results = json.loads(RESULTS.read_text())
    if a.resummarise:
        atomic_write_json(RESULTS, resummarise(results))
        a.update = True
    section = render(results)
    if not (a.check or a.update):
        print("\n".join(section))
        return 0
    text = GUIDE.read_text()
    new = replace(text, section)
    if a.update:
        GUIDE.write_text(new)
        return 0
    if new != text:
        print(f"{GUIDE}: the section differs from {RESULTS}; run scripts/bench_guide.py --update", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
