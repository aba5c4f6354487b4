"""The store's constants, SQL schema, error type and the row helpers every other module of the store uses.

A checkpoint is a directory::

    store.sqlite                      the database (WAL mode; ``store.sqlite-wal``/``-shm`` appear while open)
    weights/<sha256>.safetensors      the ML module's state_dict (core weights w_c + user weights w_u),
                                      named by the sha256 of the file's bytes
    factor.safetensors                the dual factor built at training, when training used the dual
    primal.safetensors                the primal factor, when training used the primal

Tables:

* ``checkpoint(key, value)`` — what never changes after training, one JSON value per key: format,
  architecture and its options, input shape, classes, seed, ML configuration, data configuration and data
  fingerprint, core ids, user ids, training configuration.
* ``requests`` — one row per committed request, ``id`` 0 being the training: ``key`` (identity of the
  request: kind, sorted ids, σ), ``kind`` (``train``, ``forget``, ``forget_all``), ``ids`` (JSON list of the
  sample ids the request forgot; empty for ``train`` and ``forget_all``), ``n_ids``, ``n_remaining`` (user
  samples left after it), ``sigma``, ``solver`` (JSON dict of every figure the step reported: solver, steps,
  residual, objective before/after, …), ``seconds`` (wall time of the step), ``time_utc`` (ISO 8601, UTC),
  ``sha256_before``/``sha256_after`` (of the weights file), ``status`` (``applied``; only committed requests
  are ever stored, a refused or interrupted one leaves no row), ``digests``/``hash`` (the record chain).
* ``state`` — one row: the request the checkpoint is at, the sha256 of its weights, the forgotten ids, and
  whether ``forget-all`` dropped the user weights.
* ``submissions`` — the queue of the HTTP service (``scrubnet serve``): requests received and not yet, or
  never, applied; an applied one names its committed request (set in the request's own transaction).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import sqlite3
import sys
import time
from pathlib import Path

import torch

FORMAT = "scrubnet-mlforget/3"
#: the previous format: the same tables without the record chain; sealed in place by `upgrade`
FORMAT_UNSEALED = "scrubnet-mlforget/2"
CHAIN_FORMAT = "scrubnet-record-chain/1"
SEAL_KEY = "record_seal"
DB = "store.sqlite"
WEIGHTS = "weights"
FACTOR = "factor.safetensors"
FACTOR_FORMAT = "scrubnet-dual-factor/1"
PRIMAL = "primal.safetensors"
PRIMAL_FORMAT = "scrubnet-primal-factor/1"
LEGACY_STATE = "state.json"
LEGACY_LEDGER = "ledger.jsonl"
#: the format of the ledger checkpoints (``state.json`` + ``ledger.jsonl``) that `upgrade` migrates
LEGACY_FORMAT = "scrubnet-mlforget/1"
PAUSE_ENV = "SCRUBNET_MLFORGET_PAUSE_AT"
#: seconds a request waits for the write lock before giving up
LOCK_TIMEOUT_S = float(os.environ.get("SCRUBNET_MLFORGET_LOCK_TIMEOUT", "600"))

SCHEMA = """
CREATE TABLE checkpoint (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE requests (
    id INTEGER PRIMARY KEY,
    key TEXT,
    kind TEXT NOT NULL CHECK (kind IN ('train', 'forget', 'forget_all')),
    ids TEXT NOT NULL,
    n_ids INTEGER NOT NULL,
    n_remaining INTEGER NOT NULL,
    sigma REAL,
    solver TEXT NOT NULL,
    seconds REAL NOT NULL,
    time_utc TEXT NOT NULL,
    sha256_before TEXT,
    sha256_after TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status = 'applied'),
    digests TEXT,
    hash TEXT
);
CREATE UNIQUE INDEX requests_key ON requests (key) WHERE key IS NOT NULL;
CREATE TABLE state (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    request_id INTEGER NOT NULL REFERENCES requests (id),
    weights_sha256 TEXT NOT NULL,
    forgotten_ids TEXT NOT NULL,
    user_weights_dropped INTEGER NOT NULL,
    digests TEXT,
    hash TEXT
);
"""

#: the queue of the HTTP service (``scrubnet serve``): one row per submitted request, in arrival order.
#: ``status`` queued → applied (``request_id`` names the committed request, set in the same transaction) |
#: refused (``reason``) | failed (``reason``); ``receipt`` the signed receipt of an applied one.
SUBMISSIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS submissions (
    id INTEGER PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL CHECK (kind IN ('forget', 'forget_all')),
    ids TEXT NOT NULL,
    sigma REAL,
    ids_hash TEXT,
    salt TEXT,
    client TEXT,
    submitted_utc TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'applied', 'refused', 'failed')),
    reason TEXT,
    request_id INTEGER REFERENCES requests (id),
    finished_utc TEXT,
    receipt TEXT
);
CREATE INDEX IF NOT EXISTS submissions_status ON submissions (status, id);
"""

REQUEST_COLUMNS = ("id", "key", "kind", "ids", "n_ids", "n_remaining", "sigma", "solver", "seconds", "time_utc",
                   "sha256_before", "sha256_after", "status")


class StoreError(ValueError):
    """A checkpoint directory that is missing, corrupt or inconsistent, or a refused request."""


def needs_upgrade(path: Path, fmt: str) -> StoreError:
    """The error of opening a checkpoint of a previous format: it names the command that upgrades it.

    Parameters
    ----------
    path : Path
        The checkpoint directory.
    fmt : str
        The format found there.

    Returns
    -------
    StoreError
        To raise; opening never changes a checkpoint, so nothing was written.
    """
    return StoreError(f"{path} is a checkpoint of the previous format {fmt}; run `scrubnet mlforget upgrade "
                      f"{path}` to bring it to {FORMAT} (opening it for reading or for requests never changes it)")


def _pause(stage: str) -> None:
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"PAUSED {stage}", flush=True)
        sys.stdout.flush()
        time.sleep(3600)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported on this platform: the renamed files themselves were fsynced
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the renamed files themselves were fsynced
    finally:
        os.close(fd)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _json_safe(v):
    """Plain JSON values: tensors and numpy scalars to numbers, non-finite floats to strings."""
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, torch.Tensor):
        return _json_safe(v.tolist())
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _insert_request(con: sqlite3.Connection, r: dict) -> None:
    con.execute(f"INSERT INTO requests ({', '.join(REQUEST_COLUMNS)}) VALUES ({', '.join('?' * len(REQUEST_COLUMNS))})",
                (r["id"], r["key"], r["kind"], json.dumps([int(i) for i in r["ids"]]), int(r["n_ids"]),
                 int(r["n_remaining"]), r["sigma"], json.dumps(_json_safe(r["solver"])), float(r["seconds"]),
                 r["time_utc"], r["sha256_before"], r["sha256_after"], "applied"))


def _row_to_request(row: sqlite3.Row) -> dict:
    d = {k: row[k] for k in REQUEST_COLUMNS}
    d["ids"] = json.loads(d["ids"])
    d["solver"] = json.loads(d["solver"])
    return d


def _read_state(con: sqlite3.Connection) -> dict:
    row = con.execute("SELECT request_id, weights_sha256, forgotten_ids, user_weights_dropped FROM state").fetchone()
    if row is None:
        raise StoreError("the store has no state row: the checkpoint is corrupt")
    return {"request_id": row[0], "weights_sha256": row[1], "forgotten_ids": json.loads(row[2]),
            "user_weights_dropped": bool(row[3])}


SUBMISSION_COLUMNS = ("id", "idempotency_key", "kind", "ids", "sigma", "ids_hash", "salt", "client",
                      "submitted_utc", "status", "reason", "request_id", "finished_utc", "receipt")


def _row_to_submission(row: sqlite3.Row) -> dict:
    d = {k: row[k] for k in SUBMISSION_COLUMNS}
    d["ids"] = json.loads(d["ids"])
    d["receipt"] = json.loads(d["receipt"]) if d["receipt"] else None
    return d
