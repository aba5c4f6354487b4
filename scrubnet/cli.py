"""The ``scrubnet`` command line: run experiments, train, forget, evaluate, report.

Every command turns bad input (unknown dataset/model/method, bad forget ids, missing or corrupt
checkpoints, a data directory in the wrong format) into one line ``error: …`` on stderr and exit code 2,
and writes its outputs atomically, so nothing half-written is left at ``--out``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.markup import escape
from rich.table import Table

from scrubnet.atomic_io import atomic_write_json, atomic_write_text, require_writable as check_writable
from scrubnet.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from scrubnet.cli_audit import audit
from scrubnet.cli_dp import dp
from scrubnet.cli_mlforget import mlforget_app, require_cpu
from scrubnet.cli_own import evaluate_own, forget_own
from scrubnet.cli_study import critical_periods, study_app
from scrubnet.cli_serve import receipt_app, serve
from scrubnet.data.ids import parse_sample_ids
from scrubnet.data.registry import DATASETS
from scrubnet.device import resolve_device
from scrubnet.data.splits import SplitError
from scrubnet.experiments.config import ExperimentConfig, dump_toml, load_config, read_toml
from scrubnet.experiments.ml_protocols import rerender as rerender_ml, run_ml_protocol
from scrubnet.experiments.report import format_readout, mia_degenerate, readout_unit, report_from_dir, report_warnings
from scrubnet.experiments.runner import SeedRun, evaluate as eval_fn, get_split, prepare_seed, resolve_methods, \
    run_experiment
from scrubnet.experiments.sweep import plot_sweep, run_sweep, sweep_figure_path
from scrubnet.curvature.progress import progress_reporter
from scrubnet.methods.base import (available_methods, estimate, get_method, method_class, protocol_context,
                                   protocol_method)
from scrubnet.scrub import scrub_and_measure
from scrubnet.training.cost import check_budget
from scrubnet.models import MODELS
from scrubnet.models.user import USER_ARCH

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="scrubnet: make a trained network forget a cohort of its training data, and measure it.")
console = Console(width=None if sys.stdout.isatty() else 120)  # pipes and logs get the full table
err_console = Console(stderr=True)


DEVICE_HELP = "auto | cpu | cuda: where tensors live (auto: CUDA when a GPU is present, else the CPU)"
DEVICE_OPTION = typer.Option("auto", "--device", help=DEVICE_HELP)
DATASET_HELP = " | ".join(DATASETS)
MODEL_HELP = " | ".join(MODELS)
THREADS_OPTION = typer.Option(1, help="torch CPU threads (1: numbers independent of the machine's core count)")
OWN_MODEL_HELP = ("your own model: FILE.py:FACTORY or MODULE:FACTORY, a callable returning the untrained "
                  "nn.Module (called with the --model-option values as keyword arguments). Importing it RUNS "
                  "that file's code: give only your own, trusted code")
MODEL_OPTION_HELP = "keyword argument KEY=VALUE (JSON value) of the --model factory (repeatable)"
WEIGHTS_HELP = ("the weights of --model: .safetensors, or a torch.save state_dict (read with "
                "torch.load(weights_only=True), nothing else is unpickled)")
DATA_HELP = ("the training data of --model: an .npz with x_train, y_train (integer labels) and optionally "
             "x_test, y_test; or an image folder (one sub-folder per class)")
RECIPE_HELP = ("TOML file with a \\[recipe] table saying how --model was trained (loss, wd, wd_center, lr, "
               "momentum, batch_size, epochs); default: cross-entropy, no weight decay")


class UserError(Exception):
    """An input problem reported to the user without a traceback."""


def _fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)  # "[nan]" is no markup
    raise typer.Exit(2)


def handle_errors(fn):
    """Map expected input errors to one clear message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, CheckpointError, SplitError, ValueError, FileNotFoundError, NotADirectoryError,
                KeyError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            _fail(str(msg))
    return wrapper


def read_forget_ids(path: Path) -> list[int]:
    """Forget ids (positions in D) from a text file (integers separated by spaces, commas or newlines;
    ``#`` comments) or a JSON list of integers (:func:`scrubnet.data.ids.parse_sample_ids`)."""
    if not path.is_file():
        raise UserError(f"forget-ids file not found: {path}")
    return parse_sample_ids(path.read_text(), f"forget-ids file {path}")


def _parse_list(s: Optional[str]) -> Optional[list[str]]:
    if s is None:
        return None
    items = [t.strip() for t in s.split(",") if t.strip()]
    if not items:
        raise UserError("empty list")
    return items


def _refuse_existing_file(out: Path, overwrite: bool = False, inputs: tuple[Path, ...] = ()) -> None:
    """A checkpoint path to write: not a directory; not one of ``inputs`` nor an existing file unless
    ``overwrite``; in a writable directory."""
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a directory; give a checkpoint file path")
    if not overwrite:
        for p in inputs:
            if p.exists() and out.exists() and out.resolve() == p.resolve():
                raise UserError(f"--out {out} is the input checkpoint; give another path (or --overwrite)")
        if out.exists() or Path(str(out) + ".json").exists():
            raise UserError(f"--out {out} already exists; give a new path or pass --overwrite")
    require_writable(out)


def require_writable(out: Path) -> None:
    """:func:`scrubnet.atomic_io.require_writable`, failing as a user error (one ``error:`` line, exit 2)."""
    try:
        check_writable(out)
    except ValueError as err:
        raise UserError(str(err)) from None


#: the files `scrubnet train` writes
TRAIN_OUTPUTS = ("start.safetensors", "original.safetensors", "retrain.safetensors", "forget_ids.txt")

#: the files `scrubnet run` writes into its output directory
RUN_OUTPUTS = ("results.json", "report.md", "readouts.png", "entropy.png", "entropies.json")


def _prepare_run_dir(out: Path, overwrite: bool) -> None:
    """``run --out``: a new or empty directory; an earlier run's directory only with ``--overwrite``, which
    then deletes the earlier run's files (and nothing else) before the new run starts, so no stale file mixes
    with the new ones."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    require_writable(out)
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} is not empty (an earlier run?); give a new directory or pass --overwrite "
                            "to replace the earlier run's files")
        for name in RUN_OUTPUTS:
            (out / name).unlink(missing_ok=True)
        for pattern in ("sequential_*.png", "class_*.png"):  # the ML protocols' figures
            for f in out.glob(pattern):
                f.unlink()


#: per dataset, the split values ``--dataset`` sets when the TOML file does not give them
DATASET_SPLIT_DEFAULTS = {
    "digits": {"n_train_per_class": 60, "n_test_per_class": 60},
    "cifar10": {"core_classes": [], "task_classes": list(range(5))},
    "imagefolder": {"core_classes": [], "task_classes": list(range(5))},
    "cifar100": {"core_classes": list(range(5, 100)), "task_classes": list(range(5))},
}


def _build_config(config: Optional[Path], dataset, data_dir, model, methods, seeds, forget_class, forget_count,
                  forget_ids, retrain_mode):

    raw = read_toml(config) if config else {}
    cfg = ExperimentConfig.from_dict(raw)
    in_toml = set(raw) | {f"data.{k}" for k in (raw.get("data") or {})}
    if dataset is not None:
        if dataset not in DATASETS:
            raise UserError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
        cfg.data.dataset = dataset
        # the dataset's default split, for the keys the TOML file does not set (its values win)
        defaults = DATASET_SPLIT_DEFAULTS.get(dataset, {})
        for k, v in defaults.items():
            if f"data.{k}" not in in_toml:
                setattr(cfg.data, k, list(v) if isinstance(v, list) else v)
        if dataset != "mnist1d" and model is None and "model" not in in_toml:
            cfg.model = "cnn2d"
    if data_dir is not None:
        cfg.data.data_dir = str(data_dir)
    if model is not None:
        if model not in MODELS:
            raise UserError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
        cfg.model = model
    if methods is not None:
        cfg.methods = _parse_list(methods)
    if seeds is not None:
        if seeds < 1:
            raise UserError("--seeds must be at least 1")
        cfg.seeds = list(range(seeds))
    if forget_ids is not None:
        cfg.data.forget_ids = read_forget_ids(forget_ids)
        cfg.data.forget_class = cfg.data.forget_count = None
    elif forget_class is not None:
        cfg.data.forget_class = forget_class
        cfg.data.forget_count = forget_count
    elif forget_count is not None:
        cfg.data.forget_count = forget_count
    if retrain_mode is not None:
        cfg.retrain_mode = retrain_mode
    return cfg


@app.command()
@handle_errors
def run(out: Path = typer.Option(..., "--out", help="output directory (results.json, report.md, figures)"),
        dataset: Optional[str] = typer.Option(None, help=DATASET_HELP),
        data_dir: Optional[Path] = typer.Option(None, help="directory of a file-based dataset"),
        model: Optional[str] = typer.Option(None, help=MODEL_HELP),
        methods: Optional[str] = typer.Option(None, help="comma-separated methods (default: all that apply) of "
                                              + ", ".join(available_methods())),
        seeds: Optional[int] = typer.Option(None, help="number of seeds (default 3)"),
        forget_class: Optional[int] = typer.Option(None, help="forget class (task index)"),
        forget_count: Optional[int] = typer.Option(None, help="samples of the forget class (default: all)"),
        forget_ids: Optional[Path] = typer.Option(None, help="file of forget ids (positions in D)"),
        retrain_mode: Optional[str] = typer.Option(None, help="replace | remove"),
        protocol: str = typer.Option("default", help="default | sequential | class (ML-Forgetting protocols)"),
        config: Optional[Path] = typer.Option(None, help="TOML configuration file"),
        threads: int = typer.Option(1, help="torch CPU threads; 1 (default) makes the numbers independent of "
                                            "the machine's core count and is fastest for the small models"),
        quiet: bool = typer.Option(False, help="no progress bar"),
        overwrite: bool = typer.Option(False, help="replace the files of an earlier run in --out"),
        device: str = DEVICE_OPTION):
    """Run the forgetting protocol: methods × seeds → results.json, report.md, figures."""

    _set_threads(threads)
    dev = resolve_device(device)
    cfg = _build_config(config, dataset, data_dir, model, methods, seeds, forget_class, forget_count, forget_ids,
                        retrain_mode)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if protocol != "default":
        if protocol not in ("sequential", "class"):
            raise UserError(f"unknown protocol {protocol!r}; choose default, sequential or class")
        require_cpu(device, f"the {protocol} ML-Forgetting protocol")
        _prepare_run_dir(out, overwrite)
        run_ml_protocol(protocol, cfg, out, progress=not quiet)
        console.print(f"wrote {out}/results.json and report.md")
        return
    # validate everything before any work or output
    resolve_methods(cfg, get_split(cfg))
    _prepare_run_dir(out, overwrite)
    results = run_experiment(cfg, out, progress=not quiet, console=console, device=dev)
    _print_summary(results)
    for w in report_warnings(results):
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, figures in {out}")


def _set_threads(threads: Optional[int]) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UserError("--threads must be at least 1")
    torch.set_num_threads(threads)


def _print_summary(results: dict) -> None:
    cols = [("error_retain", "err D_r %"), ("error_forget", "err D_f %"), ("error_test", "err test %"),
            ("loss_forget", "loss D_f (nats)"), ("mia_forget", "MIA D_f %"), ("relearn_epochs", "relearn (epochs)")]
    t = Table(title="readouts (mean ± std over seeds; retrain is the target)")
    t.add_column("method", no_wrap=True)
    for _, title in cols:
        t.add_column(title, no_wrap=True)

    degenerate = mia_degenerate(results)

    def cell(c, s, m):
        if c not in s:
            return "–"
        if c == "mia_forget" and m in degenerate:
            return "degenerate"
        k = 100.0 if c in ("error_retain", "error_forget", "error_test", "mia_forget") else 1.0
        fmt = ".1f" if k == 100.0 or c == "relearn_epochs" else ".3f"
        return f"{k * s[c]['mean']:{fmt}}±{k * s[c]['std']:{fmt}}"

    for m, d in results["methods"].items():
        t.add_row(m, *[cell(c, d["summary"], m) for c, _ in cols])
    console.print(t)


@app.command()
@handle_errors
def train(out: Path = typer.Option(..., "--out", help="directory for original/start/retrain checkpoints"),
          dataset: Optional[str] = typer.Option(None, help=DATASET_HELP),
          data_dir: Optional[Path] = typer.Option(None, help="directory of a file-based dataset"),
          model: Optional[str] = typer.Option(None, help=MODEL_HELP),
          seed: int = typer.Option(0, help="seed of every random choice of the training"),
          forget_class: Optional[int] = typer.Option(None, help="forget class (task index)"),
          forget_count: Optional[int] = typer.Option(None, help="samples of the forget class (default: all)"),
          forget_ids: Optional[Path] = typer.Option(None, help="file of forget ids: the retrain reference is "
                                                    "trained without these"),
          retrain_mode: Optional[str] = typer.Option(None, help="replace | remove"),
          config: Optional[Path] = typer.Option(None, help="TOML configuration file (see `scrubnet config --dump`)"),
          overwrite: bool = typer.Option(False, help="replace the checkpoints of an earlier training in --out"),
          threads: int = THREADS_OPTION, device: str = DEVICE_OPTION):
    """Pre-train, fine-tune the original model on D and save it, w_0 (start) and the retrain reference as
    safetensors checkpoints, plus forget_ids.txt: the ids of D_f, usable as --forget-ids of `scrubnet forget`
    and `scrubnet mlforget forget`."""

    _set_threads(threads)
    dev = resolve_device(device)
    cfg = _build_config(config, dataset, data_dir, model, None, None, forget_class, forget_count, forget_ids,
                        retrain_mode)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    require_writable(out)
    earlier = [n for n in TRAIN_OUTPUTS if (out / n).exists()]
    if earlier and not overwrite:
        raise UserError(f"--out {out} already holds {', '.join(earlier)}; give a new directory or pass --overwrite")
    sr = prepare_seed(cfg, seed, dev)
    common = dict(arch=cfg.model, in_shape=sr.split.input_shape, num_classes=sr.split.num_classes,
                  arch_options=cfg.model_options, config=cfg.to_dict(), data_fingerprint=data_fingerprint(sr.split),
                  seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / "start.safetensors", sr.start, **common, extra={"role": "start"})
    save_checkpoint(out / "original.safetensors", sr.original, **common,
                    extra={"role": "original", "start": "start.safetensors"})
    save_checkpoint(out / "retrain.safetensors", sr.retrain, **common,
                    extra={"role": "retrain", "start": "start.safetensors",
                           "forget_ids": sr.split.forget_idx.tolist()})
    atomic_write_text(out / "forget_ids.txt", "# D_f of this training: positions in D, one per line\n"
                      + "".join(f"{i}\n" for i in sr.split.forget_idx.tolist()))
    for k, h in sr.histories.items():
        if h.zero_error_epoch is None:
            console.print(f"[bold yellow]warning:[/] fine-tuning of the {k} model hit the epoch cap ({h.epochs} "
                          f"epochs) before zero training error ({100 * h.final_error:.1f} % left)", highlight=False)
    console.print(f"wrote {out}/start, original and retrain checkpoints and forget_ids.txt (|D| = {len(sr.split.y)}, "
                  f"|D_f| = {len(sr.split.forget_idx)})")


def _own_model_args(checkpoint, model, weights, data, recipe, model_option, force,
                    reference_flag: str | None = None) -> bool:
    """True for the own-model form (--model, --weights and --data all given), False for the checkpoint form;
    a mix of the two, or an incomplete own-model form, is refused naming what is missing."""
    own = {"--model": model, "--weights": weights, "--data": data}
    if any(v is not None for v in own.values()):
        if checkpoint is not None:
            raise UserError("give either --checkpoint (a model scrubnet trained) or --model/--weights/--data "
                            "(your own model), not both")
        missing = [k for k, v in own.items() if v is None]
        if missing:
            raise UserError(f"your own model needs --model, --weights and --data; missing {', '.join(missing)}")
        return True
    if checkpoint is None:
        raise UserError("give --checkpoint (a model scrubnet trained), or --model, --weights and --data (your "
                        "own model)")
    extras = [k for k, v in (("--recipe", recipe), ("--model-option", model_option or None),
                             ("--force", force or None)) if v is not None]
    if extras:
        raise UserError(f"{', '.join(extras)} apply to your own model (--model/--weights/--data); a scrubnet "
                        "checkpoint carries its training configuration in its sidecar")
    if reference_flag is not None:
        raise UserError(f"{reference_flag} is required with --checkpoint")
    return False


def data_fingerprint(split) -> str:
    """The split's data fingerprint (:meth:`scrubnet.data.Split.fingerprint`, the package's one definition)."""
    return split.fingerprint()


def _load_for_forgetting(checkpoint: Path, forget_ids: Optional[Path], device: torch.device):
    """Model, its sidecar, the rebuilt split (with the forget ids) and the ForgetContext, all on ``device``."""

    if read_meta(checkpoint).get("arch") == USER_ARCH:
        raise UserError(f"{checkpoint} holds your own model's weights: give it as --weights, with --model and "
                        "--data")
    model, meta = load_checkpoint(checkpoint)
    model = model.to(device)
    try:
        cfg = ExperimentConfig.from_dict(meta["config"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {checkpoint}: sidecar has no usable experiment config ({e})") from None
    split = get_split(cfg)
    if meta.get("data_fingerprint") and meta["data_fingerprint"] != data_fingerprint(split):
        raise CheckpointError(f"checkpoint {checkpoint} was trained on other data than its config now produces")
    if forget_ids is not None:
        split = split.with_forget(read_forget_ids(forget_ids))
    split = split.to(device)
    start = None
    if meta.get("start"):
        start, _ = load_checkpoint(Path(checkpoint).parent / meta["start"], expect_arch=meta["arch"])
        start = start.to(device)
    ctx = protocol_context(start or model, cfg.train, num_classes=split.num_classes, seed=int(meta.get("seed") or 0),
                           forget_class=split.forget_class, split=split)
    ctx.start = start  # retraining needs the checkpoint's own start model; without one it is refused
    return model, meta, split, ctx, cfg


@app.command()
@handle_errors
def forget(checkpoint: Optional[Path] = typer.Option(None, help="a checkpoint scrubnet trained (.safetensors with "
                                                    "sidecar); for your own model give --model/--weights/--data"),
           forget_ids: Path = typer.Option(..., help="file of forget ids (positions in D; for --data, in x_train)"),
           method: str = typer.Option(..., help="scrubbing method: " + ", ".join(
               m for m in available_methods() if not method_class(m).own_retrain_family)),
           out: Path = typer.Option(..., "--out", help="where to write the scrubbed checkpoint"),
           option: list[str] = typer.Option([], "--option", help="method option KEY=VALUE (repeatable)"),
           seed: Optional[int] = typer.Option(None, help="seed of the scrub's random choices"),
           overwrite: bool = typer.Option(False, help="replace an existing --out file"),
           model: Optional[str] = typer.Option(None, "--model", help=OWN_MODEL_HELP),
           model_option: list[str] = typer.Option([], "--model-option", help=MODEL_OPTION_HELP),
           weights: Optional[Path] = typer.Option(None, help=WEIGHTS_HELP),
           data: Optional[Path] = typer.Option(None, help=DATA_HELP),
           recipe: Optional[Path] = typer.Option(None, help=RECIPE_HELP),
           force: bool = typer.Option(False, help="run a curvature method even when the recipe check finds the "
                                                  "model far from a minimum of the recipe's objective"),
           threads: int = THREADS_OPTION, device: str = DEVICE_OPTION,
           dry_run: bool = typer.Option(False, "--dry-run", help="print the cost estimate and do nothing else"),
           max_seconds: Optional[float] = typer.Option(None, help="refuse (exit 2) when the estimated time on this "
                                                        "machine exceeds it"),
           memory: Optional[str] = typer.Option(None, help="refuse (exit 2) when the estimated peak memory exceeds "
                                                 "it (e.g. 2GiB, 500MB, bytes)")):
    """Scrub a checkpoint: forget the given sample ids with one method, write the scrubbed checkpoint.

    Your own model: --model FILE.py:FACTORY --weights W --data D.npz [--recipe R.toml]; the scrubbed weights
    are written as safetensors with a sidecar (hashes, recipe, method, ids). A failed scrub writes nothing."""

    _set_threads(threads)
    own = _own_model_args(checkpoint, model, weights, data, recipe, model_option, force)
    _refuse_existing_file(out, overwrite, inputs=(checkpoint or weights,))
    cls = method_class(method)
    if cls is not None and cls.own_retrain_family:
        if own:
            raise UserError(f"--method {method} trains its own mixed-linear model from scrubnet's core/task split; "
                            "it does not apply to --model")
        raise UserError(f"--method {method} trains its own mixed-linear model, which is not a checkpoint of "
                        f"this architecture; use `scrubnet mlforget train` and `scrubnet mlforget forget` for "
                        "ML-Forgetting on checkpoints")
    max_bytes = parse_bytes(memory) if memory is not None else None
    if max_seconds is not None and not max_seconds > 0:
        raise UserError(f"--max-seconds must be > 0, got {max_seconds}")
    opts = _parse_options(option)

    def budget(net, retain, forget_set, num_classes, config=None) -> bool:
        """The cost estimate: printed for --dry-run (then True: stop), checked against the budgets."""
        if not (dry_run or max_seconds is not None or max_bytes is not None):
            return False
        est = estimate(net, len(retain[1]), len(forget_set[1]), method=method, num_classes=num_classes,
                       x_probe=retain[0], config=config, **opts)
        if dry_run:
            console.print(f"estimate: {est.summary()}", highlight=False, soft_wrap=True)
            console.print_json(json.dumps({k: v for k, v in est.as_dict().items()}))
            return True
        check_budget(est, max_seconds=max_seconds, max_bytes=max_bytes)
        return False

    if own:
        with _progress_with_eta():
            meta = forget_own(spec=model, options=_parse_options(model_option, "--model-option"), weights=weights,
                              data=data, forget_ids=forget_ids, method=method, method_options=opts,
                              recipe_path=recipe, out=out, seed=0 if seed is None else seed, force=force,
                              device=resolve_device(device), before_scrub=budget)
        if meta is not None:
            console.print(f"wrote {out} ({method}, |D_f| = {len(meta['forget_ids'])})")
        return
    model, meta, split, ctx, cfg = _load_for_forgetting(checkpoint, forget_ids, resolve_device(device))
    m = protocol_method(method, **opts)
    if seed is not None:
        ctx.seed = seed
    if budget(model, split.retain, split.forget, ctx.num_classes, ctx.config):
        return
    with _progress_with_eta():  # the one scrub path: the same failure rules as scrubnet.forget
        checked = scrub_and_measure(m, model, split.retain, split.forget, ctx)
    if not checked.ok:  # nothing is written for a scrub that did not do what it claims
        raise UserError(f"method {method!r} failed: " + "; ".join(checked.reasons))
    res = checked.scrub
    extra = {"role": "scrubbed", "method": method, "method_options": opts, "forget_ids": split.forget_idx.tolist(),
             "source": str(checkpoint), "source_sha256": meta["sha256"],
             "info": {k: float(v) for k, v in res.info.items() if isinstance(v, (int, float))}}
    if meta.get("start"):
        start_src = Path(checkpoint).parent / meta["start"]
        start_dst = out.parent / meta["start"]
        if start_src.resolve() != start_dst.resolve() and not start_dst.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            for s, d in ((start_src, start_dst), (Path(str(start_src) + ".json"), Path(str(start_dst) + ".json"))):
                tmp = d.with_name("." + d.name + ".tmp")
                shutil.copyfile(s, tmp)
                os.replace(tmp, d)
        extra["start"] = meta["start"]
    save_checkpoint(out, res.model, arch=meta["arch"], in_shape=meta["in_shape"], num_classes=meta["num_classes"],
                    arch_options=meta.get("arch_options"), config=meta.get("config"),
                    data_fingerprint=meta.get("data_fingerprint"), seed=meta.get("seed"), extra=extra)
    console.print(f"wrote {out} ({method}, |D_f| = {len(split.forget_idx)})")


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB', '500MB', '1.5gb', '123456' → bytes (> 0)."""
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise UserError(f"--memory: cannot read {text!r} as a size (e.g. 2GiB, 500MB, 1048576)") from None
    if not value > 0:
        raise UserError(f"--memory must be > 0, got {text!r}")
    return int(value)


@contextlib.contextmanager
def _progress_with_eta():
    """A rich progress bar with the time remaining for every long pass the curvature code reports."""
    if not sys.stderr.isatty():
        yield
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err_console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def report(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        with progress_reporter(report):
            yield


def _same_data(checkpoint: Path, meta: dict, other: Path, other_meta: dict) -> None:
    """Refuse two checkpoints trained on different data (their recorded data fingerprints differ)."""
    a, b = meta.get("data_fingerprint"), other_meta.get("data_fingerprint")
    if a and b and a != b:
        raise UserError(f"{other} was trained on other data than {checkpoint} (data fingerprints differ); "
                        "compare models of one split")


def _parse_options(option: list[str], flag: str = "--option") -> dict:
    opts: dict = {}
    for o in option:
        if "=" not in o:
            raise UserError(f"{flag} {o!r}: expected KEY=VALUE")
        k, v = o.split("=", 1)
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    return opts


@app.command()
@handle_errors
def evaluate(checkpoint: Optional[Path] = typer.Option(None, help="checkpoint to evaluate (a model scrubnet "
                                                      "trained); for your own model give --model/--weights/--data"),
             reference: Optional[Path] = typer.Option(None, help="the retrain checkpoint (gold standard; required "
                                                      "with --checkpoint); with --model: weights of the same "
                                                      "factory retrained without D_f (optional)"),
             forget_ids: Optional[Path] = typer.Option(None, help="forget ids (default: those in the sidecar)"),
             original: Optional[Path] = typer.Option(None, help="original checkpoint (re-learn threshold)"),
             json_out: Optional[Path] = typer.Option(None, "--json", help="also write the readouts as JSON"),
             model: Optional[str] = typer.Option(None, "--model", help=OWN_MODEL_HELP),
             model_option: list[str] = typer.Option([], "--model-option", help=MODEL_OPTION_HELP),
             weights: Optional[Path] = typer.Option(None, help=WEIGHTS_HELP),
             data: Optional[Path] = typer.Option(None, help=DATA_HELP),
             threads: int = THREADS_OPTION, device: str = DEVICE_OPTION):
    """Every readout of a checkpoint against a retrain reference. The re-learn threshold comes from
    --original, else from the source checkpoint recorded in a scrubbed checkpoint's sidecar; the reference
    and the original must have been trained on the same data (fingerprints compared).

    Your own model (--model/--weights/--data): error and loss on D_r, D_f and the test set, and against
    --reference when given (its readouts, output L1 distances, weight distance)."""

    _set_threads(threads)
    own = _own_model_args(checkpoint, model, weights, data, None, model_option, False,
                          reference_flag="--reference" if reference is None and checkpoint is not None else None)
    dev = resolve_device(device)
    if json_out is not None:
        require_writable(json_out)
    if own:
        if original is not None:
            raise UserError("--original applies to --checkpoint (the re-learn readout of scrubnet's protocol)")
        r = evaluate_own(spec=model, options=_parse_options(model_option, "--model-option"), weights=weights,
                         data=data, forget_ids=forget_ids, reference=reference, device=dev)
        _print_readouts(f"readouts of {weights.name}", r, json_out)
        return
    model, meta, split, ctx, cfg = _load_for_forgetting(checkpoint, forget_ids, dev)
    if forget_ids is None and meta.get("forget_ids"):
        split = split.with_forget(meta["forget_ids"]).to(dev)
    ref, ref_meta = load_checkpoint(reference, expect_arch=meta["arch"])
    _same_data(checkpoint, meta, reference, ref_meta)
    ref = ref.to(dev)
    if original is None and meta.get("source"):
        original = Path(meta["source"])
        if not original.is_absolute() and not original.exists():
            original = Path(checkpoint).parent / original.name
        if not original.is_file():
            raise UserError(f"the original model {meta['source']} named in the sidecar of {checkpoint} is not "
                            "found; give it with --original")
    if original is not None:
        orig, orig_meta = load_checkpoint(original, expect_arch=meta["arch"])
        _same_data(checkpoint, meta, original, orig_meta)
        orig = orig.to(dev)
    else:
        orig = model  # the checkpoint is itself the original (no scrub recorded in its sidecar)
    sr = SeedRun(ctx.seed, split, ctx.start or model, orig, ref, ctx, cfg)
    r = eval_fn(model, sr, original=orig, reference=ref)
    _print_readouts(f"readouts of {checkpoint.name}", r, json_out)


def _print_readouts(title: str, r: dict, json_out: Optional[Path]) -> None:
    t = Table(title=f"{title} (--json keeps fractions, nats and 0/1 flags)")
    t.add_column("readout")
    t.add_column("value")
    t.add_column("unit")
    for k, v in r.items():
        t.add_row(k, format_readout(k, v), readout_unit(k))
    console.print(t)
    if json_out:
        atomic_write_json(json_out, r)


@app.command()
@handle_errors
def report(run_dir: Path = typer.Argument(..., help="a directory written by `scrubnet run`"),
           threads: int = THREADS_OPTION, device: str = DEVICE_OPTION):
    """Re-render report.md and the figures from RUN_DIR/results.json (no tensor work: --device is only
    validated)."""
    _set_threads(threads)
    resolve_device(device)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    rp, sp = run_dir / "results.json", run_dir / "sweep.json"
    if not rp.is_file() and sp.is_file():  # a `scrubnet sweep` directory: redraw its figure
        sweep_result = _read_json(sp)
        plot_sweep(sweep_result, sweep_figure_path(run_dir, sweep_result["method"]))
        console.print(f"re-drew the sweep figure of {sweep_result['method']} in {run_dir}")
        return
    results = _read_json(rp) if rp.is_file() else {}
    if results.get("protocol") in ("sequential", "class"):  # the ML-Forgetting protocols
        md = rerender_ml(results, run_dir)
    else:
        md = report_from_dir(run_dir)
    console.print(md, markup=False, highlight=False)


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable scrubnet results file: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"{path} is not a scrubnet results file")
    return d


@app.command()
@handle_errors
def sweep(method: str = typer.Option(..., help="method with a noise scale (fisher, ntk-fisher, newton)"),
          alphas: str = typer.Option(..., help="comma-separated values of alpha"),
          out: Path = typer.Option(..., "--out", help="output directory (sweep.json and the figure)"),
          seeds: Optional[int] = typer.Option(None, help="number of seeds (default: the configuration's)"),
          config: Optional[Path] = typer.Option(None, help="TOML configuration file (see `scrubnet config --dump`)"),
          quiet: bool = typer.Option(False, help="no progress bar"),
          threads: int = THREADS_OPTION, device: str = DEVICE_OPTION):
    """Trade-off sweep: test error against remaining information over the noise scale alpha."""

    _set_threads(threads)
    require_writable(out)
    try:
        values = [float(a) for a in _parse_list(alphas)]
    except ValueError:
        raise UserError(f"--alphas {alphas!r}: expected comma-separated numbers") from None
    dev = resolve_device(device)
    cfg = _build_config(config, None, None, None, None, seeds, None, None, None, None)
    run_sweep(method, "alpha", values, cfg, out, progress=not quiet, device=dev)
    console.print(f"wrote sweep results to {out}")


@app.command("config")
@handle_errors
def config_cmd(dump: bool = typer.Option(False, "--dump", help="print every configuration key as TOML, with its "
                                         "default (or --config's value) and unit as comments"),
               config: Optional[Path] = typer.Option(None, help="TOML file to check (and print with --dump)"),
               threads: int = THREADS_OPTION):
    """Print the experiment configuration (`scrubnet config --dump > my.toml`) or check a TOML file."""
    _set_threads(threads)
    if not dump and config is None:
        raise UserError("give --dump (print every key) and/or --config FILE (check it)")
    cfg = load_config(config) if config is not None else ExperimentConfig.from_dict({})
    if dump:
        typer.echo(dump_toml(cfg), nl=False)
    else:
        console.print(f"{config}: a valid configuration")


app.add_typer(mlforget_app, name="mlforget", help="ML-Forgetting on mixed-linear checkpoints")
app.command(name="audit")(handle_errors(audit))
app.command(name="dp")(handle_errors(dp))
study_app.command(name="critical-periods")(handle_errors(critical_periods))
app.add_typer(study_app, name="study", help="empirical studies of training (critical periods of regularisation)")
app.command(name="serve")(serve)
app.add_typer(receipt_app, name="receipt", help="Signed receipts of deletion requests: verify")


def main() -> None:  # console-script entry point

    # one thread unless asked otherwise (see `run --threads`); SCRUBNET_THREADS sets it for every command
    torch.set_num_threads(max(1, int(os.environ.get("SCRUBNET_THREADS", "1") or 1)))
    app()


if __name__ == "__main__":
    sys.exit(main())
