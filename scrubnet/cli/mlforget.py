"""``scrubnet mlforget``: train a Mixed-Linear model into a checkpoint directory and apply forgetting
requests to it (each applied exactly once and recorded in the checkpoint's SQLite request store; see
:mod:`scrubnet.mlforget.store`).

    scrubnet mlforget train --out ml/ [--dataset mnist1d --seed 0 --ml-options '{"mu": 0.05}']
    scrubnet mlforget finetune --model FILE.py:FACTORY|hf:DIR [--weights W] --data D.npz \
        --user-weights lora:query,value:r4:save=classifier|head|layers:a,b --out ml-ft/ [--mu 0.05|auto]
        [--core-ids 0,1,2 [--core-lr 0.01 --core-epochs 40] [--no-core-check]]
        [--strategy linearised|sharded|auto [--shards 4|auto --slices 4 --epochs 20 --lr 1e-3 --batch-size 32]]
        [--task generalisation|memorisation]
    scrubnet mlforget forget --checkpoint ml/ --ids 3,17,42 [--sigma 1e-4]     (ids = positions in D)
    scrubnet mlforget forget --checkpoint ml/ --forget-ids ids.txt
    scrubnet mlforget forget-all --checkpoint ml/
    scrubnet mlforget show --checkpoint ml/ [--json]

The checkpoint may also be given as the first argument.

Bad input gives one line ``error: …`` on stderr and exit code 2; nothing partial is written.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import torch
import typer

from scrubnet._config import tiny_mode
from scrubnet.cli.common import (DATA_HELP, MODEL_OPTION_HELP, UserError, json_option, parse_options, read_ids, require_cpu,
                                 require_writable, threads_option)
from scrubnet.data import DataConfig, load_split
from scrubnet.experiments.checkpoints import ml_data_loader
from scrubnet.experiments.config import TINY_EXPERIMENT
from scrubnet.data.user import load_user_data
from scrubnet.methods.mlforget import ml_config_from_options
from scrubnet.mlforget.finetune import state_dict_sha256
from scrubnet.mlforget.chance import TASKS
from scrubnet.mlforget.preflight import (STRATEGIES, TOLERANCE, choose_shards, fit_engine, memorisation_decision,
                                        preflight)
from scrubnet.mlforget.sharded import AGGREGATES, ENGINE as SHARDED
from scrubnet.mlforget.ftstore import (DTYPES, FINETUNE_ARCH, base_record, cast_inputs, default_weights, finetune_record,
                                      load_base, main_input, parse_user_weights)
from scrubnet.models.call import call_model
from scrubnet.mlforget.pipeline import train_ml
from scrubnet.mlforget.store import forget as store_forget, forget_everything, save_new, upgrade as store_upgrade
from scrubnet.serve import receipts
from scrubnet.serve.anchor import FINGERPRINT_ENV, verify_pinned  # the chain, receipts, head, tree heads
from scrubnet.training import TrainConfig

mlforget_app = typer.Typer(add_completion=False, no_args_is_help=True,
                           help="ML-Forgetting on checkpoints: train, finetune, forget, forget-all, show.")

DEVICE_HELP = ("auto | cpu | cuda; the mixed-linear computations run on the CPU, so auto means the CPU here "
               "and cuda is refused")


def _checkpoint(positional: Optional[Path], option: Optional[Path]) -> Path:
    if (positional is None) == (option is None):
        raise UserError("give the checkpoint directory once: as the argument or with --checkpoint")
    return positional if positional is not None else option


CHECKPOINT_ARG = typer.Argument(None, help="ML checkpoint directory (or --checkpoint)", show_default=False)
CHECKPOINT_OPT = typer.Option(None, "--checkpoint", help="ML checkpoint directory", show_default=False)
THREADS_HELP = "torch CPU threads (1: numbers independent of the core count)"


def _configs(dataset: str, data_dir: Optional[Path], data_options, model_options, train_options, ml_options):
    """(DataConfig, TrainConfig, MLConfig, architecture options): SCRUBNET_TINY's sizes, then the JSON options."""
    tiny = TINY_EXPERIMENT if tiny_mode() else {}  # SCRUBNET_TINY=1: the tiny experiment's sizes
    try:
        dcfg = DataConfig.from_dict({**tiny.get("data", {}), "dataset": dataset,
                                     "data_dir": str(data_dir) if data_dir else None,
                                     **json_option(data_options, "--data-options")})
        tcfg = TrainConfig.from_dict({**TrainConfig().to_dict(), **tiny.get("train", {}),
                                      **json_option(train_options, "--train-options")})
        mcfg = ml_config_from_options(json_option(ml_options, "--ml-options"))
    except TypeError as e:  # an unknown field of a configuration
        raise UserError(str(e)) from None
    mopts = {**tiny.get("model_options", {}), **json_option(model_options, "--model-options")}
    return dcfg, tcfg, mcfg, mopts


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
          threads: int = threads_option(THREADS_HELP),
          device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Pre-train, train the core weights (CE) and the user weights (linear, MSE); save the checkpoint.

    The data configuration's forget set (the default experiment's D_f, also written by `scrubnet train` as
    forget_ids.txt) is kept out of the never-forgettable core, so those ids can always be forgotten."""
    require_cpu(device)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new checkpoint directory")
    require_writable(out)
    dcfg, tcfg, mcfg, mopts = _configs(dataset, data_dir, data_options, model_options, train_options, ml_options)
    split = load_split(dcfg)
    state = train_ml(split, mcfg, tcfg, seed, model_name=model, model_options=mopts)
    save_new(out, state, arch=model, in_shape=split.input_shape, arch_options=mopts, data=dcfg.to_dict(),
             data_fingerprint=split.fingerprint(), extra={"train_config": tcfg.to_dict()})
    typer.echo(f"wrote {out}: {len(state.user_ids)} user samples, {len(state.core_ids)} core samples "
               f"(never forgettable), {state.model.num_linearized} user weights")


#: the largest --target-scale accepted: the regression targets s·onehot enter squared sums (s ≤ 1e6 keeps
#: every sum far from float64's range, and no use needs more: 5 is the default)
MAX_TARGET_SCALE = 1e6


def _check_finetune_options(mu: str, target_scale: float, sigma: float, dtype: str, core_lr: float,
                            core_epochs: int):
    """µ (a float or 'auto') after checking every numeric option of ``finetune``; a ``UserError`` naming the
    option and its value before any work."""
    try:
        mu_value = mu if mu == "auto" else float(mu)
    except ValueError:
        raise UserError(f"--mu must be a number > 0 or 'auto', got {mu!r}") from None
    if mu_value != "auto" and not (math.isfinite(mu_value) and mu_value > 0):
        raise UserError(f"--mu must be a finite number > 0 or 'auto', got {mu}")
    if not (math.isfinite(target_scale) and 0 < target_scale <= MAX_TARGET_SCALE):
        raise UserError(f"--target-scale must be a finite number in (0, {MAX_TARGET_SCALE:g}], got {target_scale:g}")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise UserError(f"--sigma must be a finite number ≥ 0, got {sigma:g}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not (math.isfinite(core_lr) and core_lr > 0):
        raise UserError(f"--core-lr must be a finite number > 0, got {core_lr:g}")
    if core_epochs < 1:
        raise UserError(f"--core-epochs must be ≥ 1, got {core_epochs}")
    return mu_value


def finetune(out: Path = typer.Option(..., "--out", help="new checkpoint directory (must not exist)"),
             model: str = typer.Option(..., "--model", help="the pretrained model: FILE.py:FACTORY, "
                                       "MODULE:FACTORY or hf:DIR (a HuggingFace directory, nothing downloaded)"),
             weights: Optional[Path] = typer.Option(None, "--weights", help="its weights (.safetensors or a "
                                                    "torch.save state_dict); default for hf:DIR: "
                                                    "DIR/model.safetensors"),
             data: Path = typer.Option(..., "--data", help=DATA_HELP),
             user_weights: str = typer.Option("head", "--user-weights", help="head | layers:A,B | "
                                              "lora:T1,T2:rR[:aALPHA][:save=M1,M2] (LoRA B on the nn.Linear "
                                              "modules T1, T2; the modules M also user weights)"),
             model_option: list[str] = typer.Option([], "--model-option", help=MODEL_OPTION_HELP),
             mu: str = typer.Option("0.05", help="µ of the ridge (µ/2)‖w_u‖², or 'auto': picked on 10 % of the "
                                    "deletable samples held out (the best µ falls with N; 0.05 is ML-Forgetting's)"),
             target_scale: float = typer.Option(5.0, help="s of the s·one-hot regression target"),
             sigma: float = typer.Option(1e-4, help="default noise std of the deletion requests"),
             solver: str = typer.Option("auto", help="auto | primal | cg (dual: tensor inputs only)"),
             dtype: str = typer.Option("float64", help="float64 (exact deletions) | float32"),
             seed: int = typer.Option(0, help="seed of the LoRA factors A and the requests' noise"),
             core_ids: Optional[str] = typer.Option(None, "--core-ids", help="samples that will never be deleted "
                                                    "('0,1 2' or '[0, 1, 2]'): the user weights are first "
                                                    "fine-tuned the ordinary way on them and the model is "
                                                    "linearised there (closes most of the accuracy gap); "
                                                    "requests naming them are refused"),
             core_ids_file: Optional[Path] = typer.Option(None, "--core-ids-file",
                                                          help="a file of core sample ids (formats of --ids)"),
             core_lr: float = typer.Option(1e-2, help="learning rate of the core fine-tuning (Adam, CE)"),
             core_epochs: int = typer.Option(40, help="epochs of the core fine-tuning"),
             core_check: bool = typer.Option(True, "--core-check/--no-core-check",
                                             help="compare the core point with the pretrained point on held-out "
                                             "samples and drop a core that makes the model worse (off: your "
                                             "own validation decides)"),
             strategy: str = typer.Option("linearised", "--strategy", help="the exact engine: linearised "
                                          "(closed-form deletion of a linearised fine-tune) | sharded (ordinary "
                                          "fine-tuning of isolated adapters; a deletion retrains its shard) | auto "
                                          "(a pre-flight on held-out data chooses, and says why)"),
             shards: str = typer.Option("4", "--shards", help="sharded: S, isolated adapters, or auto (the "
                                        "largest S whose shard-sized ordinary fine-tune is within --tolerance of "
                                        "the whole data's, on the pre-flight's held-out split)"),
             slices: int = typer.Option(4, "--slices", help="sharded: R, slices (checkpoints) per shard"),
             epochs: int = typer.Option(20, "--epochs", help="sharded: epochs budget of each shard (and of the "
                                        "pre-flight's ordinary fine-tuning on half the data)"),
             lr: float = typer.Option(1e-3, "--lr", help="sharded: Adam learning rate"),
             batch_size: int = typer.Option(32, "--batch-size", help="sharded: batch size"),
             aggregate: str = typer.Option("mean", "--aggregate", help="sharded: mean (of probabilities) | vote"),
             tolerance: float = typer.Option(TOLERANCE, "--tolerance", help="auto: the largest held-out error gap "
                                             "(linearised − ordinary) that keeps the linearised engine"),
             task: str = typer.Option("generalisation", "--task", help="what the chance guard scores: "
                                      "generalisation (held-out samples) | memorisation (facts about the training "
                                      "people, e.g. TOFU: the model that answers, on its own training answers)"),
             threads: int = threads_option(THREADS_HELP),
             device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Fine-tune a pretrained model forgettably on your data (the base model is read, never modified) and save
    the checkpoint: `scrubnet mlforget forget`, `show` and `scrubnet serve` then work on it."""
    require_cpu(device)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new checkpoint directory")
    require_writable(out)
    mu_value = _check_finetune_options(mu, target_scale, sigma, dtype, core_lr, core_epochs)
    if shards != "auto":
        try:
            shards = int(shards)
        except ValueError:
            raise UserError(f"--shards must be an integer ≥ 1 or 'auto', got {shards!r}") from None
        if shards < 1:
            raise UserError(f"--shards must be ≥ 1, got {shards}")
    _check_strategy(strategy, 2 if shards == "auto" or task == "memorisation" else shards, slices, epochs, lr,
                    batch_size, aggregate, tolerance)
    if task not in TASKS:
        raise UserError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "memorisation" and shards == "auto":
        raise UserError("--shards auto reads held-out errors, which a memorisation task cannot answer: give a number")
    if task == "memorisation" and mu_value == "auto" and strategy != "sharded":
        raise UserError("--mu auto chooses µ on held-out samples, which a memorisation task cannot answer: give a "
                        "fixed --mu (or --strategy sharded)")
    core = None if core_ids is None and core_ids_file is None else \
        read_ids(core_ids, core_ids_file, "--core-ids or --core-ids-file")
    if core is not None and len(set(core)) != len(core):
        dup = sorted({i for i in core if core.count(i) > 1})
        raise UserError(f"--core-ids names sample {dup[0]} more than once ({len(dup)} duplicated id"
                        f"{'s' if len(dup) > 1 else ''}); give each core sample once")
    spec = parse_user_weights(user_weights)
    base = base_record(model, default_weights(model, weights), parse_options(model_option, "--model-option"),
                       dtype)
    net = load_base(base)
    ud = load_user_data(data)
    x = cast_inputs(ud.x, dtype)
    with torch.no_grad():
        c = int(call_model(net, x[:1]).shape[-1 if ud.y.dim() == 2 else 1])
    ud.check_labels(c)
    if core is not None and (min(core) < 0 or max(core) >= len(ud.y) or len(set(core)) >= len(ud.y)):
        raise UserError(f"--core-ids must name 1 to {len(ud.y) - 1} distinct samples in [0, {len(ud.y)})")
    sharded_opts = {"shards": shards, "slices": slices, "epochs": epochs, "lr": lr, "batch_size": batch_size,
                    "aggregate": aggregate}
    engine, decision = strategy, None
    if strategy == "auto" and task == "memorisation":
        decision = memorisation_decision()
        engine = decision["engine"]
        typer.echo(f"strategy auto={engine}: {decision['reason']}")
    elif strategy == "auto":
        decision = preflight(net, x, ud.y, c, user_weights=spec, tolerance=tolerance, target_scale=target_scale,
                             solver=solver, seed=seed, budget={"epochs": epochs, "lr": lr,
                                                                "batch_size": batch_size})
        engine = decision["engine"]
        typer.echo(f"strategy auto={engine}: {decision['reason']}")
    if engine == SHARDED and core is not None:
        raise UserError("--core-ids belong to the linearised engine; the sharded engine can delete every sample")
    shard_choice = None
    if engine == SHARDED and shards == "auto":
        shard_choice = choose_shards(net, x, ud.y, c, user_weights=spec, tolerance=tolerance, seed=seed,
                                     budget={"epochs": epochs, "lr": lr, "batch_size": batch_size})
        shards = shard_choice["shards"]
        typer.echo(shard_choice["reason"])
        if shards < 2:  # the out-of-shard chance check needs a second shard; S = 1 is judged on held-out data
            shards = 2
            typer.echo("shards 2: the chance guard scores each shard on the other's samples (S = 1 would need a "
                       "held-out split the engine does not train on)")
    sharded_opts["shards"] = shards
    state = fit_engine(engine, net, x, ud.y, c, user_weights=spec, seed=seed, sharded=sharded_opts,
                       linearised={"mu": mu_value, "target_scale": target_scale, "sigma": sigma, "solver": solver,
                                   "core_ids": core, "core_train": {"lr": core_lr, "epochs": core_epochs},
                                   "check_core": core_check}, task=task)
    if engine == SHARDED:
        state.base_sha256, state.user_weights = state_dict_sha256(net), state.model.spec
    state.base_sha256 = state_dict_sha256(net)  # the model file's, also when read through its label words
    record = finetune_record(base, state, data, out, engine=engine, task_kind=task, preflight=decision)
    if shard_choice is not None:
        record["shard_choice"] = shard_choice
    save_new(out, state, arch=FINETUNE_ARCH, in_shape=list(main_input(x).shape[1:]),
             data_fingerprint=ud.fingerprint, extra={"finetune": record})
    if engine == SHARDED:
        info, check = state.train_info, state.train_info["chance_check"]
        typer.echo(f"wrote {out}: sharded engine, {len(state.user_ids)} user samples (all deletable) in "
                   f"{shards} shards × {slices} slices (samples per shard {info['samples_per_shard']}), "
                   f"{state.model.num_linearized} user weights per shard; "
                   + ("training-answer error" if task == "memorisation" else "out-of-shard error")
                   + f" {check['error']:.3f} "
                   f"(chance {check['chance']:.3f}); base model {base['model']} (state_dict sha256 "
                   f"{state.base_sha256[:12]}, unchanged)")
        return
    kept = f"{len(state.core_ids)} never deletable (core)" if len(state.core_ids) else "all deletable"
    check = state.train_info.get("core_check")
    if check is not None:
        errs = (f"held-out error {check['core_error']:.3f} at the core point, {check['pretrained_error']:.3f} at "
                f"the pretrained point ({check['held_out']} samples)")
        typer.echo(f"core check: {errs}: kept" if check["kept"] else
                   f"core dropped: the core fine-tuning made the model worse ({errs}); linearised at the "
                   "pretrained point instead, every sample deletable (try a smaller --core-lr)")
    if "mu_search" in state.train_info:
        found = state.train_info["mu_search"]
        typer.echo(f"mu auto: {found['chosen']:g} (held-out error by mu: "
                   + ", ".join(f"{k} {v:.3f}" for k, v in found["errors"].items()) + ")")
    typer.echo(f"wrote {out}: {len(state.user_ids)} user samples ({kept}), {state.model.num_linearized} "
               f"user weights, {state.train_info.get('train_solver', '?')} solver; base model "
               f"{base['model']} (state_dict sha256 {state.base_sha256[:12]}, unchanged)")


def _check_strategy(strategy: str, shards: int, slices: int, epochs: int, lr: float, batch_size: int,
                    aggregate: str, tolerance: float) -> None:
    """``UserError`` naming a bad engine option before any work."""
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy != "linearised" and shards < 2:
        raise UserError(f"--shards must be ≥ 2 (each shard is checked on the others' samples; a memorisation "
                        f"task, checked on its own answers, may use 1), got {shards}")
    for name, v in (("--slices", slices), ("--epochs", epochs), ("--batch-size", batch_size)):
        if v < 1:
            raise UserError(f"{name} must be ≥ 1, got {v}")
    if not (math.isfinite(lr) and lr > 0):
        raise UserError(f"--lr must be a finite number > 0, got {lr:g}")
    if aggregate not in AGGREGATES:
        raise UserError(f"--aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}")
    if not (math.isfinite(tolerance) and 0 <= tolerance < 1):
        raise UserError(f"--tolerance must lie in [0, 1), got {tolerance:g}")


def forget(checkpoint: Optional[Path] = CHECKPOINT_ARG, checkpoint_opt: Optional[Path] = CHECKPOINT_OPT,
           ids: Optional[str] = typer.Option(None, help="sample ids (positions in D): '3,17 42' or '[3, 17, 42]'"),
           ids_file: Optional[Path] = typer.Option(None, "--forget-ids", "--ids-file",
                                                   help="file of sample ids, same formats as `scrubnet forget`"),
           sigma: Optional[float] = typer.Option(None, help="noise std (default: the checkpoint's)"),
           budget_nats: Optional[float] = typer.Option(None, "--budget-nats",
                                                       help="certified request: stop CG once KL(scrubbed ‖ "
                                                            "retrained) at σ is proven ≤ this many nats"),
           threads: int = threads_option(THREADS_HELP),
           device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Forget a set of user samples: one request, applied exactly once, recorded in the store."""
    require_cpu(device)
    ckpt = _checkpoint(checkpoint, checkpoint_opt)
    id_list = read_ids(ids, ids_file)
    if budget_nats is not None and not (budget_nats > 0 and budget_nats < float("inf")):
        raise UserError(f"--budget-nats must be a finite number > 0, got {budget_nats}")
    record, applied = store_forget(ckpt, id_list, sigma=sigma, data_loader=ml_data_loader, budget_nats=budget_nats)
    if applied:
        info = record["solver"]
        if info.get("factor_file_problem"):
            typer.echo(f"warning: {info['factor_file_problem']}; the factor was rebuilt from the data"
                       + (" and the file rewritten" if info.get("factor_file_rewritten") else ""), err=True)
        cert = info.get("certificate") or {}
        if cert.get("budget_nats") is not None:
            typer.echo(f"certificate: KL(scrubbed ‖ retrained) ≤ {cert['kl_bound_nats']:.3g} nats at σ = "
                       f"{cert['sigma']:g} (‖w − w*‖ ≤ {cert['weight_error_bound']:.3g})")
        if info.get("engine") == SHARDED:
            typer.echo(f"request #{record['id']}: forgot {record['n_ids']} samples, {record['n_remaining']} remain; "
                       f"sharded engine: retrained shard(s) {info['shards_retrained']} from slice(s) "
                       f"{info['from_slice']} ({info['sample_passes']} of the training's "
                       f"{info['full_sample_passes']} sample-passes), {record['seconds']:.2f} s")
            return
        typer.echo(f"request #{record['id']}: forgot {record['n_ids']} samples, {record['n_remaining']} remain; "
                   f"{info.get('solver')} solver ({info.get('iterations')} iterations), residual "
                   f"{float(info.get('relative_residual') or 0):.2e}, {record['seconds']:.2f} s")
    else:
        typer.echo(f"request already applied as #{record['id']} (nothing done)")


def forget_all_cmd(checkpoint: Optional[Path] = CHECKPOINT_ARG, checkpoint_opt: Optional[Path] = CHECKPOINT_OPT,
                   threads: int = threads_option(THREADS_HELP),
                   device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Forget all user data: the user weights are set to 0 (the model becomes the core model)."""
    require_cpu(device)
    record, applied = forget_everything(_checkpoint(checkpoint, checkpoint_opt))
    typer.echo(f"request #{record['id']}: user weights set to 0 ({record['n_ids']} user samples forgotten; the "
               "core samples stay in the core weights)" if applied
               else f"forget-all already applied as #{record['id']} (nothing done)")


def _pinned(checkpoint: Path, key: Optional[Path], fingerprint: Optional[str], retired: list) -> dict:
    """The record verified against the pinned key (never the file beside the data)."""
    if key is None:
        if retired:
            raise UserError("--retired-key needs --key (the current key)")
        return verify_pinned(checkpoint, fingerprint=fingerprint)
    try:
        return verify_pinned(checkpoint, receipts.load_public_key(key),
                             retired=[receipts.load_public_key(k) for k in retired])
    except receipts.ReceiptError as e:
        raise UserError(f"--key: {e}") from None


def show(checkpoint: Optional[Path] = CHECKPOINT_ARG, checkpoint_opt: Optional[Path] = CHECKPOINT_OPT,
         as_json: bool = typer.Option(False, "--json", help="print the record as one JSON object"),
         key: Optional[Path] = typer.Option(None, "--key", help="the service's public key (PEM or hex, from GET "
                                            "/v1/key, kept apart from the data) to check the signed record with"),
         fingerprint: Optional[str] = typer.Option(None, "--fingerprint", envvar=FINGERPRINT_ENV,
                                                   help="sha256 of the service's public key, instead of --key"),
         retired_key: Optional[List[Path]] = typer.Option(None, "--retired-key", help="a key the service signed "
                                                          "with before a rotation (with --key); repeatable"),
         threads: int = threads_option(THREADS_HELP),
         device: str = typer.Option("auto", "--device", help=DEVICE_HELP)):
    """Print the requests and verify the record chain: every field of the checkpoint's static record, of each
    request and of the state, and the chain of weight hashes (exit 2 naming any edited field)."""
    require_cpu(device)
    rec = _pinned(_checkpoint(checkpoint, checkpoint_opt), key, fingerprint, retired_key or [])
    st = rec["state"]
    if as_json:
        typer.echo(json.dumps({k: v for k, v in rec.items() if k != "leaf_hashes"}, indent=1))
    else:
        for r in rec["requests"]:
            typer.echo(f"#{r['id']:<4} {r['kind']:<10} {r['time_utc']}  ids={r['n_ids']:<5} "
                       f"remaining={r['n_remaining']:<6} {r['status']:<8} "
                       f"sha256 {str(r['sha256_before'])[:12]:<12} → {r['sha256_after'][:12]}")
        typer.echo(f"at request #{st['request_id']}: {len(st['forgotten_ids'])} user samples forgotten, "
                   f"{rec['n_core']} core (never forgotten)"
                   + ("; user weights dropped (forget-all)" if st["user_weights_dropped"] else ""))
        typer.echo("hash chain: valid" if rec["valid"] else "hash chain: BROKEN")
        if rec["key_fingerprint"] is not None:
            typer.echo(f"signed by key {rec['key_fingerprint']}" + (" (pinned)" if rec["key_pinned"] else
                                                                    " (NOT pinned)"))
    if not rec["valid"]:
        raise UserError("the checkpoint's record is inconsistent: " + "; ".join(rec["problems"]))


def upgrade(checkpoint: Optional[Path] = CHECKPOINT_ARG, checkpoint_opt: Optional[Path] = CHECKPOINT_OPT,
            threads: int = threads_option(THREADS_HELP)):
    """Bring a checkpoint of an earlier format to the current one (migrate a ledger checkpoint, seal an unsealed
    store); reading a checkpoint never does this. A current checkpoint is left untouched."""
    out = store_upgrade(_checkpoint(checkpoint, checkpoint_opt))
    typer.echo(f"upgraded {out['path']} from {out['from']} to {out['format']}" if out["upgraded"]
               else f"{out['path']} is already {out['format']} (nothing done)")
