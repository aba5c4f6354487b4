"""Trade-off sweep: one method, one option swept over values, × seeds → sweep.json and a figure.

The papers' Figure 3 (left) / Fig. 2.2: test error against the information left about D_f as the noise
scale α grows. For every seed the protocol is prepared once (pre-train, original, same-seed retrain, via
:func:`scrubnet.experiments.runner.prepare_seed`); then for every value the method runs with
``{param: value}`` on top of the configuration's options for that method, and every readout is collected
(:func:`~scrubnet.experiments.runner.evaluate` plus the numeric ``ScrubResult.info``, where
``info_weights_nats`` and the black-box ``info_activations_nats_*`` live). The original and retrain models
are evaluated too, as horizontal reference lines.

``sweep.json`` layout::

    {"method": m, "param": p, "values": [...], "seeds": [...], "config": {...},
     "runs": [{"value": v, "seed": s, "time_s": t, "readouts": {...}}],
     "summary": [{"value": v, "readouts": {"<readout>": {"mean": ..., "std": ...}}}],
     "anchors": {"original": {"<readout>": {"mean", "std"}}, "retrain": {...}}}

The figure ``sweep_<method>.png`` has one panel per information readout present (x, log scale: nats;
y: error_test; one point per value, mean ± std over seeds, labelled with the value); if the method reports
no information readout, error_test is plotted against the swept value instead.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.io import atomic_savefig, atomic_write_json, subplots
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.runner import evaluate, measure, prepare_seed, run_method
from scrubnet.methods.base import protocol_method

INFO_READOUTS = ["info_weights_nats", "info_activations_nats_forget", "info_activations_nats_retain",
                 "info_activations_nats_test"]


def _summary(readouts: list[dict]) -> dict[str, dict[str, float]]:
    keys = [k for k in readouts[0] if all(k in r for r in readouts)] if readouts else []
    out = {}
    for k in keys:
        vals = np.array([r[k] for r in readouts], dtype=float)
        out[k] = {"mean": float(np.mean(vals)), "std": float(np.std(vals))}
    return out


def run_sweep(method: str, param: str, values: list[float], cfg: ExperimentConfig, out_dir: Path | str,
              progress: bool = True, device=None) -> dict:
    """Run ``method`` with ``{param: v}`` for every v in ``values`` and every seed of ``cfg``; write
    ``out_dir/sweep.json`` (atomically) and ``out_dir/sweep_<method>.png``; return the sweep.json dict."""

    values = [float(v) for v in values]
    if not values:
        raise ValueError("a sweep needs at least one value")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"sweep values must be finite numbers, got {values}")
    if not param or not isinstance(param, str):
        raise ValueError("param must be the name of a method option, e.g. 'alpha'")
    if not cfg.seeds:
        raise ValueError("at least one seed is needed")
    base_opts = dict(cfg.method_options.get(method, {}))
    for v in values:  # fail fast on an unknown method or option, before any training
        protocol_method(method, **{**base_opts, param: v})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    runs: list[dict] = []
    anchor_runs: dict[str, list[dict]] = {"original": [], "retrain": []}
    with make_progress(enabled=progress) as bar:
        task = bar.add_task(f"sweep {method}", total=len(cfg.seeds) * (len(values) + 1))
        for seed in cfg.seeds:
            bar.update(task, description=f"seed {seed}: training original and retrain")
            sr = prepare_seed(cfg, seed, device)
            anchor_runs["original"].append(evaluate(sr.original, sr))
            anchor_runs["retrain"].append(evaluate(sr.retrain, sr))
            bar.advance(task)
            for v in values:
                bar.update(task, description=f"seed {seed}: {method} {param}={v:g}")
                res, t = run_method(method, sr, {param: v})
                readouts = measure(method, res, sr, {param: v})
                runs.append({"value": v, "seed": seed, "time_s": t, "readouts": readouts})
                bar.advance(task)
    summary = [{"value": v, "readouts": _summary([r["readouts"] for r in runs if r["value"] == v])}
               for v in values]
    result = {"method": method, "param": param, "values": values, "seeds": list(cfg.seeds),
              "config": cfg.to_dict(), "runs": runs, "summary": summary,
              "anchors": {k: _summary(v) for k, v in anchor_runs.items()},
              "created_unix": time.time()}
    atomic_write_json(out_dir / "sweep.json", result)
    plot_sweep(result, sweep_figure_path(out_dir, method))
    return result


def sweep_figure_path(out_dir: Path | str, method: str) -> Path:
    """Where the sweep figure of ``method`` goes in ``out_dir``."""
    return Path(out_dir) / f"sweep_{_safe(method)}.png"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def plot_sweep(result: dict, path: Path | str) -> None:
    """error_test against each information readout present (log x), one point per swept value."""

    summary = result["summary"]
    present = [k for k in INFO_READOUTS if any(k in s["readouts"] for s in summary)]
    xs_keys = present or [None]
    fig, axes = subplots(1, len(xs_keys), figsize=(4.6 * len(xs_keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], xs_keys):
        pts = []
        for s in summary:
            r = s["readouts"]
            if "error_test" not in r:
                continue
            if key is None:
                x, xe = s["value"], 0.0
            elif key in r:
                x, xe = r[key]["mean"], r[key]["std"]
            else:
                continue
            pts.append((x, xe, 100 * r["error_test"]["mean"], 100 * r["error_test"]["std"], s["value"]))
        pts = [p for p in pts if p[0] > 0 and math.isfinite(p[0])]
        if pts:
            x, xe, y, ye, v = map(np.array, zip(*pts))
            ax.errorbar(x, y, xerr=xe, yerr=ye, fmt="o-", capsize=3, label=result["method"])
            for xi, yi, vi in zip(x, y, v):
                ax.annotate(f"{result['param']}={vi:g}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
            ax.set_xscale("log")
            import matplotlib.ticker  # imported where used: matplotlib costs ≈ 0.6 CPU-s at start-up

            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # avoid overlapping labels
        for name, style in (("original", "k--"), ("retrain", "g:")):
            a = result.get("anchors", {}).get(name, {})
            if "error_test" in a:
                ax.axhline(100 * a["error_test"]["mean"], color=style[0], linestyle=style[1:], label=name)
        ax.set_xlabel(key.replace("_", " ") if key else f"{result['param']} (log)")
        ax.set_ylabel("test error (%)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['method']}: test error vs information left ({len(result['seeds'])} seed(s))")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
