"""``scrubnet references``: train the forgetting verdict's reference models of a user's model once, and store
them beside its weights; ``scrubnet forget --references DIR`` then calibrates every verdict by them
(docs/guides/verdict.md)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import typer

from scrubnet.cli.common import (DATA_HELP, DEVICE_OPTION, MODEL_OPTION_HELP, OWN_MODEL_HELP, RECIPE_HELP,
                                 WEIGHTS_HELP, UserError, console, parse_options, require_writable, threads_option)
from scrubnet.device import resolve_device
from scrubnet.own_model import references_dir, train_own_references


def references(model: str = typer.Option(..., "--model", help=OWN_MODEL_HELP),
               weights: Path = typer.Option(..., help=WEIGHTS_HELP),
               data: Path = typer.Option(..., help=DATA_HELP),
               recipe: Optional[Path] = typer.Option(None, help=RECIPE_HELP),
               model_option: list[str] = typer.Option([], "--model-option", help=MODEL_OPTION_HELP),
               train: Optional[str] = typer.Option(None, "--train", help="FILE.py:FUNCTION (or MODULE:FUNCTION): "
                                                   "your own training, train(model, (x, y)) -> model; default: "
                                                   "the recipe reproduced"),
               pairs: int = typer.Option(2, help="pairs of reference models, each pair on complementary random "
                                         "halves of x_train (2 pairs = 4 models, the measured default)"),
               out: Optional[Path] = typer.Option(None, "--out", help="directory to write (default: beside the "
                                                  "weights, WEIGHTS.references)"),
               overwrite: bool = typer.Option(False, help="replace an existing --out directory"),
               seed: int = typer.Option(0, help="seed of the halves and of the references' training"),
               threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Train the reference models of your model once (2·pairs trainings on half the data, the way you trained
    it), and store them beside its weights: `scrubnet forget --references DIR` calibrates the forgetting
    verdict by them, for every later deletion request. Prints what they cost."""
    if pairs < 1:
        raise UserError(f"--pairs must be at least 1, got {pairs}")
    out = out if out is not None else references_dir(weights)
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} already exists; give a new path or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    require_writable(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # written aside, moved in place whole: a failed run leaves no half-written directory at --out
        info = train_own_references(spec=model, options=parse_options(model_option, "--model-option"),
                                    weights=weights, data=data, recipe_path=recipe, out=tmp, pairs=pairs, seed=seed,
                                    device=resolve_device(device), train_spec=train)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"wrote {out}: {info['models']} reference models, trained once in {info['seconds']:.1f} s "
                  f"(each on half of x_train); use it as `scrubnet forget ... --references {out}`", highlight=False,
                  soft_wrap=True)
