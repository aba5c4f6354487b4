"""The critical-periods study's configuration, training runs and analysis (outputs: :mod:`.outputs`)."""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor

from scrubnet._config import strict_from_dict, tiny_mode, under_defaults
from scrubnet.data.augment import AUGMENTATIONS, make_augment
from scrubnet.data.embedded import digits_pools, mnist1d_pools
from scrubnet.diagnostics.fisher_trace import FisherTraceMonitor, probe_subset
from scrubnet.diagnostics.readiness import fisher_readiness, linearization_gap
from scrubnet.diagnostics.trajectory import WeightNormLog
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

def scale_text(cfg: CriticalPeriodsConfig) -> str:
    return (f"{cfg.epochs} epochs from scratch, batch {cfg.batch_size}, SGD with momentum {cfg.momentum}, lr × "
            f"{cfg.lr_decay}^epoch, weight decay {cfg.weight_decay} when on; seeds {cfg.seeds}; MNIST-1D: 1-D CNN "
            f"({cfg.mnist1d_channels} channels, BatchNorm), lr {cfg.mnist1d_lr}, {cfg.mnist1d_train} training "
            f"samples (of 6,400), tested on 1,600, augmentation {cfg.augment_mnist1d}; digits: 2-D CNN with BatchNorm "
            f"({cfg.digits_channels} channels), lr {cfg.digits_lr}, "
            f"{cfg.digits_train} training images (of 896), tested on 901, augmentation {cfg.augment_digits}; FIM trace on {cfg.probe_size} fixed training "
            f"inputs, {cfg.label_samples} sampled label(s) each, every epoch")
