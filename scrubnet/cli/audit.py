"""``scrubnet audit``: per-example forgetting audits (U-LiRA and the NeurIPS-2023 ε-score) on a pool of models.

    scrubnet audit --out runs/audit                                  # every method of the embedded experiment
    scrubnet audit --methods original,retrain,fisher --pool 32 --out runs/audit-fisher
    scrubnet audit --engine ray --out runs/audit                     # a local Ray
    scrubnet audit --engine ray --address HEAD:6379 --out runs/audit # an existing Ray cluster
    scrubnet audit --method mymethods:MyScrub --methods original,retrain --out runs/audit-mine  # your method
    scrubnet audit --logits pool_a.npz --logits pool_b.npz --out runs/audit-files  # pools trained elsewhere

Writes audit.json, audit.md, roc.png, epsilon_hist.png and the model cache (``OUT/cache``: an interrupted
audit resumes, a second audit in the same OUT reuses the originals and retrains). Bad input gives one line
``error: …`` and exit code 2, before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.audit.engine import make_engine
from scrubnet.audit.logits_file import audit_logits_files
from scrubnet.audit.report import audit_warnings, write_logits_audit
from scrubnet.audit.run import EPS_MODELS_RANGE, POOL_RANGE, default_plan, run_audit
from scrubnet.cli.common import QUIET_OPTION, UserError, console, require_out_dir, threads_option
from scrubnet.device import resolve_device
from scrubnet.experiments.config import ExperimentConfig, load_config
from scrubnet.experiments.runner import get_split, resolve_methods
from scrubnet.methods.base import method_class
from scrubnet.methods.user_methods import load_user_method

#: the files `scrubnet audit` writes into --out (``--overwrite`` deletes these; the model cache stays)
AUDIT_OUTPUTS = ("audit.json", "audit.md", "roc.png", "epsilon_hist.png")


def audit(out: Path = typer.Option(..., "--out", help="output directory (audit.json, audit.md, figures, cache/)"),
          methods: Optional[str] = typer.Option(None, help="comma-separated methods (default: those of `run`)"),
          pool: Optional[int] = typer.Option(None, help=f"originals trained on random halves of the data, "
                                             f"{POOL_RANGE[0]} to {POOL_RANGE[1]} (default 32, ¾ of them shadows)"),
          eps_models: Optional[int] = typer.Option(None, "--eps-models",
                                                   help=f"models per side for the ε-score, {EPS_MODELS_RANGE[0]} "
                                                   f"to {EPS_MODELS_RANGE[1]} (default 32; half for mlforget)"),
          engine: str = typer.Option("local", help="local | ray"),
          address: Optional[str] = typer.Option(None, help="HOST:PORT of a running Ray cluster (with --engine ray)"),
          ray_cpus: Optional[int] = typer.Option(None, "--ray-cpus", help="CPUs of a local Ray (default: all)"),
          max_retries: int = typer.Option(3, "--max-retries", help="Ray: re-runs of a task whose worker died"),
          config: Optional[Path] = typer.Option(None, help="TOML experiment configuration (as for `run`)"),
          seed: Optional[int] = typer.Option(None, help="audit seed, ≥ 0 (default: the experiment's first seed)"),
          threads: int = threads_option("torch threads per task"),
          device: str = typer.Option("auto", "--device", help="auto | cpu | cuda, resolved where each task runs "
                                                               "(auto: CUDA when the worker has a GPU)"),
          overwrite: bool = typer.Option(False, help="replace the results of an earlier audit in --out (its "
                                         "model cache is kept and reused)"),
          quiet: bool = QUIET_OPTION,
          method: Optional[list[str]] = typer.Option(
              None, "--method", help="your own method as module:Class (a ForgettingMethod subclass), audited with "
                                     "the others; repeatable"),
          logits: Optional[list[Path]] = typer.Option(
              None, "--logits", help="audit a pool trained elsewhere: a scrubnet-audit-logits/1 .npz file per "
                                     "method (README, 'Per-example audits'); repeatable; no pool is trained")):
    """Per-example audit of forgetting methods: U-LiRA and the NeurIPS-2023 ε-score over a pool of models.

    --out must be new, empty, or hold only the model cache of an interrupted audit (which resumes); an
    earlier audit's results are replaced only with --overwrite."""
    resolve_device(device)  # validate here; Ray workers resolve "auto" on their own machine
    if seed is not None and seed < 0:
        raise UserError(f"--seed must be ≥ 0, got {seed}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if logits:
        _audit_logits(out, list(logits), seed, overwrite, other_inputs=bool(
            method or methods is not None or config is not None or pool is not None or eps_models is not None))
        return
    user = [load_user_method(spec) for spec in (method or [])]
    cfg = load_config(config) if config else ExperimentConfig.from_dict({})
    if user and (methods is not None or cfg.methods is not None):
        # an explicit list gets the user's methods added; without one, they are registered like the built-ins
        base = [m.strip() for m in methods.split(",") if m.strip()] if methods is not None else cfg.methods
        methods = ",".join(dict.fromkeys(base + user))
    if methods is not None:
        cfg.methods = [m.strip() for m in methods.split(",") if m.strip()]
        if not cfg.methods:
            raise UserError("--methods: empty list")
    default_plan(["original"], pool=pool, eps_models=eps_models)  # ranges, before the data are built
    require_out_dir(out)
    split = get_split(cfg)
    # class-only methods (hiding) need a whole forgotten class; the pool's forget sets are per-example subsets
    chosen = [m for m in resolve_methods(cfg, split) if not method_class(m).class_only]
    if not chosen:
        raise UserError("no method to audit (class-only methods cannot be audited on per-example forget sets)")
    plan = default_plan(chosen, pool=pool, eps_models=eps_models)
    prepare_output_dir(out, overwrite, AUDIT_OUTPUTS, resumable=("cache",))  # every input checked: now clean
    eng = make_engine(engine, address=address, num_cpus=ray_cpus, max_retries=max_retries)
    try:
        results = run_audit(cfg, chosen, out, plan=plan, engine=eng, audit_seed=seed, threads=threads,
                            device=device, progress=not quiet, console=console, user_methods=list(method or []))
    finally:
        eng.close()
    print_summary(results)
    for w in audit_warnings(results):
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'audit.json'}, {out / 'audit.md'}, roc.png, epsilon_hist.png "
                  f"({results['seconds']:.0f} s)")


def _audit_logits(out: Path, logits: list[Path], seed: Optional[int], overwrite: bool, other_inputs: bool) -> None:
    """``--logits``: audit pools trained elsewhere (no pool is trained here)."""
    if other_inputs:
        raise UserError("--logits audits the given files only: drop --method/--methods/--config/--pool/--eps-models")
    require_out_dir(out)
    res = audit_logits_files(logits, seed=0 if seed is None else seed)
    prepare_output_dir(out, overwrite, AUDIT_OUTPUTS, resumable=("cache",))
    res = {"config": {"logits_files": [str(p) for p in logits]}, **res}
    write_logits_audit(res, out)
    console.print(f"wrote {out / 'audit.json'}, {out / 'audit.md'}")


def print_summary(results: dict) -> None:
    """The terminal table (rates in %, as every human-facing table): the game (50 % ideal), its interval,
    retrain-OUT, retain leakage (points), KLoM (nats), the ε forget score (0–1)."""
    t = Table(title="per-example audit (game 50 %, leakage 0, KLoM 0 and ε forget score 1 are ideal)")
    for c in ("method", "game bal. acc. %", "95 % CI %", "retrain-OUT %", "retain leakage (points)",
              "KLoM forget (nats)", "ε forget, 0–1 (U=R)"):
        t.add_column(c, no_wrap=True)
    for m, d in results["methods"].items():
        ci = d.get("ulira_game_balanced_accuracy_ci95")
        eps = d.get("epsilon_forget_score")
        t.add_row(m, _pct(d["ulira_game_balanced_accuracy"]), f"[{_pct(ci[0])}, {_pct(ci[1])}]" if ci else "–",
                  _pct(d.get("ulira_retrain_out_balanced_accuracy")), _pct(d.get("retain_leakage"), "+.1f"),
                  _fmt(d.get("klom_forget"), ".2f"),
                  f"{eps:.3f} ({d['epsilon_u']})" if eps is not None else "–")
    console.print(t)


def _pct(v, spec: str = ".1f") -> str:
    return "–" if v is None else format(100 * v, spec)


def _fmt(v, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)
