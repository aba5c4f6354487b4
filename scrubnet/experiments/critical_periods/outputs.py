"""Running the critical-periods study and writing its outputs: results.json, report.md and the figures."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from scrubnet.diagnostics.trajectory import trajectory_pca
from scrubnet.experiments.critical_periods.figures import FIGURES, plot_all
from scrubnet.experiments.critical_periods.study import (CHAPTER_R, CriticalPeriodsConfig, analyse, load_study_data,
                                                         readiness_readout, run_key, scale_text, schedule_windows,
                                                         train_run, unique_runs)
from scrubnet.experiments.io import atomic_write_json, atomic_write_text

def run_study(cfg: CriticalPeriodsConfig, out: Path | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Every data set × seed × distinct WD window; with ``out``, writes results.json, report.md and figures."""
    cfg.validate()
    t_all = time.time()
    rows: list[dict] = []
    trajectories: dict[str, dict[str, Tensor]] = {}
    traj_epochs: dict[str, list[int]] = {}
    readiness: dict[str, list[dict]] = {}
    for ds in cfg.datasets:
        data = load_study_data(ds, cfg)
        trajectories[ds] = {}
        readiness[ds] = []
        for seed in cfg.seeds:
            for key, window in unique_runs(cfg).items():
                first = seed == cfg.seeds[0]
                rec = train_run(data, cfg, seed, window, keep_trajectory=first,
                                keep_anchors=first and key in ("none", run_key((0, cfg.epochs))))
                rows.append({"dataset": ds, "seed": seed, "key": key, "window": list(window) if window else None,
                             "test_acc": rec.test_acc, "train_acc": rec.train_acc, "fisher": rec.fisher,
                             "weights": rec.weights})
                if rec.snapshots:
                    trajectories[ds][key] = torch.stack(rec.snapshots)
                    traj_epochs[ds] = rec.snapshot_epochs
                if rec.final_model is not None:
                    readiness[ds].append(readiness_readout(rec, data, cfg))
                if log:
                    log(f"{ds} seed {seed} {key:>12}: test acc {100 * rec.test_acc:5.1f} %  FIM peak "
                        f"{rec.fisher['peak']:.3g} @ {rec.fisher['peak_at']}  final {rec.fisher['final']:.3g}  "
                        f"({rec.seconds:.1f} s)")
    pca = {}
    for ds, paths in trajectories.items():
        if sum(len(p) for p in paths.values()) >= 2:
            proj, ratio = trajectory_pca(paths)
            pca[ds] = {"epochs": traj_epochs[ds], "explained": ratio.tolist(),
                       "paths": {k: v.tolist() for k, v in proj.items()}}
    result = {"config": cfg.to_dict(), "scale": scale_text(cfg), "schedules": {k: (list(w) if w else None)
                                                                             for k, w in schedule_windows(cfg).items()},
              "runs": rows, "analysis": analyse(rows, cfg), "readiness": readiness, "pca": pca,
              "chapter": {k: {"r": v[0], "p": v[1]} for k, v in CHAPTER_R.items()}}
    if log:
        log(f"study done in {time.time() - t_all:.0f} s")
    if out is not None:
        write_outputs(result, Path(out))
    return result



def report_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["# Critical periods of regularisation at the embedded data's scale", "",
             f"Scale: {result['scale']}.", "",
             "The chapter's setting is ResNet-18 / All-CNN on CIFAR-10 for 200 epochs; this is a few-minute "
             "version of its three protocols, so every verdict below is about this scale only.", ""]
    for ds in cfg["datasets"]:
        an = result["analysis"][ds]
        lines += [f"## {ds}", "", "| schedule | WD window | test accuracy (%) | vs no WD (points) |", "|---|---|---|---|"]
        for name, w in result["schedules"].items():
            a, g = an["test_acc"][name], an["gain_over_none"][name]
            lines.append(f"| {name} | {'—' if w is None else f'[{w[0]}, {w[1]})'} | {100 * a['mean']:.2f} ± "
                         f"{100 * a['std']:.2f} | {100 * g['mean']:+.2f} ± {100 * g['std']:.2f} |")
        lines += ["", "Pearson correlation with the final test accuracy, across all runs of this data set "
                  "(scipy.stats.pearsonr, two-sided):", "", "| quantity | r here | p here | n | chapter |",
                  "|---|---|---|---|---|"]
        for k, c in an["correlations"].items():
            lines.append(f"| {k.replace('_', ' ')} | {c['r']:.2f} | {c['p']:.2g} | {c['n']} | "
                         f"{CHAPTER_R[k][0]} ({CHAPTER_R[k][1]}) |")
        lines += ["", "| claim of the chapter | measured here | verdict |", "|---|---|---|"]
        for v in an["verdicts"]:
            lines.append(f"| {v['claim']} | {v['measured']} | **{v['verdict']}** |")
        lines.append("")
        rd = result["readiness"].get(ds, [])
        if rd:
            lines += ["Linearisation readiness (a heuristic; seed "
                      f"{cfg['seeds'][0]}). 'Ready' = the FIM trace is past its peak by ≥ 3 epochs and ≥ 20 % below "
                      "it, judged on the curve measured so far (the first epoch where that holds). Gap = "
                      "‖f_lin − f‖ / ‖f − f_anchor‖ on the test set between the network at the end of training and "
                      "its linearisation around the anchor epoch, with the final network's BatchNorm statistics / "
                      "with the anchor's (weights alone); in brackets the share of test inputs where both predict "
                      "the same class. A gap ≪ 1 means the rest of training was nearly linear.", "",
                      "| run | FIM peak epoch | 'ready' first at | anchor epoch: gap, own BN stats (agreement) | "
                      "gap, anchor's BN stats |", "|---|---|---|---|---|"]
            for r in rd:
                gaps = ", ".join(f"{t}: {g['relative_gap']:.2f} ({100 * g['agreement']:.0f} %)"
                                 for t, g in r["gap_from_anchor"].items())
                same = ", ".join(f"{t}: {g['relative_gap']:.2f}"
                                 for t, g in r.get("gap_from_anchor_same_bn_statistics", {}).items())
                lines.append(f"| {r['schedule']} | {r['final']['peak_at']} | {r['ready_at']} | {gaps} | {same} |")
            lines.append("")
    lines += ["Figures: " + ", ".join(f"`{f}`" for f in FIGURES) + "."]
    return "\n".join(lines) + "\n"


def rerender(out: Path) -> dict:
    """Recompute the analysis from the runs in ``out``/results.json and rewrite report.md and the figures
    (no training)."""
    result = json.loads((Path(out) / "results.json").read_text())
    cfg = CriticalPeriodsConfig.from_dict(result["config"])
    result["analysis"] = analyse(result["runs"], cfg)
    result["scale"] = scale_text(cfg)
    write_outputs(result, Path(out))
    return result


def check_result(result: dict) -> None:
    """``ValueError`` unless every run has an accuracy in [0, 1] and finite FIM-trace and weight-norm curves."""
    for r in result["runs"]:
        curves = r["fisher"]["trace"] + r["weights"]["sq_norm"] + [r["test_acc"], r["train_acc"]]
        if not (0 <= r["test_acc"] <= 1 and all(math.isfinite(v) for v in curves)):
            raise ValueError(f"run {r['dataset']} seed {r['seed']} {r['key']} diverged (non-finite FIM trace or "
                             "weights): lower the learning rate or the weight decay")


def write_outputs(result: dict, out: Path) -> None:
    """Checked, then rendered into a temporary sibling directory and moved into ``out`` file by file (each move
    atomic), results.json last: a failure while rendering leaves ``out`` as it was."""
    check_result(result)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        plot_all(result, tmp)
        atomic_write_text(tmp / "report.md", report_markdown(result))
        atomic_write_json(tmp / "results.json", result)
        for name in FIGURES + ("report.md", "results.json"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
