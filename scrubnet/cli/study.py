"""``scrubnet study``: empirical studies of training itself.

    scrubnet study critical-periods --out runs/critical-periods            # 2 data sets × 3 seeds, minutes
    scrubnet study critical-periods --seeds 1 --datasets digits --out runs/cp-quick
    scrubnet study critical-periods --config cp.toml --out runs/cp-custom   # any CriticalPeriodsConfig field

Writes results.json (config, every run's FIM-trace / weight-norm / effective-lr curves, the analysis with the
correlations and verdicts, the readiness readout, the trajectory PCA), report.md and the figures. Bad input
(including an --out that is a file or not writable) gives one line ``error: …`` and exit code 2 before any
work, and nothing is written.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.cli.common import UserError, read_config_file, threads_option
from scrubnet.experiments.critical_periods import FIGURES, CriticalPeriodsConfig, run_study

study_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="empirical studies of training (critical periods of regularisation)")


def build_cp_config(config: Optional[Path], seeds: Optional[int], epochs: Optional[int],
                    datasets: Optional[str]) -> CriticalPeriodsConfig:
    """Defaults, then the TOML file, then the command-line options (validated)."""
    d = read_config_file(config)
    if seeds is not None:
        if seeds < 1:
            raise UserError("--seeds must be at least 1")
        d["seeds"] = list(range(seeds))
    if epochs is not None:
        d["epochs"] = epochs
    if datasets is not None:
        d["datasets"] = [t.strip() for t in datasets.split(",") if t.strip()]
    try:
        return CriticalPeriodsConfig.from_dict(d)
    except TypeError as e:
        raise UserError(f"bad critical-periods configuration: {e}") from None


def critical_periods(out: Path = typer.Option(..., "--out", help="output directory (results.json, report.md, "
                                              "figures)"),
                     seeds: Optional[int] = typer.Option(None, help="number of seeds (default 3)"),
                     epochs: Optional[int] = typer.Option(None, help="training epochs per run (default 30)"),
                     datasets: Optional[str] = typer.Option(None, help="comma-separated: mnist1d,digits (default "
                                                            "both)"),
                     config: Optional[Path] = typer.Option(None, help="TOML file with any CriticalPeriodsConfig "
                                                           "field"),
                     overwrite: bool = typer.Option(False, help="replace the files of an earlier study in --out"),
                     threads: int = threads_option("torch CPU threads (1: reproducible across machines)"),
                     quiet: bool = typer.Option(False, help="no per-run progress lines")):
    """Critical periods of regularisation: weight decay interrupted / delayed / in a sliding window, with the
    Fisher-trace, weight-norm and effective-lr curves → results.json, report.md, figures.

    --out must be new or empty; with --overwrite an earlier study's files there are deleted first."""
    cfg = build_cp_config(config, seeds, epochs, datasets)
    # before any work, as dp and audit do: an earlier study's files are never mixed with new ones
    prepare_output_dir(out, overwrite, FIGURES + ("report.md", "results.json"))
    result = run_study(cfg, out, log=None if quiet else (lambda m: print(m, file=sys.stderr)))
    for ds in cfg.datasets:
        c = result["analysis"][ds]["correlations"]
        typer.echo(f"{ds}: Pearson r with test accuracy — peak FIM trace {c['peak_fisher']['r']:.2f} "
                   f"(p = {c['peak_fisher']['p']:.2g}), final FIM trace {c['final_fisher']['r']:.2f} "
                   f"(p = {c['final_fisher']['p']:.2g})")
        for v in result["analysis"][ds]["verdicts"]:
            typer.echo(f"  {v['verdict']:>18}: {v['claim']}")
    typer.echo(f"wrote {out / 'results.json'}, {out / 'report.md'}, {', '.join(FIGURES)} in {out}")
