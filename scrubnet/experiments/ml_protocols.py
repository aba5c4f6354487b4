"""ML-Forgetting protocols with readouts after every request (the thesis's Figs. 6.3, 6.6–6.7).

* ``sequential`` — 10 % of the user data forgotten in 10 requests of 1 % each (random, seeded, never core).
* ``class`` — a whole task class (``cfg.data.forget_class``, default 0) forgotten in one request; the core
  30 % is then drawn outside that class so the class can be forgotten entirely.

For each seed: w_0 as in the default protocol, the ML model (:mod:`scrubnet.mlforget`, options from
``cfg.method_options["mlforget"]``), then the requests in order. After request k the scrubbed model is
evaluated with the runner's readouts against the ML model retrained from scratch on the remaining data
(same seed and solver; activation distance measured to it, re-learn threshold = the ML original's D_f loss,
D_f = everything forgotten so far); the retrained model itself (plus σ noise, by default the scrub's own
draw: ``MLConfig.coupled_noise``) gives the band.
``info_weights_nats`` = ‖w'_u − ŵ_u‖²/(2σ²) (the Gaussian KL, ½ included) and ``info_weights_bound_nats`` =
‖w'_u − ŵ_u‖²/σ² (the thesis's bound) after every request; ``forget_s`` times the request, ``retrain_s``
retraining from scratch with the best exact solver.

Outputs in ``out_dir``: ``results.json``, ``report.md`` and one figure per readout (value vs request index,
mlforget mean ± std over seeds against the retrain band).
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import json

import numpy as np
import torch

from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.io import atomic_savefig, atomic_write_text, subplots
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.report import PERCENT, readout_unit
from scrubnet.experiments.runner import CORE_READOUTS, SeedRun, evaluate, get_split
from scrubnet.methods.mlforget import ml_config_from_options
from scrubnet.mlforget.model import (MLState, build_ml_model, forget_request, ml_module_with_weights, reference_noise,
                                     remaining_information_bound, remaining_information_nats,
                                     retrain_user_weights)
from scrubnet.mlforget.pipeline import fine_tuning_start

PROTOCOLS = ("sequential", "class")


def _requests(protocol: str, state: MLState, split, seed: int, n_requests: int, fraction: float) -> list[torch.Tensor]:
    deletable = state.deletable_ids().numpy()
    if protocol == "class":
        cls = split.forget_class if split.forget_class is not None else 0
        ids = deletable[split.y[deletable].numpy() == cls]
        if len(ids) == 0:
            raise ValueError(f"class {cls} has no forgettable user samples")
        return [torch.as_tensor(np.sort(ids))]
    per = max(1, int(round(fraction * len(state.user_ids))))
    if per * n_requests > len(deletable):
        raise ValueError(f"{n_requests} requests of {per} samples exceed the {len(deletable)} forgettable samples")
    rng = np.random.default_rng(10_007 * seed + 5)
    chosen = rng.choice(deletable, size=per * n_requests, replace=False)
    return [torch.as_tensor(np.sort(chosen[k * per:(k + 1) * per])) for k in range(n_requests)]


def run_ml_protocol(protocol: str, cfg: ExperimentConfig, out_dir: Path | str | None, progress: bool = True,
                    n_requests: int = 10, request_fraction: float = 0.01) -> dict:
    """Run ``protocol`` ('sequential' | 'class') over ``cfg.seeds``; write outputs to ``out_dir`` if given."""

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown ML protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    ml_cfg = ml_config_from_options(cfg.method_options.get("mlforget", {}))
    base_split = get_split(cfg)
    if protocol == "class" and base_split.forget_class is None and cfg.data.forget_class is None:
        raise ValueError("the class protocol needs a forget class (data.forget_class)")
    runs: dict[str, list] = {"mlforget": [], "mlforget-retrain": [], "original": []}
    meta: list[dict] = []
    total = len(cfg.seeds) * (n_requests if protocol == "sequential" else 1)
    with make_progress(enabled=progress) as bar:
        task = bar.add_task(f"ML protocol {protocol}", total=total)
        for seed in cfg.seeds:
            split = base_split
            if protocol == "class":
                cls = cfg.data.forget_class if cfg.data.forget_class is not None else 0
                split = base_split.with_forget(torch.nonzero(base_split.y == cls).flatten(), forget_class=cls)
            bar.update(task, description=f"seed {seed}: training the ML model")
            start = fine_tuning_start(split, cfg.model, cfg.model_options, cfg.train, seed)
            excl = split.forget_idx if protocol == "class" else torch.zeros(0, dtype=torch.long)
            t0 = time.perf_counter()
            state = build_ml_model(start, split, ml_cfg, cfg.train, seed, exclude_from_core=excl)
            t_train = time.perf_counter() - t0
            original = copy.deepcopy(state.model)
            reqs = _requests(protocol, state, split, seed, n_requests, request_fraction)
            seed_rows = {"mlforget": [], "mlforget-retrain": [], "original": []}
            for k, ids in enumerate(reqs, start=1):
                bar.update(task, description=f"seed {seed}: request {k}/{len(reqs)}")
                out = forget_request(state, split.x, split.y, ids, noise_seed=1_000_003 * seed + k)
                t1 = time.perf_counter()
                w_hat = retrain_user_weights(state, split.x, split.y)
                t_retrain = time.perf_counter() - t1
                retrain_noisy = ml_module_with_weights(state, w_hat + reference_noise(ml_cfg, out,
                                                                                     2_000_003 * seed + k))
                retrain_exact = ml_module_with_weights(state, w_hat)
                forgotten = state.forgotten_ids[~torch.isin(state.forgotten_ids, state.core_ids)]
                split_k = split.with_forget(forgotten, forget_class=split.forget_class if protocol == "class"
                                            else None)
                sr = SeedRun(seed, split_k, start, original, retrain_exact, None, cfg)
                info = out.info
                r_m = evaluate(state.model, sr, original=original, reference=retrain_exact)
                r_m.update({"info_weights_nats": remaining_information_nats(out.w_before_noise, w_hat, ml_cfg.sigma),
                            "info_weights_bound_nats": remaining_information_bound(out.w_before_noise, w_hat,
                                                                                   ml_cfg.sigma),
                            "forget_s": info.seconds, "retrain_s": t_retrain,
                            "solver_iterations": float(info.iterations),
                            "solver_relative_residual": info.relative_residual})
                r_r = evaluate(retrain_noisy, sr, original=original, reference=retrain_exact)
                r_o = evaluate(original, sr, original=original, reference=retrain_exact)
                seed_rows["mlforget"].append(r_m)
                seed_rows["mlforget-retrain"].append(r_r)
                seed_rows["original"].append(r_o)
                bar.advance(task)
            for m in runs:
                runs[m].append({"seed": seed, "requests": seed_rows[m]})
            meta.append({"seed": seed, "ml_train_s": t_train, "n_core": int(len(state.core_ids)),
                         "n_user": int(len(state.user_ids)), "request_sizes": [int(len(r)) for r in reqs]})
    n_req = len(runs["mlforget"][0]["requests"])
    summary = {m: [_summarise([r["requests"][k] for r in runs[m]]) for k in range(n_req)] for m in runs}
    results = {"protocol": protocol, "config": cfg.to_dict(), "ml_config": ml_cfg.to_dict(), "seeds": meta,
               "runs": runs, "summary": summary, "checks": band_checks(summary)}
    if out_dir is not None:
        _write(results, Path(out_dir))
    return results


def _summarise(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if all(k in r for r in rows)]
    return {k: {"mean": float(np.mean([r[k] for r in rows])), "std": float(np.std([r[k] for r in rows]))}
            for k in keys}


def band_checks(summary: dict) -> dict:
    """Per readout and request: is mlforget's mean inside the retrain band (mean ± std over seeds)?
    ``distance_in_std`` = |Δmean| / std_retrain (inf when the band has zero width and the means differ)."""
    out = {}
    for r in CORE_READOUTS:
        rows = []
        for k, (m, b) in enumerate(zip(summary["mlforget"], summary["mlforget-retrain"]), start=1):
            if r not in m or r not in b:
                continue
            d = abs(m[r]["mean"] - b[r]["mean"])
            sd = b[r]["std"]
            rows.append({"request": k, "inside": bool(d <= sd), "distance_in_std": d / sd if sd > 0 else
                         (0.0 if d == 0 else math.inf)})
        out[r] = {"inside_all": all(x["inside"] for x in rows), "requests": rows}
    return out


def _write(results: dict, out_dir: Path) -> str:
    """results.json, the figures and report.md (each atomically); returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "results.json", json.dumps(results, indent=1, default=float) + "\n")
    return rerender(results, out_dir)


def rerender(results: dict, out_dir: Path) -> str:
    """The figures and report.md of a protocol run from its results dict (``scrubnet report`` uses it)."""
    figs = _figures(results, out_dir)
    md = render_ml_report(results, figs)
    atomic_write_text(out_dir / "report.md", md)
    return md


def _figures(results: dict, out_dir: Path) -> list[str]:


    s = results["summary"]
    n = len(s["mlforget"])
    xs = np.arange(1, n + 1)
    names = []
    for r in CORE_READOUTS + ["info_weights_nats"]:
        if r not in s["mlforget"][0]:
            continue
        fig, ax = subplots(figsize=(5, 3.2))
        for m, style in (("mlforget-retrain", None), ("original", "--"), ("mlforget", "-o")):
            if r not in s[m][0]:
                continue
            k = 100.0 if r in PERCENT else 1.0  # figures show errors and the attack in %
            mean = k * np.array([row[r]["mean"] for row in s[m]])
            std = k * np.array([row[r]["std"] for row in s[m]])
            if m == "mlforget-retrain":
                ax.fill_between(xs, mean - std, mean + std, color="tab:green", alpha=0.3, label="retrain band")
                ax.plot(xs, mean, color="tab:green", lw=1)
            else:
                ax.errorbar(xs, mean, yerr=std, fmt=style, label="ML original" if m == "original" else m,
                            color="tab:gray" if m == "original" else "tab:blue", capsize=2, ms=3)
        ax.set_xlabel("request")
        ax.set_ylabel(f"{r} ({readout_unit(r)})" if readout_unit(r) else r)
        ax.set_title(f"{results['protocol']}: {r}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{results['protocol']}_{r}.png"
        atomic_savefig(fig, out_dir / name, dpi=110)
        names.append(name)
    return names


def render_ml_report(results: dict, figures: list[str]) -> str:
    s = results["summary"]
    lines = [f"# ML-Forgetting, {results['protocol']} protocol", "",
             f"seeds: {[m['seed'] for m in results['seeds']]}; requests per seed: "
             f"{results['seeds'][0]['request_sizes']} samples; core {results['seeds'][0]['n_core']}, "
             f"user {results['seeds'][0]['n_user']}; µ = {results['ml_config']['mu']}, "
             f"σ = {results['ml_config']['sigma']}", "",
             "mean ± std over seeds after each request: mlforget | retrain (band) | ML original", ""]
    cols = ["error_forget", "error_test", "loss_forget", "mia_forget", "activation_l1_forget", "info_weights_nats"]
    lines.append("| request | " + " | ".join(f"{c} ({readout_unit(c)})" if readout_unit(c) else c for c in cols)
                 + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for k in range(len(s["mlforget"])):
        cells = []
        for c in cols:
            parts = []
            for m in ("mlforget", "mlforget-retrain", "original"):
                v = s[m][k].get(c)
                f = 100.0 if c in PERCENT else 1.0  # errors and the attack in %, as the header says
                parts.append(f"{f * v['mean']:.3g}±{f * v['std']:.2g}" if v else "–")
            cells.append(" \\| ".join(parts))
        lines.append(f"| {k + 1} | " + " | ".join(cells) + " |")
    lines += ["", "## Inside the retrain band (|Δmean| ≤ std of the retrain over seeds)", ""]
    for r, c in results["checks"].items():
        worst = max((x["distance_in_std"] for x in c["requests"]), default=0.0)
        lines.append(f"- {r}: {'inside after every request' if c['inside_all'] else 'outside after some request'}"
                     f" (largest |Δ|/std = {worst:.2f})")
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    return "\n".join(lines) + "\n"
