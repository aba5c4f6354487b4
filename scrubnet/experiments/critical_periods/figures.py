"""Figures of the critical-periods study (matplotlib): one function per figure, all drawn by :func:`plot_all`."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from scrubnet.experiments.critical_periods.study import CHAPTER_R, run_features, run_key
from scrubnet.experiments.io import atomic_savefig, subplots

FIGURES = ("accuracy_vs_timing.png", "fisher_trace.png", "weight_norm.png", "trajectory_pca.png",
           "fisher_vs_accuracy.png", "fisher_per_layer.png")


def _rows(n_rows: int, n_cols: int, width: float):
    """A figure of ``n_rows`` × ``n_cols`` panels, one row (3.6 in high) per dataset; axes always 2-D."""
    return subplots(n_rows, n_cols, figsize=(width, 3.6 * n_rows), squeeze=False)


def _panels(dss, items) -> list[tuple[int, str, int, object]]:
    """(row, dataset, col, item) of every panel of a dataset × item grid, row by row."""
    return [(row, ds, col, it) for row, ds in enumerate(dss) for col, it in enumerate(items)]


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=100)


def _curve(result: dict, ds: str, key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(epochs, mean, std) over seeds of a run key's FIM trace."""
    rows = [r for r in result["runs"] if r["dataset"] == ds and r["key"] == key]
    a = np.asarray([r["fisher"]["trace"] for r in rows])
    return rows[0]["fisher"]["times"], a.mean(0), a.std(0)


def _key_of(result: dict, name: str) -> str:
    w = result["schedules"][name]
    return run_key(tuple(w) if w else None)


def _accuracy_vs_timing(result: dict, out: Path) -> None:
    """Final test accuracy vs onset / offset (the chapter's Fig. 4.1)."""
    cfg, dss = result["config"], result["config"]["datasets"]
    e = cfg["epochs"]
    an = result["analysis"]
    fig, axes = _rows(len(dss), 3, 13)
    for row, ds in enumerate(dss):
        acc, gain = an[ds]["test_acc"], an[ds]["gain_over_none"]
        on = sorted(cfg["onsets"])
        for col, (fam, title) in enumerate((("interrupted", "WD on in [0, t0): stopped at t0"),
                                            ("delayed", "WD on in [t0, end): started at t0"))):
            ax = axes[row, col]
            xs = on + [e]
            names = [f"{fam}@{t}" for t in on] + ["always" if fam == "interrupted" else "none"]
            m = [100 * acc[n]["mean"] for n in names]
            s = [100 * acc[n]["std"] for n in names]
            ax.errorbar(xs, m, yerr=s, marker="o", capsize=3)
            ax.axhline(100 * acc["none"]["mean"], color="gray", ls=":", label="no WD")
            ax.axhline(100 * acc["always"]["mean"], color="k", ls="--", label="WD throughout")
            ax.set(title=f"{ds}: {title}", xlabel="t0 (epoch)", ylabel="final test accuracy (%)")
            ax.legend(fontsize=7)
        ax = axes[row, 2]
        wo = sorted(cfg["window_onsets"])
        ax.errorbar(wo, [100 * gain[f"window@{t}"]["mean"] for t in wo],
                    yerr=[100 * gain[f"window@{t}"]["std"] for t in wo], marker="o", capsize=3)
        ax.axhline(0, color="gray", ls=":")
        ax.set(title=f"{ds}: WD only in [t0, t0+{cfg['window']})", xlabel="window onset t0 (epoch)",
               ylabel="test accuracy − no WD (points)")
    _save(fig, out / "accuracy_vs_timing.png")


def _fisher_trace(result: dict, out: Path) -> None:
    """FIM trace over epochs per schedule (Fig. 4.5 left / 4.7)."""
    cfg, dss = result["config"], result["config"]["datasets"]
    fig, axes = _rows(len(dss), 2, 11)
    for row, ds, col, fam in _panels(dss, ("interrupted", "delayed")):
        ax = axes[row, col]
        for n in ["none", "always"] + [f"{fam}@{t}" for t in sorted(cfg["onsets"]) if t > 0]:
            t, m, _ = _curve(result, ds, _key_of(result, n))
            ax.plot(t, m, label=n, lw=2 if n in ("none", "always") else 1)
        ax.set(title=f"{ds}: FIM trace ({fam} WD), mean over seeds", xlabel="epoch", ylabel="tr F", yscale="log")
        ax.legend(fontsize=6, ncol=2)
    _save(fig, out / "fisher_trace.png")


def _weight_norm(result: dict, out: Path) -> None:
    """Weight norm and effective learning rate (Fig. 4.2, 4.10)."""
    cfg, dss = result["config"], result["config"]["datasets"]
    fig, axes = _rows(len(dss), 2, 11)
    for row, ds in enumerate(dss):
        for n in ["none", "always"] + [f"interrupted@{t}" for t in sorted(cfg["onsets"]) if t > 0] + \
                 [f"delayed@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2]:
            rows = [r for r in result["runs"] if r["dataset"] == ds and r["key"] == _key_of(result, n)]
            norm = np.sqrt(np.asarray([r["weights"]["sq_norm"] for r in rows])).mean(0)
            eff = np.asarray([r["weights"]["effective_lr"] for r in rows]).mean(0)
            axes[row, 0].plot(rows[0]["weights"]["epochs"], norm, label=n)
            axes[row, 1].plot(rows[0]["weights"]["epochs"], eff, label=n)
        axes[row, 0].set(title=f"{ds}: ‖w_t‖ (mean over seeds)", xlabel="epoch", ylabel="‖w‖")
        axes[row, 1].set(title=f"{ds}: effective lr η_t/‖w_t‖²", xlabel="epoch", yscale="log")
        axes[row, 0].legend(fontsize=6, ncol=2)
    _save(fig, out / "weight_norm.png")


def _trajectory_pca(result: dict, out: Path) -> None:
    """Trajectory PCA."""
    cfg, dss = result["config"], result["config"]["datasets"]
    fig, axes = subplots(1, len(dss), figsize=(5.5 * len(dss), 4.2), squeeze=False)
    names = ["none", "always"] + [f"interrupted@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2] + \
            [f"delayed@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2]
    for col, ds in enumerate(dss):
        ax = axes[0, col]
        p = result["pca"].get(ds)
        if p:
            for n in names:
                xy = np.asarray(p["paths"][_key_of(result, n)])
                ax.plot(xy[:, 0], xy[:, 1], marker=".", label=n)
            ev = p["explained"]
            ax.set(title=f"{ds}: training paths (seed {cfg['seeds'][0]})", xlabel=f"PC1 ({100 * ev[0]:.0f} %)",
                   ylabel=f"PC2 ({100 * ev[1]:.0f} %)" if len(ev) > 1 else "PC2")
            ax.legend(fontsize=6)
    _save(fig, out / "trajectory_pca.png")


def _fisher_vs_accuracy(result: dict, out: Path) -> None:
    """FIM trace vs test accuracy (Fig. 4.5 right)."""
    cfg, dss = result["config"], result["config"]["datasets"]
    e, an = cfg["epochs"], result["analysis"]
    fig, axes = _rows(len(dss), 2, 10)
    for row, ds in enumerate(dss):
        rows = [r for r in result["runs"] if r["dataset"] == ds]
        for col, k in enumerate(("peak_fisher", "final_fisher")):
            f = [run_features(r, e)[k] for r in rows]
            ax = axes[row, col]
            ax.scatter(f, [100 * r["test_acc"] for r in rows], s=12,
                       c=["k" if r["window"] is None else "C0" for r in rows])
            c = an[ds]["correlations"][k]
            ax.set(title=f"{ds}: {k.replace('_', ' ')}: r = {c['r']:.2f} (p = {c['p']:.2g}); "
                         f"chapter {CHAPTER_R[k][0]}", xlabel=k.replace("_", " "), ylabel="test accuracy (%)")
            ax.title.set_fontsize(8)
    _save(fig, out / "fisher_vs_accuracy.png")


def _fisher_per_layer(result: dict, out: Path) -> None:
    """Layer-wise FIM trace (Fig. 4.11), WD throughout and none, first seed."""
    cfg, dss = result["config"], result["config"]["datasets"]
    fig, axes = _rows(len(dss), 2, 11)
    for row, ds, col, n in _panels(dss, ("always", "none")):
        r = next(r for r in result["runs"] if r["dataset"] == ds and r["key"] == _key_of(result, n)
                 and r["seed"] == cfg["seeds"][0])
        for layer, vals in r["fisher"]["per_layer"].items():
            axes[row, col].plot(r["fisher"]["times"], vals, label=layer or "(root)")
        axes[row, col].set(title=f"{ds}: FIM trace per layer ({'WD throughout' if n == 'always' else 'no WD'})",
                           xlabel="epoch", ylabel="tr F (layer)", yscale="log")
        axes[row, col].legend(fontsize=6, ncol=2)
    _save(fig, out / "fisher_per_layer.png")


def plot_all(result: dict, out: Path) -> None:
    """Every figure of :data:`FIGURES`, written into ``out``."""
    for draw in (_accuracy_vs_timing, _fisher_trace, _weight_norm, _trajectory_pca, _fisher_vs_accuracy,
                 _fisher_per_layer):
        draw(result, out)
