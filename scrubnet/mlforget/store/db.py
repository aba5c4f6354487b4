"""Opening the database: read-only or for writing, never upgrading; creating one; the write transaction.

Every open checks the format: a checkpoint of a previous format (the ledger files of
``scrubnet-mlforget/1``, or the unsealed tables of ``scrubnet-mlforget/2``) is refused with an error naming
``scrubnet mlforget upgrade`` (:func:`~scrubnet.mlforget.store.migrate.upgrade` is the only code that
changes a checkpoint's format). A read-only open (``write=False``: ``load``, ``requests``, ``verify``, the
service's reads) uses SQLite's ``mode=ro``, so it cannot write to the database file.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import urllib.parse
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from scrubnet.mlforget.ftstore import is_finetune, rebuild_network
from scrubnet.mlforget.sharded import ENGINE as SHARDED
from scrubnet.mlforget.model import MLConfig, MLState
from scrubnet.mlforget.store.blobs import _check_finite_model, _weights_path
from scrubnet.mlforget.store.chain import _seal_all
from scrubnet.mlforget.store.schema import (DB, FORMAT, FORMAT_UNSEALED, LEGACY_FORMAT, LEGACY_STATE,
                                            LOCK_TIMEOUT_S, SCHEMA, SUBMISSIONS_SCHEMA, StoreError,
                                            _insert_request, _json_safe, _sha, needs_upgrade)
from scrubnet.models import build_model
from scrubnet.models.linearized import LinearizedModel, convert_relu_to_leaky


def _connect(db: Path, *, read_only: bool = False) -> sqlite3.Connection:
    """Autocommit connection (transactions are explicit), WAL journal, full fsync at commit.

    Parameters
    ----------
    db : Path
        The database file.
    read_only : bool
        Open with SQLite's ``mode=ro``: any write (a migration, a seal, a checkpoint of the WAL into the
        file) fails instead of happening. SQLite may still create the empty ``-wal``/``-shm`` side files
        (the WAL's index, shared with writers); the database file itself is never written. In a directory
        that cannot be written (a read-only mount) SQLite cannot create them: the file is then opened
        ``immutable`` (no locks, nobody can be writing it there).

    Returns
    -------
    sqlite3.Connection
        Rows as :class:`sqlite3.Row`; waits up to ``LOCK_TIMEOUT_S`` for a lock.
    """
    if read_only:
        uri = f"file:{urllib.parse.quote(str(Path(db).resolve()))}?mode=ro"
        if not os.access(Path(db).resolve().parent, os.W_OK):
            uri += "&immutable=1"
        con = sqlite3.connect(uri, uri=True, timeout=LOCK_TIMEOUT_S, isolation_level=None)
    else:
        con = sqlite3.connect(str(db), timeout=LOCK_TIMEOUT_S, isolation_level=None)
    con.row_factory = sqlite3.Row
    con.execute("PRAGMA synchronous=FULL")
    return con


def _create_db(db: Path, static: dict, first: dict, state: dict) -> None:
    """A new database file ``db`` (must not exist) holding one checkpoint."""
    con = sqlite3.connect(str(db), isolation_level=None)
    con.row_factory = sqlite3.Row
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=FULL")
        con.execute("BEGIN")
        for stmt in SCHEMA.split(";"):
            if stmt.strip():
                con.execute(stmt)
        con.executemany("INSERT INTO checkpoint (key, value) VALUES (?, ?)",
                        [(k, json.dumps(_json_safe(v))) for k, v in static.items()])
        for r in [first] if isinstance(first, dict) else first:
            _insert_request(con, r)
        con.execute("INSERT INTO state (one, request_id, weights_sha256, forgotten_ids, user_weights_dropped) "
                    "VALUES (1, ?, ?, ?, ?)", (state["request_id"], state["weights_sha256"],
                                               json.dumps(state["forgotten_ids"]), int(state["user_weights_dropped"])))
        for stmt in SUBMISSIONS_SCHEMA.split(";"):
            if stmt.strip():
                con.execute(stmt)
        _seal_all(con)
        con.execute("COMMIT")
    finally:
        con.close()


def _db_path(path: Path) -> Path:
    """``path/store.sqlite``; ``StoreError`` when ``path`` is no checkpoint, or one of the ledger format
    (which needs ``upgrade``)."""
    if not path.is_dir():
        raise StoreError(f"ML checkpoint directory not found: {path}")
    db = path / DB
    if db.is_file():
        return db
    if (path / LEGACY_STATE).is_file():
        raise needs_upgrade(path, f"{LEGACY_FORMAT} (state.json + ledger.jsonl)")
    raise StoreError(f"{path} is not an ML checkpoint (no {DB}); create one with `scrubnet mlforget train`")


def _read_static(con: sqlite3.Connection, path: Path) -> dict:
    """Every ``checkpoint`` value, whatever the format; ``StoreError`` when the file is not a database."""
    try:
        return {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM checkpoint")}
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path / DB} is not a readable scrubnet store: {e}") from None


def _static(con: sqlite3.Connection, path: Path) -> dict:
    """The static record of a store of the current format; a previous format is refused (needs ``upgrade``)."""
    static = _read_static(con, path)
    if static.get("format") == FORMAT_UNSEALED:
        raise needs_upgrade(path, f"{FORMAT_UNSEALED} (no record chain)")
    if static.get("format") != FORMAT:
        raise StoreError(f"{path / DB} is not a {FORMAT} store (format {static.get('format')!r})")
    return static


@contextlib.contextmanager
def _open(path: str | Path, *, write: bool = False):
    """``(path, connection, static record)`` of the checkpoint at ``path``, closed on exit.

    Parameters
    ----------
    path : str or Path
        The checkpoint directory.
    write : bool
        False (the default): a read-only connection, which cannot change the database file. True: a
        connection that may take the write lock (requests, the service's queue).

    Raises
    ------
    StoreError
        No checkpoint, not a database, or a previous format (the message names ``scrubnet mlforget upgrade``;
        no open ever upgrades).
    """
    path = Path(path)
    db = _db_path(path)
    try:
        con = _connect(db, read_only=not write)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot open {db}: {e}") from None
    try:
        yield path, con, _static(con, path)
    finally:
        con.close()


@contextlib.contextmanager
def _write_transaction(con: sqlite3.Connection):
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on any exception)."""
    try:
        con.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as e:
        raise StoreError(f"the checkpoint is busy (write lock not obtained in {LOCK_TIMEOUT_S:.0f} s): {e}") from None
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def _empty_model(static: dict, path: Path | None = None) -> LinearizedModel:
    if is_finetune(static):  # a forgettable fine-tune: the recorded base model (hash-checked) and its adapters,
        return rebuild_network(static, path)  # its paths relative to the checkpoint directory
    cfg = MLConfig.from_dict(static["ml_config"])
    core = build_model(static["arch"], static["in_shape"], static["num_classes"], seed=0, **static["arch_options"])
    if cfg.leaky_slope is not None:
        convert_relu_to_leaky(core, cfg.leaky_slope)
    return LinearizedModel(core, prefixes=cfg.linearize)


def _load_state(path: Path, static: dict, st: dict, model: LinearizedModel | None = None) -> MLState:
    wf = _weights_path(path, st["weights_sha256"])
    if not wf.is_file():
        raise StoreError(f"weights file {wf} named by the state is missing: the checkpoint is corrupt")
    data = wf.read_bytes()
    if _sha(data) != st["weights_sha256"]:
        raise StoreError(f"{wf} does not match its sha256: the checkpoint is corrupt")
    model = _empty_model(static, path) if model is None else model
    try:
        model.load_state_dict(st_load(data), strict=True)
    except RuntimeError as e:
        raise StoreError(f"weights in {wf} do not fit the recorded architecture: {e}") from None
    _check_finite_model(model, f"checkpoint {path}")
    state = MLState(model, torch.tensor(static["core_ids"], dtype=torch.long),
                    torch.tensor(static["user_ids"], dtype=torch.long),
                    torch.tensor(st["forgotten_ids"], dtype=torch.long), MLConfig.from_dict(static["ml_config"]),
                    static["num_classes"], static["seed"])
    if is_finetune(static):
        state.base_sha256 = static["finetune"]["base"]["state_dict_sha256"]
        state.user_weights = static["finetune"]["user_weights"]
        if getattr(model, "engine", None) == SHARDED:  # the engine keeps its own copy of the bookkeeping
            model.forgotten = state.forgotten_ids.clone()
    return state
