"""``scrubnet mlforget``: train a Mixed-Linear model into a checkpoint directory and apply forgetting
requests to it (each recorded in the checkpoint's append-only ledger; see :mod:`scrubnet.mlforget.store`).

    scrubnet mlforget train --out ckpt/ [--dataset mnist1d --seed 0 --ml-options '{"mu": 0.05}']
    scrubnet mlforget forget ckpt/ --ids 3,17,42 [--sigma 1e-4]     (ids = positions in D)
    scrubnet mlforget forget-all ckpt/
    scrubnet mlforget show ckpt/

Bad input gives one line ``error: …`` on stderr and exit code 2; nothing partial is written.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch
import typer

from scrubnet.data import DataConfig, load_split
from scrubnet.data.splits import SplitError
from scrubnet.device import resolve_device
from scrubnet.methods.mlforget import ml_config_from_options
from scrubnet.mlforget.pipeline import train_ml
from scrubnet.mlforget.store import forget as store_forget, forget_everything, load, read_ledger, save_new
from scrubnet.training import TrainConfig

mlforget_app = typer.Typer(add_completion=False, no_args_is_help=True,
                           help="ML-Forgetting on checkpoints: train, forget, forget-all, show.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _handle(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, SplitError, FileNotFoundError, KeyError, TypeError) as e:
            _fail(str(e.args[0]) if e.args else type(e).__name__)
    return wrapper


DEVICE_HELP = ("auto | cpu | cuda; the mixed-linear computations run on the CPU, so auto means the CPU here "
               "and cuda is refused")


def require_cpu(device: str, what: str = "ML-Forgetting on checkpoints") -> None:
    """The mixed-linear computations run on the CPU: validate ``device`` and refuse an explicit GPU."""
    if resolve_device(device).type != "cpu" and device.strip().lower() != "auto":
        raise ValueError(f"--device {device}: {what} runs on the CPU only (use --device cpu or auto)")


def _json_option(text: Optional[str], what: str) -> dict:
    if not text:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object")
    return d


def parse_ids(ids: Optional[str], ids_file: Optional[Path]) -> list[int]:
    """Sample ids from ``--ids 1,2,3`` or a file of integers (spaces, commas, newlines; ``#`` comments)."""
    if (ids is None) == (ids_file is None):
        raise ValueError("give the sample ids with exactly one of --ids or --ids-file")
    if ids_file is not None:
        if not ids_file.is_file():
            raise ValueError(f"ids file not found: {ids_file}")
        text = "\n".join(line.split("#", 1)[0] for line in ids_file.read_text().splitlines())
    else:
        text = ids
    out = []
    for tok in text.replace(",", " ").split():
        try:
            out.append(int(tok))
        except ValueError:
            raise ValueError(f"{tok!r} is not an integer sample id") from None
    if not out:
        raise ValueError("no sample ids given")
    return out


def _data_loader(meta: dict):
    split = load_split(DataConfig.from_dict(meta["data"]))
    if meta.get("data_fingerprint") and split.fingerprint() != meta["data_fingerprint"]:
        raise ValueError("the data regenerated from the checkpoint's data configuration differ from the data "
                         "it was trained on (fingerprint mismatch)")
    return split.x, split.y


@mlforget_app.command()
@_handle
def train(out: Path = typer.Option(..., "--out", help="new checkpoint directory (must not exist)"),
          dataset: str = typer.Option("mnist1d", help="mnist1d | digits | cifar10 | cifar100 | imagefolder"),
          data_dir: Optional[Path] = typer.Option(None, help="directory of a file-based dataset"),
          model: str = typer.Option("mlp", help="architecture of the zoo"),
          seed: int = typer.Option(0, help="seed of every random choice"),
          data_options: Optional[str] = typer.Option(None, help="JSON object of DataConfig fields"),
          model_options: Optional[str] = typer.Option(None, help="JSON object of architecture options"),
          train_options: Optional[str] = typer.Option(None, help="JSON object of TrainConfig fields (core)"),
          ml_options: Optional[str] = typer.Option(None, help="JSON object of MLConfig fields (mu, sigma, linearize, "
                                                   "…) and solver fields (solver, cg_tol, precond)"),
          device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Pre-train, train the core weights (CE) and the user weights (linear, MSE) and save the checkpoint."""
    require_cpu(device)


    if out.exists():
        raise ValueError(f"--out {out} already exists; choose a new checkpoint directory")
    dcfg = DataConfig.from_dict({"dataset": dataset, "data_dir": str(data_dir) if data_dir else None,
                                 **_json_option(data_options, "--data-options")})
    tcfg = TrainConfig.from_dict({**TrainConfig().to_dict(), **_json_option(train_options, "--train-options")})
    mcfg = ml_config_from_options(_json_option(ml_options, "--ml-options"))
    mopts = _json_option(model_options, "--model-options")
    split = load_split(dcfg)
    state = train_ml(split, mcfg, tcfg, seed, model_name=model, model_options=mopts,
                     exclude_from_core=torch.zeros(0, dtype=torch.long))
    save_new(out, state, arch=model, in_shape=split.input_shape, arch_options=mopts, data=dcfg.to_dict(),
             data_fingerprint=split.fingerprint(), extra={"train_config": tcfg.to_dict()})
    typer.echo(f"wrote {out}: {len(state.user_ids)} user samples, {len(state.core_ids)} core samples "
               f"(never forgettable), {state.model.num_linearized} user weights")


@mlforget_app.command()
@_handle
def forget(checkpoint: Path = typer.Argument(..., help="ML checkpoint directory"),
           ids: Optional[str] = typer.Option(None, help="comma-separated sample ids (positions in D)"),
           ids_file: Optional[Path] = typer.Option(None, help="file of sample ids"),
           sigma: Optional[float] = typer.Option(None, help="noise std (default: the checkpoint's)"),
           device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Forget a set of user samples (one request; recorded in the ledger)."""
    require_cpu(device)

    id_list = parse_ids(ids, ids_file)
    record, applied = store_forget(checkpoint, id_list, sigma=sigma, data_loader=_data_loader)
    if applied:
        typer.echo(f"request #{record['seq']}: forgot {record['n_ids']} samples, {record['n_remaining']} remain; "
                   f"{record['steps']} {record['solver']} steps, residual {record['residual_norm']:.2e}, "
                   f"{record['seconds']:.2f} s")
    else:
        typer.echo(f"request already applied as #{record['seq']} (nothing done)")


@mlforget_app.command("forget-all")
@_handle
def forget_all_cmd(checkpoint: Path = typer.Argument(..., help="ML checkpoint directory"),
                   device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Forget all user data: the user weights are set to 0 (the model becomes the core model)."""
    require_cpu(device)

    record, applied = forget_everything(checkpoint)
    typer.echo(f"request #{record['seq']}: user weights set to 0" if applied
               else f"forget-all already applied as #{record['seq']} (nothing done)")


@mlforget_app.command()
@_handle
def show(checkpoint: Path = typer.Argument(..., help="ML checkpoint directory"),
         device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Print the request ledger."""
    require_cpu(device)

    state, meta = load(checkpoint)
    for r in read_ledger(checkpoint):
        typer.echo(f"#{r['seq']:<4} {r['kind']:<10} {r['time']}  ids={r['n_ids']:<5} remaining={r['n_remaining']:<6} "
                   f"sha256 {str(r['sha256_before'])[:12]} → {r['sha256_after'][:12]}")
    typer.echo(f"{len(state.remaining_ids())} user samples remain, {len(state.forgotten_ids)} forgotten, "
               f"{len(state.core_ids)} core")


if __name__ == "__main__":
    mlforget_app()
