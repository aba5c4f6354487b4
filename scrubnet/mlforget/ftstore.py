"""Forgettable fine-tuning as a checkpoint of the request store: what it records, and how it is rebuilt.

A checkpoint of a forgettable fine-tune (:func:`scrubnet.mlforget.finetune.forgettable_finetune`) is an ordinary
ML checkpoint (:mod:`scrubnet.mlforget.store`) whose static record has ``arch`` = :data:`FINETUNE_ARCH` and a
``finetune`` entry:

* ``base``: the pretrained model's source — ``model`` (``FILE.py:FACTORY``, ``MODULE:FACTORY`` or ``hf:DIR``),
  ``options`` (the factory's keyword arguments), ``weights`` (the weights file),
  ``weights_sha256`` (sha256 of that file's bytes), ``dtype`` (the model is cast to it before fine-tuning) and
  ``state_dict_sha256`` (``state.base_sha256``: the state_dict of the cast model);
* ``user_weights``: the spec (``state.user_weights``: LoRA config, layer prefixes or head);
* ``data``: the ``.npz`` file (its array fingerprint is the checkpoint's ``data_fingerprint``);
* ``absolute``: the same three paths, absolute, as they were when the checkpoint was written;
* ``engine``: ``"linearised"`` (absent in checkpoints written before the sharded engine: the same) or
  ``"sharded"`` (:mod:`scrubnet.mlforget.sharded`), then with ``sharded``: its :class:`ShardedConfig`.
  The layout is the same for both engines; the weights file of a sharded checkpoint holds every shard's
  user weights after every slice (its ``state_dict``);
* ``task`` (optional): ``{"kind": "answer-token", "label_tokens": [...]}`` for a causal LM fine-tuned by the
  linearised engine through the logits of its label words at the answer position
  (:class:`~scrubnet.mlforget.preflight.AnswerLogits`); the data loader gives that view of the data.

**Paths.** ``model`` (its file or directory), ``weights`` and ``data`` are recorded relative to the checkpoint
directory, so a checkpoint moved together with its base model and data (a project directory copied elsewhere,
or a self-contained checkpoint holding ``base/`` and ``data.npz``, as :mod:`scrubnet.mlforget.hf` writes) still
works; a checkpoint moved alone finds them at their ``absolute`` paths. Each path is tried relative to the
checkpoint first, then absolute (checkpoints written before relative paths hold absolute ones only), and the
file found is accepted only if its hash is the recorded one. The record is part of the hash chain, so it is
never rewritten: a move changes nothing in the checkpoint.

The store rebuilds the network's *structure* from these (the base model, its adapters) and loads the stored
weights into it; the base model is loaded from its file and refused when either hash differs, so a request
never runs on another base model. The base model's file is only read, never written.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

from scrubnet.data.user import load_user_data
from scrubnet.mlforget.finetune import UserWeights, state_dict_sha256, tangent_network, user_weight_names
from scrubnet.mlforget.preflight import AnswerLogits, answer_token_task
from scrubnet.mlforget.sharded import ENGINE as SHARDED, ShardedConfig, ShardedModel
from scrubnet.models.linearized import LinearizedModel
from scrubnet.models.lora import LoRA
from scrubnet.integrity import file_sha256
from scrubnet.models.user import HF_PREFIX, build_user_model, check_hf_directory, load_user_weights, read_state_dict

#: the ``arch`` of a forgettable fine-tune's checkpoint (rebuilt from its ``finetune`` record, not the zoo)
FINETUNE_ARCH = "forgettable-finetune"

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def parse_user_weights(spec: str) -> UserWeights:
    """The user weights of a command-line spec.

    Parameters
    ----------
    spec : str
        ``head``; ``layers:A,B`` (parameter-name prefixes); ``lora:T1,T2:rR[:aALPHA][:save=M1,M2][:seedS]``
        (a LoRA adapter of rank R on the ``nn.Linear`` modules named T1, T2 — peft's suffix matching —, scale
        ALPHA/R, with the modules M1, M2 (e.g. a classifier head) also user weights).

    Returns
    -------
    LoRA, list of str, or "head"
    """
    kind, _, rest = spec.partition(":")
    if kind == "head" and not rest:
        return "head"
    if kind == "layers" and rest:
        return [s for s in rest.split(",") if s]
    if kind == "lora" and rest:
        targets, *opts = rest.split(":")
        kw: dict = {"target_modules": [t for t in targets.split(",") if t]}
        try:
            for o in opts:
                if o.startswith("save="):
                    kw["modules_to_save"] = [m for m in o[5:].split(",") if m]
                elif o.startswith("seed"):
                    kw["seed"] = int(o[4:])
                elif o.startswith("r"):
                    kw["rank"] = int(o[1:])
                elif o.startswith("a"):
                    kw["alpha"] = float(o[1:])
                else:
                    raise ValueError(f"unknown part {o!r}")
            return LoRA(**kw)
        except ValueError as e:
            raise ValueError(f"--user-weights {spec!r}: {e}") from None
    raise ValueError(f"--user-weights {spec!r}: expected head, layers:A,B or lora:T1,T2:rR[:aALPHA][:save=M]")


def user_weights_from_dict(spec: dict) -> UserWeights:
    """The inverse of ``state.user_weights`` (the spec dict :func:`user_weight_names` returns)."""
    kind = spec.get("kind")
    if kind == "lora":
        return LoRA(spec["target_modules"], spec["rank"], spec.get("alpha"), spec.get("modules_to_save") or [],
                    spec.get("seed", 0))
    if kind == "head":
        return list(spec["prefixes"])  # the head found at training time, by its name
    if kind == "layers":
        return list(spec["prefixes"])
    raise ValueError(f"unknown user-weights kind {kind!r} in the checkpoint")


#: the key under which the store passes a fine-tune checkpoint's directory to :func:`finetune_data` (a copy of
#: the static record, never stored)
ROOT_KEY = "checkpoint_dir"


def with_root(static: dict, path: str | Path) -> dict:
    """A copy of a checkpoint's static record that names its directory (:data:`ROOT_KEY`), for the data
    loader; the record itself is left alone (its fields are digested in the hash chain)."""
    return {**static, ROOT_KEY: str(Path(path).resolve())} if is_finetune(static) else static


def _is_file_spec(spec: str) -> bool:
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def _spec_path(spec: str) -> str | None:
    """The file or directory a model spec names (``hf:DIR``, ``FILE.py:FACTORY``), None for ``MODULE:FACTORY``."""
    if spec.startswith(HF_PREFIX):
        return spec[len(HF_PREFIX):]
    return spec.rsplit(":", 1)[0] if _is_file_spec(spec) else None


def _with_spec_path(spec: str, path: str) -> str:
    if spec.startswith(HF_PREFIX):
        return HF_PREFIX + path
    return f"{path}:{spec.rsplit(':', 1)[1]}" if _is_file_spec(spec) else spec


def _relative(path: str, root: Path) -> str:
    return os.path.relpath(Path(path).resolve(), root.resolve())


def candidates(rel: str, absolute: str | None, root: str | Path | None) -> list[Path]:
    """Where a recorded path may be now: relative to the checkpoint directory ``root`` first, then the
    recorded absolute path (both when they differ; an absolute ``rel`` of an older checkpoint stays itself)."""
    out = [Path(root) / rel] if root is not None else [Path(rel)]
    if absolute and Path(absolute) not in out:
        out.append(Path(absolute))
    return out


def _first_existing(paths: list[Path]) -> Path:
    return next((p for p in paths if p.exists()), paths[0])


def located_base(ft: dict, root: str | Path | None) -> dict:
    """The ``finetune.base`` record with ``model`` and ``weights`` resolved to where they are now
    (:func:`candidates`; the weights: the first whose sha256 is the recorded one, else the first found)."""
    base, absolute = dict(ft["base"]), ft.get("absolute") or {}
    where = candidates(base["weights"], absolute.get("weights"), root)
    found = [p for p in where if p.is_file()]
    if not found:
        raise ValueError("the base model's weights file is not found at " + " nor ".join(map(str, where))
                         + " (the checkpoint needs it; it was recorded with its sha256)")
    want = base.get("weights_sha256")
    good = [p for p in found if want and file_sha256(p) == want]
    weights = (good or found)[0]
    spec_path = _spec_path(base["model"])
    if spec_path is not None:
        where = _first_existing(candidates(spec_path, _spec_path(absolute.get("model") or "") or None, root))
        base["model"] = _with_spec_path(base["model"], str(where))
    base["weights"] = str(weights)
    return base


def load_base(base: dict) -> nn.Module:
    """The pretrained model a checkpoint's ``finetune.base`` record names, checked against both its hashes.

    Parameters
    ----------
    base : dict
        ``model``, ``options``, ``weights``, ``weights_sha256``, ``dtype``, ``state_dict_sha256`` (module
        docstring); ``*_sha256`` may be None (not checked) when building the record.

    Returns
    -------
    nn.Module
        The model (eval mode, cast to ``dtype``); ``ValueError`` when the weights file or its state_dict is
        not the recorded one.
    """
    weights = Path(base["weights"])
    if not weights.is_file():
        raise ValueError(f"the base model's weights file {weights} is not found (the checkpoint needs it; it "
                         "was recorded with its sha256)")
    if base.get("weights_sha256") and file_sha256(weights) != base["weights_sha256"]:
        raise ValueError(f"the base model's weights file {weights} changed since the fine-tuning (sha256 "
                         "differs); the checkpoint refuses another base model")
    model = build_user_model(base["model"], base.get("options") or {})
    load_user_weights(model, read_state_dict(weights), str(weights))
    model = model.to(DTYPES[base.get("dtype", "float64")]).eval()
    if base.get("state_dict_sha256") and state_dict_sha256(model) != base["state_dict_sha256"]:
        raise ValueError(f"the base model built from {base['model']} and {weights} differs from the one "
                         "fine-tuned (state_dict sha256); the checkpoint refuses another base model")
    return model


def default_weights(model_spec: str, weights: str | Path | None) -> Path:
    """``weights``, or for ``hf:DIR`` without one, DIR's ``model.safetensors``."""
    if weights is not None:
        return Path(weights)
    if model_spec.startswith(HF_PREFIX):
        return check_hf_directory(model_spec[len(HF_PREFIX):]) / "model.safetensors"
    raise ValueError("--weights is needed with a factory --model (hf:DIR defaults to DIR/model.safetensors)")


def base_record(model_spec: str, weights: str | Path, options: dict | None, dtype: str) -> dict:
    """The ``finetune.base`` record of a model source, absolute paths (made relative to the checkpoint and
    the hashes filled in by :func:`finetune_record`).

    Parameters
    ----------
    model_spec : str
        ``FILE.py:FACTORY``, ``MODULE:FACTORY`` or ``hf:DIR``.
    weights : str or Path
        The weights file.
    options : dict, optional
        The factory's keyword arguments.
    dtype : str
        ``float64`` or ``float32``.

    Returns
    -------
    dict
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    spec = model_spec
    if spec.startswith(HF_PREFIX):
        spec = HF_PREFIX + str(Path(spec[len(HF_PREFIX):]).resolve())
    elif ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        src, name = spec.rsplit(":", 1)
        spec = f"{Path(src).resolve()}:{name}"
    return {"model": spec, "options": dict(options or {}), "weights": str(Path(weights).resolve()),
            "weights_sha256": None, "dtype": dtype, "state_dict_sha256": None}


def finetune_record(base: dict, state, data_path: str | Path, out: str | Path, *, engine: str | None = None,
                    task_kind: str | None = None, preflight: dict | None = None) -> dict:
    """The static record's ``finetune`` entry for a state trained from ``base`` (:func:`base_record`), its
    paths relative to the checkpoint directory ``out`` (module docstring, "Paths").

    Parameters
    ----------
    base : dict
        :func:`base_record` (absolute paths).
    state : MLState
        The fine-tuned state (``base_sha256``, ``user_weights``).
    data_path : str or Path
        The ``.npz`` file.
    out : str or Path
        The checkpoint directory the record will be in (it need not exist yet).
    engine, task_kind, preflight : optional
        The engine that trained it (``linearised`` or ``sharded``: the sharded engine's settings are recorded
        too), the declared task kind, and the pre-flight's decision; each recorded when given.

    Returns
    -------
    dict
    """
    record = _paths_record(base, state, data_path, out)
    if engine is not None:
        record["engine"] = engine
        if engine == SHARDED:
            record["sharded"] = state.model.config.to_dict()
    if task_kind is not None:
        record["task_kind"] = task_kind
    if "task" in state.train_info:
        record["task"] = state.train_info["task"]
    if preflight is not None:
        record["preflight"] = preflight
    return record


def _paths_record(base: dict, state, data_path: str | Path, out: str | Path) -> dict:
    root = Path(out).resolve()
    data_abs = str(Path(data_path).resolve())
    spec_path = _spec_path(base["model"])
    rel_model = base["model"] if spec_path is None else _with_spec_path(base["model"], _relative(spec_path, root))
    return {"base": {**base, "model": rel_model, "weights": _relative(base["weights"], root),
                     "weights_sha256": file_sha256(base["weights"]), "state_dict_sha256": state.base_sha256},
            "user_weights": state.user_weights, "data": _relative(data_abs, root),
            "absolute": {"model": base["model"], "weights": str(Path(base["weights"]).resolve()),
                         "data": data_abs}}


def engine_of(static: dict) -> str:
    """``"linearised"`` or ``"sharded"``: the engine of a fine-tune checkpoint's static record."""
    return (static.get("finetune") or {}).get("engine", "linearised")


def rebuild_network(static: dict, root: str | Path | None = None) -> LinearizedModel | ShardedModel:
    """The linearised network of a fine-tune checkpoint, its user weights at 0: the base model (hashes
    checked), its adapters, the tangent in the user weights. The store loads the stored weights into it.

    Parameters
    ----------
    static : dict
        The checkpoint's static record.
    root : str or Path, optional
        The checkpoint directory (relative paths are resolved against it; default: ``static``'s
        :data:`ROOT_KEY`, else the working directory).

    Returns
    -------
    LinearizedModel
    """
    ft = static["finetune"]
    base = load_base(located_base(ft, root if root is not None else static.get(ROOT_KEY)))
    task = ft.get("task")
    if task is not None and task.get("kind") == "answer-token":  # a causal LM read through its label words
        base = AnswerLogits(base, task["label_tokens"])
    net, names, _ = user_weight_names(base, user_weights_from_dict(ft["user_weights"]))
    if engine_of(static) == SHARDED:  # the shards' user weights (all slices) are loaded by the store
        sm = ShardedModel(net, names, ShardedConfig(**ft["sharded"]), static["user_ids"])
        sm.spec = ft["user_weights"]
        return sm
    return tangent_network(net, names)


def finetune_data(static: dict) -> tuple:
    """The data D of a fine-tune checkpoint: its ``.npz`` read again (beside the checkpoint, ``static``'s
    :data:`ROOT_KEY`, first; then at its absolute path) and checked against the recorded fingerprint
    (``ValueError`` on a mismatch).

    Returns
    -------
    (x, y) : (Tensor or ModelInputs (n, ...), Tensor (n,) int64)
    """
    ft = static["finetune"]
    found = candidates(ft["data"], (ft.get("absolute") or {}).get("data"), static.get(ROOT_KEY))
    path, data = found[0], None
    for path in [p for p in found if p.exists()] or found[:1]:
        data = load_user_data(path)
        if not static.get("data_fingerprint") or data.fingerprint == static["data_fingerprint"]:
            break
    if static.get("data_fingerprint") and data.fingerprint != static["data_fingerprint"]:
        raise ValueError(f"the data file {path} differs from the data the checkpoint was trained on "
                         "(fingerprint mismatch)")
    x, y = cast_inputs(data.x, static["finetune"]["base"].get("dtype", "float64")), data.y
    task = ft.get("task")
    if task is not None and task.get("kind") == "answer-token":  # the linearised engine's view of a causal LM
        found = answer_token_task(x, y, task["label_tokens"])
        if found is None:
            raise ValueError("the data no longer hold one answer token per sample among the recorded label tokens")
        x, y, _ = found
    return x, y


def cast_inputs(x, dtype: str):
    """``x`` (a tensor or ModelInputs) with its floating tensors in ``dtype`` (token ids keep theirs)."""
    if isinstance(x, Tensor):
        return x.to(DTYPES[dtype]) if x.is_floating_point() else x
    return x.to(DTYPES[dtype])


def is_finetune(static: dict) -> bool:
    """True for the static record of a forgettable fine-tune's checkpoint."""
    return static.get("arch") == FINETUNE_ARCH


def main_input(x) -> Tensor:
    """The main tensor of inputs (a tensor or ModelInputs)."""
    return getattr(x, "main", x)
