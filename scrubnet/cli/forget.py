"""``scrubnet forget`` and ``scrubnet evaluate``: scrub a checkpoint (scrubnet's own, or the user's model given
as ``--model/--weights/--data``) and measure every readout against a retrain reference. The loading, scrubbing
and saving live in :mod:`scrubnet.experiments.checkpoints` and :mod:`scrubnet.own_model`; here the options
are parsed, checked and the results printed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from scrubnet.cli.common import (DATA_HELP, DEVICE_OPTION, MODEL_OPTION_HELP, OWN_MODEL_HELP, RECIPE_HELP,
                                 WEIGHTS_HELP, UserError, console, parse_bytes, parse_options, progress_with_eta,
                                 read_forget_ids, refuse_existing_file, require_writable, threads_option)
from scrubnet.atomic_io import atomic_write_json
from scrubnet.device import resolve_device
from scrubnet.experiments.checkpoints import load_companion, load_for_forgetting, recorded_original, save_scrubbed
from scrubnet.experiments.report import format_readout, readout_unit
from scrubnet.experiments.runner import SeedRun, evaluate as eval_fn
from scrubnet.methods.base import available_methods, method_class, protocol_method
from scrubnet.readouts.forgetting import verdict_lines
from scrubnet.scrub import scrub_and_measure
from scrubnet.cost_guard import budgeted_options, price_call, recipe_refusal
from scrubnet.data.stream import as_stream
from scrubnet.training.cost import check_budget, format_bytes, format_seconds
from scrubnet.own_model import evaluate_own, forget_own
from scrubnet.tuning.profile import TunedProfile


def _own_model_args(checkpoint, model, weights, data, recipe, model_option, force,
                    reference_flag: str | None = None, train: str | None = None) -> bool:
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
                             ("--force", force or None), ("--train", train)) if v is not None]
    if extras:
        raise UserError(f"{', '.join(extras)} apply to your own model (--model/--weights/--data); a scrubnet "
                        "checkpoint carries its training configuration in its sidecar")
    if reference_flag is not None:
        raise UserError(f"{reference_flag} is required with --checkpoint")
    return False


def _refuse_own_retrain_family(method: str, own: bool) -> None:
    cls = method_class(method)
    if cls is not None and cls.own_retrain_family:
        if own:
            raise UserError(f"--method {method} trains its own mixed-linear model from scrubnet's core/task split; "
                            "it does not apply to --model")
        raise UserError(f"--method {method} trains its own mixed-linear model, which is not a checkpoint of "
                        f"this architecture; use `scrubnet mlforget train` and `scrubnet mlforget forget` for "
                        "ML-Forgetting on checkpoints")


def _budget_check(method: str, opts: dict, dry_run: bool, max_seconds: Optional[float], memory: Optional[str],
                  max_cost_vs_retrain: Optional[float] = None, json_out: Optional[Path] = None):
    """The cost estimate as a ``before_scrub`` hook: printed for --dry-run beside the retraining estimate, with
    the recipe check's verdict (then True: stop), checked against the budgets (a refusal raises); False when
    nothing asks for it. The hook takes (model, D_r, D_f, ctx) with D_r, D_f as (x, y) tensors."""
    max_bytes = parse_bytes(memory) if memory is not None else None
    if max_seconds is not None and not 0 < max_seconds < float("inf"):
        raise UserError(f"--max-seconds must be a finite number > 0, got {max_seconds}")
    if max_cost_vs_retrain is not None and not 0 < max_cost_vs_retrain < float("inf"):
        raise UserError(f"--max-cost-vs-retrain must be a finite number > 0, got {max_cost_vs_retrain}")

    def budget(net, retain, forget_set, ctx) -> bool:
        if not (dry_run or max_seconds is not None or max_bytes is not None or max_cost_vs_retrain is not None):
            return False
        r_s, f_s = as_stream(retain), as_stream(forget_set)
        est, ref = price_call(method, opts, net, r_s, f_s, ctx)
        if est is None:
            raise UserError(f"method {method!r} declares no cost estimate")
        if ctx.start is None:  # a user's model: scrubnet.forget runs the budgeted mode when the full one is dearer
            target = 1.0 if max_cost_vs_retrain is None else min(1.0, max_cost_vs_retrain)
            budgeted = budgeted_options(method, opts, net, r_s, f_s, ctx, est, target)
            est = est if budgeted is None else budgeted[1]
        if dry_run:
            _print_estimate(est, ref, recipe_refusal(method, net, as_stream(retain), ctx))
            if json_out is not None:
                atomic_write_json(json_out, est.as_dict())
                console.print(f"wrote {json_out}", highlight=False)
            return True
        check_budget(est, max_seconds=max_seconds, max_bytes=max_bytes, max_cost_vs_retrain=max_cost_vs_retrain)
        return False
    return budget


def auto_method(method: str, option: list[str], profile: Optional[Path], own: bool):
    """(method, options, profile) of ``--method auto --profile P``: the profile's choice, its tuned options
    (``--option`` values override them); unchanged for any other method (``--profile`` refused with one)."""
    if method != "auto":
        if profile is not None:
            raise UserError("--profile applies to --method auto")
        return method, option, None
    if profile is None or not own:
        raise UserError("--method auto needs --profile (written by `scrubnet tune`) and your own model "
                        "(--model/--weights/--data)")
    try:
        tuned = TunedProfile.load(profile)
    except ValueError as e:
        raise UserError(str(e)) from None
    given = {o.split("=", 1)[0] for o in option}
    tuned_opts = [f"{k}={json.dumps(v)}" for k, v in tuned.options.items() if k not in given]
    console.print(f"auto: {tuned.method} — {tuned.chosen['why']}", highlight=False, soft_wrap=True)
    return tuned.method, tuned_opts + list(option), tuned


def _print_estimate(est, ref, refusal: Optional[str]) -> None:
    """The estimate and the retraining estimate side by side, the ratio, and the recipe check's verdict."""
    t = Table(title=f"cost of {est.method} against retraining (this machine, one thread)")
    for col in ("", est.method, ref.method):
        t.add_column(col)
    t.add_row("time", format_seconds(est.seconds), format_seconds(ref.seconds))
    t.add_row("FLOPs", f"{est.flops:.3g}", f"{ref.flops:.3g}")
    t.add_row("peak memory", format_bytes(est.peak_bytes), format_bytes(ref.peak_bytes))
    t.add_row("passes over D_r", f"{est.passes:.4g}", f"{ref.passes:.4g}")
    console.print(t)
    console.print(f"cost_vs_retrain: {est.cost_vs_retrain:.3g}", highlight=False)
    if est.details.get("budgeted"):
        console.print(f"budgeted mode (the full method costs more than retraining): {est.details['budgeted']}",
                      highlight=False)
    if refusal is not None:
        console.print(f"would be refused by the recipe check: {refusal}", highlight=False, soft_wrap=True)


def forget(checkpoint: Optional[Path] = typer.Option(None, help="a checkpoint scrubnet trained (.safetensors with "
                                                    "sidecar); for your own model give --model/--weights/--data"),
           forget_ids: Path = typer.Option(..., help="file of forget ids (positions in D; for --data, in x_train)"),
           method: str = typer.Option(..., help="scrubbing method: " + ", ".join(
               m for m in available_methods() if not method_class(m).own_retrain_family) + "; or auto (with "
               "--profile: the method `scrubnet tune` chose for this model)"),
           out: Optional[Path] = typer.Option(None, "--out", help="where to write the scrubbed checkpoint (not "
                                              "needed with --dry-run)"),
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
           threads: int = threads_option(), device: str = DEVICE_OPTION,
           dry_run: bool = typer.Option(False, "--dry-run", help="print the cost estimate and do nothing else"),
           json_out: Optional[Path] = typer.Option(None, "--json", help="with --dry-run: also write the estimate "
                                                   "as JSON to this file"),
           max_seconds: Optional[float] = typer.Option(None, help="refuse (exit 2) when the estimated time on this "
                                                        "machine exceeds it"),
           memory: Optional[str] = typer.Option(None, help="refuse (exit 2) when the estimated peak memory exceeds "
                                                 "it (e.g. 2GiB, 500MB, bytes)"),
           warn_not_forgotten: bool = typer.Option(False, "--warn-not-forgotten", help="write the scrub even when "
                                                   "the forgetting verdict (D_f against the test data) is "
                                                   "did_not_forget or moved_wrong_way; default: that fails"),
           max_cost_vs_retrain: Optional[float] = typer.Option(
               None, help="refuse (exit 2) before any work when the estimate exceeds this many of your retrainings "
                          "(measured: --train, else the recipe reproduced)"),
           train: Optional[str] = typer.Option(None, "--train", help="FILE.py:FUNCTION (or MODULE:FUNCTION): your "
                                               "own training, train(model, (x, y)) -> model; --method retrain runs "
                                               "it on D_r and the cost against retraining times it"),
           profile: Optional[Path] = typer.Option(None, help="with --method auto: the tuned profile `scrubnet "
                                                  "tune` wrote for this model (JSON)"),
           references: Optional[Path] = typer.Option(None, "--references", help="the reference models `scrubnet "
                                                     "references` wrote for these weights and data: the "
                                                     "forgetting verdict's scores are calibrated by them")):
    """Scrub a checkpoint: forget the given sample ids with one method, write the scrubbed checkpoint.

    Your own model: --model FILE.py:FACTORY --weights W --data D.npz [--recipe R.toml]; the scrubbed weights
    are written as safetensors with a sidecar (hashes, recipe, method, ids). A failed scrub writes nothing.

    With test data (the split's test set; x_test/y_test in --data) the forgetting verdict is printed: does D_f
    now look like data the model never saw? A forgetting method ending at did_not_forget or moved_wrong_way
    fails unless --warn-not-forgotten. --references DIR (written once by `scrubnet references`) calibrates it."""
    own = _own_model_args(checkpoint, model, weights, data, recipe, model_option, force, train=train)
    if references is not None and not own:
        raise UserError("--references applies to your own model (--model/--weights/--data); `scrubnet run "
                        "--references N` trains them for scrubnet's protocol")
    if references is not None and not (Path(references) / "references.json").is_file():
        raise UserError(f"--references {references} holds no reference models (no references.json): write them "
                        "with `scrubnet references`")
    if json_out is not None and not dry_run:
        raise UserError(f"--json {json_out} applies to --dry-run only")
    if out is None and not dry_run:
        raise UserError("--out is required (where to write the scrubbed checkpoint), except with --dry-run")
    if out is not None:
        refuse_existing_file(out, overwrite, inputs=(checkpoint or weights,))
    if json_out is not None:
        require_writable(json_out)
    method, option, tuned = auto_method(method, option, profile, own)
    _refuse_own_retrain_family(method, own)
    opts = parse_options(option)
    protocol = getattr(method_class(method), "protocol_options", {}) if not own else {}
    budget = _budget_check(method, {**protocol, **opts}, dry_run, max_seconds, memory, max_cost_vs_retrain, json_out)
    on_not_forgotten = "warn" if warn_not_forgotten else "fail"
    if own:
        with progress_with_eta():
            meta = forget_own(spec=model, options=parse_options(model_option, "--model-option"), weights=weights,
                              data=data, forget_ids=read_forget_ids(forget_ids), method=method, method_options=opts,
                              recipe_path=recipe, out=out, seed=0 if seed is None else seed, force=force,
                              device=resolve_device(device), before_scrub=budget, on_not_forgotten=on_not_forgotten,
                              train_spec=train, profile=tuned, references=references)
        if meta is not None:
            v = meta.get("forgetting")
            _print_verdict(v, meta.get("warnings", []))
            console.print(f"wrote {out} ({method}, |D_f| = {len(meta['forget_ids'])})")
        return
    dev = resolve_device(device)
    net, meta, split, ctx, _ = load_for_forgetting(checkpoint, read_forget_ids(forget_ids), dev)
    m = protocol_method(method, **opts)
    if seed is not None:
        ctx.seed = seed
    if budget(net, split.retain, split.forget, ctx):
        return
    with progress_with_eta():  # the one scrub path: the same failure rules as scrubnet.forget
        checked = scrub_and_measure(m, net, split.retain, split.forget, ctx,
                                    test=split.test if len(split.y_test) else None, on_not_forgotten=on_not_forgotten)
    if not checked.ok:  # nothing is written for a scrub that did not do what it claims
        raise UserError(f"method {method!r} failed: " + "; ".join(checked.reasons))
    res = checked.scrub
    save_scrubbed(out, res.model, checkpoint, meta,
                  {"role": "scrubbed", "method": method, "method_options": opts,
                   "forget_ids": split.forget_idx.tolist(),
                   "info": {k: float(v) for k, v in res.info.items() if isinstance(v, (int, float))},
                   "forgetting": None if checked.forgetting is None else checked.forgetting.to_dict(),
                   "warnings": list(checked.warnings)})
    _print_verdict(None if checked.forgetting is None else checked.forgetting.to_dict(), checked.warnings)
    console.print(f"wrote {out} ({method}, |D_f| = {len(split.forget_idx)})")


def _print_verdict(verdict: dict | None, warnings: list[str]) -> None:
    """The forgetting verdict on a few short lines (or why there is none) and the scrub's warnings."""
    if verdict is not None:
        lines = verdict_lines(verdict)
    elif any(w.startswith("no forgetting verdict") for w in warnings):
        lines = ["forgetting verdict: none (see the warning)"]
    else:
        lines = ["forgetting verdict: none (no test data to compare D_f with)"]
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    for w in warnings:
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)


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
             threads: int = threads_option(), device: str = DEVICE_OPTION):
    """Every readout of a checkpoint against a retrain reference. The re-learn threshold comes from
    --original, else from the source checkpoint recorded in a scrubbed checkpoint's sidecar; the reference
    and the original must have been trained on the same data (fingerprints compared).

    Your own model (--model/--weights/--data): error and loss on D_r, D_f and the test set, and against
    --reference when given (its readouts, output L1 distances, weight distance)."""
    own = _own_model_args(checkpoint, model, weights, data, None, model_option, False,
                          reference_flag="--reference" if reference is None and checkpoint is not None else None)
    dev = resolve_device(device)
    if json_out is not None:
        require_writable(json_out)
    ids = read_forget_ids(forget_ids) if forget_ids is not None else None
    if own:
        if original is not None:
            raise UserError("--original applies to --checkpoint (the re-learn readout of scrubnet's protocol)")
        r = evaluate_own(spec=model, options=parse_options(model_option, "--model-option"), weights=weights,
                         data=data, forget_ids=ids, reference=reference, device=dev)
        _print_readouts(f"readouts of {weights.name}", r, json_out)
        return
    net, meta, split, ctx, cfg = load_for_forgetting(checkpoint, ids, dev)
    if forget_ids is None and meta.get("forget_ids"):
        split = split.with_forget(meta["forget_ids"]).to(dev)
    ref = load_companion(checkpoint, meta, reference, dev)
    if original is None:
        original = recorded_original(checkpoint, meta)
    # without an original (no scrub recorded in its sidecar) the checkpoint is itself the original
    orig = load_companion(checkpoint, meta, original, dev) if original is not None else net
    sr = SeedRun(ctx.seed, split, ctx.start or net, orig, ref, ctx, cfg)
    r = eval_fn(net, sr, original=orig, reference=ref)
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
