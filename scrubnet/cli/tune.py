"""``scrubnet tune``: tune the forgetting methods on your own model against your own retraining and write the
tuned profile that ``scrubnet forget --method auto --profile P`` runs (:mod:`scrubnet.tuning`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from scrubnet.cli.common import (DATA_HELP, DEVICE_OPTION, MODEL_OPTION_HELP, OWN_MODEL_HELP, RECIPE_HELP,
                                 WEIGHTS_HELP, console, parse_list, parse_options, read_forget_ids,
                                 refuse_existing_file, threads_option)
from scrubnet.device import resolve_device
from scrubnet.tuning.own import tune_own
from scrubnet.tuning.profile import DEFAULT_CANDIDATES


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
         budget: int = typer.Option(4, min=1, help="options tried per candidate method (the same for each)"),
         tolerance: float = typer.Option(0.05, min=0.0, max=1.0, help="retain and test error within this of the "
                                         "retraining (a fraction), and at least half the forget-loss gap closed"),
         seed: int = typer.Option(0, help="fixes the validation draw and every random choice"),
         overwrite: bool = typer.Option(False, help="replace an existing --out file"),
         threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Tune on your model: draw a validation forget set like --forget-ids (disjoint from it), retrain once
    without it with your --train function, tune every candidate method's rate and length to come closest to
    that retraining, and write the profile: what was tried, how close, what it cost, and the method
    `scrubnet forget --method auto --profile OUT` runs."""
    refuse_existing_file(out, overwrite, inputs=(weights,))
    prof = tune_own(spec=model, options=parse_options(model_option, "--model-option"), weights=weights, data=data,
                    forget_ids=read_forget_ids(forget_ids), train_spec=train, recipe_path=recipe, out=out,
                    init=init, seed=seed, budget=budget,
                    methods=tuple(parse_list(methods) or DEFAULT_CANDIDATES), tolerance=tolerance,
                    device=resolve_device(device))
    for line in prof.summary():
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"tuning cost {prof.tuning_seconds:.3g} CPU-s "
                  f"({prof.tuning_seconds / max(prof.validation['retrain_seconds'], 1e-9):.1f} retrainings); "
                  f"wrote {out}", highlight=False)
