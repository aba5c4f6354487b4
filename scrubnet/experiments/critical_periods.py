"""The critical-periods study ("time matters in regularising deep networks") at the embedded data's scale.

Networks are trained from scratch with SGD + momentum, an exponential learning-rate decay per epoch and
ordinary weight decay (WD) switched on only in an epoch window [a, b) — the chapter's three protocols:

* **interrupted**: WD on in [0, t0), then off (t0 = 0: never; t0 = E: always);
* **delayed**: WD off until t0, then on to the end (t0 = 0: always; t0 = E: never);
* **sliding window**: WD on only in [t0, t0 + w); its *sensitivity* is the final test accuracy minus that
  of training without WD.

Every run records, per epoch, the trace of the Fisher information on a fixed probe subset of the training
set (labels sampled from the model: :mod:`scrubnet.diagnostics.fisher_trace`), per layer and in total,
‖w_t‖² and η_t/‖w_t‖²; seed 0 also keeps weight snapshots for the trajectory PCA, and for the always/never
runs of seed 0 the linearisation gap from anchors along the run to its final weights. Augmentation (MNIST-1D's
shift + noise) is on throughout where the data set has it, as in the chapter (DA on when WD is studied).

Across all runs of a data set the Pearson correlations (scipy.stats.pearsonr, two-sided p-values) of the
final test accuracy with the peak and the final FIM trace and with the mean initial / final effective
learning rate are reported against the chapter's values, and every claim gets a verdict at this scale.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from scrubnet._config import strict_from_dict, tiny_mode, under_defaults
from scrubnet.data.augment import AUGMENTATIONS, make_augment
from scrubnet.data.embedded import digits_pools, mnist1d_pools
from scrubnet.diagnostics.fisher_trace import FisherTraceMonitor, probe_subset
from scrubnet.diagnostics.readiness import fisher_readiness, linearization_gap
from scrubnet.diagnostics.trajectory import WeightNormLog, trajectory_pca
from scrubnet.experiments.io import atomic_savefig, atomic_write_json, atomic_write_text, subplots
from scrubnet.models import build_model
from scrubnet.training import error_rate, sgd_loop

STUDY_DATASETS = ("mnist1d", "digits")
#: the chapter's numbers (ResNet-18 on CIFAR-10, 200 epochs): Pearson r of test accuracy with ...
CHAPTER_R = {"peak_fisher": (0.92, "p < 0.001"), "final_fisher": (0.29, "p > 0.05"),
             "initial_effective_lr": (0.96, "p < 0.001"), "final_effective_lr": (0.85, "p < 0.001")}


@dataclass
class CriticalPeriodsConfig:
    """Scale of the study (units: epochs, samples, learning rate per step)."""

    datasets: list[str] = field(default_factory=lambda: list(STUDY_DATASETS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    epochs: int = 30
    onsets: list[int] = field(default_factory=lambda: [0, 5, 10, 15, 20])   # t0 of interrupted / delayed
    window: int = 10                                                     # w of the sliding window
    window_onsets: list[int] = field(default_factory=lambda: [0, 5, 10, 15, 20])
    mnist1d_lr: float = 0.1
    digits_lr: float = 0.05
    lr_decay: float = 0.93                 # η_e = lr·lr_decay^e
    momentum: float = 0.9
    batch_size: int = 64
    weight_decay: float = 5e-3
    mnist1d_train: int = 1000              # training samples drawn from the MNIST-1D pool (all 10 classes)
    mnist1d_channels: int = 32
    digits_channels: int = 16
    digits_train: int = 200                # training images drawn from the digits train pool (≤ 896)
    augment_mnist1d: str = "none"          # on throughout when set (none | shift_noise)
    augment_digits: str = "none"
    probe_size: int = 256                  # fixed probe subset of the training set for the FIM trace
    label_samples: int = 1                 # sampled labels per probe input
    snapshot_every: int = 2                # weight snapshots for the trajectory PCA (seed 0)
    gap_anchors: list[int] = field(default_factory=lambda: [0, 2, 5, 10, 15, 20, 25])
    data_seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CriticalPeriodsConfig":
        """The configuration ``d`` describes (missing keys take their defaults; with ``SCRUBNET_TINY=1`` the
        defaults of :data:`TINY_CRITICAL_PERIODS`)."""
        d = under_defaults(TINY_CRITICAL_PERIODS, d) if tiny_mode() else d
        cfg = strict_from_dict(cls, d, "critical-periods", "", CP_RANGES)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.datasets or any(ds not in STUDY_DATASETS for ds in self.datasets):
            raise ValueError(f"datasets must be a non-empty list of {', '.join(STUDY_DATASETS)}; got {self.datasets}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one; got {self.seeds}")
        for name in ("onsets", "window_onsets", "gap_anchors"):
            vals = getattr(self, name)
            if not vals or any(v < 0 or v >= self.epochs for v in vals):
                raise ValueError(f"{name} must lie in [0, epochs = {self.epochs}); got {vals}")
        for kind in (self.augment_mnist1d, self.augment_digits):
            if kind not in AUGMENTATIONS:
                raise ValueError(f"unknown augmentation {kind!r}; choose one of {', '.join(AUGMENTATIONS)}")


#: the defaults under ``SCRUBNET_TINY=1`` (:func:`scrubnet._config.tiny_mode`): one seed, 6 epochs, three
#: onsets, small nets and sets: the whole study in seconds (the README test uses it; the numbers mean nothing)
TINY_CRITICAL_PERIODS = {"seeds": [0], "epochs": 6, "onsets": [0, 2, 4], "window": 2, "window_onsets": [0, 2, 4],
                         "mnist1d_train": 120, "digits_train": 60, "mnist1d_channels": 8, "digits_channels": 4,
                         "probe_size": 32, "snapshot_every": 1, "gap_anchors": [0, 2, 4]}


CP_RANGES = {"seeds": ">= 0", "epochs": ">= 2", "window": ">= 1", "mnist1d_lr": "> 0", "digits_lr": "> 0", "lr_decay": "(0, 1]",
             "momentum": "[0, 1)", "batch_size": ">= 1", "weight_decay": "> 0", "mnist1d_train": ">= 20",
             "mnist1d_channels": ">= 1", "digits_channels": ">= 1", "digits_train": ">= 20", "probe_size": ">= 1", "label_samples": ">= 1",
             "snapshot_every": ">= 1", "data_seed": ">= 0"}


# --------------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------------

def schedule_windows(cfg: CriticalPeriodsConfig) -> dict[str, tuple[int, int] | None]:
    """{schedule name: WD window [a, b) (b ≤ epochs), or None for no WD}; names "none", "always",
    "interrupted@t0", "delayed@t0", "window@t0". Runs with the same window are trained once (see
    :func:`unique_runs`)."""
    e = cfg.epochs
    out: dict[str, tuple[int, int] | None] = {"none": None, "always": (0, e)}
    for t0 in cfg.onsets:
        out[f"interrupted@{t0}"] = (0, t0) if t0 > 0 else None
        out[f"delayed@{t0}"] = (t0, e)
    for t0 in cfg.window_onsets:
        out[f"window@{t0}"] = (t0, min(e, t0 + cfg.window))
    return out


def unique_runs(cfg: CriticalPeriodsConfig) -> dict[str, tuple[int, int] | None]:
    """{run key: window}, one per distinct window ("none" for no WD, "wd[a,b)" otherwise)."""
    runs: dict[str, tuple[int, int] | None] = {}
    for w in schedule_windows(cfg).values():
        runs[run_key(w)] = w
    return runs


def run_key(window: tuple[int, int] | None) -> str:
    return "none" if window is None else f"wd[{window[0]},{window[1]})"


# --------------------------------------------------------------------------------------------------
# data and one run
# --------------------------------------------------------------------------------------------------

@dataclass
class StudyData:
    name: str
    model: str
    model_options: dict
    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor
    augment: str
    lr: float
    num_classes: int = 10


def load_study_data(name: str, cfg: CriticalPeriodsConfig) -> StudyData:
    """MNIST-1D (1-D CNN, ``mnist1d_train`` training samples, the generator's test split) or scikit-learn
    digits (BN CNN, the embedded 50/50 split)."""
    if name == "mnist1d":
        x, y, xt, yt = mnist1d_pools()
        g = torch.Generator().manual_seed(10_007 * cfg.data_seed + 11)
        idx = torch.sort(torch.randperm(len(y), generator=g)[:min(cfg.mnist1d_train, len(y))]).values
        return StudyData(name, "cnn1d", {"channels": cfg.mnist1d_channels}, x[idx], y[idx], xt, yt,
                         cfg.augment_mnist1d, cfg.mnist1d_lr)
    x, y, xt, yt = digits_pools(cfg.data_seed)
    g = torch.Generator().manual_seed(10_007 * cfg.data_seed + 12)
    idx = torch.sort(torch.randperm(len(y), generator=g)[:min(cfg.digits_train, len(y))]).values
    x, y = x[idx], y[idx]
    return StudyData(name, "cnn2d", {"channels": cfg.digits_channels}, x, y, xt, yt, cfg.augment_digits, cfg.digits_lr)


@dataclass
class RunRecord:
    dataset: str
    seed: int
    key: str
    window: tuple[int, int] | None
    test_acc: float
    train_acc: float
    fisher: dict
    weights: dict
    snapshots: list[Tensor] = field(default_factory=list)
    snapshot_epochs: list[int] = field(default_factory=list)
    anchors: dict[int, torch.nn.Module] = field(default_factory=dict)
    final_model: torch.nn.Module | None = None
    seconds: float = 0.0


def train_run(data: StudyData, cfg: CriticalPeriodsConfig, seed: int, window: tuple[int, int] | None, *,
              keep_trajectory: bool = False, keep_anchors: bool = False) -> RunRecord:
    """Train one network from scratch (seeded init, batch order, augmentation and probe labels) with WD on in
    ``window`` (None: never), recording the FIM trace, ‖w‖² and η_eff at every epoch 0..E."""
    t_start = time.time()
    in_shape = data.x.shape[1:]
    model = build_model(data.model, in_shape, data.num_classes, seed=seed, **data.model_options)
    probe = data.x[probe_subset(len(data.y), cfg.probe_size, seed=10_007 * seed + 21)]
    fim = FisherTraceMonitor(model, probe, mode="sampled", label_samples=cfg.label_samples,
                             seed=10_007 * seed + 22)
    norms = WeightNormLog(model, lr_at=lambda e: data.lr * cfg.lr_decay ** e,
                          snapshot_every=cfg.snapshot_every if keep_trajectory else 0)
    anchors: dict[int, torch.nn.Module] = {}

    def on_epoch(epoch: int) -> None:
        fim.on_epoch(epoch)
        norms.on_epoch(epoch)
        if keep_anchors and epoch in cfg.gap_anchors:
            anchors[epoch] = copy.deepcopy(model).eval()

    sgd_loop(model, data.x, data.y, lr=data.lr, momentum=cfg.momentum, batch_size=cfg.batch_size,
             max_epochs=cfg.epochs, generator=torch.Generator().manual_seed(10_007 * seed + 23),
             weight_decay=cfg.weight_decay if window is not None else 0.0,
             weight_decay_epochs=window, augment=make_augment(data.augment, 10_007 * seed + 24),
             lr_decay=cfg.lr_decay, on_epoch=on_epoch)
    return RunRecord(data.name, seed, run_key(window), window,
                     1.0 - error_rate(model, data.x_test, data.y_test), 1.0 - error_rate(model, data.x, data.y),
                     fim.summary(), norms.summary(), norms.snapshots, norms.snapshot_epochs, anchors,
                     model if keep_anchors else None, time.time() - t_start)


# --------------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------------

def _mean_std(v: list[float]) -> dict:
    a = np.asarray(v, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "n": len(a)}


def pearson(x: list[float], y: list[float]) -> dict:
    """{"r", "p", "n"} by scipy.stats.pearsonr (two-sided); r = p = NaN when either is constant or n < 3."""
    from scipy import stats  # imported where used: scipy.stats costs ≈ 0.5 s at every command's start-up

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"r": float("nan"), "p": float("nan"), "n": len(x)}
    res = stats.pearsonr(x, y)
    return {"r": float(res.statistic), "p": float(res.pvalue), "n": len(x)}


def run_features(r: dict, epochs: int) -> dict:
    """Per-run summaries: peak / final FIM trace, epoch of the peak, mean η_eff over the first and the last
    half of training (the chapter: first and last 100 of 200 epochs)."""
    eff = r["weights"]["effective_lr"][:epochs]            # epochs 0..E−1: the rates training ran at
    half = max(1, epochs // 2)
    return {"peak_fisher": r["fisher"]["peak"], "final_fisher": r["fisher"]["final"],
            "peak_at": r["fisher"]["peak_at"], "initial_effective_lr": float(np.mean(eff[:half])),
            "final_effective_lr": float(np.mean(eff[-half:]))}


def analyse(runs: list[dict], cfg: CriticalPeriodsConfig) -> dict:
    """Per data set: accuracy per schedule (mean ± std over seeds), the three protocol curves, correlations
    and verdicts. ``runs``: the JSON rows of results.json."""
    windows = schedule_windows(cfg)
    out: dict = {}
    for ds in cfg.datasets:
        rows = [r for r in runs if r["dataset"] == ds]
        by = {(r["key"], r["seed"]): r for r in rows}
        acc = {name: _mean_std([by[(run_key(w), s)]["test_acc"] for s in cfg.seeds])
               for name, w in windows.items()}
        base = {s: by[("none", s)]["test_acc"] for s in cfg.seeds}
        gain = {name: _mean_std([by[(run_key(w), s)]["test_acc"] - base[s] for s in cfg.seeds])
                for name, w in windows.items()}
        per_seed = {name: [by[(run_key(w), s)]["test_acc"] - base[s] for s in cfg.seeds]
                    for name, w in windows.items()}
        feats = [run_features(r, cfg.epochs) for r in rows]
        accs = [r["test_acc"] for r in rows]
        corr = {k: pearson([f[k] for f in feats], accs) for k in CHAPTER_R}
        always = run_key((0, cfg.epochs))
        peak_change = [by[(always, s)]["fisher"]["peak"] - by[("none", s)]["fisher"]["peak"] for s in cfg.seeds]
        final_change = [by[(always, s)]["fisher"]["final"] - by[("none", s)]["fisher"]["final"] for s in cfg.seeds]
        out[ds] = {"test_acc": acc, "gain_over_none": gain, "correlations": corr,
                   "layer_order_kept": layer_order_kept(rows),
                   "wd_fisher_peak_change": _mean_std(peak_change), "wd_fisher_final_change": _mean_std(final_change),
                   "verdicts": verdicts(cfg, per_seed, corr, peak_change, final_change)}
        lo = out[ds]["layer_order_kept"]
        out[ds]["verdicts"].append({
            "claim": "the layers keep their relative order by FIM trace through training",
            "measured": f"same ranking at the peak and at the end in {lo['kept']} of {lo['runs']} runs; mean "
                        f"Spearman ρ {lo['spearman_mean']:.2f}",
            "verdict": "reproduces" if lo["spearman_mean"] >= 0.9 else "does not reproduce"})
    return out


def layer_order_kept(rows: list[dict]) -> dict:
    """Whether the layers keep their order by FIM trace from the epoch of the peak to the end (the chapter:
    unlike [ARS19], the relative ordering of layers does not change): {"kept": runs where the ranking at the
    last epoch equals the one at the peak, "runs": runs, "spearman_mean": mean rank correlation}."""
    from scipy import stats

    kept, rhos = 0, []
    for r in rows:
        per = r["fisher"]["per_layer"]
        names = list(per)
        i_peak = r["fisher"]["times"].index(r["fisher"]["peak_at"])
        at_peak = [per[k][i_peak] for k in names]
        at_end = [per[k][-1] for k in names]
        kept += int(np.array_equal(np.argsort(at_peak), np.argsort(at_end)))
        if len(names) > 2:
            rhos.append(float(stats.spearmanr(at_peak, at_end).statistic))
    return {"kept": kept, "runs": len(rows), "spearman_mean": float(np.mean(rhos)) if rhos else float("nan")}


def _one_sided(values: list[float], alternative: str = "greater") -> float:
    """p-value of a one-sample t-test of mean(values) against 0 (NaN for fewer than 2 values or no spread)."""
    from scipy import stats

    v = np.asarray(values, float)
    if len(v) < 2 or np.ptp(v) == 0:
        return float("nan") if len(v) < 2 else (0.0 if (v[0] > 0) == (alternative == "greater") and v[0] != 0
                                                else 1.0)
    return float(stats.ttest_1samp(v, 0.0, alternative=alternative).pvalue)


def _fmt_gain(v: list[float]) -> str:
    a = np.asarray(v, float)
    return f"{100 * a.mean():+.2f} ± {100 * (a.std(ddof=1) if len(a) > 1 else 0.0):.2f} points (n = {len(a)})"


def verdicts(cfg: CriticalPeriodsConfig, gains: dict[str, list[float]], corr: dict, peak_change: list[float],
             final_change: list[float]) -> list[dict]:
    """The chapter's claims, each with what was measured here and "reproduces" / "does not reproduce" /
    "not testable" (too few runs). ``gains``: {schedule: per-seed test accuracy − no WD}. Tests at 5 %:
    one-sided t-tests on the per-seed gains (pooled over the schedules of a family, treated as independent),
    Welch's t-test for early against late, Pearson for the window onset and the correlations."""
    from scipy import stats

    e = cfg.epochs
    out = []

    def add(claim, measured, ok, testable=True):
        out.append({"claim": claim, "measured": measured,
                    "verdict": ("reproduces" if ok else "does not reproduce") if testable else "not testable"})

    g = gains["always"]
    p = _one_sided(g)
    add("weight decay throughout improves the final test accuracy over no weight decay",
        f"{_fmt_gain(g)}; one-sided p = {p:.2g}", p < 0.05, not math.isnan(p))
    early = [v for t in cfg.onsets if 0 < t <= e // 2 for v in gains[f"interrupted@{t}"]]
    late = [v for t in cfg.onsets if t >= e // 2 for v in gains[f"delayed@{t}"]]
    if early:
        p = _one_sided(early)
        add(f"weight decay only early (stopped at an epoch ≤ {e // 2}) improves the final test accuracy",
            f"{_fmt_gain(early)} over interrupted schedules × seeds; one-sided p = {p:.2g}", p < 0.05,
            not math.isnan(p))
    if late:
        p = _one_sided(late)
        add(f"weight decay started late (epoch ≥ {e // 2}) brings no improvement",
            f"{_fmt_gain(late)} over delayed schedules × seeds; one-sided p (gain > 0) = {p:.2g}", not p < 0.05,
            not math.isnan(p))
    if len(early) >= 2 and len(late) >= 2:
        p = float(stats.ttest_ind(early, late, equal_var=False, alternative="greater").pvalue)
        add("early weight decay helps more than late weight decay",
            f"early − late = {100 * (np.mean(early) - np.mean(late)):+.2f} points; Welch one-sided p = {p:.2g}",
            p < 0.05, not math.isnan(p))
    ws = sorted(cfg.window_onsets)
    xs = [t for t in ws for _ in gains[f"window@{t}"]]
    ys = [v for t in ws for v in gains[f"window@{t}"]]
    c = pearson(xs, ys)
    add(f"the sensitivity to a {cfg.window}-epoch window of weight decay decreases with its onset",
        "window gain at onsets " + ", ".join(f"{t}: {100 * np.mean(gains[f'window@{t}']):+.2f}" for t in ws)
        + f" points; Pearson r(onset, gain) = {c['r']:.2f}, p = {c['p']:.2g}",
        c["r"] < 0 and c["p"] < 0.05, not math.isnan(c["r"]))
    for k, label in (("peak_fisher", "peak FIM trace"), ("final_fisher", "final FIM trace"),
                     ("initial_effective_lr", "mean initial effective lr"),
                     ("final_effective_lr", "mean final effective lr")):
        r_ch, p_ch = CHAPTER_R[k]
        c = corr[k]
        measured = f"r = {c['r']:.2f}, p = {c['p']:.2g}, n = {c['n']} runs"
        if k == "final_fisher":   # the chapter: weak and not significant
            add(f"the {label} is not significantly correlated with test accuracy (r = {r_ch}, {p_ch})", measured,
                not c["p"] < 0.05, not math.isnan(c["r"]))
        else:
            add(f"the {label} correlates positively with test accuracy (r = {r_ch}, {p_ch})", measured,
                c["r"] > 0 and c["p"] < 0.05, not math.isnan(c["r"]))
    p = _one_sided(peak_change)
    add("weight decay raises the peak of the FIM trace and changes its final value less",
        f"always − none: peak {np.mean(peak_change):+.3g}, final {np.mean(final_change):+.3g} (mean over seeds); "
        f"one-sided p (peak raised) = {p:.2g}",
        p < 0.05 and abs(np.mean(final_change)) < abs(np.mean(peak_change)), not math.isnan(p))
    return out


def readiness_readout(rec: RunRecord, data: StudyData, cfg: CriticalPeriodsConfig) -> dict:
    """The heuristic on one run: the first epoch at which :func:`fisher_readiness` says "ready" when fed the
    curve so far, and the linearisation gap from each anchor epoch to the final weights on the test set."""
    times, tr = rec.fisher["times"], rec.fisher["trace"]
    ready_at = next((times[i] for i in range(len(tr)) if fisher_readiness(times[:i + 1], tr[:i + 1])["ready"]),
                    None)
    gaps = {str(t): linearization_gap(m, rec.final_model, data.x_test) for t, m in sorted(rec.anchors.items())}
    same = {str(t): linearization_gap(m, rec.final_model, data.x_test, anchor_statistics=True)
            for t, m in sorted(rec.anchors.items())}
    return {"schedule": rec.key, "seed": rec.seed, "final": fisher_readiness(times, tr), "ready_at": ready_at,
            "gap_from_anchor": gaps, "gap_from_anchor_same_bn_statistics": same}


# --------------------------------------------------------------------------------------------------
# the study
# --------------------------------------------------------------------------------------------------

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


def scale_text(cfg: CriticalPeriodsConfig) -> str:
    return (f"{cfg.epochs} epochs from scratch, batch {cfg.batch_size}, SGD with momentum {cfg.momentum}, lr × "
            f"{cfg.lr_decay}^epoch, weight decay {cfg.weight_decay} when on; seeds {cfg.seeds}; MNIST-1D: 1-D CNN "
            f"({cfg.mnist1d_channels} channels, BatchNorm), lr {cfg.mnist1d_lr}, {cfg.mnist1d_train} training "
            f"samples (of 6,400), tested on 1,600, augmentation {cfg.augment_mnist1d}; digits: 2-D CNN with BatchNorm "
            f"({cfg.digits_channels} channels), lr {cfg.digits_lr}, "
            f"{cfg.digits_train} training images (of 896), tested on 901, augmentation {cfg.augment_digits}; FIM trace on {cfg.probe_size} fixed training "
            f"inputs, {cfg.label_samples} sampled label(s) each, every epoch")


# --------------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------------

FIGURES = ("accuracy_vs_timing.png", "fisher_trace.png", "weight_norm.png", "trajectory_pca.png",
           "fisher_vs_accuracy.png", "fisher_per_layer.png")


def _curve(result: dict, ds: str, key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(epochs, mean, std) over seeds of a run key's FIM trace."""
    rows = [r for r in result["runs"] if r["dataset"] == ds and r["key"] == key]
    a = np.asarray([r["fisher"]["trace"] for r in rows])
    return rows[0]["fisher"]["times"], a.mean(0), a.std(0)


def plot_all(result: dict, out: Path) -> None:
    cfg = result["config"]
    dss = cfg["datasets"]
    e = cfg["epochs"]
    sched = result["schedules"]
    an = result["analysis"]

    def key_of(name):
        w = sched[name]
        return run_key(tuple(w) if w else None)

    # 1. final test accuracy vs onset / offset (the chapter's Fig. 4.1)
    fig, axes = subplots(len(dss), 3, figsize=(13, 3.6 * len(dss)), squeeze=False)
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
    fig.tight_layout()
    atomic_savefig(fig, out / "accuracy_vs_timing.png", dpi=100)

    # 2. FIM trace over epochs per schedule (Fig. 4.5 left / 4.7)
    fig, axes = subplots(len(dss), 2, figsize=(11, 3.6 * len(dss)), squeeze=False)
    for row, ds in enumerate(dss):
        for col, fam in enumerate(("interrupted", "delayed")):
            ax = axes[row, col]
            names = ["none", "always"] + [f"{fam}@{t}" for t in sorted(cfg["onsets"]) if t > 0]
            for n in names:
                t, m, _ = _curve(result, ds, key_of(n))
                ax.plot(t, m, label=n, lw=2 if n in ("none", "always") else 1)
            ax.set(title=f"{ds}: FIM trace ({fam} WD), mean over seeds", xlabel="epoch", ylabel="tr F",
                   yscale="log")
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, out / "fisher_trace.png", dpi=100)

    # 3. weight norm and effective learning rate (Fig. 4.2, 4.10)
    fig, axes = subplots(len(dss), 2, figsize=(11, 3.6 * len(dss)), squeeze=False)
    for row, ds in enumerate(dss):
        for n in ["none", "always"] + [f"interrupted@{t}" for t in sorted(cfg["onsets"]) if t > 0] + \
                 [f"delayed@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2]:
            rows = [r for r in result["runs"] if r["dataset"] == ds and r["key"] == key_of(n)]
            norm = np.sqrt(np.asarray([r["weights"]["sq_norm"] for r in rows])).mean(0)
            eff = np.asarray([r["weights"]["effective_lr"] for r in rows]).mean(0)
            axes[row, 0].plot(rows[0]["weights"]["epochs"], norm, label=n)
            axes[row, 1].plot(rows[0]["weights"]["epochs"], eff, label=n)
        axes[row, 0].set(title=f"{ds}: ‖w_t‖ (mean over seeds)", xlabel="epoch", ylabel="‖w‖")
        axes[row, 1].set(title=f"{ds}: effective lr η_t/‖w_t‖²", xlabel="epoch", yscale="log")
        axes[row, 0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, out / "weight_norm.png", dpi=100)

    # 4. trajectory PCA
    fig, axes = subplots(1, len(dss), figsize=(5.5 * len(dss), 4.2), squeeze=False)
    names = ["none", "always"] + [f"interrupted@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2] + \
            [f"delayed@{t}" for t in sorted(cfg["onsets"]) if t > 0][:2]
    for col, ds in enumerate(dss):
        ax = axes[0, col]
        p = result["pca"].get(ds)
        if p:
            for n in names:
                xy = np.asarray(p["paths"][key_of(n)])
                ax.plot(xy[:, 0], xy[:, 1], marker=".", label=n)
            ev = p["explained"]
            ax.set(title=f"{ds}: training paths (seed {cfg['seeds'][0]})", xlabel=f"PC1 ({100 * ev[0]:.0f} %)",
                   ylabel=f"PC2 ({100 * ev[1]:.0f} %)" if len(ev) > 1 else "PC2")
            ax.legend(fontsize=6)
    fig.tight_layout()
    atomic_savefig(fig, out / "trajectory_pca.png", dpi=100)

    # 5. FIM trace vs test accuracy (Fig. 4.5 right)
    fig, axes = subplots(len(dss), 2, figsize=(10, 3.6 * len(dss)), squeeze=False)
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
    fig.tight_layout()
    atomic_savefig(fig, out / "fisher_vs_accuracy.png", dpi=100)

    # 6. layer-wise FIM trace (Fig. 4.11), WD throughout and none, first seed
    fig, axes = subplots(len(dss), 2, figsize=(11, 3.6 * len(dss)), squeeze=False)
    for row, ds in enumerate(dss):
        for col, n in enumerate(("always", "none")):
            r = next(r for r in result["runs"] if r["dataset"] == ds and r["key"] == key_of(n)
                     and r["seed"] == cfg["seeds"][0])
            for layer, vals in r["fisher"]["per_layer"].items():
                axes[row, col].plot(r["fisher"]["times"], vals, label=layer or "(root)")
            axes[row, col].set(title=f"{ds}: FIM trace per layer ({'WD throughout' if n == 'always' else 'no WD'})",
                               xlabel="epoch", ylabel="tr F (layer)", yscale="log")
            axes[row, col].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    atomic_savefig(fig, out / "fisher_per_layer.png", dpi=100)


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
