"""Verified safetensors artifacts: a content hash written with the tensors, checked before they are used.

:func:`save_verified` writes ``tensors`` as one safetensors file whose metadata carries ``content_sha256``
(:func:`content_sha256`: sha256 over the other metadata and every tensor's name, dtype, shape and raw bytes,
tensors in sorted name order), by temporary file, fsync and rename (:mod:`scrubnet.atomic_io`).
:func:`load_verified` reads it back and raises :class:`ArtifactError` — naming the file and the reason —
when the file is

* ``missing``;
* ``truncated``: shorter than its header says (header or tensor data cut off);
* ``not safetensors``: a header that is not the JSON of a safetensors file, or tensors that cannot be read;
* ``no content hash``: written without :func:`save_verified` (or its metadata was stripped);
* ``hash mismatch``: the recomputed hash differs from the stored one (a flipped bit anywhere in the tensors
  or metadata);
* ``non-finite``: a floating-point tensor holds a NaN or an inf (unless ``allow_non_finite``).

Files with a separate record of their hash (a checkpoint's JSON sidecar) use :func:`file_sha256` and
:func:`check_file_sha256`, which raise the same exception.

Only tensors and a JSON header are ever parsed (nothing is unpickled). The lowest layer: no scrubnet
imports but :mod:`scrubnet.atomic_io`.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load as st_load, save as st_save

from scrubnet.atomic_io import atomic_write_bytes

#: metadata key of the content hash
HASH_KEY = "content_sha256"
#: the hash's format, recorded beside it so a later change of the canonical order is recognised
HASH_FORMAT_KEY = "content_hash"
HASH_FORMAT = "sha256/sorted-names+dtype+shape+bytes+metadata/1"
#: a header longer than this is not one safetensors writes (it would describe ~millions of tensors)
MAX_HEADER_BYTES = 100 * 1024 * 1024


class ArtifactError(ValueError):
    """A stored artifact that cannot be trusted: ``path`` (the file) and ``reason`` (one of ``missing``,
    ``truncated``, ``not safetensors``, ``no content hash``, ``hash mismatch``, ``non-finite``) plus a
    sentence of detail. A ``ValueError``, so the CLI reports it as one ``error:`` line with exit code 2."""

    def __init__(self, path: str | Path, reason: str, detail: str = ""):
        self.path = Path(path)
        self.reason = reason
        self.detail = detail
        super().__init__(f"{self.path}: {reason}" + (f" ({detail})" if detail else ""))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of ``t`` in row-major order, as safetensors stores them (little-endian)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def content_sha256(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """sha256 over ``metadata`` (without the hash keys; JSON with sorted keys) then, for each tensor in sorted
    name order, its name, dtype, shape and raw bytes, each part length-prefixed so no two inputs share a
    byte stream."""
    h = hashlib.sha256()

    def part(b: bytes) -> None:
        h.update(struct.pack("<Q", len(b)))
        h.update(b)

    meta = {k: v for k, v in (metadata or {}).items() if k not in (HASH_KEY, HASH_FORMAT_KEY)}
    part(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        part(name.encode())
        part(str(t.dtype).encode())
        part(json.dumps(list(t.shape)).encode())
        part(_tensor_bytes(t))
    return h.hexdigest()


def non_finite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf, sorted."""
    return sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))


def _describe(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def verified_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *,
                   allow_non_finite: bool = False, path: str | Path = "<memory>") -> bytes:
    """The safetensors serialisation of ``tensors`` with ``metadata`` plus the content hash. Refuses
    (:class:`ArtifactError`, reason ``non-finite``) NaN/inf values unless ``allow_non_finite``."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    if not allow_non_finite:
        bad = non_finite_names(tensors)
        if bad:
            raise ArtifactError(path, "non-finite", f"refusing to write NaN or inf values in {_describe(bad)}")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[HASH_FORMAT_KEY] = HASH_FORMAT
    meta[HASH_KEY] = content_sha256(tensors, meta)
    return st_save(tensors, metadata=meta)


def save_verified(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *,
                  allow_non_finite: bool = False) -> str:
    """Write ``tensors`` (+ ``metadata``, string values) to ``path`` atomically with their content hash;
    returns the hash."""
    data = verified_bytes(tensors, metadata, allow_non_finite=allow_non_finite, path=path)
    atomic_write_bytes(path, data)
    return read_header(data, path)[1][HASH_KEY]


def read_header(data: bytes, path: str | Path = "<memory>") -> tuple[dict, dict[str, str]]:
    """(tensor entries, metadata) of safetensors bytes, checked for truncation: :class:`ArtifactError` with
    reason ``truncated`` or ``not safetensors``."""
    if len(data) < 8:
        raise ArtifactError(path, "truncated", f"{len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise ArtifactError(path, "not safetensors", f"its header length field says {n} bytes")
    if len(data) < 8 + n:
        raise ArtifactError(path, "truncated", f"{len(data)} bytes, the header alone needs {8 + n}")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(path, "not safetensors", f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ArtifactError(path, "not safetensors", "its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    end = 0
    for name, entry in header.items():
        offs = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ArtifactError(path, "not safetensors", f"tensor {name!r} has no valid data offsets")
        end = max(end, offs[1])
    if len(data) < 8 + n + end:
        raise ArtifactError(path, "truncated", f"{len(data)} bytes, its tensors need {8 + n + end}")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ArtifactError(path, "not safetensors", "its metadata is not a map of strings")
    return header, meta


def load_verified_bytes(data: bytes, path: str | Path = "<memory>", *, allow_non_finite: bool = False
                        ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata without the hash keys) of verified safetensors bytes; :class:`ArtifactError`
    naming ``path`` when they are truncated, not safetensors, without hash, mismatched or non-finite."""
    _, meta = read_header(data, path)
    try:
        tensors = st_load(data)
    except Exception as e:  # noqa: BLE001 - any parse failure of the tensors is a corrupt file
        raise ArtifactError(path, "not safetensors", f"its tensors cannot be read: {e}") from None
    stored = meta.get(HASH_KEY)
    if stored is None:
        raise ArtifactError(path, "no content hash", "it was not written with a content hash")
    if meta.get(HASH_FORMAT_KEY) != HASH_FORMAT:
        raise ArtifactError(path, "no content hash", f"unknown hash format {meta.get(HASH_FORMAT_KEY)!r}")
    actual = content_sha256(tensors, meta)
    if actual != stored:
        raise ArtifactError(path, "hash mismatch", f"content sha256 {actual[:12]}…, recorded {stored[:12]}…: "
                            "the file was damaged or modified")
    if not allow_non_finite:
        bad = non_finite_names(tensors)
        if bad:
            raise ArtifactError(path, "non-finite", f"NaN or inf values in {_describe(bad)}")
    return tensors, {k: v for k, v in meta.items() if k not in (HASH_KEY, HASH_FORMAT_KEY)}


def load_verified(path: str | Path, *, allow_non_finite: bool = False
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the file ``path`` written by :func:`save_verified`, verified (module docstring)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(path, "missing", "no such file") from None
    except IsADirectoryError:
        raise ArtifactError(path, "not safetensors", "it is a directory") from None
    return load_verified_bytes(data, path, allow_non_finite=allow_non_finite)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_file_sha256(path: str | Path, expected: str, data: bytes | None = None) -> bytes:
    """The bytes of ``path`` (or ``data``, already read from it) after checking their sha256 against
    ``expected`` (a sidecar's record); :class:`ArtifactError` naming the file on mismatch. A mismatch is
    reported as ``truncated`` when the safetensors header says the file is cut short."""
    path = Path(path)
    if data is None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ArtifactError(path, "missing", "no such file") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        read_header(data, path)  # raises "truncated" / "not safetensors" when that is the cause
        raise ArtifactError(path, "hash mismatch", f"sha256 {actual[:12]}…, the sidecar records "
                            f"{str(expected)[:12]}…: the file was damaged or modified")
    return data
