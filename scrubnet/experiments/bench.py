"""``scrubnet bench``: every method (seed and field) on the field's standard settings, scored by the standard
metrics (UA, RA, TA, MIA-efficacy, run time, Avg. Gap to retraining), with 95 % intervals and the groups of
methods the bench cannot tell apart.

Settings (:data:`SETTINGS`): ``random-10`` (10 % of D forgotten, drawn at random), ``random-1`` (1 %) and
``class`` (a whole class). Each is run on several *forget sets* (default :data:`DEFAULT_FORGET_SETS`) × the
experiment's seeds (default 3), the same units for every method: random settings take disjoint blocks of one
permutation of D (seeded by the ``data_seed``), the class setting takes the classes in turn. A unit is one
(forget set, seed); every cell of ``bench.json`` / ``bench.md`` is a mean over units with its 95 % t-interval,
every method is compared with the best of its setting unit by unit (a paired t-interval of the Avg. Gap
difference), and the methods whose difference with a group's leader is not distinguishable from 0 form a tie
group (:mod:`scrubnet.experiments.bench_stats`).

Tuning (fair to every method): each method's main knob (:data:`TUNE_GRIDS`) is chosen on a *validation split*
— another forget set of the same size (``random-*``: a block of the permutation no test set uses; ``class``: a
class no test set uses), trained with its own seed (:data:`VALIDATION_SEED`) and its own retrain — as the value
with the smallest Avg. Gap to that retrain. Every tuned method gets :data:`TUNE_TRIALS` trials: a 3-value grid,
then, while the best value sits on the grid's edge, one more value beyond it (the grid widens), else the
midpoint toward its better neighbour (the grid refines); a choice still on an edge after the trials is flagged.
The trials, their gaps and the choice are recorded in ``bench.json``. Methods without a knob (``hiding``,
``mlforget``: nothing of theirs sets a scale) run with their protocol options; ``tune=False`` runs every method
at its defaults (as released, for the field's methods).

Every (setting, role, forget set, seed, method, options) is one *job*: its result is written to ``OUT/jobs/`` as
soon as it finishes, so a killed bench resumes where it stopped. The jobs of one (setting, forget set, seed)
form one engine task, sharing the original and retrain models; the engines are the audit's
(:mod:`scrubnet.audit.engine`: in-process or Ray).

Outputs: ``bench.json``, ``bench.md`` and ``bench.png`` (:mod:`scrubnet.experiments.bench_report`).
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
from scrubnet.experiments.bench_report import plot_bench, render_bench, summarise_setting
from scrubnet.experiments.bench_stats import best_index, choice_tolerance, next_trial, on_edge
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.runner import get_split, prepare_seed, scrub_method
from scrubnet.methods.base import available_methods, method_class
from scrubnet.readouts.standard import standard_readouts

#: the standard settings: a forgotten fraction of D drawn at random, or a whole class (task index)
SETTINGS = {"random-10": {"fraction": 0.10}, "random-1": {"fraction": 0.01}, "class": {"forget_class": 0}}
#: forget sets per setting (× the seeds: the units every cell is a mean over)
DEFAULT_FORGET_SETS = 5
#: ``--quick``: forget sets and seeds
QUICK = {"forget_sets": 2, "seeds": 2}
#: training seed of the validation split (apart from the experiment's seeds)
VALIDATION_SEED = 1000
#: trials of every tuned knob (3 grid values, then widening or refining steps)
TUNE_TRIALS = 5
#: each method's main knob, its starting grid (the released default in it where there is one) and the space the
#: grid is even in ("log": log v; "logit": log v/(1−v) for a knob in (0, 1)). Not listed: no knob.
TUNE_GRIDS = {
    "finetune": ("lr", [0.003, 0.01, 0.03], "log"),
    "neggrad": ("lr", [0.003, 0.01, 0.03], "log"),
    "randomlabels": ("lr", [0.003, 0.01, 0.03], "log"),
    "fisher": ("alpha", [1e-6, 3e-6, 1e-5], "log"),
    "ntk-fisher": ("alpha", [1e-10, 1e-9, 1e-8], "log"),
    "newton": ("damping", [1e-4, 1e-3, 1e-2], "log"),
    "ntk": ("step_scale", [0.5, 1.0, 2.0], "log"),
    "ga": ("lr", [1e-4, 1e-3, 1e-2], "log"),
    "neggrad-plus": ("beta", [0.9, 0.95, 0.99], "logit"),
    "l1-sparse": ("gamma", [5e-5, 2e-4, 1e-3], "log"),
    "salun": ("lr", [0.004, 0.013, 0.04], "log"),
    "scrub": ("lr", [1e-4, 5e-4, 2e-3], "log"),
    "ssd": ("selection_threshold", [3.0, 10.0, 30.0], "log"),
    "bad-teacher": ("lr", [1e-4, 1e-3, 1e-2], "log"),
    "unsir": ("lr", [1e-4, 1e-3, 1e-2], "log"),
    "boundary-shrink": ("lr", [1e-3, 1e-2, 1e-1], "log"),
}
#: under ``SCRUBNET_TINY=1``: these methods only, the grids of the first two of them (two values, three trials)
TINY_METHODS = ["original", "retrain", "finetune", "fisher", "neggrad-plus", "salun", "ssd", "boundary-shrink"]
TINY_TUNED = ("neggrad-plus", "salun")
BENCH_OUTPUTS = ("bench.json", "bench.md", "bench.png")
ANCHORS = ("original", "retrain")
#: not a method of its own: the retrained mixed-linear model, ML-Forgetting's reference
REFERENCE_ONLY = ("mlforget-retrain",)
#: the seed methods that are scrubnet's own variants of a field method (said beside their rows)
VARIANTS = {"neggrad": "scrubnet's capped variant (−min(CE, log c) on D_f, with D_r): not the field's GA or "
                       "NegGrad+"}


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


def tune_grids(methods: list[str]) -> dict[str, tuple[str, list, str]]:
    """The starting grids of ``methods`` (:data:`TUNE_GRIDS`; under ``SCRUBNET_TINY=1`` the first and last
    values of the grids of :data:`TINY_TUNED` only)."""
    if tiny_mode():
        return {m: (TUNE_GRIDS[m][0], [TUNE_GRIDS[m][1][0], TUNE_GRIDS[m][1][-1]], TUNE_GRIDS[m][2])
                for m in methods if m in TINY_TUNED}
    return {m: TUNE_GRIDS[m] for m in methods if m in TUNE_GRIDS}


def tune_trials() -> int:
    """Trials per tuned knob (:data:`TUNE_TRIALS`; 3 under ``SCRUBNET_TINY=1``)."""
    return 3 if tiny_mode() else TUNE_TRIALS


def _task_classes(cfg: ExperimentConfig) -> int:
    base = copy.deepcopy(cfg.data)
    base.forget_ids, base.forget_class, base.forget_count = None, 0, None
    return int(get_split(ExperimentConfig(data=base)).num_classes)


def setting_config(cfg: ExperimentConfig, setting: str, role: str, forget_set: int = 0) -> ExperimentConfig:
    """The experiment configuration of one forget set (``role`` "test") or of the validation split.

    Random settings: blocks of ``k = round(fraction · |D|)`` positions (at least 1) of a permutation of D seeded
    by the ``data_seed``: the validation split is the first block, test forget set j the block j + 1 (all
    disjoint). Class: test forget set j forgets class j, the validation split the last class (never a test
    class: at most c − 1 forget sets)."""
    spec = SETTINGS[setting]
    out = copy.deepcopy(cfg)
    out.methods = None
    out.data.forget_ids = out.data.forget_count = None
    if "forget_class" in spec:
        c = _task_classes(cfg)
        if role == "test" and not 0 <= forget_set < c - 1:
            raise ValueError(f"the class setting has {c - 1} forget sets on {c} classes (the last one validates); "
                             f"forget set {forget_set} asked")
        out.data.forget_class = forget_set if role == "test" else c - 1
        return out
    base = copy.deepcopy(cfg.data)
    base.forget_ids, base.forget_class, base.forget_count = None, 0, None
    n = int(len(get_split(ExperimentConfig(data=base)).y))
    k = max(1, int(round(spec["fraction"] * n)))
    block = forget_set + 1 if role == "test" else 0
    if (block + 1) * k > n:
        raise ValueError(f"{setting}: forget set {forget_set} needs {(block + 1) * k} of the {n} samples "
                         "(disjoint blocks); ask for fewer forget sets")
    perm = np.random.default_rng(cfg.data.data_seed).permutation(n)
    out.data.forget_class = None
    out.data.forget_ids = sorted(int(i) for i in perm[block * k:(block + 1) * k])
    return out


def forget_sets_of(cfg: ExperimentConfig, setting: str, n_sets: int) -> list[int]:
    """The test forget sets of ``setting``: 0 … n_sets − 1 (the class setting: at most c − 1)."""
    if "forget_class" in SETTINGS[setting]:
        return list(range(min(int(n_sets), _task_classes(cfg) - 1)))
    return list(range(int(n_sets)))


def applies(method: str, setting: str) -> bool:
    """Class-only methods (Hiding, UNSIR, Boundary Shrink) run in the ``class`` setting only."""
    return setting == "class" or not method_class(method).class_only


def job_key(fingerprint: str, job: dict) -> str:
    """A file-safe name of one job, unique for the configuration and the job."""
    h = hashlib.sha256((fingerprint + json.dumps(job, sort_keys=True)).encode()).hexdigest()[:12]
    return f"{job['setting']}-{job['role']}-f{job['forget_set']}-s{job['seed']}-{job['method']}-{h}"


def config_fingerprint(cfg: ExperimentConfig) -> str:
    """What the jobs' results depend on besides the job itself (the seeds and method list excluded, so a bench
    with more seeds or methods reuses the finished jobs)."""
    d = cfg.to_dict()
    d.pop("seeds", None)
    d.pop("methods", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


_PREPARED: dict = {}


def _prepared(cfg: ExperimentConfig, seed: int, device: str | None = None):
    """The seed's original and retrain models on ``device`` (default CPU; kept for the jobs of the same task:
    one entry)."""
    key = (cfg.to_json(), seed, str(device or "cpu"))
    if key not in _PREPARED:
        _PREPARED.clear()
        _PREPARED[key] = prepare_seed(cfg, seed, device)
    return _PREPARED[key]


def run_job(cfg: ExperimentConfig, job: dict, device: str | None = None) -> dict:
    """Run one job and measure it: its scrub's standard metrics, Avg. Gap to the seed's retrain, the scrub's
    wall time (s) and its verdict (``ok``; the reasons of a failure).

    Parameters
    ----------
    cfg : ExperimentConfig
        The forget set's configuration (:func:`setting_config`).
    job : dict
        ``setting``, ``role`` ("tune" or "eval"), ``forget_set``, ``seed``, ``method``, ``options``.
    device : str, optional
        Where the models train and scrub (default CPU).

    Returns
    -------
    dict
        The job with ``metrics`` (fractions), ``time_s``, ``ok``, ``reasons``. A scrub that raised (e.g. a tuning
        value that makes the weights non-finite) gives ``metrics`` None, ``ok`` False and the error as reason.
    """
    sr = _prepared(cfg, job["seed"], device)
    try:
        checked, t = scrub_method(job["method"], sr, job["options"])
    except (ValueError, RuntimeError, FloatingPointError) as e:
        return {**job, "metrics": None, "time_s": 0.0, "ok": False, "reasons": [f"the scrub raised: {e}"]}
    s = sr.split
    metrics, _ = standard_readouts(checked.scrub.model, s.retain, s.forget, s.test, reference=sr.retrain_standard(),
                                   seed=sr.seed)
    return {**job, "metrics": metrics, "time_s": t, "ok": bool(checked.scrub.ok),
            "reasons": list(checked.scrub.reasons)}


def bench_task(shared: dict, payload: dict) -> list[dict]:
    """One engine task: the jobs of one (setting, forget set, seed), in order; each result is written to
    ``shared["jobs_dir"]`` as soon as it is known (the resume point) and returned."""
    if shared.get("threads"):
        torch.set_num_threads(int(shared["threads"]))
    cfg = ExperimentConfig.from_dict(payload["config"])
    out = []
    for key, job in payload["jobs"]:
        dev = shared.get("device")
        res = run_job(cfg, job) if dev is None else run_job(cfg, job, dev)
        atomic_write_json(Path(shared["jobs_dir"]) / f"{key}.json", res)
        out.append(res)
    return out


def choose(results: list[dict], tol: float = 0.0) -> dict:
    """The tuned value: the first value tried whose validation Avg. Gap is within ``tol`` of the smallest (a run
    that failed only if every value failed; ``tol``: :func:`~scrubnet.experiments.bench_stats.choice_tolerance`
    of the setting, so that gaps one forget sample apart count as a tie, broken by the order tried).

    Parameters
    ----------
    results : list of dict
        One tuning job result per value, in the order tried (``options`` has the single knob).

    Returns
    -------
    dict
        ``option``, ``grid`` (the values in the order tried), ``avg_gap`` (one per value, fractions), ``ok`` (per
        value), ``chosen``, ``trials``, ``on_edge`` (the choice is the smallest or largest value tried) and
        ``tolerance``.
    """
    if not results:
        raise ValueError("no tuning result to choose from")
    (option,) = results[0]["options"]
    gaps = [_gap(r) for r in results]
    ok = [bool(r["ok"]) for r in results]
    grid = [r["options"][option] for r in results]
    chosen = grid[best_index(gaps, ok, tol)]
    return {"option": option, "grid": grid, "avg_gap": [None if g == float("inf") else g for g in gaps], "ok": ok,
            "chosen": chosen, "trials": len(grid), "on_edge": on_edge(grid, chosen), "tolerance": float(tol)}


def _gap(r: dict) -> float:
    """A job's Avg. Gap (inf when its scrub raised)."""
    return float("inf") if r["metrics"] is None else float(r["metrics"]["avg_gap"])


def _groups(cfg: ExperimentConfig, settings: list[str], methods: list[str], role: str, options_of,
            n_sets: int) -> list[tuple[ExperimentConfig, list[dict]]]:
    """The jobs of one stage, grouped per (setting, forget set, seed): ``role`` "tune" runs ``options_of`` on
    the validation split; "eval" runs each method once per unit with ``options_of(setting, method)``."""
    out = []
    for setting in settings:
        sets = [-1] if role == "tune" else forget_sets_of(cfg, setting, n_sets)
        seeds = [VALIDATION_SEED] if role == "tune" else list(cfg.seeds)
        for f in sets:
            scfg = setting_config(cfg, setting, "validation" if role == "tune" else "test", max(f, 0))
            for seed in seeds:
                jobs = [{"setting": setting, "role": role, "forget_set": f, "seed": seed, "method": m, "options": o}
                        for m in methods if applies(m, setting) for o in options_of(setting, m)]
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


def _tune(cfg, settings, grids, run_stage, n_sets) -> dict:
    """Tuning rounds: the starting grids, then one more value per (setting, method) each round until every
    tuned method has :func:`tune_trials` trials (:func:`~scrubnet.experiments.bench_stats.next_trial`)."""
    tried = {(s, m): list(grids[m][1]) for s in settings for m in grids if applies(m, s)}
    results: dict = {}
    pending = dict(tried)
    while pending:
        by_setting = {s: {m: v for (s2, m), v in pending.items() if s2 == s} for s in settings}
        groups = _groups(cfg, settings, sorted({m for _, m in pending}), "tune",
                         lambda s, m: [{grids[m][0]: v} for v in by_setting[s].get(m, [])], n_sets)
        done = run_stage(groups)
        for _, jobs in groups:
            for j in jobs:
                results.setdefault((j["setting"], j["method"]), []).append(done[j["key"]])
        pending = {}
        for (s, m), vals in tried.items():
            if len(vals) >= tune_trials():
                continue
            rs = results[(s, m)]
            new = next_trial(vals, [_gap(r) for r in rs], [bool(r["ok"]) for r in rs], grids[m][2])
            if new is not None:
                vals.append(new)
                pending[(s, m)] = [new]
    tuning: dict = {s: {} for s in settings}
    tols = {s: choice_tolerance(len(get_split(setting_config(cfg, s, "validation", 0)).forget_idx))
            for s in settings}
    for (s, m), rs in results.items():
        tuning[s][m] = {**choose(rs, tols[s]), "space": grids[m][2]}
    return tuning


def run_bench(cfg: ExperimentConfig, out_dir: str | Path, *, settings: list[str] | None = None, tune: bool = True,
              engine=None, threads: int | None = None, progress: bool = True, console=None,
              forget_sets: int = DEFAULT_FORGET_SETS, device: str | torch.device | None = None) -> dict:
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
        Choose each method's knob on the validation split (False: the defaults).
    engine : LocalEngine or RayEngine, optional
        Where the jobs run (default in-process).
    threads : int, optional
        torch threads per task.
    progress, console
        The progress bar and its console.
    forget_sets : int
        Forget sets per setting (default :data:`DEFAULT_FORGET_SETS`; the class setting: at most c − 1).
    device : str or torch.device, optional
        Where every task trains and scrubs (default CPU; e.g. "cuda" for the CIFAR-10 protocol).

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
    if int(forget_sets) < 1:
        raise ValueError(f"forget_sets must be ≥ 1, got {forget_sets!r}")
    methods = default_methods(cfg)
    grids = tune_grids(methods) if tune else {}
    out = Path(out_dir)
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    shared = {"jobs_dir": str(out / "jobs"), "threads": threads, "device": None if device is None else str(device)}
    fp = config_fingerprint(cfg)
    engine = engine or LocalEngine()
    counts = {"run": 0, "reused": 0}
    n_eval = sum(len(j) for _, j in _groups(cfg, settings, methods, "eval", lambda s, m: [{}], forget_sets))
    n_tune = sum(tune_trials() for s in settings for m in grids if applies(m, s))
    with make_progress(enabled=progress, console=console) as bar:
        task = bar.add_task("bench: tuning", total=n_tune + n_eval)

        def run_stage(groups):
            done = _execute(groups, engine, shared, fp, bar, task, counts)
            for _, jobs in groups:
                for j in jobs:
                    j["key"] = job_key(fp, {k: v for k, v in j.items() if k != "key"})
            return done

        tuning = _tune(cfg, settings, grids, run_stage, forget_sets)

        def options_of(s, m):
            t = tuning[s].get(m)
            return [{t["option"]: t["chosen"]} if t else {}]

        eval_groups = _groups(cfg, settings, methods, "eval", options_of, forget_sets)
        evaluated = run_stage(eval_groups)
    runs = [evaluated[j.pop("key")] for _, jobs in eval_groups for j in jobs]
    results = {"config": cfg.to_dict(), "methods": methods, "settings": _settings_info(cfg, settings, forget_sets),
               "seeds": list(cfg.seeds), "forget_sets": int(forget_sets), "tune": bool(tune),
               "tune_trials": tune_trials() if tune else 0, "validation_seed": VALIDATION_SEED,
               "grids": {m: {"option": o, "values": v, "space": sp} for m, (o, v, sp) in grids.items()},
               "untuned": [m for m in methods if m not in TUNE_GRIDS and m not in ANCHORS], "tuning": tuning,
               "variants": {m: VARIANTS[m] for m in methods if m in VARIANTS},
               "summary": {s: summarise_setting([r for r in runs if r["setting"] == s], tuning[s], family)
                           for s in settings},
               "runs": runs, "jobs": counts, "seconds": time.perf_counter() - t0, "engine": engine.name}
    atomic_write_json(out / "bench.json", results)
    atomic_write_text(out / "bench.md", render_bench(results))
    plot_bench(results, out / "bench.png")
    return results


def _settings_info(cfg: ExperimentConfig, settings: list[str], n_sets: int) -> dict:
    """Each setting's definition, its forget sets and its sizes (|D_r|, |D_f|, |D_test|) on the first one."""
    out = {}
    for s in settings:
        split = get_split(setting_config(cfg, s, "test", 0))
        out[s] = {**SETTINGS[s], "forget_sets": forget_sets_of(cfg, s, n_sets),
                  "n_retain": int(len(split.retain_idx)), "n_forget": int(len(split.forget_idx)),
                  "n_test": int(len(split.y_test))}
    return out
