"""``scrubnet bench``: every method (seed and field) on the field's standard settings, scored by the standard
metrics (UA, RA, TA, MIA-efficacy, run time, Avg. Gap to retraining).

Settings (:data:`SETTINGS`): ``random-10`` (10 % of D forgotten, drawn at random), ``random-1`` (1 %) and
``class`` (a whole class). Each is run for every seed of the experiment with the same seeds for every method;
the forget set of a setting is fixed (the experiment's ``data_seed``), the seed changes the training.

Tuning (fair to every method): each method's main knob (:data:`TUNE_GRIDS`) is chosen on a *validation split*
— another forget set of the same size (``random-*``: a disjoint random draw; ``class``: another class), trained
with its own seed (:data:`VALIDATION_SEED`) and its own retrain — as the grid value with the smallest Avg. Gap
to that retrain; the grid, every value's gap and the choice are recorded in ``bench.json``. Methods without a
knob (the closed-form and curvature steps whose scale the protocol fixes) run with their protocol options;
``tune=False`` runs every method with them (the published defaults).

Every (setting, role, seed, method, options) is one *job*: its result is written to ``OUT/jobs/`` as soon as it
finishes, so a killed bench resumes where it stopped (a job whose file exists is not run again). The jobs of
one (setting, role, seed) form one engine task, sharing the original and retrain models of that seed; the
engines are the audit's (:mod:`scrubnet.audit.engine`: in-process or Ray).

Outputs: ``bench.json``, ``bench.md`` (per setting, one table ordered by Avg. Gap) and ``bench.png`` (UA
against TA per setting, with the retrain point).
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from scrubnet._config import tiny_mode
from scrubnet.audit.engine import LocalEngine
from scrubnet.atomic_io import atomic_write_json, atomic_write_text
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.io import atomic_savefig, subplots
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.runner import get_split, prepare_seed, scrub_method
from scrubnet.methods.base import available_methods, method_class
from scrubnet.readouts.standard import GAP_METRICS, standard_readouts

#: the standard settings: a forgotten fraction of D drawn at random, or a whole class (task index)
SETTINGS = {"random-10": {"fraction": 0.10}, "random-1": {"fraction": 0.01}, "class": {"forget_class": 0}}
#: the class forgotten on the validation split of the ``class`` setting (task index)
VALIDATION_CLASS = 1
#: training seed of the validation split (apart from the experiment's seeds)
VALIDATION_SEED = 1000
#: each method's main knob and its grid (methods not listed have no knob: their protocol options are used)
TUNE_GRIDS = {
    "finetune": ("lr", [0.003, 0.01, 0.03]),
    "neggrad": ("lr", [0.003, 0.01, 0.03]),
    "randomlabels": ("lr", [0.003, 0.01, 0.03]),
    "fisher": ("alpha", [1e-6, 3e-6, 1e-5]),
    "ntk-fisher": ("alpha", [1e-10, 1e-9, 1e-8]),
    "neggrad-plus": ("beta", [0.5, 0.9, 0.99]),
    "l1-sparse": ("gamma", [5e-5, 2e-4, 1e-3]),
    "salun": ("lr", [0.006, 0.03, 0.1]),
    "scrub": ("lr", [1e-4, 5e-4, 2e-3]),
    "ssd": ("selection_threshold", [1.0, 3.0, 10.0]),
    "bad-teacher": ("lr", [1e-4, 1e-3, 1e-2]),
    "unsir": ("lr", [1e-4, 1e-3, 1e-2]),
    "boundary-shrink": ("lr", [1e-3, 1e-2, 1e-1]),
}
#: under ``SCRUBNET_TINY=1``: these methods only, the grids of the first two of them (two values each)
TINY_METHODS = ["original", "retrain", "finetune", "fisher", "neggrad-plus", "salun", "ssd", "boundary-shrink"]
TINY_TUNED = ("neggrad-plus", "salun")
BENCH_OUTPUTS = ("bench.json", "bench.md", "bench.png")
ANCHORS = ("original", "retrain")
#: not a method of its own: the retrained mixed-linear model, ML-Forgetting's reference
REFERENCE_ONLY = ("mlforget-retrain",)


def family(method: str) -> str:
    """``anchor``, ``seed`` (a method of scrubnet's default run) or ``field`` (the 2022–24 methods)."""
    cls = method_class(method)
    if cls is not None and cls.anchor is not None:
        return "anchor"
    return "seed" if cls is not None and cls.in_default_run else "field"


def default_methods(cfg: ExperimentConfig) -> list[str]:
    """The bench's methods: ``cfg.methods`` or every registered method (anchors first); on a file dataset
    (CIFAR-10 …) without the curvature methods and ML-Forgetting, which do not scale to a ResNet-18 on CPU
    (name them in ``cfg.methods`` to run them)."""
    if cfg.methods is not None:
        unknown = [m for m in cfg.methods if method_class(m) is None]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(available_methods())}")
        return list(dict.fromkeys(list(ANCHORS) + list(cfg.methods)))
    names = TINY_METHODS if tiny_mode() else available_methods()
    out = [m for m in names if m not in REFERENCE_ONLY]
    if cfg.data.dataset not in ("mnist1d", "digits"):
        out = [m for m in out if not (method_class(m).uses_curvature or method_class(m).audit_scrub_cost == "expensive")]
    return sorted(out, key=lambda m: (ANCHORS.index(m) if m in ANCHORS else 2, m))


def tune_grids(methods: list[str]) -> dict[str, tuple[str, list]]:
    """The grids of ``methods`` (:data:`TUNE_GRIDS`; under ``SCRUBNET_TINY=1`` the first and last values of
    the grids of :data:`TINY_TUNED` only)."""
    if tiny_mode():
        return {m: (TUNE_GRIDS[m][0], list(dict.fromkeys([TUNE_GRIDS[m][1][0], TUNE_GRIDS[m][1][-1]])))
                for m in methods if m in TINY_TUNED}
    return {m: TUNE_GRIDS[m] for m in methods if m in TUNE_GRIDS}


def setting_config(cfg: ExperimentConfig, setting: str, role: str) -> ExperimentConfig:
    """The experiment configuration of one setting's ``"test"`` or ``"validation"`` split.

    Random settings: D_f = ``round(fraction · |D|)`` positions (at least 1) of a permutation of D seeded by
    the ``data_seed``; the validation split takes the next ones (disjoint). Class: the setting's class (test)
    or :data:`VALIDATION_CLASS` (validation)."""
    spec = SETTINGS[setting]
    out = copy.deepcopy(cfg)
    out.methods = None
    out.data.forget_ids = out.data.forget_count = None
    if "forget_class" in spec:
        out.data.forget_class = spec["forget_class"] if role == "test" else VALIDATION_CLASS
        return out
    base = copy.deepcopy(cfg.data)
    base.forget_ids, base.forget_class, base.forget_count = None, 0, None
    n = int(len(get_split(ExperimentConfig(data=base)).y))
    k = max(1, int(round(spec["fraction"] * n)))
    perm = np.random.default_rng(cfg.data.data_seed).permutation(n)
    ids = perm[:k] if role == "test" else perm[k:2 * k]
    out.data.forget_class = None
    out.data.forget_ids = sorted(int(i) for i in ids)
    return out


def applies(method: str, setting: str) -> bool:
    """Class-only methods (Hiding, UNSIR, Boundary Shrink) run in the ``class`` setting only."""
    return setting == "class" or not method_class(method).class_only


def job_key(fingerprint: str, job: dict) -> str:
    """A file-safe name of one job, unique for the configuration and the job."""
    h = hashlib.sha256((fingerprint + json.dumps(job, sort_keys=True)).encode()).hexdigest()[:12]
    return f"{job['setting']}-{job['role']}-s{job['seed']}-{job['method']}-{h}"


def config_fingerprint(cfg: ExperimentConfig) -> str:
    """What the jobs' results depend on besides the job itself (the seeds and method list excluded, so a bench
    with more seeds or methods reuses the finished jobs)."""
    d = cfg.to_dict()
    d.pop("seeds", None)
    d.pop("methods", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


_PREPARED: dict = {}


def _prepared(cfg: ExperimentConfig, seed: int):
    """The seed's original and retrain models (kept for the jobs of the same task: one entry)."""
    key = (cfg.to_json(), seed)
    if key not in _PREPARED:
        _PREPARED.clear()
        _PREPARED[key] = prepare_seed(cfg, seed)
    return _PREPARED[key]


def run_job(cfg: ExperimentConfig, job: dict) -> dict:
    """Run one job and measure it: its scrub's standard metrics, Avg. Gap to the seed's retrain, the scrub's
    wall time (s) and its verdict (``ok``; the reasons of a failure).

    Parameters
    ----------
    cfg : ExperimentConfig
        The setting's configuration (:func:`setting_config`).
    job : dict
        ``setting``, ``role`` ("tune" or "eval"), ``seed``, ``method``, ``options``.

    Returns
    -------
    dict
        The job with ``metrics`` (fractions), ``time_s``, ``ok``, ``reasons``.
    """
    sr = _prepared(cfg, job["seed"])
    checked, t = scrub_method(job["method"], sr, job["options"])
    s = sr.split
    metrics, _ = standard_readouts(checked.scrub.model, s.retain, s.forget, s.test, reference=sr.retrain_standard(),
                                   seed=sr.seed)
    return {**job, "metrics": metrics, "time_s": t, "ok": bool(checked.scrub.ok),
            "reasons": list(checked.scrub.reasons)}


def bench_task(shared: dict, payload: dict) -> list[dict]:
    """One engine task: the jobs of one (setting, role, seed), in order; each result is written to
    ``shared["jobs_dir"]`` as soon as it is known (the resume point) and returned."""
    if shared.get("threads"):
        torch.set_num_threads(int(shared["threads"]))
    cfg = ExperimentConfig.from_dict(payload["config"])
    out = []
    for key, job in payload["jobs"]:
        res = run_job(cfg, job)
        atomic_write_json(Path(shared["jobs_dir"]) / f"{key}.json", res)
        out.append(res)
    return out


def choose(results: list[dict]) -> dict:
    """The tuned value: the grid value of the smallest validation Avg. Gap (a run that failed only if every
    value failed; ties: the first in grid order).

    Parameters
    ----------
    results : list of dict
        One tuning job result per grid value, in grid order (``options`` has the single knob).

    Returns
    -------
    dict
        ``option``, ``grid``, ``avg_gap`` (one per value, fractions), ``ok`` (per value), ``chosen``.
    """
    if not results:
        raise ValueError("no tuning result to choose from")
    (option,) = results[0]["options"]
    gaps = [float(r["metrics"]["avg_gap"]) for r in results]
    ok = [bool(r["ok"]) for r in results]
    pool = [i for i in range(len(results)) if ok[i]] or list(range(len(results)))
    best = min(pool, key=lambda i: (gaps[i], i))
    return {"option": option, "grid": [r["options"][option] for r in results], "avg_gap": gaps, "ok": ok,
            "chosen": results[best]["options"][option]}


def _groups(cfg: ExperimentConfig, settings: list[str], methods: list[str], role: str,
            options_of) -> list[tuple[ExperimentConfig, list[dict]]]:
    """The jobs of one stage, grouped per (setting, seed): ``role`` "tune" runs every grid value on the
    validation split; "eval" runs each method once per seed with ``options_of(setting, method)``."""
    out = []
    for setting in settings:
        scfg = setting_config(cfg, setting, "validation" if role == "tune" else "test")
        seeds = [VALIDATION_SEED] if role == "tune" else list(cfg.seeds)
        for seed in seeds:
            jobs = []
            for m in methods:
                if not applies(m, setting):
                    continue
                for opts in options_of(setting, m):
                    jobs.append({"setting": setting, "role": role, "seed": seed, "method": m, "options": opts})
            if jobs:
                out.append((scfg, jobs))
    return out


def _execute(groups, engine, shared: dict, fingerprint: str, bar, task, counts: dict) -> dict[str, dict]:
    """Run the jobs not finished yet (one engine task per group), read the finished ones from ``jobs/``;
    returns every job's result by key and counts ``run`` / ``reused`` jobs in ``counts``."""
    jobs_dir = Path(shared["jobs_dir"])
    done: dict[str, dict] = {}
    payloads = []
    for scfg, jobs in groups:
        pending = []
        for job in jobs:
            key = job_key(fingerprint, job)
            path = jobs_dir / f"{key}.json"
            if path.is_file():
                done[key] = json.loads(path.read_text())
                counts["reused"] += 1
                bar.advance(task)
            else:
                pending.append((key, job))
        if pending:
            payloads.append({"config": scfg.to_dict(), "jobs": pending})
    for i, results in engine.map(bench_task, shared, payloads):
        for (key, _), res in zip(payloads[i]["jobs"], results):
            atomic_write_json(jobs_dir / f"{key}.json", res)  # again here: a Ray worker may not share the disk
            done[key] = res
            counts["run"] += 1
        bar.advance(task, len(results))
        bar.update(task, description=f"bench: {payloads[i]['jobs'][-1][1]['setting']}")
    return done


def _summarise(runs: list[dict]) -> dict:
    """Mean and std (ddof 0) over seeds of the metrics and the run time of one method in one setting."""
    keys = list(GAP_METRICS) + ["avg_gap"]
    out = {k: {"mean": float(np.mean([r["metrics"][k] for r in runs])),
               "std": float(np.std([r["metrics"][k] for r in runs]))} for k in keys}
    out["time_s"] = {"mean": float(np.mean([r["time_s"] for r in runs])),
                     "std": float(np.std([r["time_s"] for r in runs]))}
    return out


def summarise_setting(runs: list[dict], tuning: dict) -> dict:
    """One setting's rows (ordered by mean Avg. Gap) and which method is closest to retrain: overall (anchors
    excluded), among the seed methods and among the field's."""
    rows = []
    for m in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == m]
        rows.append({"method": m, "family": family(m), "options": rs[0]["options"], "tuned": m in tuning,
                     "seeds": [r["seed"] for r in rs], "failed": sum(not r["ok"] for r in rs),
                     "mia_degenerate": sum(bool(r["metrics"].get("mia_efficacy_degenerate")) for r in rs),
                     **_summarise(rs)})
    rows.sort(key=lambda r: (r["method"] != "retrain", r["avg_gap"]["mean"], r["method"]))
    out = {"rows": rows}
    for name, fam in (("closest", ("seed", "field")), ("closest_seed", ("seed",)), ("closest_field", ("field",))):
        cand = [r for r in rows if r["family"] in fam]
        out[name] = cand[0]["method"] if cand else None
    return out


def run_bench(cfg: ExperimentConfig, out_dir: str | Path, *, settings: list[str] | None = None, tune: bool = True,
              engine=None, threads: int | None = None, progress: bool = True, console=None) -> dict:
    """Run the bench (module docstring) and write its outputs into ``out_dir``.

    Parameters
    ----------
    cfg : ExperimentConfig
        Data, model, training and seeds (``cfg.methods``: the methods, anchors added; None: all).
    out_dir : path
        ``bench.json``, ``bench.md``, ``bench.png`` and ``jobs/`` (the finished jobs; kept for resuming).
    settings : list of str, optional
        Keys of :data:`SETTINGS` (default all three).
    tune : bool
        Choose each method's knob on the validation split (False: the protocol's defaults).
    engine : LocalEngine or RayEngine, optional
        Where the jobs run (default in-process).
    threads : int, optional
        torch threads per task.

    Returns
    -------
    dict
        The content of ``bench.json``.
    """
    t0 = time.perf_counter()
    settings = list(SETTINGS) if settings is None else list(settings)
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not settings:
        raise ValueError(f"unknown setting(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SETTINGS)}")
    methods = default_methods(cfg)
    grids = tune_grids(methods) if tune else {}
    out = Path(out_dir)
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    shared = {"jobs_dir": str(out / "jobs"), "threads": threads}
    fp = config_fingerprint(cfg)
    engine = engine or LocalEngine()
    tune_groups = _groups(cfg, settings, [m for m in methods if m in grids], "tune",
                          lambda s, m: [{grids[m][0]: v} for v in grids[m][1]])
    counts = {"run": 0, "reused": 0}
    n_eval = sum(len(j) for _, j in _groups(cfg, settings, methods, "eval", lambda s, m: [{}]))
    with make_progress(enabled=progress, console=console) as bar:
        task = bar.add_task("bench: tuning", total=sum(len(j) for _, j in tune_groups) + n_eval)
        tuned = _execute(tune_groups, engine, shared, fp, bar, task, counts)
        tuning: dict = {s: {} for s in settings}
        for _, jobs in tune_groups:
            for m in dict.fromkeys(j["method"] for j in jobs):
                tuning[jobs[0]["setting"]][m] = choose([tuned[job_key(fp, j)] for j in jobs if j["method"] == m])

        def options_of(s, m):
            t = tuning[s].get(m)
            return [{t["option"]: t["chosen"]} if t else {}]

        eval_groups = _groups(cfg, settings, methods, "eval", options_of)
        evaluated = _execute(eval_groups, engine, shared, fp, bar, task, counts)
    runs = [evaluated[job_key(fp, j)] for _, jobs in eval_groups for j in jobs]
    results = {"config": cfg.to_dict(), "methods": methods, "settings": _settings_info(cfg, settings),
               "seeds": list(cfg.seeds), "tune": bool(tune), "validation_seed": VALIDATION_SEED,
               "grids": {m: {"option": o, "values": v} for m, (o, v) in grids.items()}, "tuning": tuning,
               "summary": {s: summarise_setting([r for r in runs if r["setting"] == s], tuning[s]) for s in settings},
               "runs": runs, "jobs": counts, "seconds": time.perf_counter() - t0, "engine": engine.name}
    atomic_write_json(out / "bench.json", results)
    atomic_write_text(out / "bench.md", render_bench(results))
    plot_bench(results, out / "bench.png")
    return results


def _settings_info(cfg: ExperimentConfig, settings: list[str]) -> dict:
    """Each setting's definition and its sizes (|D_r|, |D_f|, |D_test|) on the test split."""
    out = {}
    for s in settings:
        split = get_split(setting_config(cfg, s, "test"))
        out[s] = {**SETTINGS[s], "n_retain": int(len(split.retain_idx)), "n_forget": int(len(split.forget_idx)),
                  "n_test": int(len(split.y_test))}
    return out


def _cell(s: dict, scale: float = 100.0, digits: int = 1) -> str:
    return f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}"


def render_bench(results: dict) -> str:
    """``bench.md``: per setting, a table ordered by Avg. Gap (metrics in %, time in s) and the closest methods."""
    cfg = results["config"]
    lines = ["# scrubnet bench", "",
             f"Dataset `{cfg['data']['dataset']}`, model `{cfg['model']}`, seeds {results['seeds']}; "
             + ("each method's knob tuned on a validation split (Avg. Gap to its retrain)." if results["tune"]
                else "published defaults (no tuning)."), "",
             "UA = error on D_f, RA / TA = accuracy on D_r / D_test, MIA-eff. = share of D_f the confidence "
             "attack calls non-member, Avg. Gap = mean |metric − retrain's| over the four (lower is better); "
             "mean ± std over seeds, in %; time = the scrub's wall time (s).", ""]
    for s, summ in results["summary"].items():
        info = results["settings"][s]
        lines += [f"## {s} (|D_f| = {info['n_forget']}, |D_r| = {info['n_retain']})", "",
                  f"Closest to retrain: **{summ['closest']}** (seed methods: {summ['closest_seed']}; field: "
                  f"{summ['closest_field']}).", ""]
        lines += bench_table_rows(summ["rows"]) + [""]
        tuned = results["tuning"].get(s, {})
        if tuned:
            lines.append("Tuning: " + "; ".join(
                f"{m} {t['option']} ∈ {t['grid']} → **{t['chosen']}**" for m, t in tuned.items()) + ".")
            lines.append("")
    lines.append(f"Jobs: {results['jobs']['run']} run, {results['jobs']['reused']} reused from an earlier run; "
                 f"{results['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def bench_table_rows(rows: list[dict]) -> list[str]:
    """One markdown table of a setting's rows."""
    out = ["| method | family | UA % | RA % | TA % | MIA-eff. % | Avg. Gap % | time (s) | options |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['failed']} failed)" if r["failed"] else ""
        opts = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
        out.append(f"| {r['method']}{note} | {r['family']} | {_cell(r['ua'])} | {_cell(r['ra'])} | {_cell(r['ta'])} "
                   f"| {_cell(r['mia_efficacy'])} | {_cell(r['avg_gap'])} | {r['time_s']['mean']:.2f} | "
                   f"{opts or 'defaults'} |")
    return out


def plot_bench(results: dict, path: Path) -> None:
    """UA against TA (%, means over seeds) per setting; retrain as a star, the original as a cross."""
    settings = list(results["summary"])
    fig, axes = subplots(1, len(settings), figsize=(5 * len(settings), 4.2), squeeze=False)
    for ax, s in zip(axes[0], settings):
        for r in results["summary"][s]["rows"]:
            x, y = 100 * r["ta"]["mean"], 100 * r["ua"]["mean"]
            style = {"retrain": ("*", "k", 180), "original": ("x", "gray", 60)}.get(
                r["method"], ("o", "tab:blue" if r["family"] == "seed" else "tab:orange", 30))
            ax.scatter([x], [y], marker=style[0], c=style[1], s=style[2], zorder=3)
            ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(s)
        ax.set_xlabel("TA: test accuracy (%)")
        ax.set_ylabel("UA: error on D_f (%)")
        ax.grid(alpha=0.3)
    fig.suptitle("scrubnet bench: UA vs TA (star: retrain; blue: seed methods, orange: field methods)", fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path)
