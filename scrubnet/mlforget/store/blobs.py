"""The store's files beside the database: the content-addressed weights and the persisted factors.

``weights/<sha256>.safetensors`` holds the ML module's state_dict, named by the sha256 of its bytes and
written by temp file, fsync and rename. ``factor.safetensors`` is the dual factor built at training
(eigendecomposed user-data Gram, :class:`~scrubnet.mlforget.dual.DualFactor`); its metadata ``key``
(:func:`factor_key`) says what it was built from. ``primal.safetensors`` is the primal factor
(eigendecomposed p×p user-weight system, :class:`~scrubnet.mlforget.primal.PrimalFactor`), written and read
with :mod:`scrubnet.integrity` (content hash) and keyed like the dual factor. A factor file that is
unreadable or does not match is ignored and rebuilt by the request (:mod:`.apply`).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from scrubnet.integrity import ArtifactError, load_verified, save_verified, verified_bytes
from scrubnet.mlforget.dual import DualFactor
from scrubnet.mlforget.primal import PrimalFactor
from scrubnet.mlforget.store.schema import (FACTOR, FACTOR_FORMAT, PRIMAL, PRIMAL_FORMAT, WEIGHTS, StoreError,
                                            _fsync_dir, _json_safe, _pause, _sha)
from scrubnet.models.linearized import LinearizedModel


def weights_bytes(model: LinearizedModel) -> bytes:
    """The safetensors serialisation of the ML module's state_dict."""
    return save({k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()})


def _check_finite_model(model: torch.nn.Module, what: str) -> None:
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StoreError(f"{what}: weight {name!r} has non-finite values (NaN or inf); nothing was written")


def _weights_path(path: Path, sha: str) -> Path:
    return path / WEIGHTS / f"{sha}.safetensors"


def _write_weights(path: Path, data: bytes, sha: str) -> None:
    """``weights/<sha>.safetensors`` by temp file, fsync and rename (content-addressed: an existing file with
    this name already holds these bytes). ``weights_partial`` pauses with half the bytes written."""
    final = _weights_path(path, sha)
    if final.is_file() and _sha(final.read_bytes()) == sha:
        return
    final.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{sha[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            _pause("weights_partial")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def factor_key(model: LinearizedModel, static: dict, factor_ids: Tensor, fmt: str = FACTOR_FORMAT) -> str:
    """sha256 identifying a dual factor: the core network's weights (the Jacobian's linearisation point), the
    data fingerprint, the factor's sample ids and the settings the Gram and residuals depend on (architecture
    and its options, input shape, classes, µ, target scale, linearised prefixes, leaky slope)."""
    cfg = static["ml_config"]
    settings = {"format": fmt, "arch": static["arch"], "arch_options": static["arch_options"],
                "in_shape": list(static["in_shape"]), "num_classes": int(static["num_classes"]),
                "mu": cfg["mu"], "target_scale": cfg["target_scale"], "linearize": cfg["linearize"],
                "leaky_slope": cfg["leaky_slope"], "data_fingerprint": static.get("data_fingerprint")}
    h = hashlib.sha256()
    h.update(json.dumps(_json_safe(settings), sort_keys=True).encode())
    h.update(save({k: v.detach().contiguous().cpu().clone() for k, v in model.base.state_dict().items()}))
    h.update(factor_ids.to(torch.long).contiguous().numpy().tobytes())
    return h.hexdigest()


def _write_factor(path: Path, factor: DualFactor, key: str) -> None:
    """``factor.safetensors`` with metadata key, µ and classes and its content hash
    (:func:`scrubnet.integrity.verified_bytes`); temp file, fsync, rename."""
    data = verified_bytes(factor.to_tensors(), {"key": key, "format": FACTOR_FORMAT, "mu": repr(factor.mu),
                                                "num_classes": str(factor.num_classes)}, path=path / FACTOR)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".factor.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the checkpoint's files get the usual ones
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / FACTOR)
        _fsync_dir(path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_primal(path: Path, factor: PrimalFactor, key: str) -> None:
    """``primal.safetensors``: the primal factor (:class:`~scrubnet.mlforget.primal.PrimalFactor`) with its
    content hash (:func:`scrubnet.integrity.save_verified`: atomic, verified on load) and metadata key,
    µ, classes, target scale and block structure."""
    save_verified(path / PRIMAL, factor.to_tensors(), {
        "key": key, "format": PRIMAL_FORMAT, "mu": repr(factor.mu), "num_classes": str(factor.num_classes),
        "target_scale": repr(factor.target_scale), "block": str(int(factor.block))})


def _read_primal(path: Path) -> tuple[PrimalFactor | None, str, str | None]:
    """(factor, status, key) from ``path/primal.safetensors``: ``read``, ``absent`` or ``unreadable`` (any
    :class:`~scrubnet.integrity.ArtifactError` — truncated, hash mismatch, … — or inconsistent tensors)."""
    f = path / PRIMAL
    if not f.is_file():
        return None, "absent", None
    try:
        tensors, meta = load_verified(f)
        if meta.get("format") != PRIMAL_FORMAT:
            return None, "unreadable", None
        factor = PrimalFactor.from_tensors(tensors, float(meta["mu"]), int(meta["num_classes"]),
                                           float(meta["target_scale"]), meta["block"] == "1")
        return factor, "read", meta.get("key")
    except (ArtifactError, ValueError, KeyError, TypeError, OSError):
        return None, "unreadable", None


def _read_factor(path: Path) -> tuple[DualFactor | None, str, str | None, str | None]:
    """(factor, status, key, problem) from ``path/factor.safetensors``, verified against its content hash:
    status ``read``, ``absent`` or ``unreadable``; ``problem`` names the file and the reason when unreadable
    (truncated, not safetensors, no content hash, hash mismatch, non-finite, or not a consistent factor).
    Only tensors and a JSON header are parsed."""
    f = path / FACTOR
    if not f.is_file():
        return None, "absent", None, None
    try:
        tensors, meta = load_verified(f)
        if meta.get("format") != FACTOR_FORMAT:
            raise ArtifactError(f, "not safetensors", f"format {meta.get('format')!r} is not {FACTOR_FORMAT}")
        try:
            factor = DualFactor.from_tensors(tensors, float(meta["mu"]), int(meta["num_classes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f, "not a consistent factor", str(e)) from None
        return factor, "read", meta.get("key"), None
    except ArtifactError as e:
        return None, "unreadable", None, str(e)
    except OSError as e:
        return None, "unreadable", None, f"{f}: {e}"
