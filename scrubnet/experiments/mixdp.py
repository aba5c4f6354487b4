"""The MixDP protocol on embedded data: AdaMix against its baselines, over ε and seeds.

Data (MNIST-1D, generated offline by the scrubnet split rule): the feature network is pre-trained on the core
classes 5–9 and frozen; the task classes 0–4 are split, per seed and per class, into a few-shot **public** set
(``public_per_class``), a **private** set (``private_per_class``) and a labelled **validation** set
(``val_per_class``, public data used only to choose learning rates); the test set comes from the generator's
test pool. Features are centred by the mean core feature (a public statistic) and L2-normalised.

Methods (one row per method × ε × seed in ``results.json``):

* ``adamix``: public few-shot initialisation, adaptive clipping, public-gradient subspace, public term;
* ``public-init-dp``: the same without the adaptive parts (fixed clip threshold, no projection);
* ``noisygd``: fully private NoisyGD from zero on public + private data;
* ``only-public``: the few-shot fit alone (private data discarded; ``eps`` null);
* ``paragon``: non-private fit on public + private data (``eps`` null).

The learning rate of each private method is chosen per (ε, seed) from ``lr_grid`` by the error on the
validation set. That search is *not* part of the privacy accounting, as in the method's original evaluation
(which chose the best rate over seeds); it never reads the test set.

Readouts: test error; the loss-threshold membership AUC (score = per-sample loss, test samples = positives,
private training samples = negatives; 0.5 = no leak); the Performance Boost
PB = (err_only-public − err_paragon)/(err_method − err_paragon) (> 1: the private data helped); the relative
reconstruction error of the clipped private gradient in the public subspace vs a random one; the
per-instance ε of every private sample (AdaMix and NoisyGD, seed 0).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from scrubnet._config import strict_from_dict, tiny_mode, under_defaults
from scrubnet.readouts.roc import auc_score
from scrubnet.data import DataConfig, load_split
from scrubnet.experiments.io import atomic_savefig, atomic_write_json, atomic_write_text, subplots
from scrubnet.models import MODELS, build_model
from scrubnet.privacy.accounting import Accounting, max_steps
from scrubnet.privacy.linear import error_rate, fit_full_batch, loss_per_sample, normalise_features
from scrubnet.privacy.model import FrozenFeatureLinear, save_private_classifier
from scrubnet.privacy.noisygd import PRESETS, NoisyGDConfig, preset, train_private
from scrubnet.training import TrainConfig, pretrain
from scrubnet.models.call import call_model

PRIVATE_METHODS = ("adamix", "noisygd", "public-init-dp")
METHODS = PRIVATE_METHODS + ("only-public", "paragon")


#: documented ranges (inclusive; ε's lower end exclusive) of the MixDP knobs checked on entry, by key
RANGES = {"epsilons (--eps)": (0.0, 64.0), "delta (--delta)": (1e-12, 0.1), "sigma (--sigma)": (0.1, 1000.0),
          "seeds (--seeds)": (1, 100), "public_per_class": (1, 10_000), "private_per_class": (1, 10_000),
          "val_per_class": (1, 10_000), "test_per_class": (1, 10_000), "num_samples": (100, 1_000_000),
          "pretrain_epochs": (0, 1000), "public_fit_iters": (1, 100_000), "paragon_iters": (1, 100_000)}
#: the defaults under ``SCRUBNET_TINY=1``: one seed, two pre-training epochs, 30 private samples per class
TINY_DP = {"seeds": [0], "pretrain_epochs": 2, "num_samples": 2000, "private_per_class": 30, "val_per_class": 10,
           "test_per_class": 30, "lr_grid": [8.0], "subspace_dim": 8, "public_fit_iters": 50, "paragon_iters": 50}
#: the most full-batch noisy steps T_max(ε, δ, σ) a run may take (ε = 8 at the default σ = 20 takes 1110)
MAX_STEPS = 50_000


def _in_range(key: str, value, integer: bool = False) -> None:
    """``ValueError`` naming ``key`` and its range unless ``value`` is a finite number in it (an integer when
    ``integer``); ε's lower end is exclusive."""
    lo, hi = RANGES[key]
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{key} must be {'an integer' if integer else 'a number'} in [{lo:g}, {hi:g}], "
                         f"got {value!r}")
    if not math.isfinite(value) or not (lo < value <= hi if key.startswith("epsilons") else lo <= value <= hi):
        interval = f"({lo:g}, {hi:g}]" if key.startswith("epsilons") else f"[{lo:g}, {hi:g}]"
        raise ValueError(f"{key} must lie in {interval}, got {value!r}")


@dataclass
class MixDPConfig:
    """The MixDP protocol's knobs; ``docs/decisions/index.md`` (AdaMix) has the measurements behind the defaults.

    Chosen by single-seed exploration (test error %): the 1-D CNN features (D = 64) make five public shots
    informative (Only-Public 23.5, paragon ≈ 10.5) where the MLP's do not (55.8 / 24.4); 100 private samples
    per class keep the noise relevant at ε = 1 (with 600 per class NoisyGD from zero is already at 12.1, next to
    the paragon, and public data cannot matter); P = 48 of 64 is within noise of no projection; the lr grid is
    shared by the three private methods, lr ≥ 128 diverges. The default run (seeds 0–2) gives AdaMix 17.2 vs
    NoisyGD 20.7 vs Only-Public 23.7 at ε = 1 and 15.0 vs 15.7 vs 23.7 at ε = 3 (paragon 10.8); with
    ``val_per_class = 20`` AdaMix loses its ε = 2 and ε = 3 lead (the learning rate is picked less reliably).
    """

    epsilons: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 8.0])
    delta: float = 1e-5
    sigma: float = 20.0
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    backbone: str = "cnn1d"
    backbone_options: dict = field(default_factory=dict)
    pretrain_epochs: int = 30
    num_samples: int = 8000           # MNIST-1D generator pool (80 % train pool, 20 % test pool)
    public_per_class: int = 5
    private_per_class: int = 100
    val_per_class: int = 100
    test_per_class: int = 150
    lr_grid: list[float] = field(default_factory=lambda: [2.0, 8.0, 32.0])
    subspace_dim: int | None = 48
    clip_percentile: float = 90.0
    clip_threshold: float = 1.0       # fixed threshold of noisygd and public-init-dp
    wd: float = 1e-2
    wd_center: str = "zero"
    public_fit_iters: int = 200
    public_fit_lrs: list[float] = field(default_factory=lambda: [4.0, 2.0, 1.0])
    paragon_iters: int = 500
    paragon_lrs: list[float] = field(default_factory=lambda: [8.0, 4.0, 2.0])
    save_checkpoints: bool = True     # AdaMix classifiers of seed 0 as checkpoints

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MixDPConfig":
        """The configuration ``d`` describes, validated (with ``SCRUBNET_TINY=1`` missing keys take the defaults
        of :data:`TINY_DP`)."""
        return strict_from_dict(cls, under_defaults(TINY_DP, d) if tiny_mode() else d, "dp").validate()

    def validate(self) -> "MixDPConfig":
        """Every knob in its documented range (:data:`RANGES`; the key is named), and T_max(ε, δ, σ) ≤
        :data:`MAX_STEPS` for every ε, so a run is refused on entry instead of running for days."""
        if not isinstance(self.epsilons, list) or not self.epsilons:
            raise ValueError("epsilons (--eps) must be a non-empty list of numbers")
        for e in self.epsilons:
            _in_range("epsilons (--eps)", e)
        if len(set(self.epsilons)) != len(self.epsilons):
            raise ValueError("epsilons (--eps) must not repeat")
        _in_range("delta (--delta)", self.delta)
        _in_range("sigma (--sigma)", self.sigma)
        if (not isinstance(self.seeds, list) or not self.seeds or len(set(self.seeds)) != len(self.seeds)
                or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds)):
            raise ValueError("seeds must be distinct non-negative integers")
        if len(self.seeds) > RANGES["seeds (--seeds)"][1]:
            raise ValueError(f"seeds (--seeds): at most {RANGES['seeds (--seeds)'][1]}, got {len(self.seeds)}")
        if self.backbone not in MODELS:
            raise ValueError(f"unknown backbone {self.backbone!r}; choose one of {', '.join(MODELS)}")
        for name in ("public_per_class", "private_per_class", "val_per_class", "test_per_class", "num_samples",
                     "pretrain_epochs", "public_fit_iters", "paragon_iters"):
            _in_range(name, getattr(self, name), integer=True)
        if not self.lr_grid or any(not (isinstance(lr, (int, float)) and 0 < lr < 1e6) for lr in self.lr_grid):
            raise ValueError("lr_grid must be a non-empty list of learning rates in (0, 1e6)")
        NoisyGDConfig(sigma=self.sigma, subspace_dim=self.subspace_dim, clip_percentile=self.clip_percentile,
                      clip_threshold=self.clip_threshold, wd=self.wd, wd_center=self.wd_center).validate()
        for e in self.epsilons:
            t = max_steps(e, self.delta, self.sigma)
            if t > MAX_STEPS:
                raise ValueError(f"epsilons (--eps) {e:g} with delta {self.delta:g} and sigma {self.sigma:g} allows "
                                 f"T = {t} noisy steps, more than the limit {MAX_STEPS}; lower ε or σ")
            if t < 1:
                raise ValueError(f"epsilons (--eps) {e:g} with delta {self.delta:g} and sigma {self.sigma:g} allows "
                                 "no noisy step at all; raise ε or σ")
        return self

    def method_config(self, method: str, lr: float) -> NoisyGDConfig:
        over = dict(lr=lr, sigma=self.sigma, clip_percentile=self.clip_percentile, clip_threshold=self.clip_threshold,
                    wd=self.wd, wd_center=self.wd_center)
        if "subspace_dim" not in PRESETS[method]:
            over["subspace_dim"] = self.subspace_dim
        return preset(method, **over)


@dataclass
class Embedded:
    """Frozen, normalised features of one seed: public, private, validation, test; plus the feature model."""

    x_pub: torch.Tensor
    y_pub: torch.Tensor
    x_pri: torch.Tensor
    y_pri: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    backbone: torch.nn.Module
    center: torch.Tensor
    num_classes: int
    in_shape: tuple


def data_config(cfg: MixDPConfig) -> DataConfig:
    """The scrubnet split: core 5–9 (all their training samples), task 0–4 with public + private + validation
    samples per class in D, ``test_per_class`` in D_test. (The split rule's forget set is not used here.)"""
    return DataConfig(dataset="mnist1d", num_samples=cfg.num_samples,
                      n_train_per_class=cfg.public_per_class + cfg.private_per_class + cfg.val_per_class,
                      n_test_per_class=cfg.test_per_class, forget_class=None, forget_count=None, forget_ids=[0])


def embed(cfg: MixDPConfig, split, seed: int) -> Embedded:
    """Pre-train the feature network on the core (seeded), freeze it, split D per class into public /
    private / validation (seeded) and return the normalised features."""
    net = build_model(cfg.backbone, split.input_shape, split.num_core_classes, seed=seed, **cfg.backbone_options)
    net = pretrain(net, *split.core, TrainConfig(pretrain_epochs=cfg.pretrain_epochs), seed=seed)
    net.head = torch.nn.Identity()
    net.eval()
    with torch.no_grad():
        center = call_model(net, split.x_core).mean(0)

        def feats(x):
            return normalise_features(call_model(net, x) - center)

        x_all, x_test = feats(split.x), feats(split.x_test)
    rng = np.random.default_rng(10_009 * seed + 5)
    y = split.y.numpy()
    parts: list[list[np.ndarray]] = [[], [], []]
    for c in range(split.num_classes):
        idx = rng.permutation(np.nonzero(y == c)[0])
        a, b = cfg.public_per_class, cfg.public_per_class + cfg.private_per_class
        parts[0].append(idx[:a])
        parts[1].append(idx[a:b])
        parts[2].append(idx[b:b + cfg.val_per_class])
    pub, pri, val = (torch.as_tensor(np.sort(np.concatenate(p))) for p in parts)
    return Embedded(x_all[pub], split.y[pub], x_all[pri], split.y[pri], x_all[val], split.y[val], x_test,
                    split.y_test, net, center, split.num_classes, tuple(split.input_shape))


def membership_auc(e: Embedded, w: torch.Tensor) -> float:
    """Loss-threshold attack: AUC of "loss ≥ t ⇒ not a training member" with test samples as positives and
    private training samples as negatives (0.5: the attack learns nothing)."""
    return auc_score(loss_per_sample(e.x_test, e.y_test, w).numpy(), loss_per_sample(e.x_pri, e.y_pri, w).numpy())


def _row(method, eps, seed, e: Embedded, w, acc: Accounting, **extra) -> dict:
    return {"method": method, "eps": eps, "seed": seed, "test_error": error_rate(e.x_test, e.y_test, w),
            "mia_auc": membership_auc(e, w), "mu": acc.mu, "steps": acc.steps, "epsilon_spent": acc.epsilon,
            "delta": acc.delta, "sigma": acc.sigma, "val_error": error_rate(e.x_val, e.y_val, w), **extra}


def run_mixdp(cfg: MixDPConfig, out: Path | None = None, log=None) -> dict:
    """Run the protocol; with ``out`` also write results.json, report.md, the figures and seed-0 checkpoints."""
    cfg.validate()
    split = load_split(data_config(cfg))
    results: list[dict] = []
    pdp: dict[str, list[float]] = {}
    checkpoints: list[tuple[str, FrozenFeatureLinear, dict, int]] = []
    pdp_eps = min(cfg.epsilons, key=lambda v: abs(v - 3.0))
    for seed in cfg.seeds:
        t0 = time.time()
        e = embed(cfg, split, seed)
        w_pub, lr_pub = fit_full_batch(e.x_pub, e.y_pub, e.num_classes, wd=cfg.wd, iters=cfg.public_fit_iters,
                                       lrs=cfg.public_fit_lrs)
        results.append(_row("only-public", None, seed, e, w_pub, Accounting.public_only(cfg.public_fit_iters),
                            lr=lr_pub))
        x_all, y_all = torch.cat([e.x_pub, e.x_pri]), torch.cat([e.y_pub, e.y_pri])
        w_par, lr_par = fit_full_batch(x_all, y_all, e.num_classes, wd=cfg.wd, iters=cfg.paragon_iters,
                                       lrs=cfg.paragon_lrs)
        results.append(_row("paragon", None, seed, e, w_par, Accounting.non_private(cfg.paragon_iters), lr=lr_par))
        for eps in cfg.epsilons:
            for method in PRIVATE_METHODS:
                best = None
                for lr in cfg.lr_grid:
                    run = train_private(e.x_pri, e.y_pri, e.x_pub, e.y_pub, e.num_classes,
                                        cfg.method_config(method, lr), epsilon=eps, delta=cfg.delta, seed=seed,
                                        public_init=w_pub)
                    v = error_rate(e.x_val, e.y_val, run.weights)
                    if best is None or v < best[0]:
                        best = (v, lr, run)
                _, lr, run = best
                acc = run.accounting
                results.append(_row(method, eps, seed, e, run.weights, acc, lr=lr,
                                    clip_thresholds=acc.clip_thresholds,
                                    pdp_epsilon_max=float(run.pdp_epsilon.max()),
                                    pdp_epsilon_median=float(np.median(run.pdp_epsilon)),
                                    recon_error_public=run.recon_error_public,
                                    recon_error_random=run.recon_error_random))
                if seed == cfg.seeds[0] and eps == pdp_eps and method in ("adamix", "noisygd"):
                    pdp[method] = run.pdp_epsilon[:len(e.y_pri)].tolist()
                if seed == cfg.seeds[0] and method == "adamix" and cfg.save_checkpoints:
                    model = FrozenFeatureLinear(e.backbone, e.center, run.weights)
                    checkpoints.append((f"adamix-eps{eps:g}-seed{seed}.safetensors", model,
                                        {"accounting": acc.to_dict(), "lr": lr}, seed))
        if log:
            log(f"seed {seed}: {time.time() - t0:.1f} s")
    report = {"config": {**cfg.to_dict(), "steps": {str(eps): max_steps(eps, cfg.delta, cfg.sigma)
                                                    for eps in cfg.epsilons},
                         "n_public": len(e.y_pub), "n_private": len(e.y_pri), "n_val": len(e.y_val),
                         "n_test": len(e.y_test), "feature_dim": int(e.x_pub.shape[1])},
              "results": results, "summary": summarise(results, cfg.epsilons),
              "pdp": {"eps": pdp_eps, "seed": cfg.seeds[0], "epsilon": pdp}}
    if out is not None:
        write_outputs(report, Path(out), checkpoints, cfg, e.in_shape)
    return report


def _mean(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return (float(np.mean(vals)), float(np.std(vals))) if vals else (None, None)


def summarise(results: list[dict], epsilons) -> dict:
    """Mean ± std over seeds per (method, ε), and the Performance Boost of each private method per ε."""
    summary: dict = {}
    for m in METHODS:
        for eps in ([None] if m in ("only-public", "paragon") else epsilons):
            rows = [r for r in results if r["method"] == m and r["eps"] == eps]
            if not rows:
                continue
            key = m if eps is None else f"{m}@{eps:g}"
            summary[key] = {k: dict(zip(("mean", "std"), _mean(rows, k)))
                            for k in ("test_error", "mia_auc", "recon_error_public", "recon_error_random")
                            if any(r.get(k) is not None for r in rows)}
    pub = summary.get("only-public", {}).get("test_error", {}).get("mean")
    par = summary.get("paragon", {}).get("test_error", {}).get("mean")
    for key, s in summary.items():
        if "@" in key and pub is not None and par is not None:
            gap = s["test_error"]["mean"] - par
            s["performance_boost"] = (pub - par) / gap if gap > 0 else None
    return summary


def write_outputs(report: dict, out: Path, checkpoints, cfg: MixDPConfig, in_shape) -> None:
    """Figures and checkpoints first, results.json and report.md last (each atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    figures(report, out)
    for name, model, extra, seed in checkpoints:
        save_private_classifier(out / "checkpoints" / name, model, backbone=cfg.backbone,
                                backbone_options=cfg.backbone_options, in_shape=in_shape,
                                accounting=extra["accounting"], config=cfg.to_dict(), seed=seed,
                                extra={"method": "adamix", "lr": extra["lr"]})
    atomic_write_text(out / "report.md", render(report))
    atomic_write_json(out / "results.json", report)


def figures(report: dict, out: Path) -> None:
    s, eps = report["summary"], report["config"]["epsilons"]
    fig, (ax1, ax2) = subplots(1, 2, figsize=(10, 4))
    for m in PRIVATE_METHODS:
        err = [100 * s[f"{m}@{e:g}"]["test_error"]["mean"] for e in eps]
        sd = [100 * s[f"{m}@{e:g}"]["test_error"]["std"] for e in eps]
        ax1.errorbar(eps, err, yerr=sd, marker="o", capsize=3, label=m)
        ax2.plot(eps, [s[f"{m}@{e:g}"]["mia_auc"]["mean"] for e in eps], marker="o", label=m)
    for m, style in (("only-public", "--"), ("paragon", ":")):
        ax1.axhline(100 * s[m]["test_error"]["mean"], ls=style, color="k", label=m)
        ax2.axhline(s[m]["mia_auc"]["mean"], ls=style, color="k", label=m)
    ax1.set(xlabel="ε (δ = %g)" % report["config"]["delta"], ylabel="test error (%)", title="test error vs ε")
    ax2.axhline(0.5, color="grey", lw=0.5)
    ax2.set(xlabel="ε", ylabel="loss-threshold membership AUC", title="membership AUC vs ε")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, out / "error_vs_eps.png", dpi=110)
    pdp = report["pdp"]
    fig, ax = subplots(figsize=(6, 4))
    bins = np.linspace(0.0, 1.05 * pdp["eps"], 43)   # shared bins; no value exceeds the target
    for m, vals in pdp["epsilon"].items():
        ax.hist(vals, bins=bins, alpha=0.6, label=m)
    ax.axvline(pdp["eps"], color="k", ls="--", label=f"target ε = {pdp['eps']:g}")
    ax.set(xlabel="per-instance ε of a private sample", ylabel="samples",
           title=f"per-instance privacy (seed {pdp['seed']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, out / "pdp_hist.png", dpi=110)


def render(report: dict) -> str:
    cfg, s = report["config"], report["summary"]
    lines = ["# MixDP: AdaMix and its baselines", "",
             f"MNIST-1D, feature network `{cfg['backbone']}` pre-trained on the core classes and frozen "
             f"(D = {cfg['feature_dim']}); |public| = {cfg['n_public']}, |private| = {cfg['n_private']}, "
             f"|validation| = {cfg['n_val']}, |test| = {cfg['n_test']}; σ = {cfg['sigma']:g}, δ = {cfg['delta']:g}, "
             f"seeds {cfg['seeds']}. Mean ± std over seeds; errors in %.", "",
             "| method | ε | steps T | μ | test error % | membership AUC | Performance Boost | recon. public / random |",
             "|---|---|---|---|---|---|---|---|"]

    def f(d, k, scale=1.0, fmt=".1f"):
        v = d.get(k, {})
        return "–" if v.get("mean") is None else f"{scale * v['mean']:{fmt}} ± {scale * v['std']:{fmt}}"

    for m in ("only-public", "paragon"):
        lines.append(f"| {m} | – | – | – | {f(s[m], 'test_error', 100)} | {f(s[m], 'mia_auc', 1, '.3f')} | – | – |")
    for e in cfg["epsilons"]:
        for m in PRIVATE_METHODS:
            d = s[f"{m}@{e:g}"]
            t = cfg["steps"][str(e)]
            pb = d.get("performance_boost")
            rec = (f"{d['recon_error_public']['mean']:.2f} / {d['recon_error_random']['mean']:.2f}"
                   if "recon_error_public" in d else "–")
            lines.append(f"| {m} | {e:g} | {t} | {math.sqrt(t) / cfg['sigma']:.3f} | {f(d, 'test_error', 100)} | "
                         f"{f(d, 'mia_auc', 1, '.3f')} | {'–' if pb is None else f'{pb:.2f}'} | {rec} |")
    pdp = report["pdp"]
    lines += ["", "Performance Boost = (err_only-public − err_paragon) / (err_method − err_paragon): above 1 the "
              "private data helped. Membership AUC 0.5 = the loss-threshold attack learns nothing. recon = "
              "‖M − UUᵀM‖/‖M‖ of the clipped private gradient sum in the public subspace vs a random one.", ""]
    for m, vals in pdp["epsilon"].items():
        v = np.asarray(vals)
        lines.append(f"Per-instance ε of {m} at target ε = {pdp['eps']:g} (seed {pdp['seed']}): median "
                     f"{np.median(v):.3f}, max {v.max():.3f}, {np.mean(v >= 0.9 * pdp['eps']) * 100:.0f} % of "
                     "samples above 0.9·target.")
    lines += ["", "Figures: `error_vs_eps.png` (test error and membership AUC vs ε, Only-Public and paragon "
              "as horizontal lines), `pdp_hist.png` (per-instance ε histogram).", ""]
    return "\n".join(lines)
