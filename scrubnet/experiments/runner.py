"""The multi-seed forgetting protocol: methods × seeds → readouts → results.json, report.md, figures.

For each seed the whole protocol is re-run: pre-train on the core, fine-tune the original w(D) from w_0,
retrain the gold standard without D_f (same seed and schedule), then run every method on
(original, D_r, D_f) and evaluate all readouts. Scrub, then measure: the methods never see the retrain
model; the runner measures every result against it (:func:`evaluate`, :func:`scrub_readouts`). The retrain *band* is mean ± std of the retrain
readouts over seeds (std with ddof=0, as ``numpy.std``).

``results.json`` layout::

    {"config": {...},
     "methods": {"<method>": {"runs": [{"seed": s, "time_s": t, "readouts": {...},
                                        "forgetting": {...} | null, "warnings": [...]}],
                              "summary": {"<readout>": {"mean": m, "std": s}}}}}

``forgetting`` is the forgetting verdict of the run (:mod:`scrubnet.readouts.forgetting`: D_f against the test
set, before and after, no retrained model needed); it is kept out of the readouts and the summary. The two
anchors (original, retrain) are always run: a run naming neither gets them added
(``config.resolved.anchors_added``), since every comparison of the report is with them.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scrubnet.data import Split, load_split
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.ntk_figures import plot_ntk_lines
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.report import write_outputs
from scrubnet.curvature.params import trainable_params
from scrubnet.methods.artifacts import retrain_key
from scrubnet.methods.base import (ForgetContext, ForgettingMethod, ScrubResult, anchor_method, available_methods,
                                   method_class, protocol_context, protocol_method)
from scrubnet.scrub import ForgetResult, scrub_and_measure
from scrubnet.models import build_model
from scrubnet.readouts.activation_info import activation_information_sets
from scrubnet.readouts.basic import activation_l1, error_and_loss, softmax_entropy
from scrubnet.readouts.information import weight_information, weight_step_geometry
from scrubnet.readouts.mia import membership_attack_flagged
from scrubnet.readouts.references import ReferenceModels, train_references
from scrubnet.readouts.relearn import relearn_time
from scrubnet.readouts.standard import StandardMetrics, standard_readouts
from scrubnet.training import TrainHistory, finetune, finetune_start, pretrain, retrain

#: readouts every method gets, in report order
CORE_READOUTS = ["error_retain", "error_forget", "error_test", "loss_retain", "loss_forget", "loss_test",
                 "mia_forget", "relearn_epochs", "activation_l1_retain", "activation_l1_forget",
                 "activation_l1_test"]

_SPLIT_CACHE: dict[str, Split] = {}


@dataclass
class SeedRun:
    """Everything the protocol produced for one seed."""

    seed: int
    split: Split
    start: nn.Module
    original: nn.Module
    retrain: nn.Module
    ctx: ForgetContext
    config: ExperimentConfig
    histories: dict[str, TrainHistory] = field(default_factory=dict)
    _retrain_standard: StandardMetrics | None = None

    def retrain_standard(self) -> StandardMetrics:
        """The standard metrics of this seed's retrain model (computed once): the Avg. Gap reference."""
        if self._retrain_standard is None:
            s = self.split
            self._retrain_standard = standard_readouts(self.retrain, s.retain, s.forget, s.test, seed=self.seed)[1]
        return self._retrain_standard


def get_split(cfg: ExperimentConfig) -> Split:
    """The split of ``cfg.data`` (cached: the data do not depend on the training seed)."""
    key = repr(sorted(cfg.data.to_dict().items()))
    if key not in _SPLIT_CACHE:
        _SPLIT_CACHE[key] = load_split(cfg.data)
    return _SPLIT_CACHE[key]


def resolve_methods(cfg: ExperimentConfig, split: Split) -> list[str]:
    """The methods to run: ``cfg.methods`` (validated) or every applicable registered method."""
    avail = available_methods()
    if cfg.methods is None:
        out = []
        for m in avail:
            cls = type(protocol_method(m, **cfg.method_options.get(m, {})))
            if (cls.class_only and split.forget_class is None) or not cls.in_default_run:
                continue
            out.append(m)
        # the two anchors first (the trained model, then the gold standard), as in the papers' tables
        rank = {"original": 0, "retrain": 1}
        return sorted(out, key=lambda m: (rank.get(method_class(m).anchor, 2), m))
    unknown = [m for m in cfg.methods if m not in avail]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(avail)}")
    return list(cfg.methods)


def with_anchors(methods: list[str]) -> tuple[list[str], list[str]]:
    """(``methods`` with the original and retrain anchors first where missing, the anchors added)."""
    added = [a for a in (anchor_method("original"), anchor_method("retrain")) if a and a not in methods]
    return added + list(methods), added


def prepare_seed(cfg: ExperimentConfig, seed: int, device: torch.device | str | None = None) -> SeedRun:
    """Pre-train, build w_0, fine-tune the original and retrain the gold standard for ``seed``, with the data
    and the models on ``device`` (default CPU; the model is initialised on the CPU, then moved, so every
    device starts from the same weights)."""
    split = get_split(cfg).to(device or "cpu")
    n_pre = split.num_core_classes if len(split.y_core) else split.num_classes
    model = build_model(cfg.model, split.input_shape, n_pre, seed=seed, **cfg.model_options).to(split.x.device)
    pre = pretrain(model, split.x_core, split.y_core, cfg.train, seed) if len(split.y_core) else model
    start = finetune_start(pre, split.num_classes, seed)
    original, h_o = finetune(start, split.x, split.y, cfg.train, seed)
    ret, h_r = retrain(start, split.x, split.y, split.forget_idx, cfg.train, seed, mode=cfg.retrain_mode)
    ctx = protocol_context(start, cfg.train, num_classes=split.num_classes, seed=seed,
                           forget_class=split.forget_class, split=split, retrain_mode=cfg.retrain_mode)
    ctx.cache.put(retrain_key(start, split.x, split.y, split.forget_idx, train=cfg.train.to_dict(), seed=seed,
                              mode=cfg.retrain_mode), ret)
    return SeedRun(seed, split, start, original, ret, ctx, cfg, {"original": h_o, "retrain": h_r})


def configured_method(name: str, sr: SeedRun, options: dict | None = None) -> ForgettingMethod:
    """The method ``name`` with the experiment's options for it, updated by ``options``."""
    opts = dict(sr.config.method_options.get(name, {}))
    opts.update(options or {})
    return protocol_method(name, **opts)


def seed_references(sr: SeedRun, pairs: int) -> ReferenceModels:
    """The verdict's reference models of the seed's original: 2·``pairs`` models fine-tuned from the same start
    with the same recipe, each pair on complementary random halves of D (seeded by the run's seed)."""
    s = sr.split

    def fit(idx, seed):
        sel = torch.as_tensor(idx, dtype=torch.long, device=s.x.device)
        return finetune(sr.start, s.x[sel], s.y[sel], sr.config.train, seed)[0].eval()
    return train_references(fit, len(s.y), pairs=pairs, seed=sr.seed)


def scrub_method(name: str, sr: SeedRun, options: dict | None = None, *,
                 verdict: bool = False, references: ReferenceModels | None = None) -> tuple[ForgetResult, float]:
    """Run one method on the seed's original model through :func:`scrubnet.scrub.scrub_and_measure` (the one
    scrub path; its retain-error rule reported in ``checks`` and a failing forgetting verdict in ``warnings``,
    neither failing the run, so the protocol's results record the method's own verdict); returns the result
    and its wall time (s, the checks included, the forgetting verdict not). ``verdict``: also judge D_f
    against the test set (``result.forgetting``), calibrated by ``references`` when given."""
    method = configured_method(name, sr, options)
    ctx = copy.copy(sr.ctx)  # methods may add to ctx.cache (shared dict) but not rebind the fields
    t0 = time.perf_counter()
    test = sr.split.test if verdict and len(sr.split.y_test) else None
    refs = references if test is not None else None
    out = scrub_and_measure(method, sr.original, sr.split.retain, sr.split.forget, ctx, retain_rule="report",
                            test=test, on_not_forgotten="warn", references=refs,
                            forget_ids=None if refs is None else sr.split.forget_idx.tolist())
    return out, time.perf_counter() - t0 - out.report.get("verdict_seconds", 0.0)


def run_method(name: str, sr: SeedRun, options: dict | None = None) -> tuple[ScrubResult, float]:
    """:func:`scrub_method`, returning the method's own :class:`~scrubnet.methods.base.ScrubResult`."""
    out, t = scrub_method(name, sr, options)
    return out.scrub, t


def _weights(model: nn.Module) -> dict:
    return {k: v.detach() for k, v in trainable_params(model).items()}


def scrub_readouts(method: ForgettingMethod, res: ScrubResult, sr: SeedRun, *,
                   max_queries: int | None = None) -> dict[str, float]:
    """What the scrub left, measured against the retrain reference (``res.reference`` or the seed's retrain):

    * weight-space geometry of the scrub's deterministic point (the Gaussian's mean for a noisy method) —
      :func:`scrubnet.readouts.information.weight_step_geometry`, when the three models share parameters;
    * for a noisy method (``res.noise``): the method's procedure is applied to the reference
      (:meth:`~scrubnet.methods.base.ForgettingMethod.noise_at`), and the white-box bound
      (``info_weights_nats``, ``_code``) and the black-box bound per query set
      (``info_activations_nats_{forget,retain,test}``, ``_code``; first ``max_queries`` of each) are computed
      from the two Gaussians; ``information_seconds`` is the time this took.
    """
    original = sr.original if res.original is None else res.original
    reference = sr.retrain if res.reference is None else res.reference
    out: dict[str, float] = {}
    w_o, w_r = _weights(original), _weights(reference)
    w_s = res.noise.mean if res.noise is not None else _weights(res.model)
    if set(w_o) == set(w_s) == set(w_r) and all(w_o[k].shape == w_s[k].shape == w_r[k].shape for k in w_o):
        out.update(weight_step_geometry(w_o, w_s, w_r))
    if res.noise is not None:
        queries = {"forget": sr.split.forget[0], "retain": sr.split.retain[0], "test": sr.split.x_test}
        out.update(noise_information(method, res, reference, sr.split.retain, sr.split.forget, copy.copy(sr.ctx),
                                     queries=queries, max_queries=max_queries))
    return out


def noise_information(method: ForgettingMethod, res: ScrubResult, reference: nn.Module, retain, forget,
                      ctx: ForgetContext, *, queries: dict | None = None,
                      max_queries: int | None = None) -> dict[str, float]:
    """The information bounds of a noisy result: ``method``'s procedure applied to ``reference``
    (:meth:`~scrubnet.methods.base.ForgettingMethod.noise_at`), then ``info_weights_nats`` (+ ``_code``) from
    the two Gaussians and, for each query set in ``queries`` ({name: x}), ``info_activations_nats_<name>``
    (+ ``_code``); ``information_seconds`` is the time taken. Empty for a deterministic result."""
    if res.noise is None:
        return {}
    t0 = time.perf_counter()
    out: dict[str, float] = {}
    ref = method.noise_at(reference, retain, forget, ctx)
    if ref is not None:
        out.update(weight_information(res.noise.mean, res.noise.var, ref.mean, ref.var))
        if queries:
            out.update(activation_information_sets(res.model, res.noise.mean, res.noise.var, reference, ref.mean,
                                                   ref.var, queries, max_queries=max_queries))
    out["information_seconds"] = time.perf_counter() - t0
    return out


def measure(name: str, res: ScrubResult, sr: SeedRun, options: dict | None = None) -> dict[str, float]:
    """All readouts of one method's result: :func:`evaluate`, the method's numeric ``info`` and
    :func:`scrub_readouts`."""
    readouts = evaluate(res.model, sr, original=res.original, reference=res.reference)
    readouts.update(_numeric_info(res.info))
    readouts.update(scrub_readouts(configured_method(name, sr, options), res, sr))
    s = sr.split
    # the field's standard metrics (UA, RA, TA, MIA-efficacy, Avg. Gap to this seed's retrain model)
    readouts.update(standard_readouts(res.model, s.retain, s.forget, s.test, reference=sr.retrain_standard(),
                                      seed=sr.seed)[0])
    return readouts


def evaluate(model: nn.Module, sr: SeedRun, *, original: nn.Module | None = None,
             reference: nn.Module | None = None) -> dict[str, float]:
    """Every core readout of ``model`` for this seed.

    ``original`` sets the re-learn threshold (its D_f loss); ``reference`` is the model the activation
    distance is measured to. Defaults: the protocol's original and retrain models.
    """
    original = sr.original if original is None else original
    reference = sr.retrain if reference is None else reference
    s = sr.split
    out: dict[str, float] = {}
    for part, (x, y) in (("retain", s.retain), ("forget", s.forget), ("test", s.test)):
        out[f"error_{part}"], out[f"loss_{part}"] = error_and_loss(model, x, y)
    out["mia_forget"], degenerate = membership_attack_flagged(model, s.retain, s.forget, s.test)
    out["mia_degenerate"] = float(degenerate)  # 1: the attack predicted one class for every point
    _, thr = error_and_loss(original, *s.forget)
    out["relearn_epochs"] = float(relearn_time(model, s.x, s.y, *s.forget, thr, wd=sr.config.train.wd,
                                               max_epochs=sr.config.relearn_max_epochs, seed=sr.seed,
                                               freeze_bn=sr.config.train.freeze_bn))
    for part, (x, _) in (("retain", s.retain), ("forget", s.forget), ("test", s.test)):
        out[f"activation_l1_{part}"] = activation_l1(model, reference, x)
    return out


def entropies(model: nn.Module, split: Split) -> dict[str, list[float]]:
    """Softmax entropies (nats) on D_r, D_f, D_test, for the histograms."""
    return {part: softmax_entropy(model, d[0]).tolist()
            for part, d in (("retain", split.retain), ("forget", split.forget), ("test", split.test))}


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    """mean, std (ddof=0) and the number of seeds ``n`` of every readout present in all runs (with one seed
    there is no spread to show: the report prints the value alone, never ``± 0``)."""
    keys = [k for k in runs[0]["readouts"] if all(k in r["readouts"] for r in runs)]
    out = {}
    for k in keys:
        vals = np.array([r["readouts"][k] for r in runs], dtype=float)
        out[k] = {"mean": float(np.mean(vals)), "std": float(np.std(vals)), "n": len(vals)}
    return out


def _numeric_info(info: dict) -> dict[str, float]:
    out = {}
    for k, v in info.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = float(v)
    return out


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None, progress: bool = True,
                   console=None, device: torch.device | str | None = None, references: int = 0) -> dict:
    """Run methods × seeds on ``device`` (default CPU); when ``out_dir`` is given write results.json,
    report.md and figures there. ``references``: pairs of reference models trained per seed for the
    forgetting verdict (0: none; their cost is ``protocol[seed]["references_s"]``, outside every ``time_s``)."""
    device = torch.device(device or "cpu")

    split = get_split(cfg)
    methods, added = with_anchors(resolve_methods(cfg, split))
    results: dict = {"config": cfg.to_dict(), "methods": {m: {"runs": []} for m in methods}}
    results["config"]["resolved"] = {"methods": methods, "num_classes": split.num_classes,
                                     "n_retain": int(len(split.retain_idx)), "n_forget": int(len(split.forget_idx)),
                                     "n_test": int(len(split.y_test)), "n_core": int(len(split.y_core)),
                                     "forget_class": split.forget_class, "data_fingerprint": split.fingerprint(),
                                     "device": str(device), "anchors_added": added}
    hist_data: dict[str, dict] = {}
    total = len(cfg.seeds) * (len(methods) + 1)
    with make_progress(enabled=progress, console=console) as bar:
        task = bar.add_task("scrubnet run", total=total)
        for seed in cfg.seeds:
            bar.update(task, description=f"seed {seed}: training original and retrain")
            t0 = time.perf_counter()
            sr = prepare_seed(cfg, seed, device)
            results.setdefault("protocol", {})[str(seed)] = {
                "time_s": time.perf_counter() - t0,
                **{f"{k}_epochs": v.epochs for k, v in sr.histories.items()},
                **{f"{k}_zero_error_epoch": v.zero_error_epoch for k, v in sr.histories.items()},
                **{f"{k}_train_error": v.final_error for k, v in sr.histories.items()}}
            refs = None
            if references:
                bar.update(task, description=f"seed {seed}: {2 * references} reference models")
                refs = seed_references(sr, references)
                results["protocol"][str(seed)]["references_s"] = refs.seconds
            bar.advance(task)
            steps: dict[str, nn.Module] = {}
            for m in methods:
                bar.update(task, description=f"seed {seed}: {m}")
                checked, t = scrub_method(m, sr, verdict=True, references=refs)
                res = checked.scrub
                readouts = measure(m, res, sr)
                run = {"seed": seed, "time_s": t, "readouts": readouts,
                       "forgetting": None if checked.forgetting is None else checked.forgetting.to_dict(),
                       "warnings": list(checked.warnings)}
                if not res.ok:  # the method says it did not do what it claims: the report warns
                    run["failed"] = list(res.reasons)
                results["methods"][m]["runs"].append(run)
                if seed == cfg.seeds[0]:
                    hist_data[m] = entropies(res.model, sr.split)
                    steps[m] = res.model
                bar.advance(task)
            figure_steps = sorted({method_class(m).figure_step for m in methods} - {None})
            if seed == cfg.seeds[0] and out_dir is not None and figure_steps:
                # Figures 4 and 6 of the NTK paper, along the deterministic step of the first seed
                step = figure_steps[0]
                scrubbed = steps[step] if step in steps else run_method(step, sr)[0].model
                plot_ntk_lines(sr.original, scrubbed, sr.retrain, sr.split, Path(out_dir), seed=seed)
    for m in methods:
        results["methods"][m]["summary"] = summarise(results["methods"][m]["runs"])
        results["methods"][m]["band"] = band_reference(m)
    results["checks"] = separation_checks(results)
    if out_dir is not None:
        write_outputs(results, hist_data, Path(out_dir))
    return results


def band_reference(method: str) -> str:
    """The method whose band ``method`` is judged against: ``retrain`` unless the method's class names
    another in ``band_reference`` (e.g. ML-Forgetting is judged against the retrained mixed-linear model)."""
    cls = method_class(method)
    return cls.band_reference if cls is not None else "retrain"


def inside_band(results: dict, method: str) -> dict[str, bool]:
    """For every core readout: is the method's mean inside its reference's mean ± std band?"""
    ms = results["methods"]
    ref = ms.get(ms[method].get("band", "retrain"), {}).get("summary", {})
    out = {}
    for r in CORE_READOUTS:
        if r in ref and r in ms[method].get("summary", {}):
            v, b = ms[method]["summary"][r]["mean"], ref[r]
            out[r] = bool(abs(v - b["mean"]) <= b["std"] + 1e-9)
    return out


def separation_checks(results: dict) -> dict:
    """The protocol's sanity checks, stated as numbers.

    * ``band_separated_<r>``: |mean(original) − mean(retrain)| > 2·std(retrain) for r in loss_forget,
      error_forget, mia_forget — the forget set must be measurably different after retraining;
    * ``<method>_closer_to_<original|retrain>``: on loss_forget, which anchor each method's mean is nearer to.
    """
    ms = results["methods"]
    out: dict = {}
    orig, ret = anchor_method("original"), anchor_method("retrain")
    if orig not in ms or ret not in ms:
        return out
    so, sr = ms[orig]["summary"], ms[ret]["summary"]
    for r in ("loss_forget", "error_forget", "mia_forget"):
        if r in so and r in sr:
            gap = abs(so[r]["mean"] - sr[r]["mean"])
            out[f"band_separated_{r}"] = {"gap": gap, "two_std_retrain": 2 * sr[r]["std"],
                                          "separated": bool(gap > 2 * sr[r]["std"])}
    refs = {d.get("band", "retrain") for d in ms.values()}
    for m, d in ms.items():
        if m in (orig, ret) or "loss_forget" not in d.get("summary", {}):
            continue
        if m in refs or d.get("band", "retrain") != "retrain":
            continue  # judged against its own band below
        v = d["summary"]["loss_forget"]["mean"]
        do, dr = abs(v - so["loss_forget"]["mean"]), abs(v - sr["loss_forget"]["mean"])
        lo, hi = sr["loss_forget"]["mean"] - sr["loss_forget"]["std"], sr["loss_forget"]["mean"] + sr["loss_forget"]["std"]
        out[f"{m}_loss_forget"] = {"distance_to_original": do, "distance_to_retrain": dr,
                                   "closer_to": "original" if do < dr else "retrain",
                                   "inside_retrain_band": bool(lo <= v <= hi)}
    for m, d in ms.items():
        if m in (orig, ret) or d.get("band", "retrain") == m:
            continue
        out[f"{m}_inside_band"] = {"band": d.get("band", "retrain"), "readouts": inside_band(results, m)}
    return out


def finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)
