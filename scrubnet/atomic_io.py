"""Atomic file writing: write to a temporary file in the same folder, fsync, then rename.

The lowest layer of the package (no scrubnet imports): checkpoints, the ML-Forgetting store and the
experiment outputs all write through it, so a crash never leaves a half-written file at the target path.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=True) + "\n")


def require_writable(out: str | Path, what: str = "--out") -> None:
    """Fail (``ValueError``) before any computation when ``out`` cannot be created or written: its nearest
    existing ancestor must be a directory (a path under a regular file is refused, even for root) that is
    writable, and ``out`` itself too if it exists."""
    out = Path(out)
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {out}: {parent} is not a directory")
    target = out if out.exists() else parent
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        raise ValueError(f"{what} {out}: {target} is not writable")


def prepare_output_dir(out: str | Path, overwrite: bool, outputs: tuple[str, ...], patterns: tuple[str, ...] = (),
                       what: str = "--out", resumable: tuple[str, ...] = ()) -> None:
    """An output directory for a command (the rule of ``scrubnet run``): new or empty; one holding files only
    with ``overwrite``, which then deletes the files this command writes (``outputs``: names, ``patterns``:
    globs relative to ``out``) and nothing else, so no stale output mixes with the new ones. Checked for
    writability first; ``ValueError`` with one sentence otherwise. Entries named in ``resumable`` (a cache an
    interrupted run resumes from) neither count as an earlier run nor are deleted. Nothing is created here."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} exists and is not a directory")
    require_writable(out, what)
    if out.is_dir() and any(p.name not in resumable for p in out.iterdir()):
        if not overwrite:
            raise ValueError(f"{what} {out} is not empty (an earlier run?); give a new directory or pass "
                             "--overwrite to replace the earlier run's files")
        for name in outputs:
            (out / name).unlink(missing_ok=True)
        for pattern in patterns:
            for f in out.glob(pattern):
                if f.is_file():
                    f.unlink()
