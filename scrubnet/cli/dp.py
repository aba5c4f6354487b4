"""``scrubnet dp``: the MixDP protocol (AdaMix against NoisyGD, public-init DP, Only-Public and the paragon).

    scrubnet dp --out runs/dp                                  # ε = 1, 2, 3, 8; δ = 1e-5; σ = 20; 3 seeds
    scrubnet dp --eps 1,3 --seeds 5 --out runs/dp5
    scrubnet dp --config dp.toml --out runs/dp-custom          # any field of MixDPConfig, as TOML

Writes results.json (``{"config", "results": [{"method", "eps", "seed", "test_error", "mia_auc", "mu", "steps",
...}], "summary", "pdp"}``), report.md, error_vs_eps.png, pdp_hist.png and the seed-0 AdaMix classifiers as
checkpoints (``checkpoints/``). Bad input (a value outside its range: ε ∈ (0, 64], δ ∈ [1e-12, 0.1],
σ ∈ [0.1, 1000], T_max(ε, δ, σ) ≤ 50000 steps, 1–100 seeds; a non-writable or non-empty --out without
``--overwrite``) gives one line ``error: …`` and exit code 2 before any work, and nothing is written.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.cli.common import UserError, read_config_file, threads_option
from scrubnet.experiments.mixdp import MixDPConfig, run_mixdp

#: the files `scrubnet dp` writes into --out (``--overwrite`` deletes these and nothing else)
DP_OUTPUTS = ("results.json", "report.md", "error_vs_eps.png", "pdp_hist.png")
DP_OUTPUT_PATTERNS = ("checkpoints/adamix-*.safetensors", "checkpoints/adamix-*.safetensors.json")


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"{what} {text!r}: expected comma-separated numbers") from None
    if not vals:
        raise UserError(f"{what} is empty")
    return vals


def build_dp_config(config: Optional[Path], eps: Optional[str], delta: Optional[float], sigma: Optional[float],
                    seeds: Optional[int]) -> MixDPConfig:
    """The protocol configuration: defaults, then the TOML file, then the command-line options (validated)."""
    d = read_config_file(config)
    if eps is not None:
        d["epsilons"] = _floats(eps, "--eps")
    if delta is not None:
        d["delta"] = delta
    if sigma is not None:
        d["sigma"] = sigma
    if seeds is not None:
        if not 1 <= seeds <= 100:
            raise UserError(f"--seeds must lie in [1, 100], got {seeds}")
        d["seeds"] = list(range(seeds))
    try:
        return MixDPConfig.from_dict(d)
    except TypeError as e:
        raise UserError(f"bad dp configuration: {e}") from None


def dp(out: Path = typer.Option(..., "--out", help="output directory (results.json, report.md, figures)"),
       eps: Optional[str] = typer.Option(None, "--eps", help="comma-separated target ε, each in (0, 64] "
                                         "(default 1,2,3,8)"),
       delta: Optional[float] = typer.Option(None, help="target δ in [1e-12, 0.1] (default 1e-5)"),
       sigma: Optional[float] = typer.Option(None, help="noise multiplier σ in [0.1, 1000] (default 20); the run "
                                             "takes T = T_max(ε, δ, σ) ≤ 50000 noisy steps"),
       config: Optional[Path] = typer.Option(None, help="TOML file with any MixDP configuration field"),
       seeds: Optional[int] = typer.Option(None, help="number of seeds, 1 to 100 (default 3)"),
       overwrite: bool = typer.Option(False, help="replace the files of an earlier dp run in --out"),
       threads: int = threads_option("torch CPU threads (1: reproducible across machines)"),
       quiet: bool = typer.Option(False, help="no per-seed progress lines")):
    """Mixed differential privacy: AdaMix and its baselines over ε and seeds → results.json, report.md, figures.

    --out must be new or empty; with --overwrite an earlier run's files there are deleted first."""
    cfg = build_dp_config(config, eps, delta, sigma, seeds)
    prepare_output_dir(out, overwrite, DP_OUTPUTS, DP_OUTPUT_PATTERNS)
    report = run_mixdp(cfg, out, log=None if quiet else (lambda m: print(m, file=sys.stderr)))
    s = report["summary"]
    for key in ("only-public", "paragon") + tuple(f"{m}@{e:g}" for e in cfg.epsilons
                                                   for m in ("adamix", "noisygd", "public-init-dp")):
        d = s[key]
        typer.echo(f"{key:>22}: test error {100 * d['test_error']['mean']:5.1f} ± {100 * d['test_error']['std']:.1f} %"
                   f"   membership AUC {d['mia_auc']['mean']:.3f}")
    typer.echo(f"wrote {out / 'results.json'}, {out / 'report.md'}, figures in {out}")
