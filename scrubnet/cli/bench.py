"""``scrubnet bench``: every method (seed and field) on the field's standard settings — 10 % random, 1 % random
and whole-class forgetting — over several forget sets × seeds, scored by UA, RA, TA, MIA-efficacy, run time and
Avg. Gap to retraining, with 95 % intervals and tie groups.

    scrubnet bench --out runs/bench                                   # embedded data, 5 forget sets × 3 seeds
    scrubnet bench --quick --out runs/bench-quick                     # 2 forget sets × 2 seeds
    scrubnet bench --no-tune --out runs/bench-defaults                # the defaults (as released)
    scrubnet bench --dataset cifar10 --dry-run                        # the field's protocol: sizes, epochs, time
    scrubnet bench --dataset cifar10 --data-dir DIR --out runs/cifar  # the field's protocol on the python batches
    scrubnet bench --dataset cifar10 --data-dir DIR --device cuda --out runs/cifar   # … on a GPU
    scrubnet bench --dataset cifar10 --scale 0.02 --data-dir DIR --out runs/cifar-cpu   # a CPU-sized version
    scrubnet bench --engine ray --out runs/bench                      # jobs on a local Ray
    scrubnet bench --dataset tofu-synthetic --out runs/tofu           # forget people from a fine-tuned LM

Writes bench.json, bench.md, bench.png and ``OUT/jobs/`` (one file per finished job: a killed bench run again
with the same --out resumes). Bad input gives one line ``error: …`` naming the option and the value given, and
exit code 2, before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.cli import bench_tofu
from scrubnet.audit.engine import make_engine
from scrubnet.cli.common import DATASET_HELP, DEVICE_OPTION, MODEL_HELP, QUIET_OPTION, UserError, console, \
    parse_list, threads_option
from scrubnet.cli.run import CONFIG_HELP, _apply_dataset, _build_config
from scrubnet.experiments.bench import (BENCH_OUTPUTS, DEFAULT_FORGET_SETS, QUICK, SETTINGS, default_methods,
                                        run_bench, setting_config, tune_grids, tune_trials)
from scrubnet.experiments.bench_cifar import (CIFAR_FORGET_SETS, CIFAR_SEEDS, CIFAR_SETTINGS, apply_cifar_protocol,
                                              cifar_plan, render_plan)
from scrubnet.experiments.config import read_toml
from scrubnet.device import resolve_device

#: the data sets scrubnet carries inside (no --data-dir)
EMBEDDED = ("mnist1d", "digits")
ENGINES = ("local", "ray")


def _check_options(engine, address, max_retries, ray_cpus, forget_sets, seeds, scale, dataset, data_dir,
                   config) -> None:
    """Refuse bad values before anything is read or trained (one line naming the option and the value)."""
    if engine not in ENGINES:
        raise UserError(f"--engine {engine!r}: unknown engine; choose {' or '.join(ENGINES)}")
    if address is not None and engine != "ray":
        raise UserError(f"--address {address!r}: it joins a Ray cluster; add --engine ray")
    if max_retries < 0:
        raise UserError(f"--max-retries {max_retries}: must be ≥ 0")
    if ray_cpus is not None and ray_cpus < 1:
        raise UserError(f"--ray-cpus {ray_cpus}: must be ≥ 1")
    if forget_sets is not None and forget_sets < 1:
        raise UserError(f"--forget-sets {forget_sets}: must be ≥ 1")
    if seeds is not None and seeds < 1:
        raise UserError(f"--seeds {seeds}: must be ≥ 1")
    if scale is not None and not 0.0 < scale <= 1.0:
        raise UserError(f"--scale {scale:g}: must be in (0, 1]")
    name = dataset or ((read_toml(config).get("data") or {}).get("dataset") if config else None) or "mnist1d"
    if scale is not None and name != "cifar10":
        raise UserError(f"--scale {scale:g}: only for --dataset cifar10 (the field's protocol), not {name!r}")
    if data_dir is not None and name in EMBEDDED:
        raise UserError(f"--data-dir {str(data_dir)!r}: the {name} data set is embedded and reads no directory; "
                        "drop --data-dir or choose a file dataset (--dataset cifar10 …)")


def bench(out: Optional[Path] = typer.Option(None, "--out", help="output directory (bench.json, bench.md, "
                                             "bench.png, jobs/); not needed with --dry-run"),
          config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
          dataset: Optional[str] = typer.Option(None, help=DATASET_HELP + " (cifar10: the field's protocol) | "
                                                f"{bench_tofu.DATASET} (forget people from a fine-tuned language "
                                                "model, scored as TOFU)"),
          data_dir: Optional[Path] = typer.Option(None, help="directory of a file-based dataset (CIFAR-10: the "
                                                  "python batches)"),
          model: Optional[str] = typer.Option(None, help=MODEL_HELP),
          methods: Optional[str] = typer.Option(None, help="comma-separated methods (default: every method; "
                                                "original and retrain are always added)"),
          settings: Optional[str] = typer.Option(None, help=f"comma-separated settings: {', '.join(SETTINGS)} "
                                                 "(default all; cifar10: random-10,class)"),
          seeds: Optional[int] = typer.Option(None, help="number of seeds 0..N-1 (default 3; cifar10: 1)"),
          forget_sets: Optional[int] = typer.Option(None, "--forget-sets", help="forget sets per setting "
                                                    f"(default {DEFAULT_FORGET_SETS}; cifar10: 3)"),
          quick: bool = typer.Option(False, "--quick", help=f"{QUICK['forget_sets']} forget sets × "
                                     f"{QUICK['seeds']} seeds (explicit --forget-sets / --seeds win)"),
          scale: Optional[float] = typer.Option(None, help="cifar10: images per class, epochs and width × SCALE "
                                                "in (0, 1] (a CPU-sized version; default 1)"),
          dry_run: bool = typer.Option(False, "--dry-run", help="print the split sizes, epochs, jobs and an "
                                       "estimated time, and stop (reads no data)"),
          no_tune: bool = typer.Option(False, "--no-tune", help="run every method at its defaults (as released "
                                       "for the field's methods; no tuning on the validation split)"),
          engine: str = typer.Option("local", help="local | ray"),
          exact: Optional[str] = typer.Option(None, help=f"{bench_tofu.DATASET}: the exact route, retrain (re-fine-"
                                              "tune without the people) | sharded (the isolated engine; default)"),
          address: Optional[str] = typer.Option(None, help="HOST:PORT of a running Ray cluster (with --engine ray)"),
          ray_cpus: Optional[int] = typer.Option(None, "--ray-cpus", help="CPUs of a local Ray (default: all)"),
          max_retries: int = typer.Option(3, "--max-retries", help="Ray: re-runs of a task whose worker died"),
          threads: int = threads_option("torch threads per task"),
          overwrite: bool = typer.Option(False, help="replace the outputs of an earlier bench in --out (its "
                                         "finished jobs are kept and reused)"),
          device: str = DEVICE_OPTION, quiet: bool = QUIET_OPTION):
    """Benchmark every method on the standard settings with the standard metrics (Avg. Gap to retrain), with
    95 % intervals over forget sets × seeds and the groups of methods it cannot tell apart.

    --out must be new, empty, or hold only the jobs/ of an interrupted bench (which resumes)."""
    if dataset == bench_tofu.DATASET:
        return bench_tofu.run(out, quick=quick, dry=dry_run, seeds=seeds, methods=methods, no_tune=no_tune, exact=exact,
                              engine=engine, address=address, ray_cpus=ray_cpus, max_retries=max_retries,
                              overwrite=overwrite, quiet=quiet,
                              unused={"--config": config, "--data-dir": data_dir, "--model": model,
                                      "--settings": settings, "--forget-sets": forget_sets, "--scale": scale})
    if exact is not None:
        raise UserError(f"--exact {exact!r}: only for --dataset {bench_tofu.DATASET}")
    _check_options(engine, address, max_retries, ray_cpus, forget_sets, seeds, scale, dataset, data_dir, config)
    dev = resolve_device(device)
    cifar = dataset == "cifar10"
    default_sets, default_seeds = (CIFAR_FORGET_SETS, CIFAR_SEEDS) if cifar else (DEFAULT_FORGET_SETS, None)
    if quick:
        default_sets, default_seeds = QUICK["forget_sets"], QUICK["seeds"]
    n_sets = forget_sets or default_sets
    cfg = _build_config(config, None, data_dir, model, methods, seeds or default_seeds, None, None, None, None)
    if dataset is not None:
        _apply_bench_dataset(cfg, dataset, model, config, scale or 1.0)
    chosen = parse_list(settings) if settings is not None else list(CIFAR_SETTINGS if cifar else SETTINGS)
    bad = [s for s in chosen or [] if s not in SETTINGS]
    if bad or not chosen:
        raise UserError(f"--settings {settings!r}: unknown or empty ({', '.join(bad) or 'none given'}); choose "
                        f"from {', '.join(SETTINGS)}")
    try:
        names = default_methods(cfg)
    except ValueError as e:
        raise UserError(f"--methods {methods!r}: {e}") from None
    if dry_run:
        return _dry_run(cfg, names, chosen, n_sets, no_tune, cifar, scale or 1.0)
    if out is None:
        raise UserError("--out: missing (the output directory; only --dry-run runs without it)")
    try:
        for s in chosen:  # builds every split: a missing or malformed dataset is refused here
            setting_config(cfg, s, "test")
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    prepare_output_dir(out, overwrite, BENCH_OUTPUTS, resumable=("jobs",))
    eng = make_engine(engine, address=address, num_cpus=ray_cpus, max_retries=max_retries)
    try:
        res = run_bench(cfg, out, settings=chosen, tune=not no_tune, engine=eng, threads=threads,
                        progress=not quiet, console=console, forget_sets=n_sets, device=dev)
    finally:
        eng.close()
    for s, summ in res["summary"].items():
        ties = summ["ties"][0] if summ["ties"] else []
        console.print(f"{s}: best {summ['best']}; not distinguishable from it: {', '.join(ties[1:]) or 'none'}")
    console.print(f"{len(names)} methods; jobs: {res['jobs']['run']} run, {res['jobs']['reused']} reused; wrote "
                  f"{out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} ({res['seconds']:.0f} s)")


def _dry_run(cfg, names, chosen, n_sets, no_tune, cifar, scale) -> None:
    """Print the plan of the bench (cifar10: the field's protocol, from its nominal sizes; no data read)."""
    grids = {} if no_tune else tune_grids(names)
    trials = 0 if no_tune else tune_trials()
    if cifar:
        plan = cifar_plan(names, scale=scale, forget_sets=n_sets, seeds=len(cfg.seeds), trials=trials,
                          tuned=set(grids))
        for line in render_plan(plan, scale):
            console.print(line, highlight=False)
    console.print(f"settings {', '.join(chosen)}; {n_sets} forget set(s) × {len(cfg.seeds)} seed(s); "
                  f"{len(names)} methods; {trials} tuning trials for each of {len(grids)} tuned methods",
                  highlight=False)


def _apply_bench_dataset(cfg, dataset: str, model: Optional[str], config: Optional[Path], scale: float) -> None:
    """``--dataset``: cifar10 is the field's protocol (:func:`apply_cifar_protocol`; values of the TOML file win);
    the other datasets as for ``scrubnet run``."""
    raw = read_toml(config) if config else {}
    in_toml = set(raw) | {f"data.{k}" for k in (raw.get("data") or {})}
    _apply_dataset(cfg, dataset, model, in_toml)
    if dataset == "cifar10":
        data, train = dict(raw.get("data") or {}), dict(raw.get("train") or {})
        model_options = dict(raw.get("model_options") or {})
        apply_cifar_protocol(cfg, scale)
        for k, v in data.items():
            setattr(cfg.data, k, v)
        for k, v in train.items():
            setattr(cfg.train, k, v)
        cfg.model_options.update(model_options)
        if model is not None or "model" in raw:
            cfg.model = model or raw["model"]
