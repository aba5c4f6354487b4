"""``scrubnet run``, ``train``, ``sweep``, ``report`` and ``config``: the forgetting protocol on scrubnet's own
experiments (methods × seeds), its checkpoints, the noise-scale sweep, re-rendering and the configuration."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from scrubnet.cli.common import (DATASET_HELP, DEVICE_OPTION, MODEL_HELP, QUIET_OPTION, UserError, console,
                                 parse_list, read_forget_ids, require_cpu, require_out_dir, require_writable,
                                 threads_option)
from scrubnet.data.registry import DATASETS
from scrubnet.device import resolve_device
from scrubnet.experiments.checkpoints import TRAIN_OUTPUTS, save_training
from scrubnet.experiments.config import ExperimentConfig, dump_toml, load_config, read_toml
from scrubnet.experiments.ml_protocols import rerender as rerender_ml, run_ml_protocol
from scrubnet.experiments.report import group_warnings, mia_degenerate, report_from_dir, report_warnings
from scrubnet.experiments.runner import get_split, prepare_seed, resolve_methods, run_experiment
from scrubnet.experiments.sweep import plot_sweep, run_sweep, sweep_figure_path
from scrubnet.methods.base import available_methods
from scrubnet.models import MODELS

#: the files `scrubnet run` writes into its output directory
RUN_OUTPUTS = ("results.json", "report.md", "readouts.png", "entropy.png", "entropies.json")

#: per dataset, the split values ``--dataset`` sets when the TOML file does not give them
DATASET_SPLIT_DEFAULTS = {
    "digits": {"n_train_per_class": 60, "n_test_per_class": 60},
    "cifar10": {"core_classes": [], "task_classes": list(range(5))},
    "imagefolder": {"core_classes": [], "task_classes": list(range(5))},
    "cifar100": {"core_classes": list(range(5, 100)), "task_classes": list(range(5))},
}

CONFIG_HELP = "TOML configuration file (see `scrubnet config --dump`)"


def _prepare_run_dir(out: Path, overwrite: bool) -> None:
    """``run --out``: a new or empty directory; an earlier run's directory only with ``--overwrite``, which
    then deletes the earlier run's files (and nothing else) before the new run starts, so no stale file mixes
    with the new ones."""
    require_out_dir(out)
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out} is not empty (an earlier run?); give a new directory or pass --overwrite "
                            "to replace the earlier run's files")
        for name in RUN_OUTPUTS:
            (out / name).unlink(missing_ok=True)
        for pattern in ("sequential_*.png", "class_*.png"):  # the ML protocols' figures
            for f in out.glob(pattern):
                f.unlink()


def _apply_dataset(cfg: ExperimentConfig, dataset: str, model: Optional[str], in_toml: set[str]) -> None:
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    cfg.data.dataset = dataset
    # the dataset's default split, for the keys the TOML file does not set (its values win)
    for k, v in DATASET_SPLIT_DEFAULTS.get(dataset, {}).items():
        if f"data.{k}" not in in_toml:
            setattr(cfg.data, k, list(v) if isinstance(v, list) else v)
    if dataset != "mnist1d" and model is None and "model" not in in_toml:
        cfg.model = "cnn2d"


def _build_config(config: Optional[Path], dataset, data_dir, model, methods, seeds, forget_class, forget_count,
                  forget_ids, retrain_mode) -> ExperimentConfig:
    """The experiment configuration: defaults, then the TOML file, then the command-line options."""
    raw = read_toml(config) if config else {}
    cfg = ExperimentConfig.from_dict(raw)
    if dataset is not None:
        _apply_dataset(cfg, dataset, model, set(raw) | {f"data.{k}" for k in (raw.get("data") or {})})
    if data_dir is not None:
        cfg.data.data_dir = str(data_dir)
    if model is not None:
        if model not in MODELS:
            raise UserError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
        cfg.model = model
    if methods is not None:
        cfg.methods = parse_list(methods)
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
        threads: int = threads_option("torch CPU threads; 1 (default) makes the numbers independent of the "
                                      "machine's core count and is fastest for the small models"),
        quiet: bool = QUIET_OPTION,
        overwrite: bool = typer.Option(False, help="replace the files of an earlier run in --out"),
        device: str = DEVICE_OPTION,
        references: int = typer.Option(0, "--references", help="pairs of reference models trained per seed to "
                                       "calibrate the forgetting verdict (2 = 4 models; 0: none)")):
    """Run the forgetting protocol: methods × seeds → results.json, report.md, figures."""
    dev = resolve_device(device)
    if references < 0:
        raise UserError(f"--references must be 0 or more pairs, got {references}")
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
    results = run_experiment(cfg, out, progress=not quiet, console=console, device=dev, references=references)
    _print_summary(results)
    for w in group_warnings(report_warnings(results)):
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, figures in {out}")


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
          config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
          overwrite: bool = typer.Option(False, help="replace the checkpoints of an earlier training in --out"),
          threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Pre-train, fine-tune the original model on D and save it, w_0 (start) and the retrain reference as
    safetensors checkpoints, plus forget_ids.txt: the ids of D_f, usable as --forget-ids of `scrubnet forget`
    and `scrubnet mlforget forget`."""
    dev = resolve_device(device)
    cfg = _build_config(config, dataset, data_dir, model, None, None, forget_class, forget_count, forget_ids,
                        retrain_mode)
    require_out_dir(out)
    earlier = [n for n in TRAIN_OUTPUTS if (out / n).exists()]
    if earlier and not overwrite:
        raise UserError(f"--out {out} already holds {', '.join(earlier)}; give a new directory or pass --overwrite")
    sr = prepare_seed(cfg, seed, dev)
    save_training(out, cfg, sr, seed)
    for k, h in sr.histories.items():
        if h.zero_error_epoch is None:
            console.print(f"[bold yellow]warning:[/] fine-tuning of the {k} model hit the epoch cap ({h.epochs} "
                          f"epochs) before zero training error ({100 * h.final_error:.1f} % left)", highlight=False)
    console.print(f"wrote {out}/start, original and retrain checkpoints and forget_ids.txt (|D| = {len(sr.split.y)}, "
                  f"|D_f| = {len(sr.split.forget_idx)})")


def report(run_dir: Path = typer.Argument(..., help="a directory written by `scrubnet run`"),
           threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Re-render report.md and the figures from RUN_DIR/results.json (no tensor work: --device is only
    validated)."""
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


def sweep(method: str = typer.Option(..., help="method with a noise scale (fisher, ntk-fisher, newton)"),
          alphas: str = typer.Option(..., help="comma-separated values of alpha"),
          out: Path = typer.Option(..., "--out", help="output directory (sweep.json and the figure)"),
          seeds: Optional[int] = typer.Option(None, help="number of seeds (default: the configuration's)"),
          config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
          quiet: bool = QUIET_OPTION,
          threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Trade-off sweep: test error against remaining information over the noise scale alpha."""
    require_writable(out)
    try:
        values = [float(a) for a in parse_list(alphas)]
    except ValueError:
        raise UserError(f"--alphas {alphas!r}: expected comma-separated numbers") from None
    dev = resolve_device(device)
    cfg = _build_config(config, None, None, None, None, seeds, None, None, None, None)
    run_sweep(method, "alpha", values, cfg, out, progress=not quiet, device=dev)
    console.print(f"wrote sweep results to {out}")


def config_cmd(dump: bool = typer.Option(False, "--dump", help="print every configuration key as TOML, with its "
                                         "default (or --config's value) and unit as comments"),
               config: Optional[Path] = typer.Option(None, help="TOML file to check (and print with --dump)"),
               threads: int = threads_option()):
    """Print the experiment configuration (`scrubnet config --dump > my.toml`) or check a TOML file."""
    if not dump and config is None:
        raise UserError("give --dump (print every key) and/or --config FILE (check it)")
    cfg = load_config(config) if config is not None else ExperimentConfig.from_dict({})
    if dump:
        typer.echo(dump_toml(cfg), nl=False)
    else:
        console.print(f"{config}: a valid configuration")
