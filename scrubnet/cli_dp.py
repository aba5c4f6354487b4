"""``scrubnet dp``: the MixDP protocol (AdaMix against NoisyGD, public-init DP, Only-Public and the paragon).

    scrubnet dp --out runs/dp                                  # ε = 1, 2, 3, 8; δ = 1e-5; σ = 20; 3 seeds
    scrubnet dp --eps 1,3 --seeds 5 --out runs/dp5
    scrubnet dp --config dp.toml --out runs/dp-custom          # any field of MixDPConfig, as TOML

Writes results.json (``{"config", "results": [{"method", "eps", "seed", "test_error", "mia_auc", "mu", "steps",
...}], "summary", "pdp"}``), report.md, error_vs_eps.png, pdp_hist.png and the seed-0 AdaMix classifiers as
checkpoints (``checkpoints/``). Bad input gives one line ``error: …`` and exit code 2 before any work, and
nothing is written.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch
import typer

from scrubnet.experiments.config import read_toml
from scrubnet.experiments.mixdp import MixDPConfig, run_mixdp


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected comma-separated numbers") from None
    if not vals:
        raise ValueError(f"{what} is empty")
    return vals


def build_dp_config(config: Optional[Path], eps: Optional[str], delta: Optional[float], sigma: Optional[float],
                    seeds: Optional[int]) -> MixDPConfig:
    """The protocol configuration: defaults, then the TOML file, then the command-line options (validated)."""
    d: dict = {}
    if config is not None:
        if not config.is_file():
            raise ValueError(f"configuration file not found: {config}")
        d = read_toml(config)
    if eps is not None:
        d["epsilons"] = _floats(eps, "--eps")
    if delta is not None:
        d["delta"] = delta
    if sigma is not None:
        d["sigma"] = sigma
    if seeds is not None:
        if seeds < 1:
            raise ValueError("--seeds must be at least 1")
        d["seeds"] = list(range(seeds))
    try:
        return MixDPConfig.from_dict(d)
    except TypeError as e:
        raise ValueError(f"bad dp configuration: {e}") from None


def dp(out: Path = typer.Option(..., "--out", help="output directory (results.json, report.md, figures)"),
       eps: Optional[str] = typer.Option(None, "--eps", help="comma-separated target ε (default 1,2,3,8)"),
       delta: Optional[float] = typer.Option(None, help="target δ (default 1e-5)"),
       sigma: Optional[float] = typer.Option(None, help="noise multiplier σ (default 20); T = T_max(ε, δ, σ)"),
       config: Optional[Path] = typer.Option(None, help="TOML file with any MixDP configuration field"),
       seeds: Optional[int] = typer.Option(None, help="number of seeds (default 3)"),
       threads: int = typer.Option(1, help="torch CPU threads (1: reproducible across machines)"),
       quiet: bool = typer.Option(False, help="no per-seed progress lines")):
    """Mixed differential privacy: AdaMix and its baselines over ε and seeds → results.json, report.md, figures."""
    if threads < 1:
        raise ValueError("--threads must be at least 1")
    cfg = build_dp_config(config, eps, delta, sigma, seeds)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    torch.set_num_threads(threads)
    report = run_mixdp(cfg, out, log=None if quiet else (lambda m: print(m, file=sys.stderr)))
    s = report["summary"]
    for key in ("only-public", "paragon") + tuple(f"{m}@{e:g}" for e in cfg.epsilons
                                                   for m in ("adamix", "noisygd", "public-init-dp")):
        d = s[key]
        typer.echo(f"{key:>22}: test error {100 * d['test_error']['mean']:5.1f} ± {100 * d['test_error']['std']:.1f} %"
                   f"   membership AUC {d['mia_auc']['mean']:.3f}")
    typer.echo(f"wrote {out / 'results.json'}, {out / 'report.md'}, figures in {out}")
