"""``scrubnet tune``: tune the forgetting methods on your own model against your own retraining and write the
tuned profile that ``scrubnet forget --method auto --profile P`` runs (:mod:`scrubnet.tuning`)."""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from scrubnet.cli.common import (DATA_HELP, DEVICE_OPTION, MODEL_OPTION_HELP, OWN_MODEL_HELP, RECIPE_HELP,
                                 WEIGHTS_HELP, UserError, console, err_console, parse_list, parse_options,
                                 read_forget_ids, refuse_existing_file, threads_option)
from scrubnet.audit.engine import make_engine
from scrubnet.device import resolve_device
from scrubnet.tuning.own import tune_own
from scrubnet.tuning.profile import DEFAULT_CANDIDATES


@contextlib.contextmanager
def tuning_progress():
    """``progress(done, total, what)`` for :func:`scrubnet.tuning.tune.tune`: a bar with the time remaining on a
    terminal; elsewhere (a log, a pipe) one line per step with the elapsed time and an ETA (the mean step so
    far times the steps left)."""
    if sys.stderr.isatty():
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=err_console, transient=True) as bar:
            task = bar.add_task("tuning", total=None)

            def report(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=f"tuning: {what}")
            yield report
        return
    t0 = time.monotonic()

    def line(done: int, total: int, what: str) -> None:
        spent = time.monotonic() - t0
        eta = spent / max(done, 1) * (total - done)
        err_console.print(f"tuning {done}/{total} ({what}): {spent:.0f} s elapsed, ETA {eta:.0f} s",
                          highlight=False, soft_wrap=True)
    yield line


def tune(model: str = typer.Option(..., "--model", help=OWN_MODEL_HELP),
         weights: Path = typer.Option(..., help=WEIGHTS_HELP),
         data: Path = typer.Option(..., help=DATA_HELP + " (x_test/y_test required here)"),
         forget_ids: Path = typer.Option(..., help="a forget set like the requests to come (positions in "
                                         "x_train): its size and class mix are copied, its samples never used"),
         train: str = typer.Option(..., "--train", help="your training: FILE.py:FUNCTION, train(model, (x, y)) "
                                   "-> model, run once on a fresh model from --model (or --init)"),
         out: Path = typer.Option(..., "--out", help="where to write the tuned profile (JSON)"),
         recipe: Optional[Path] = typer.Option(None, help=RECIPE_HELP),
         init: Optional[Path] = typer.Option(None, help="weights your training starts from (default: a fresh "
                                             "model from the factory)"),
         model_option: list[str] = typer.Option([], "--model-option", help=MODEL_OPTION_HELP),
         methods: Optional[str] = typer.Option(None, help="candidate methods, comma-separated (default: "
                                               + ",".join(DEFAULT_CANDIDATES) + ")"),
         budget: int = typer.Option(1, min=1, help="options tried per candidate method (the same for each; 1: "
                                    "a quarter of your training at a third of its rate)"),
         tolerance: float = typer.Option(0.05, min=0.0, max=1.0, help="retain and test error within this of the "
                                         "retraining (a fraction), and at least half the forget-loss gap closed"),
         draws: int = typer.Option(3, min=1, help="validation forget sets drawn like --forget-ids; the choice "
                                   "must hold on its worst draw"),
         engine: str = typer.Option("local", help="local | ray: where the candidates' runs go"),
         address: Optional[str] = typer.Option(None, help="HOST:PORT of a running Ray cluster (with --engine ray)"),
         ray_cpus: Optional[int] = typer.Option(None, min=1, help="CPUs of a local Ray (with --engine ray)"),
         seed: int = typer.Option(0, help="fixes the validation draws and every random choice"),
         overwrite: bool = typer.Option(False, help="replace an existing --out file"),
         threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Tune on your model: draw a validation forget set like --forget-ids (disjoint from it), retrain once
    without it with your --train function, tune every candidate method's rate and length to come closest to
    that retraining, and write the profile: what was tried, how close, what it cost, and the method
    `scrubnet forget --method auto --profile OUT` runs."""
    refuse_existing_file(out, overwrite, inputs=(weights,))
    if engine not in ("local", "ray"):
        raise UserError(f"--engine {engine!r}: unknown engine; choose local or ray")
    if engine != "ray" and (address is not None or ray_cpus is not None):
        raise UserError("--address and --ray-cpus are for the Ray engine: add --engine ray")
    eng = make_engine(engine, address=address, num_cpus=ray_cpus)
    try:
        with tuning_progress() as progress:
            prof = tune_own(spec=model, options=parse_options(model_option, "--model-option"), weights=weights,
                            data=data, forget_ids=read_forget_ids(forget_ids), train_spec=train, recipe_path=recipe,
                            out=out, init=init, seed=seed, budget=budget,
                            methods=tuple(parse_list(methods) or DEFAULT_CANDIDATES), tolerance=tolerance,
                            device=resolve_device(device), draws=draws, engine=eng, progress=progress)
    finally:
        eng.close()
    for line in prof.summary():
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"tuning cost {prof.tuning_seconds:.3g} CPU-s "
                  f"({prof.tuning_seconds / max(prof.validation['retrain_seconds'], 1e-9):.1f} retrainings); "
                  f"wrote {out}", highlight=False)
