"""Checkpoints: safetensors weights + a JSON sidecar. Nothing is ever unpickled.

``save_checkpoint("m.safetensors", model, arch=...)`` writes

* ``m.safetensors`` — the model's ``state_dict`` (parameters and buffers such as BatchNorm statistics);
* ``m.safetensors.json`` — ``{"format", "arch", "arch_options", "in_shape", "num_classes", "config",
  "data_fingerprint", "seed", "sha256", "tensors": {name: shape}, ...extra}``.

Both are written to temporary files and renamed, weights first; the sidecar carries the sha256 of the
weights file, so a torn pair is detected at load (:func:`scrubnet.integrity.check_file_sha256`: the error names
the file and says whether it is truncated, not safetensors or modified). Loading rebuilds the architecture from the sidecar and
validates the hash, the tensor names and the shapes, failing with :class:`CheckpointError` on mismatch.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import nn

from scrubnet.atomic_io import atomic_write_bytes, atomic_write_json
from scrubnet.integrity import ArtifactError, check_file_sha256
from scrubnet.models import build_model

FORMAT = "scrubnet-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match what is asked of it."""


def sidecar_path(path: str | Path) -> Path:
    return Path(str(path) + ".json")


def state_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_sha256(model_or_state) -> str:
    """sha256 of the safetensors serialisation of a model's state (or a state dict).

    Tied weights (two names for one tensor, e.g. a language model's input embedding and output projection)
    are hashed under each name: safetensors refuses tensors that share memory, so a tensor whose storage was
    seen under an earlier name is copied first (the bytes, hence the hash, are those of an untied state with
    the same values)."""

    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    seen: set[tuple[str, int]] = set()
    out = {}
    for k, v in state.items():
        t = v.detach().contiguous().cpu()
        where = (str(t.device), t.untyped_storage().data_ptr())
        out[k] = t.clone() if where in seen else t
        seen.add(where)
    return state_sha256(save(out))


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``state`` holding a NaN or an inf."""
    return [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def save_checkpoint(path: str | Path, model: nn.Module, *, arch: str, in_shape, num_classes: int,
                    arch_options: dict | None = None, config: dict | None = None,
                    data_fingerprint: str | None = None, seed: int | None = None, extra: dict | None = None) -> dict:
    """Write weights + sidecar atomically; returns the sidecar dict."""


    path = Path(path)
    state = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    bad = non_finite_tensors(state)
    if bad:
        raise CheckpointError(f"refusing to write {path}: the model has non-finite weights (NaN or inf) in "
                              f"{', '.join(bad[:3])}" + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    data = save(state)
    meta = {"format": FORMAT, "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
            "num_classes": int(num_classes), "config": config or {}, "data_fingerprint": data_fingerprint,
            "seed": seed, "sha256": state_sha256(data),
            "tensors": {k: list(v.shape) for k, v in state.items()}}
    if extra:
        meta.update(extra)
    atomic_write_bytes(path, data)
    atomic_write_json(sidecar_path(path), meta)
    return meta


def read_meta(path: str | Path) -> dict:
    """The sidecar of a checkpoint, validated for format (not the weights)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    sc = sidecar_path(path)
    if not sc.is_file():
        raise CheckpointError(f"checkpoint {path} has no sidecar {sc.name} (architecture and hash unknown)")
    try:
        meta = json.loads(sc.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"sidecar {sc} is corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{sc} is not a {FORMAT} sidecar")
    return meta


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, sidecar) after checking the file's sha256 against the sidecar."""

    meta = read_meta(path)
    try:
        data = check_file_sha256(path, str(meta.get("sha256")))
    except ArtifactError as e:
        raise CheckpointError(f"checkpoint {e.path}: {e.reason} ({e.detail}); the file is corrupt or was modified, "
                              "refusing to use it") from None
    try:
        state = load(data)
    except (SafetensorError, Exception) as e:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"checkpoint {path} is not a readable safetensors file: {e}") from None
    return state, meta


def load_checkpoint(path: str | Path, *, expect_arch: str | None = None, model: nn.Module | None = None
                    ) -> tuple[nn.Module, dict]:
    """Rebuild the model named in the sidecar (or use ``model``) and load the weights, validated.

    Raises :class:`CheckpointError` if the file is missing or corrupt, the architecture differs from
    ``expect_arch``, or tensor names/shapes do not match the architecture.
    """

    state, meta = load_state(path)
    arch = meta.get("arch")
    if expect_arch is not None and arch != expect_arch:
        raise CheckpointError(f"checkpoint {path} holds a {arch!r} model, expected {expect_arch!r}")
    if model is None:
        try:
            model = build_model(arch, meta["in_shape"], meta["num_classes"], **meta.get("arch_options", {}))
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path}: cannot build architecture {arch!r}: {e}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the architecture: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    bad = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        k, got, want = bad[0]
        raise CheckpointError(f"checkpoint {path}: tensor {k} has shape {got}, the architecture needs {want}"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    bad = non_finite_tensors(state)
    if bad:
        raise CheckpointError(f"checkpoint {path} has non-finite weights (NaN or inf) in {', '.join(bad[:3])}"
                              + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    model.load_state_dict(state)
    return model.eval(), meta
