"""``scrubnet bench --dataset tofu-synthetic``: forget people from a LoRA-fine-tuned causal LM, scored as the LLM
field scores it (:mod:`scrubnet.experiments.tofu`).

    scrubnet bench --dataset tofu-synthetic --dry-run                 # the plan: people, questions, models, trials
    scrubnet bench --dataset tofu-synthetic --quick --out runs/tofu-q # minutes on a CPU
    scrubnet bench --dataset tofu-synthetic --out runs/tofu           # the committed table (3 seeds)
    scrubnet bench --dataset tofu-synthetic --engine ray --out runs/tofu   # one Ray task per seed

Writes tofu.json, tofu.md and tofu.png, and prints the one-line result. Needs the ``tofu`` extra
(transformers, peft, faker).
"""
from __future__ import annotations

from pathlib import Path

from scrubnet.atomic_io import prepare_output_dir
from scrubnet.audit.engine import make_engine
from scrubnet.cli.common import UserError, console, parse_list
from scrubnet.experiments.tofu import EXACT_ENGINES, PRESETS, prepare, run_tofu, summary_line, tofu_config
from scrubnet.experiments.tofu_report import TOFU_OUTPUTS, write_tofu
from scrubnet.models.tiny_lm import make_lm

DATASET = "tofu-synthetic"


def tofu_options(quick: bool, seeds, methods, no_tune: bool, exact) -> "object":
    """The run's :class:`~scrubnet.experiments.tofu.TofuConfig` from the command's options (``UserError`` on
    a bad value)."""
    over = {}
    if seeds is not None:
        over["seeds"] = tuple(range(seeds))
    if methods is not None:
        names = parse_list(methods)
        over["methods"] = tuple(m for m in names if m not in ("original", "retrain"))
    if no_tune:
        over["tune"] = False
    if exact is not None:
        if exact not in EXACT_ENGINES:
            raise UserError(f"--exact {exact!r}: choose {' or '.join(EXACT_ENGINES)}")
        over["exact"] = exact
    try:
        return tofu_config("quick" if quick else "default", **over)
    except ValueError as e:
        raise UserError(f"--methods {methods!r}: {e}") from None


def dry_run(cfg) -> None:
    """Print what the run would build and train (builds the data: seconds; trains nothing)."""
    try:
        data, tok = prepare(cfg)
    except ImportError as e:
        raise UserError(f"--dataset {DATASET}: needs the tofu extra (pip install 'scrubnet[tofu]'): {e}") from None
    params = sum(p.numel() for p in make_lm(tok.get_vocab_size(), cfg.size).parameters())
    forget = data.forget(cfg.split)
    n_fine = 3 + (1 if cfg.exact == "retrain" else 0)
    trials = len(cfg.lr_grid) * len(cfg.methods) if cfg.tune else 0
    lines = [f"synthetic TOFU: {cfg.n_private} private + {cfg.n_public} public people, "
             f"{len(data.questions(range(cfg.n_private)))} fine-tuning pairs, "
             f"{sum(1 for q in data.qa if q.person == -1)} world facts; {cfg.split}: {len(forget)} people, "
             f"{len(data.questions(forget))} questions; validation: {len(data.forget('validation'))} other people",
             f"model: GPT-2 '{cfg.size}' ≈ {params / 1e6:.2f} M parameters, {tok.get_vocab_size()}-word tokenizer; "
             f"pretrain {cfg.pretrain_epochs} epochs; LoRA rank {cfg.lora_r}, {cfg.finetune_epochs} epochs",
             f"{len(cfg.seeds)} seed(s): {n_fine} fine-tunes each (original, retain, retain second seed"
             f"{', exact re-fine-tune' if cfg.exact == 'retrain' else ''})"
             f"{'' if cfg.exact == 'retrain' else f', the sharded engine ({cfg.shards} shards × {cfg.slices} slices) and one request'}"
             f", {len(cfg.methods)} approximate method(s) ({', '.join(cfg.methods) or 'none'})",
             f"tuning: {trials} trials ({len(cfg.lr_grid)} learning rates per method on the validation people)"
             if trials else "tuning: none (methods at their defaults)"]
    for ln in lines:
        console.print(ln, highlight=False)


def run(out: Path | None, *, quick: bool, dry: bool, seeds, methods, no_tune: bool, exact, engine: str, address,
        ray_cpus, max_retries: int, overwrite: bool, quiet: bool, unused: dict) -> None:
    """The ``--dataset tofu-synthetic`` branch of ``scrubnet bench``."""
    given = [k for k, v in unused.items() if v is not None]
    if given:
        raise UserError(f"{given[0]} {unused[given[0]]!r}: not used by --dataset {DATASET}")
    if seeds is not None and seeds < 1:
        raise UserError(f"--seeds {seeds}: must be ≥ 1")
    if engine not in ("local", "ray"):
        raise UserError(f"--engine {engine!r}: unknown engine; choose local or ray")
    cfg = tofu_options(quick, seeds, methods, no_tune, exact)
    if dry:
        return dry_run(cfg)
    if out is None:
        raise UserError("--out: missing (the output directory; only --dry-run runs without it)")
    prepare_output_dir(out, overwrite, TOFU_OUTPUTS)
    eng = make_engine(engine, address=address, num_cpus=ray_cpus, max_retries=max_retries)
    try:
        res = run_tofu(cfg, progress=None if quiet else (lambda s: console.print(s, highlight=False)), engine=eng)
    finally:
        eng.close()
    write_tofu(res, out)
    console.print(summary_line(res), highlight=False)
    console.print(f"wrote {out / 'tofu.json'}, {out / 'tofu.md'}, {out / 'tofu.png'} ({res['seconds']:.0f} s)")


__all__ = ["DATASET", "PRESETS", "run", "tofu_options", "dry_run"]
