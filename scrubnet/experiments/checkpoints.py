"""Checkpoints of the forgetting protocol: what ``scrubnet train`` writes, what ``scrubnet forget`` and
``scrubnet evaluate`` load back, and the data an ML-Forgetting checkpoint directory was trained on.

A protocol checkpoint (:mod:`scrubnet.checkpoint`) records its experiment configuration in its sidecar; the
split is regenerated from it and must reproduce the recorded data fingerprint. A scrubbed checkpoint names its
source and the start weights w_0, which are copied beside it so that it stays usable on its own. Every problem
is a :class:`scrubnet.checkpoint.CheckpointError` (a ``ValueError``) naming the file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scrubnet.atomic_io import atomic_write_text
from scrubnet.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint, sidecar_path
from scrubnet.data import DataConfig, load_split
from scrubnet.data.splits import Split
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.runner import SeedRun, get_split
from scrubnet.methods.base import ForgetContext, protocol_context
from scrubnet.mlforget.ftstore import finetune_data, is_finetune
from scrubnet.models.user import USER_ARCH

#: the files `scrubnet train` writes
TRAIN_OUTPUTS = ("start.safetensors", "original.safetensors", "retrain.safetensors", "forget_ids.txt")


def save_training(out: Path, cfg: ExperimentConfig, sr: SeedRun, seed: int) -> None:
    """Write the start (w_0), original and retrain checkpoints of one seed and ``forget_ids.txt`` into ``out``.

    Parameters
    ----------
    out : Path
        Directory (created if missing).
    cfg : ExperimentConfig
        The configuration recorded in every sidecar.
    sr : SeedRun
        The trained models and the split (its forget ids, positions in D, go into ``forget_ids.txt``).
    seed : int
        The training seed, recorded in the sidecars.
    """
    common = dict(arch=cfg.model, in_shape=sr.split.input_shape, num_classes=sr.split.num_classes,
                  arch_options=cfg.model_options, config=cfg.to_dict(), data_fingerprint=sr.split.fingerprint(),
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


def load_for_forgetting(checkpoint: Path, forget_ids: list[int] | None, device: torch.device
                        ) -> tuple[nn.Module, dict, Split, ForgetContext, ExperimentConfig]:
    """A protocol checkpoint with everything a scrub or an evaluation needs, all on ``device``.

    Parameters
    ----------
    checkpoint : Path
        A checkpoint written by ``scrubnet train`` or ``scrubnet forget``.
    forget_ids : list of int or None
        Positions in D to forget; None keeps the split's own forget set.
    device : torch.device
        Where the models and the split are moved.

    Returns
    -------
    (model, meta, split, ctx, cfg)
        The model (eval mode), its sidecar, the regenerated split with the forget ids, the ForgetContext
        (w_0 from the recorded start checkpoint, else the model's own weights) and the experiment config.
    """
    if read_meta(checkpoint).get("arch") == USER_ARCH:
        raise CheckpointError(f"{checkpoint} holds your own model's weights: give it as --weights, with --model "
                              "and --data")
    model, meta = load_checkpoint(checkpoint)
    model = model.to(device)
    try:
        cfg = ExperimentConfig.from_dict(meta["config"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {checkpoint}: sidecar has no usable experiment config ({e})") from None
    split = get_split(cfg)
    if meta.get("data_fingerprint") and meta["data_fingerprint"] != split.fingerprint():
        raise CheckpointError(f"checkpoint {checkpoint} was trained on other data than its config now produces")
    if forget_ids is not None:
        split = split.with_forget(forget_ids)
    split = split.to(device)
    start = None
    if meta.get("start"):
        start, _ = load_checkpoint(Path(checkpoint).parent / meta["start"], expect_arch=meta["arch"])
        start = start.to(device)
    ctx = protocol_context(start or model, cfg.train, num_classes=split.num_classes, seed=int(meta.get("seed") or 0),
                           forget_class=split.forget_class, split=split)
    ctx.start = start  # retraining needs the checkpoint's own start model; without one it is refused
    return model, meta, split, ctx, cfg


def load_companion(checkpoint: Path, meta: dict, other: Path, device: torch.device) -> nn.Module:
    """A second checkpoint compared with ``checkpoint`` (its retrain reference or its original).

    Parameters
    ----------
    checkpoint : Path
        The checkpoint under evaluation (named in the error messages).
    meta : dict
        Its sidecar: the companion must hold the same architecture and, where both record one, the same data
        fingerprint.
    other : Path
        The companion checkpoint.
    device : torch.device
        Where the model is moved.

    Returns
    -------
    nn.Module
        The companion model, in eval mode, on ``device``.
    """
    model, other_meta = load_checkpoint(other, expect_arch=meta["arch"])
    a, b = meta.get("data_fingerprint"), other_meta.get("data_fingerprint")
    if a and b and a != b:
        raise CheckpointError(f"{other} was trained on other data than {checkpoint} (data fingerprints differ); "
                              "compare models of one split")
    return model.to(device)


def recorded_original(checkpoint: Path, meta: dict) -> Path | None:
    """The source checkpoint a scrubbed checkpoint's sidecar names (looked up beside it when the recorded
    relative path does not exist), or None when the sidecar names none."""
    if not meta.get("source"):
        return None
    original = Path(meta["source"])
    if not original.is_absolute() and not original.exists():
        original = Path(checkpoint).parent / original.name
    if not original.is_file():
        raise CheckpointError(f"the original model {meta['source']} named in the sidecar of {checkpoint} is not "
                              "found; give it with --original")
    return original


def save_scrubbed(out: Path, model: nn.Module, source: Path, meta: dict, extra: dict) -> dict:
    """Write a scrubbed protocol checkpoint, atomically.

    Parameters
    ----------
    out : Path
        The checkpoint file to write (its sidecar goes beside it).
    model : nn.Module
        The scrubbed model.
    source : Path
        The checkpoint it was scrubbed from; its start checkpoint (w_0) is copied beside ``out`` when it is not
        there yet, so the scrubbed checkpoint can be scrubbed or evaluated on its own.
    meta : dict
        The source's sidecar (architecture, configuration, data fingerprint, seed are carried over).
    extra : dict
        Records added to the sidecar (role, method, its options, forget ids, …), with the source's path and
        sha256.

    Returns
    -------
    dict
        The sidecar written.
    """
    extra = {**extra, "source": str(source), "source_sha256": meta["sha256"]}
    if meta.get("start"):
        start_src = Path(source).parent / meta["start"]
        start_dst = out.parent / meta["start"]
        if start_src.resolve() != start_dst.resolve() and not start_dst.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            for s, d in ((start_src, start_dst), (sidecar_path(start_src), sidecar_path(start_dst))):
                tmp = d.with_name("." + d.name + ".tmp")
                shutil.copyfile(s, tmp)
                os.replace(tmp, d)
        extra["start"] = meta["start"]
    return save_checkpoint(out, model, arch=meta["arch"], in_shape=meta["in_shape"], num_classes=meta["num_classes"],
                           arch_options=meta.get("arch_options"), config=meta.get("config"),
                           data_fingerprint=meta.get("data_fingerprint"), seed=meta.get("seed"), extra=extra)


def fingerprint_v1(split: Split) -> str:
    """The data fingerprint that ML checkpoints of the ledger format recorded: the split's fingerprint
    followed by its forget ids (kept only to check migrated checkpoints)."""
    h = hashlib.sha256()
    for t in (split.x_core, split.y_core, split.x, split.y, split.x_test, split.y_test, split.forget_idx):
        h.update(np.ascontiguousarray(t.detach().cpu().numpy()).tobytes())
    return h.hexdigest()


def ml_data_loader(meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The data D of an ML-Forgetting checkpoint, regenerated from its static record's data configuration
    and checked against the recorded fingerprints (``ValueError`` on a mismatch).

    Parameters
    ----------
    meta : dict
        The checkpoint's static record (``data``: a DataConfig dict; optional ``data_fingerprint`` and
        ``data_fingerprint_v1``); a forgettable fine-tune's (``finetune``: its ``.npz`` file) reads that file.

    Returns
    -------
    (x, y) : (Tensor (n, ...), Tensor (n,) int64)
        The training inputs and labels, positions in D as the checkpoint's ids count them.
    """
    if is_finetune(meta):  # a forgettable fine-tune: its .npz, checked against the recorded fingerprint
        return finetune_data(meta)
    split = load_split(DataConfig.from_dict(meta["data"]))
    if meta.get("data_fingerprint_v1") and fingerprint_v1(split) != meta["data_fingerprint_v1"]:
        raise ValueError("the data regenerated from the checkpoint's data configuration differ from the data "
                         "it was trained on (fingerprint mismatch)")
    if meta.get("data_fingerprint") and split.fingerprint() != meta["data_fingerprint"]:
        raise ValueError("the data regenerated from the checkpoint's data configuration differ from the data "
                         "it was trained on (fingerprint mismatch)")
    return split.x, split.y
