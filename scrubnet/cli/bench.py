"""``scrubnet bench``: every method (seed and field) on the field's standard settings — 10 % random, 1 % random
and whole-class forgetting — scored by UA, RA, TA, MIA-efficacy, run time and Avg. Gap to retraining.

    scrubnet bench --out runs/bench                                   # embedded data, 3 seeds, tuned
    scrubnet bench --no-tune --out runs/bench-defaults                # the published defaults
    scrubnet bench --dataset cifar10 --data-dir DIR --out runs/bench-cifar   # ResNet-18 on the python batches
    scrubnet bench --engine ray --out runs/bench                      # jobs on a local Ray

Writes bench.json, bench.md, bench.png and ``OUT/jobs/`` (one file per finished job: a killed bench run again
with the same --out resumes). Bad input gives one line ``error: …`` and exit code 2, before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.audit.engine import make_engine
from scrubnet.cli.common import DATASET_HELP, MODEL_HELP, QUIET_OPTION, UserError, console, parse_list, \
    threads_option
from scrubnet.cli.run import CONFIG_HELP, _apply_dataset, _build_config
from scrubnet.experiments.config import read_toml
from scrubnet.experiments.bench import BENCH_OUTPUTS, SETTINGS, default_methods, run_bench, setting_config

#: the split and model ``--dataset cifar10`` sets for the bench when the TOML file does not (the field's
#: setting: ResNet-18 on the ten classes, trained from scratch)
CIFAR_BENCH = {"core_classes": [], "task_classes": list(range(10))}


def bench(out: Path = typer.Option(..., "--out", help="output directory (bench.json, bench.md, bench.png, jobs/)"),
          config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
          dataset: Optional[str] = typer.Option(None, help=DATASET_HELP + " (cifar10: ResNet-18 on 10 classes)"),
          data_dir: Optional[Path] = typer.Option(None, help="directory of a file-based dataset (CIFAR-10: the "
                                                  "python batches)"),
          model: Optional[str] = typer.Option(None, help=MODEL_HELP),
          methods: Optional[str] = typer.Option(None, help="comma-separated methods (default: every method; "
                                                "original and retrain are always added)"),
          settings: Optional[str] = typer.Option(None, help=f"comma-separated settings: {', '.join(SETTINGS)} "
                                                 "(default all)"),
          seeds: Optional[int] = typer.Option(None, help="number of seeds 0..N-1 (default the experiment's: 3)"),
          no_tune: bool = typer.Option(False, "--no-tune", help="run every method at its published defaults "
                                       "(no tuning on the validation split)"),
          engine: str = typer.Option("local", help="local | ray"),
          address: Optional[str] = typer.Option(None, help="HOST:PORT of a running Ray cluster (with --engine ray)"),
          ray_cpus: Optional[int] = typer.Option(None, "--ray-cpus", help="CPUs of a local Ray (default: all)"),
          max_retries: int = typer.Option(3, "--max-retries", help="Ray: re-runs of a task whose worker died"),
          threads: int = threads_option("torch threads per task"),
          overwrite: bool = typer.Option(False, help="replace the outputs of an earlier bench in --out (its "
                                         "finished jobs are kept and reused)"),
          quiet: bool = QUIET_OPTION):
    """Benchmark every method on the standard settings with the standard metrics (Avg. Gap to retrain).

    --out must be new, empty, or hold only the jobs/ of an interrupted bench (which resumes)."""
    cfg = _build_config(config, None, data_dir, model, methods, seeds, None, None, None, None)
    if dataset is not None:
        _apply_bench_dataset(cfg, dataset, model, config)
    chosen = parse_list(settings) if settings is not None else list(SETTINGS)
    bad = [s for s in chosen or [] if s not in SETTINGS]
    if bad or not chosen:
        raise UserError(f"--settings: unknown or empty ({', '.join(bad) or 'none given'}); choose from "
                        f"{', '.join(SETTINGS)}")
    try:
        names = default_methods(cfg)
        for s in chosen:  # builds every split: a missing or malformed dataset is refused here
            setting_config(cfg, s, "test")
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    prepare_output_dir(out, overwrite, BENCH_OUTPUTS, resumable=("jobs",))
    eng = make_engine(engine, address=address, num_cpus=ray_cpus, max_retries=max_retries)
    try:
        res = run_bench(cfg, out, settings=chosen, tune=not no_tune, engine=eng, threads=threads,
                        progress=not quiet, console=console)
    finally:
        eng.close()
    for s, summ in res["summary"].items():
        console.print(f"{s}: closest to retrain {summ['closest']} (seed methods: {summ['closest_seed']}; field: "
                      f"{summ['closest_field']})")
    console.print(f"{len(names)} methods; jobs: {res['jobs']['run']} run, {res['jobs']['reused']} reused; wrote "
                  f"{out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} ({res['seconds']:.0f} s)")


def _apply_bench_dataset(cfg, dataset: str, model: Optional[str], config: Optional[Path]) -> None:
    """``--dataset``: the bench's split for CIFAR-10 (ten classes, no pre-training core, ResNet-18); the other
    datasets as for ``scrubnet run``. Values of the TOML file win."""
    raw = read_toml(config) if config else {}
    in_toml = set(raw) | {f"data.{k}" for k in (raw.get("data") or {})}
    _apply_dataset(cfg, dataset, model, in_toml)
    if dataset == "cifar10":
        for k, v in CIFAR_BENCH.items():
            if f"data.{k}" not in in_toml:
                setattr(cfg.data, k, list(v))
        if model is None and "model" not in in_toml:
            cfg.model = "resnet18"
