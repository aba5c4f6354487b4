"""Upgrading a checkpoint of a previous format: :func:`upgrade`, the only code that changes a format.

* ``scrubnet-mlforget/1`` (``state.json`` + ``ledger.jsonl`` + ``weights-<seq>.safetensors``):
  :func:`migrate_legacy` builds the database in a temporary file and links it into place (a concurrent
  migration loses the race harmlessly); the old files stay as they were and are no longer read.
* ``scrubnet-mlforget/2`` (the same tables without the record chain): :func:`_seal_unsealed` checks the
  store and seals it in place (``sealed_from`` records when); an inconsistent one is refused, never sealed.

Opening a checkpoint (to read it, or to apply a request) never upgrades it: it is refused with an error
naming ``scrubnet mlforget upgrade``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from pathlib import Path

from scrubnet.mlforget.store.blobs import _write_weights
from scrubnet.mlforget.store.chain import _seal_all
from scrubnet.mlforget.store.db import _connect, _create_db, _read_static, _write_transaction
from scrubnet.mlforget.store.record import _consistency_problems
from scrubnet.mlforget.store.schema import (DB, FORMAT, FORMAT_UNSEALED, LEGACY_FORMAT, LEGACY_LEDGER,
                                            LEGACY_STATE, REQUEST_COLUMNS, SUBMISSIONS_SCHEMA, StoreError,
                                            _fsync_dir, _now, _read_state, _row_to_request, _sha)


def _seal_unsealed(con: sqlite3.Connection, path: Path) -> bool:
    """Bring a store of the previous format (same tables, no record chain) to this one, in place and in one
    write transaction: the weights chain and the state's consistency are checked first (an inconsistent
    store is refused, never sealed), then the columns are added, ``sealed_from`` records when and from what,
    and every row is sealed as it stands. Edits made before this moment cannot be detected: the chain
    vouches for the record from its sealing on. Returns False when a concurrent process sealed it first."""
    with _write_transaction(con):
        static = {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM checkpoint")}
        if static.get("format") != FORMAT_UNSEALED:
            return False  # a concurrent process sealed it first
        reqs = [_row_to_request(r) for r in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                                        "ORDER BY id")]
        problems = _consistency_problems(path, static, reqs, _read_state(con))
        if problems:
            raise StoreError(f"{path / DB} (format {FORMAT_UNSEALED}) is inconsistent and cannot be sealed: "
                             + "; ".join(problems) + f"; restore {path} from a backup")
        for table in ("requests", "state"):
            cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            for col in ("digests", "hash"):
                if col not in cols:
                    con.execute(f"ALTER TABLE {table} ADD COLUMN {col} TEXT")
        for stmt in SUBMISSIONS_SCHEMA.split(";"):
            if stmt.strip():
                con.execute(stmt)
        con.execute("UPDATE checkpoint SET value = ? WHERE key = 'format'", (json.dumps(FORMAT),))
        con.execute("INSERT OR REPLACE INTO checkpoint (key, value) VALUES ('sealed_from', ?)",
                    (json.dumps(f"{FORMAT_UNSEALED} (no record chain), sealed as it stood at {_now()}"),))
        _seal_all(con)
    return True


def migrate_legacy(path: str | Path) -> None:
    """Build ``store.sqlite`` from ``state.json`` + ``ledger.jsonl`` + ``weights-<seq>.safetensors``.

    The ledger's complete lines are the requests (a torn last line is dropped; the committed request it
    described is taken from ``state.json``'s ``last_request``). The chain of sha256 and the current weights
    file are checked first; anything inconsistent is refused with a message that says what to do."""
    path = Path(path)
    how = (f"; restore {path} from a backup, or retrain it with `scrubnet mlforget train` and re-apply the "
           "requests")
    try:
        meta = json.loads((path / LEGACY_STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"{path / LEGACY_STATE} cannot be read ({e}){how}") from None
    if not isinstance(meta, dict) or meta.get("format") != LEGACY_FORMAT:
        raise StoreError(f"{path / LEGACY_STATE} is not a {LEGACY_FORMAT} state record{how}")
    lines = []
    lf = path / LEGACY_LEDGER
    for line in (lf.read_bytes().split(b"\n") if lf.is_file() else []):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break  # torn tail: the committed request is in last_request
    lines = [r for r in lines if r.get("seq", 1 << 62) <= meta["seq"]]
    if len(lines) == meta["seq"] and (meta.get("last_request") or {}).get("seq") == meta["seq"]:
        lines.append(meta["last_request"])
    if [r.get("seq") for r in lines] != list(range(meta["seq"] + 1)):
        raise StoreError(f"the ledger of {path} does not list requests 0..{meta['seq']}{how}")
    wf = path / meta["weights_file"]
    data = wf.read_bytes() if wf.is_file() else b""
    if _sha(data) != meta["weights_sha256"] or lines[-1]["sha256_after"] != meta["weights_sha256"]:
        raise StoreError(f"the weights of {path} do not match the recorded sha256{how}")
    core = set(meta["core_ids"])
    dropped = any(r.get("kind") == "forget_all" for r in lines)
    records = []
    for r in lines:
        kind = r.get("kind", "forget")
        known = {"seq", "kind", "key", "time", "ids", "n_ids", "n_remaining", "sigma", "seconds", "sha256_before",
                 "sha256_after", "n_user", "n_core"}
        solver = {k: v for k, v in r.items() if k not in known}
        records.append({"id": r["seq"], "key": r.get("key"), "kind": kind, "ids": r.get("ids", []),
                        "n_ids": r.get("n_ids", 0), "n_remaining": r.get("n_remaining", 0), "sigma": r.get("sigma"),
                        "solver": solver, "seconds": r.get("seconds", 0.0) or 0.0, "time_utc": r.get("time", ""),
                        "sha256_before": r.get("sha256_before"), "sha256_after": r["sha256_after"]})
    static = {k: meta.get(k) for k in ("arch", "arch_options", "in_shape", "num_classes", "seed", "ml_config", "data",
                                       "data_fingerprint", "core_ids", "user_ids")}
    static.update({k: v for k, v in meta.items() if k not in static and k not in
                   ("format", "seq", "weights_file", "weights_sha256", "forgotten_ids", "last_request")})
    static["format"] = FORMAT
    # the ledger format's data fingerprint also covered the forget ids; kept under its own name
    static["data_fingerprint_v1"], static["data_fingerprint"] = static.get("data_fingerprint"), None
    static["migrated_from"] = "scrubnet-mlforget/1 (state.json + ledger.jsonl)"
    state = {"request_id": meta["seq"], "weights_sha256": meta["weights_sha256"],
             "forgotten_ids": [i for i in meta["forgotten_ids"] if i not in core],
             "user_weights_dropped": dropped}
    _write_weights(path, data, meta["weights_sha256"])
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".store.", suffix=".sqlite.tmp")
    os.close(fd)
    os.unlink(tmp)
    try:
        _create_db(Path(tmp), static, records, state)
        try:
            os.link(tmp, path / DB)  # fails if a concurrent migration got there first: theirs is identical
        except FileExistsError:
            pass
        _fsync_dir(path)
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)


def upgrade(path: str | Path) -> dict:
    """Bring the checkpoint at ``path`` to the current format; the only function that changes a format.

    A ledger checkpoint (``scrubnet-mlforget/1``) is migrated into a new database (its files stay as they
    were); a store of ``scrubnet-mlforget/2`` is checked and sealed in place (:func:`_seal_unsealed`); a
    current store is left untouched. Idempotent; safe against a concurrent upgrade.

    Parameters
    ----------
    path : str or Path
        The checkpoint directory.

    Returns
    -------
    dict
        ``{"path": str, "from": the format found, "format": the current format, "upgraded": bool}``;
        ``upgraded`` is False when the checkpoint was already current (or a concurrent upgrade won).

    Raises
    ------
    StoreError
        No checkpoint, an unknown format, or an inconsistent old checkpoint (refused, never upgraded; the
        message says to restore it from a backup).
    """
    path = Path(path)
    if not path.is_dir():
        raise StoreError(f"ML checkpoint directory not found: {path}")
    if not (path / DB).is_file():
        if not (path / LEGACY_STATE).is_file():
            raise StoreError(f"{path} is not an ML checkpoint (no {DB}); create one with `scrubnet mlforget train`")
        migrate_legacy(path)
        return {"path": str(path), "from": LEGACY_FORMAT, "format": FORMAT, "upgraded": True}
    try:
        con = _connect(path / DB)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot open {path / DB}: {e}") from None
    try:
        found = _read_static(con, path).get("format")
        if found == FORMAT:
            return {"path": str(path), "from": FORMAT, "format": FORMAT, "upgraded": False}
        if found != FORMAT_UNSEALED:
            raise StoreError(f"{path / DB} is not a {FORMAT} store (format {found!r}); it cannot be upgraded")
        sealed = _seal_unsealed(con, path)
    finally:
        con.close()
    return {"path": str(path), "from": FORMAT_UNSEALED, "format": FORMAT, "upgraded": sealed}
