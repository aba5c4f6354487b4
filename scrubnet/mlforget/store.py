"""ML checkpoints as a transactional request store: SQLite (WAL) for the record, safetensors for the weights.

A checkpoint is a directory::

    store.sqlite                      the database (WAL mode; ``store.sqlite-wal``/``-shm`` appear while open)
    weights/<sha256>.safetensors      the ML module's state_dict (core weights w_c + user weights w_u),
                                      named by the sha256 of the file's bytes
    factor.safetensors                the dual factor built at training (eigendecomposed user-data Gram,
                                      :class:`~scrubnet.mlforget.dual.DualFactor`), when training used the
                                      dual; its metadata ``key`` (:func:`factor_key`) says what it was built from
    primal.safetensors                the primal factor (eigendecomposed p×p user-weight system,
                                      :class:`~scrubnet.mlforget.primal.PrimalFactor`) when training used the
                                      primal; written and read with :mod:`scrubnet.integrity` (content hash),
                                      keyed like the dual factor; unreadable or mismatched: ignored and rebuilt

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

The record chain binds every stored field: the ``checkpoint`` values are sealed (``record_seal``: one sha256
per value and a link over them), request #0's link chains to that seal, request #k's to request #k−1's, the
state's to the last request's; each link hashes the sha256 of every column of its row (the whole solver dict
included) and the previous link. :func:`verify` recomputes them all and names any edited field. Stores of
the previous format (``scrubnet-mlforget/2``, the same tables without the chain) are checked and sealed in
place on first open (``sealed_from`` records when); an inconsistent one is refused, never sealed.

Protocol of a request:

1. outside any lock: load the data D (they depend only on the static ``checkpoint`` table), so the lock is
   held for the computation only;
2. ``BEGIN IMMEDIATE`` — the write lock is taken *before* the state is read, so concurrent requests
   serialise: each sees the weights its predecessor committed, none is lost, none is applied twice;
3. if a request with the same key is already stored, stop: it was applied (``applied_now=False``);
4. read the state, load the weights named by its sha256 (verified), check the ids;
5. compute the new weights in memory; refuse a non-finite result;
6. write ``weights/<new sha256>.safetensors`` (temp file, fsync, rename) — not referenced yet;
7. insert the request row and update the state row; ``COMMIT`` (SQLite makes this atomic and durable);
8. in a second short write transaction, delete weights files the state no longer names.

A process killed anywhere before 7 completes leaves the previous committed state (SQLite discards an
uncommitted transaction; an unreferenced weights file at most, deleted at the next request); killed after
it, the request is committed. Re-running the request then applies it exactly once: step 3 recognises it.
A reader (``show``, ``load``) needs no lock: WAL gives it a consistent snapshot of the record.

The factor file is read in step 1 (outside the lock), verified against the content hash in its metadata
(:mod:`scrubnet.integrity`), and used in step 5 when its key matches the checkpoint's core weights, data
fingerprint and the settings the Gram depends on (``factor_file: loaded`` in the request's record). Absent, it
is rebuilt from the data as before (``factor_file: absent``, ``factor_rebuilt: missing``). Damaged (truncated,
not safetensors, hash mismatch, non-finite), foreign (``key mismatch``) or giving a solve above the residual
tolerance (``bad solve``), it is rebuilt from the data, the problem is recorded with the file's name
(``factor_file_problem``) and the file is replaced by the rebuilt factor (``factor_file_rewritten``). It never
changes otherwise: the factor covers all user data and a request's Schur complement removes the forgotten
rows, so it is the same for every state of the checkpoint.

A request is committed only when its solver reached its tolerance (:func:`solver_result_problem`: the dual's
relative residual ≤ :data:`DUAL_RESIDUAL_TOL`, CG converged); otherwise it is refused and nothing is written.

Checkpoints of the previous format (``state.json`` + ``ledger.jsonl`` + ``weights-<seq>.safetensors``) are
migrated on first open: the database is built in a temporary file and linked into place (a concurrent
migration loses the race harmlessly); the old files stay as they were and are no longer read.

Test hook: ``SCRUBNET_MLFORGET_PAUSE_AT=<stage>`` makes the process print ``PAUSED <stage>`` and sleep at
that stage (``locked``, ``after_solve``, ``weights_partial``, ``after_weights``, ``before_commit``,
``after_commit``), so a test can kill it there for real.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor
from safetensors.torch import load as st_load, save

from scrubnet.integrity import ArtifactError, load_verified, save_verified, verified_bytes
from scrubnet.mlforget.dual import DualFactor
from scrubnet.mlforget.primal import PrimalFactor
from scrubnet.mlforget.model import MLConfig, MLState, check_forget_ids, forget_all, forget_request
from scrubnet.models import build_model
from scrubnet.models.linearized import LinearizedModel, convert_relu_to_leaky
from scrubnet.data.stream import inputs_finite

FORMAT = "scrubnet-mlforget/3"
#: the previous format: the same tables without the record chain; sealed in place on first open
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


def request_key(kind: str, ids, sigma: float | None) -> str:
    """Identity of a request: kind, sorted ids and σ."""
    payload = json.dumps({"kind": kind, "ids": sorted(int(i) for i in ids), "sigma": sigma}, sort_keys=True)
    return _sha(payload.encode())[:32]


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


#: the largest relative residual of the dual system a request may commit (a sound factor gives ~1e-14)
DUAL_RESIDUAL_TOL = 1e-8


def solver_result_problem(info: dict) -> str | None:
    """Why a request's solver result must not be committed, or None: the dual's relative residual above
    :data:`DUAL_RESIDUAL_TOL` (dual or primal), or CG (plain or certified) stopped before its tolerance. The papers' SGD is inexact by design
    (no tolerance) and is accepted."""
    raw = info.get("relative_residual")
    res = float(raw) if isinstance(raw, (int, float)) else float("nan")
    if info.get("solver") in ("dual", "primal"):
        if not math.isfinite(res) or res > DUAL_RESIDUAL_TOL:
            return (f"the {info.get('solver')} solver's relative residual {res:.3g} exceeds its tolerance "
                    f"{DUAL_RESIDUAL_TOL:g}")
    elif info.get("solver") in ("cg", "cg-certified"):
        if not info.get("converged", False) or not math.isfinite(res):
            return (f"CG stopped after {info.get('iterations')} iterations at relative residual {res:.3g} "
                    "without reaching its tolerance")
    return None


def _connect(db: Path) -> sqlite3.Connection:
    """Autocommit connection (transactions are explicit), WAL journal, full fsync at commit."""
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


def _insert_request(con: sqlite3.Connection, r: dict) -> None:
    con.execute(f"INSERT INTO requests ({', '.join(REQUEST_COLUMNS)}) VALUES ({', '.join('?' * len(REQUEST_COLUMNS))})",
                (r["id"], r["key"], r["kind"], json.dumps([int(i) for i in r["ids"]]), int(r["n_ids"]),
                 int(r["n_remaining"]), r["sigma"], json.dumps(_json_safe(r["solver"])), float(r["seconds"]),
                 r["time_utc"], r["sha256_before"], r["sha256_after"], "applied"))


# -- the record chain --------------------------------------------------------------------------------------
#
# Every stored field is bound into one chain of sha256 (format ``CHAIN_FORMAT``):
#   static seal  S  = H(prev="static", digests of every ``checkpoint`` value except the seal itself)
#   request #0   h0 = H(prev=S, digests of every column of the row)
#   request #k   hk = H(prev=h(k-1), digests of every column)
#   state        hs = H(prev=h(last request), digests of every column)
# where a field's digest is the sha256 of its canonical JSON (keys sorted, no spaces) as read back from the
# database, and H(prev, d) the sha256 of the canonical JSON of {"chain", "prev", "fields": d}. A row stores its
# digests (``digests``, JSON) and its link (``hash``); the static seal is the ``record_seal`` checkpoint value.
# The per-field digests let :func:`verify` name the edited field; the links catch an edit of the digests.

def _canon(v) -> bytes:
    return json.dumps(_json_safe(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def field_digests(fields: dict) -> dict:
    """{name: sha256 of the canonical JSON of the value}."""
    return {k: _sha(_canon(v)) for k, v in fields.items()}


def link_hash(prev: str, digests: dict) -> str:
    """One link of the record chain: sha256 of {"chain": CHAIN_FORMAT, "prev": prev, "fields": digests}."""
    return _sha(_canon({"chain": CHAIN_FORMAT, "prev": prev, "fields": digests}))


def _static_fields(con: sqlite3.Connection) -> dict:
    return {r[0]: json.loads(r[1]) for r in con.execute("SELECT key, value FROM checkpoint ORDER BY key")
            if r[0] != SEAL_KEY}


def _request_fields(con: sqlite3.Connection, rid: int) -> dict:
    row = con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests WHERE id = ?", (rid,)).fetchone()
    return _row_to_request(row)


def _state_fields(con: sqlite3.Connection) -> dict:
    return _read_state(con)


def _seal_request(con: sqlite3.Connection, rid: int, prev: str) -> str:
    """Store the digests and link of request ``rid`` (as read back) chained to ``prev``; returns the link."""
    d = field_digests(_request_fields(con, rid))
    h = link_hash(prev, d)
    con.execute("UPDATE requests SET digests = ?, hash = ? WHERE id = ?", (json.dumps(d, sort_keys=True), h, rid))
    return h


def _seal_state(con: sqlite3.Connection, prev: str) -> str:
    d = field_digests(_state_fields(con))
    h = link_hash(prev, d)
    con.execute("UPDATE state SET digests = ?, hash = ? WHERE one = 1", (json.dumps(d, sort_keys=True), h))
    return h


def _seal_all(con: sqlite3.Connection) -> None:
    """Seal the static record, every request in order and the state (inside the caller's transaction)."""
    d = field_digests(_static_fields(con))
    prev = link_hash("static", d)
    con.execute("INSERT OR REPLACE INTO checkpoint (key, value) VALUES (?, ?)",
                (SEAL_KEY, json.dumps({"fields": d, "sha256": prev}, sort_keys=True)))
    for (rid,) in con.execute("SELECT id FROM requests ORDER BY id").fetchall():
        prev = _seal_request(con, rid, prev)
    _seal_state(con, prev)


def _chain_problems(con: sqlite3.Connection) -> list[str]:
    """Every mismatch between the stored fields and the record chain, naming the row and the field."""
    problems: list[str] = []

    def check(what: str, fields: dict, stored_digests, stored_hash, prev: str) -> str:
        try:
            stored = json.loads(stored_digests) if isinstance(stored_digests, str) else stored_digests
        except json.JSONDecodeError:
            stored = None
        if not isinstance(stored, dict):
            problems.append(f"{what}: its field digests are missing or unreadable (record chain broken)")
            return stored_hash or ""
        now = field_digests(fields)
        for k in sorted(set(now) | set(stored)):
            if k not in stored:
                problems.append(f"{what}: field {k!r} was added after sealing (not in the record chain)")
            elif k not in now:
                problems.append(f"{what}: field {k!r} was removed after sealing")
            elif now[k] != stored[k]:
                problems.append(f"{what}: field {k!r} was edited (does not match the record chain)")
        if link_hash(prev, stored) != stored_hash:
            problems.append(f"{what}: its chain hash does not match its fields and the previous link "
                            "(the digests, the hash or an earlier link was edited)")
        return stored_hash or ""

    static = _static_fields(con)
    seal_row = con.execute("SELECT value FROM checkpoint WHERE key = ?", (SEAL_KEY,)).fetchone()
    seal = json.loads(seal_row[0]) if seal_row else {}
    if not isinstance(seal, dict):
        seal = {}
    prev = check("checkpoint record", static, seal.get("fields"), seal.get("sha256"), "static")
    for row in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)}, digests, hash FROM requests ORDER BY id").fetchall():
        prev = check(f"request #{row['id']}", _row_to_request(row), row["digests"], row["hash"], prev)
    row = con.execute("SELECT digests, hash FROM state").fetchone()
    if row is not None:
        check("state", _state_fields(con), row["digests"], row["hash"], prev)
    return problems


def _row_to_request(row: sqlite3.Row) -> dict:
    d = {k: row[k] for k in REQUEST_COLUMNS}
    d["ids"] = json.loads(d["ids"])
    d["solver"] = json.loads(d["solver"])
    return d


# -- creating and opening ----------------------------------------------------------------------------------

def save_new(path: str | Path, state: MLState, *, arch: str, in_shape, arch_options: dict | None = None,
             data: dict | None = None, data_fingerprint: str | None = None, extra: dict | None = None) -> dict:
    """Create checkpoint directory ``path`` (must not exist) for ``state``; built in a temporary directory
    and renamed, so an interrupted save leaves nothing at ``path``. Returns the training request's record."""
    path = Path(path)
    if path.exists():
        raise StoreError(f"{path} already exists; choose a new checkpoint directory")
    _check_finite_model(state.model, "the trained ML model")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint gets the usual permissions
    try:
        data_bytes = weights_bytes(state.model)
        sha = _sha(data_bytes)
        (tmp / WEIGHTS).mkdir()
        _weights_path(tmp, sha).write_bytes(data_bytes)
        if state.factor is not None:
            _write_factor(tmp, state.factor, factor_key(state.model, {
                "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                "num_classes": int(state.num_classes), "ml_config": state.config.to_dict(),
                "data_fingerprint": data_fingerprint}, state.factor.ids))
        if state.primal is not None:
            _write_primal(tmp, state.primal, factor_key(state.model, {
                "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                "num_classes": int(state.num_classes), "ml_config": state.config.to_dict(),
                "data_fingerprint": data_fingerprint}, state.primal.ids, PRIMAL_FORMAT))
        static = {"format": FORMAT, "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                  "num_classes": int(state.num_classes), "seed": int(state.seed), "ml_config": state.config.to_dict(),
                  "data": data, "data_fingerprint": data_fingerprint, "core_ids": state.core_ids.tolist(),
                  "user_ids": state.user_ids.tolist(), **(extra or {})}
        record = {"id": 0, "key": None, "kind": "train", "ids": [], "n_ids": 0,
                  "n_remaining": int(len(state.deletable_ids())), "sigma": None, "solver": dict(state.train_info),
                  "seconds": float(state.train_info.get("train_seconds", 0.0) or 0.0), "time_utc": _now(),
                  "sha256_before": None, "sha256_after": sha}
        _create_db(tmp / DB, static, record, {"request_id": 0, "weights_sha256": sha,
                                               "forgotten_ids": state.forgotten_ids.tolist(),
                                               "user_weights_dropped": False})
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _db_path(path: Path) -> Path:
    if not path.is_dir():
        raise StoreError(f"ML checkpoint directory not found: {path}")
    db = path / DB
    if db.is_file():
        return db
    if (path / LEGACY_STATE).is_file():
        migrate_legacy(path)
        return db
    raise StoreError(f"{path} is not an ML checkpoint (no {DB}); create one with `scrubnet mlforget train`")


def _static(con: sqlite3.Connection, path: Path) -> dict:
    try:
        static = {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM checkpoint")}
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path / DB} is not a readable scrubnet store: {e}") from None
    if static.get("format") == FORMAT_UNSEALED:
        _seal_unsealed(con, path)
        return _static(con, path)
    if static.get("format") != FORMAT:
        raise StoreError(f"{path / DB} is not a {FORMAT} store (format {static.get('format')!r})")
    return static


def _seal_unsealed(con: sqlite3.Connection, path: Path) -> None:
    """Bring a store of the previous format (same tables, no record chain) to this one, in place and in one
    write transaction: the weights chain and the state's consistency are checked first (an inconsistent
    store is refused, never sealed), then the columns are added, ``sealed_from`` records when and from what,
    and every row is sealed as it stands. Edits made before this moment cannot be detected: the chain
    vouches for the record from its sealing on."""
    with _write_transaction(con):
        static = {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM checkpoint")}
        if static.get("format") != FORMAT_UNSEALED:
            return  # a concurrent process sealed it first
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


@contextlib.contextmanager
def _open(path: str | Path):
    path = Path(path)
    db = _db_path(path)
    try:
        con = _connect(db)
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


def _read_state(con: sqlite3.Connection) -> dict:
    row = con.execute("SELECT request_id, weights_sha256, forgotten_ids, user_weights_dropped FROM state").fetchone()
    if row is None:
        raise StoreError("the store has no state row: the checkpoint is corrupt")
    return {"request_id": row[0], "weights_sha256": row[1], "forgotten_ids": json.loads(row[2]),
            "user_weights_dropped": bool(row[3])}


def _empty_model(static: dict) -> LinearizedModel:
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
    model = _empty_model(static) if model is None else model
    try:
        model.load_state_dict(st_load(data), strict=True)
    except RuntimeError as e:
        raise StoreError(f"weights in {wf} do not fit the recorded architecture: {e}") from None
    _check_finite_model(model, f"checkpoint {path}")
    return MLState(model, torch.tensor(static["core_ids"], dtype=torch.long),
                   torch.tensor(static["user_ids"], dtype=torch.long),
                   torch.tensor(st["forgotten_ids"], dtype=torch.long), MLConfig.from_dict(static["ml_config"]),
                   static["num_classes"], static["seed"])


def load(path: str | Path) -> tuple[MLState, dict]:
    """The committed :class:`MLState` of the checkpoint at ``path`` and its record: the static
    ``checkpoint`` values plus ``request_id``, ``weights_sha256``, ``forgotten_ids``, ``user_weights_dropped``.
    Reads a consistent snapshot without taking the write lock."""
    with _open(path) as (p, con, static):
        for attempt in range(5):
            con.execute("BEGIN")  # a read transaction: one snapshot of the record
            try:
                st = _read_state(con)
            finally:
                con.execute("COMMIT")
            try:
                return _load_state(p, static, st), {**static, **st}
            except StoreError:
                # a concurrent request may have committed and removed the file between the two reads
                if attempt == 4 or _read_state(con)["weights_sha256"] == st["weights_sha256"]:
                    raise
    raise AssertionError("unreachable")


def requests(path: str | Path) -> list[dict]:
    """Every committed request, in commit order (``id`` 0 = training)."""
    with _open(path) as (_, con, _static_):
        return [_row_to_request(r) for r in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                                        "ORDER BY id")]


def verify(path: str | Path) -> dict:
    """Check the record: every field of the static record, of each request and of the state matches the
    record chain (the edited field is named); ids 0, 1, 2, … without gaps; request 0 is the training; each
    request's ``sha256_before`` is its predecessor's ``sha256_after``; the state names the last request and
    its weights, whose file hashes to that sha256; the forgotten ids are the union of the forget requests' ids
    (disjoint), and ``forget_all`` is the last request when present. Returns ``{"valid", "problems",
    "requests", "state", "head"}`` (``head``: the state's chain hash)."""
    with _open(path) as (p, con, static):
        con.execute("BEGIN")
        try:
            reqs = [_row_to_request(r) for r in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                                            "ORDER BY id")]
            hashes = {r[0]: r[1] for r in con.execute("SELECT id, hash FROM requests")}
            st = _read_state(con)
            head = con.execute("SELECT hash FROM state").fetchone()[0]
            chain = _chain_problems(con)
        finally:
            con.execute("COMMIT")
    for r in reqs:
        r["hash"] = hashes[r["id"]]
    problems = chain + _consistency_problems(p, static, reqs, st)
    return {"valid": not problems, "problems": problems, "requests": reqs, "state": st, "head": head,
            "n_user": len(static["user_ids"]), "n_core": len(static["core_ids"])}


def _consistency_problems(p: Path, static: dict, reqs: list[dict], st: dict) -> list[str]:
    """The checks of the record that do not need the chain (weights chain, state, forgotten ids, files)."""
    problems = []
    if not reqs or reqs[0]["kind"] != "train" or reqs[0]["sha256_before"] is not None:
        problems.append("request #0 is not the training")
    forgotten: list[int] = []
    for k, r in enumerate(reqs):
        if r["id"] != k:
            problems.append(f"request ids jump from #{k - 1} to #{r['id']}")
            break
        if k and r["sha256_before"] != reqs[k - 1]["sha256_after"]:
            problems.append(f"request #{k}: sha256_before {str(r['sha256_before'])[:12]} is not the sha256_after "
                            f"{reqs[k - 1]['sha256_after'][:12]} of request #{k - 1}")
        if r["kind"] == "forget":
            dup = set(r["ids"]) & set(forgotten)
            if dup:
                problems.append(f"request #{k} forgets id(s) {sorted(dup)[:10]} a second time")
            forgotten += r["ids"]
        if r["kind"] == "forget_all" and k != len(reqs) - 1:
            problems.append(f"request #{k} is forget_all but later requests follow it")
    if reqs:
        last = reqs[-1]
        if st["request_id"] != last["id"]:
            problems.append(f"the state is at request #{st['request_id']} but the last request is #{last['id']}")
        if st["weights_sha256"] != last["sha256_after"]:
            problems.append("the state's weights are not those of the last request")
        if any(r["kind"] == "forget_all" for r in reqs) != st["user_weights_dropped"]:
            problems.append("the state's user_weights_dropped flag disagrees with the requests")
    if st["user_weights_dropped"]:
        core = set(static["core_ids"])
        forgotten = [i for i in static["user_ids"] if i not in core]
    if sorted(forgotten) != sorted(st["forgotten_ids"]):
        problems.append("the state's forgotten ids are not the union of the forget requests' ids")
    wf = _weights_path(p, st["weights_sha256"])
    if not wf.is_file():
        problems.append(f"weights file {wf.name} is missing")
    elif _sha(wf.read_bytes()) != st["weights_sha256"]:
        problems.append(f"weights file {wf.name} does not hash to its name")
    return problems


# -- requests --------------------------------------------------------------------------------------------

def _apply(path: str | Path, kind: str, key: str, compute, prepare=None, on_commit=None,
           on_duplicate=None) -> tuple[dict, bool]:
    """The request protocol of the module docstring. ``prepare(static)`` runs before the lock (data loading);
    ``compute(state, record_state, prepared) -> record fields`` runs under it and updates ``state`` in place.
    ``on_commit(con, record)`` runs inside the committing transaction (the service marks its submission
    applied there, atomically with the request); ``on_duplicate(con, record)`` inside the transaction that
    found the request already stored."""
    with _open(path) as (p, con, static):
        prepared = prepare(static) if prepare is not None else None
        model = _empty_model(static)
        with _write_transaction(con):
            _pause("locked")
            row = con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests WHERE key = ?", (key,)).fetchone()
            if row is not None:
                if on_duplicate is not None:
                    on_duplicate(con, _row_to_request(row))
                return _row_to_request(row), False
            st = _read_state(con)
            state = _load_state(p, static, st, model)
            if st["user_weights_dropped"]:
                raise StoreError(f"forget-all already dropped the user weights (request #{st['request_id']}); "
                                 "there is nothing left to forget")
            t0 = time.perf_counter()
            fields = compute(state, st, prepared)
            seconds = time.perf_counter() - t0
            _check_finite_model(state.model, f"the {kind} request produced a model that")
            _pause("after_solve")
            data = weights_bytes(state.model)
            sha = _sha(data)
            _write_weights(p, data, sha)
            _pause("after_weights")
            rid = st["request_id"] + 1
            record = {"id": rid, "key": key, "kind": kind, "seconds": seconds, "time_utc": _now(),
                      "sha256_before": st["weights_sha256"], "sha256_after": sha, "status": "applied", **fields}
            _insert_request(con, record)
            prev = con.execute("SELECT hash FROM requests WHERE id = ?", (st["request_id"],)).fetchone()[0]
            record["hash"] = _seal_request(con, rid, prev)
            dropped = kind == "forget_all"
            con.execute("UPDATE state SET request_id = ?, weights_sha256 = ?, forgotten_ids = ?, "
                        "user_weights_dropped = ? WHERE one = 1",
                        (rid, sha, json.dumps(state.forgotten_ids.tolist()), int(dropped)))
            _seal_state(con, record["hash"])
            if on_commit is not None:
                on_commit(con, record)
            _pause("before_commit")
        _pause("after_commit")
        _collect_garbage(p, con)
        return record, True


def _collect_garbage(path: Path, con: sqlite3.Connection) -> None:
    """Delete weights files and temp files the state does not name; under the write lock, so no request is
    between writing its weights and committing them."""
    with _write_transaction(con):
        keep = f"{_read_state(con)['weights_sha256']}.safetensors"
        for f in (path / WEIGHTS).iterdir():
            if f.name != keep:
                f.unlink(missing_ok=True)


def forget(path: str | Path, ids, *, sigma: float | None = None, x_all=None, y_all=None,
           data_loader=None, on_commit=None, on_duplicate=None, budget_nats: float | None = None
           ) -> tuple[dict, bool]:
    """Apply one forgetting request to the checkpoint at ``path``; returns (request record, applied_now).

    The data D come from ``x_all, y_all`` or from ``data_loader(static) -> (x, y)`` (called before the lock).
    A request whose key (kind, sorted ids, σ) is already stored is not applied again: its record is
    returned with ``applied_now=False``. ``on_commit``/``on_duplicate``: see :func:`_apply`. The noise of request #k is drawn from seed 1 000 003·seed + k.
    """
    ids = sorted(int(i) for i in ids)
    with _open(path) as (_, _con, static):
        sig = MLConfig.from_dict(static["ml_config"]).sigma if sigma is None else float(sigma)
    if not (math.isfinite(sig) and sig >= 0):
        raise StoreError(f"sigma must be a finite number ≥ 0, got {sig}")
    key = request_key("forget", ids, sig)

    def prepare(static):
        if x_all is not None:
            data = x_all, y_all
        elif data_loader is None:
            raise StoreError("no data given for the forgetting request")
        else:
            data = data_loader(static)
        return data, _read_factor(Path(path)), _read_primal(Path(path))

    def compute(state, st, prepared):
        ids_t = check_forget_ids(state, ids)
        (x, y), (factor, factor_status, key, factor_problem), (primal, primal_status, pkey) = prepared
        if primal is not None:
            if pkey == factor_key(state.model, static, primal.ids, PRIMAL_FORMAT):
                state.primal, primal_status = primal, "loaded"
            else:
                primal_status = "key mismatch"
        if not inputs_finite(x):
            raise StoreError("the data D contain non-finite values (NaN or inf); nothing was changed")
        if factor is not None:
            if key == factor_key(state.model, static, factor.ids):
                state.factor, factor_status = factor, "loaded"
            else:
                factor_status = "key mismatch"
                factor_problem = (f"{Path(path) / FACTOR}: key mismatch (built for other core weights, data or "
                                  "settings)")
        noise_seed = 1_000_003 * state.seed + st["request_id"] + 1
        out = forget_request(state, x, y, ids, sigma=sig, noise_seed=noise_seed, apply=False,
                             budget_nats=budget_nats)
        problem = solver_result_problem(out.info.as_dict())
        if problem and factor_status == "loaded":
            # the verified file gave a bad solve: rebuild the factor from the data once and solve again
            state.factor, factor_status = None, "bad solve"
            factor_problem = f"{Path(path) / FACTOR}: {problem}"
            out = forget_request(state, x, y, ids, sigma=sig, noise_seed=noise_seed, apply=False,
                             budget_nats=budget_nats)
            problem = solver_result_problem(out.info.as_dict())
        if problem:
            raise StoreError(f"request refused, nothing was committed: {problem}")
        state.model.set_delta_flat(out.w_after)
        state.forgotten_ids = torch.sort(torch.cat([state.forgotten_ids, ids_t])).values  # as forget_request
        rewritten = False
        if factor_problem and state.factor is not None and state.factor.source == "built":
            # the file was damaged, foreign or gave a bad solve: replace it by the factor rebuilt from the data
            _write_factor(Path(path), state.factor, factor_key(state.model, static, state.factor.ids))
            rewritten = True
        extra = {"factor_file_problem": factor_problem, "factor_file_rewritten": rewritten} if factor_problem else {}
        return {"ids": ids, "n_ids": len(ids), "n_remaining": int(len(state.deletable_ids())), "sigma": sig,
                "solver": {**out.info.as_dict(), "factor_file": factor_status, "primal_file": primal_status,
                           **extra}}

    return _apply(path, "forget", key, compute, prepare, on_commit, on_duplicate)


def forget_everything(path: str | Path, on_commit=None, on_duplicate=None) -> tuple[dict, bool]:
    """Forget all user data: w_u ← 0. The request lists no ids (it names no samples); the state records that
    the user weights were dropped and adds the deletable user ids to the forgotten ones — never the core ids,
    whose information lives in the core weights and stays. Idempotent like :func:`forget`."""
    key = request_key("forget_all", [], None)

    def compute(state, st, _):
        n = int(len(state.deletable_ids()))
        forget_all(state)
        state.forgotten_ids = state.user_ids[~torch.isin(state.user_ids, state.core_ids)]
        return {"ids": [], "n_ids": n, "n_remaining": 0, "sigma": 0.0,
                "solver": {"solver": "zero", "iterations": 0, "user_weights_dropped": True}}

    return _apply(path, "forget_all", key, compute, None, on_commit, on_duplicate)


def forgotten_by_request(reqs: list[dict]) -> list[int]:
    """The union of the ids of the ``forget`` requests (the state's forgotten ids unless ``forget_all``
    dropped the user weights)."""
    return sorted(i for r in reqs if r["kind"] == "forget" for i in r["ids"])


# -- the service's queue ----------------------------------------------------------------------------------

SUBMISSION_COLUMNS = ("id", "idempotency_key", "kind", "ids", "sigma", "ids_hash", "salt", "client",
                      "submitted_utc", "status", "reason", "request_id", "finished_utc", "receipt")


def _row_to_submission(row: sqlite3.Row) -> dict:
    d = {k: row[k] for k in SUBMISSION_COLUMNS}
    d["ids"] = json.loads(d["ids"])
    d["receipt"] = json.loads(d["receipt"]) if d["receipt"] else None
    return d


def check_ids_now(path: str | Path, ids) -> list[int]:
    """The checks of :func:`forget` that need no weights (empty, duplicated, core, unknown, already forgotten,
    every remaining sample), against the committed state; sorted ids. ``StoreError`` naming the problem."""
    with _open(path) as (_, con, static):
        st = _read_state(con)
    if st["user_weights_dropped"]:
        raise StoreError("forget-all already dropped the user weights; there is nothing left to forget")
    probe = MLState(None, torch.tensor(static["core_ids"], dtype=torch.long),
                    torch.tensor(static["user_ids"], dtype=torch.long),
                    torch.tensor(st["forgotten_ids"], dtype=torch.long), MLConfig.from_dict(static["ml_config"]),
                    static["num_classes"], static["seed"])
    try:
        return check_forget_ids(probe, ids).tolist()
    except ValueError as e:
        raise StoreError(str(e)) from None


def submit(path: str | Path, idempotency_key: str, kind: str, ids: list[int], sigma: float | None,
           ids_hash: str | None, salt: str | None, client: str | None) -> tuple[dict, bool]:
    """Queue a request (status ``queued``); returns (submission, created). A submission with the same
    idempotency key is returned as it stands (``created=False``) when its kind, ids and σ are the same;
    ``StoreError`` when they differ."""
    with _open(path) as (_, con, _static_):
        with _write_transaction(con):
            row = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions WHERE idempotency_key = ?",
                              (idempotency_key,)).fetchone()
            if row is not None:
                old = _row_to_submission(row)
                if (old["kind"], old["ids"], old["sigma"]) != (kind, sorted(ids), sigma):
                    raise StoreError("this Idempotency-Key was already used for a different request")
                return old, False
            cur = con.execute("INSERT INTO submissions (idempotency_key, kind, ids, sigma, ids_hash, salt, client, "
                              "submitted_utc, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'queued')",
                              (idempotency_key, kind, json.dumps(sorted(int(i) for i in ids)), sigma, ids_hash,
                               salt, client, _now()))
            sid = cur.lastrowid
            row = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions WHERE id = ?",
                              (sid,)).fetchone()
            return _row_to_submission(row), True


def submission_by_key(path: str | Path, idempotency_key: str) -> dict | None:
    with _open(path) as (_, con, _static_):
        row = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions WHERE idempotency_key = ?",
                          (idempotency_key,)).fetchone()
    return _row_to_submission(row) if row is not None else None


def submission(path: str | Path, sid: int) -> dict | None:
    with _open(path) as (_, con, _static_):
        row = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions WHERE id = ?",
                          (int(sid),)).fetchone()
    return _row_to_submission(row) if row is not None else None


def submissions(path: str | Path, status: str | None = None, limit: int = 1000) -> list[dict]:
    """Submissions in arrival order (``status`` filters), at most ``limit`` (the latest ones)."""
    with _open(path) as (_, con, _static_):
        where = "WHERE status = ?" if status else ""
        rows = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions {where} ORDER BY id DESC "
                           "LIMIT ?", ((status,) if status else ()) + (int(limit),)).fetchall()
    return [_row_to_submission(r) for r in reversed(rows)]


def _finish(con: sqlite3.Connection, sid: int, status: str, reason: str | None, request_id: int | None) -> None:
    con.execute("UPDATE submissions SET status = ?, reason = ?, request_id = ?, finished_utc = ? "
                "WHERE id = ? AND status = 'queued'", (status, reason, request_id, _now(), sid))


def apply_submission(path: str | Path, sid: int, data_loader) -> dict:
    """Apply queued submission ``sid`` through :func:`forget` / :func:`forget_everything`: marked ``applied``
    in the request's own transaction (so a kill leaves either both or neither), ``refused`` with the reason
    when the store refuses it (ids already forgotten, the same request already applied, …), ``failed`` with
    the error on anything else. Returns the submission as it ends."""
    sub = submission(path, sid)
    if sub is None or sub["status"] != "queued":
        return sub

    def on_commit(con, record):
        _finish(con, sid, "applied", None, record["id"])

    def on_duplicate(con, record):
        _finish(con, sid, "refused", f"the same request was already applied as request #{record['id']}", None)

    try:
        if sub["kind"] == "forget_all":
            forget_everything(path, on_commit=on_commit, on_duplicate=on_duplicate)
        else:
            forget(path, sub["ids"], sigma=sub["sigma"], data_loader=data_loader, on_commit=on_commit,
                   on_duplicate=on_duplicate)
    except (StoreError, ValueError) as e:
        _mark(path, sid, "refused", str(e.args[0]) if e.args else type(e).__name__)
    except Exception as e:  # noqa: BLE001 — recorded on the submission, the worker goes on
        _mark(path, sid, "failed", f"{type(e).__name__}: {e}")
    return submission(path, sid)


def _mark(path: str | Path, sid: int, status: str, reason: str) -> None:
    with _open(path) as (_, con, _static_):
        with _write_transaction(con):
            _finish(con, sid, status, reason, None)


def set_receipt(path: str | Path, sid: int, receipt: dict) -> None:
    with _open(path) as (_, con, _static_):
        with _write_transaction(con):
            con.execute("UPDATE submissions SET receipt = ? WHERE id = ? AND receipt IS NULL",
                        (json.dumps(receipt, sort_keys=True), int(sid)))


def oldest_queued(path: str | Path) -> int | None:
    """Id of the oldest queued submission (the worker applies them in arrival order), or None."""
    with _open(path) as (_, con, _static_):
        row = con.execute("SELECT id FROM submissions WHERE status = 'queued' ORDER BY id LIMIT 1").fetchone()
    return row[0] if row else None


def applied_without_receipt(path: str | Path) -> list[dict]:
    """Applied submissions whose receipt is not yet written, in request order."""
    with _open(path) as (_, con, _static_):
        rows = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions WHERE status = 'applied' "
                           "AND receipt IS NULL ORDER BY request_id").fetchall()
    return [_row_to_submission(r) for r in rows]


def previous_receipt(path: str | Path, request_id: int) -> dict | None:
    """The receipt of the applied submission with the largest request id below ``request_id``."""
    with _open(path) as (_, con, _static_):
        row = con.execute("SELECT receipt FROM submissions WHERE status = 'applied' AND request_id < ? "
                          "ORDER BY request_id DESC LIMIT 1", (int(request_id),)).fetchone()
    return json.loads(row[0]) if row and row[0] else None


def request_with_link(path: str | Path, request_id: int) -> tuple[dict, str, str | None]:
    """(request row, its record-chain link, its predecessor's link)."""
    with _open(path) as (_, con, _static_):
        con.execute("BEGIN")
        try:
            row = con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)}, hash FROM requests WHERE id = ?",
                              (int(request_id),)).fetchone()
            prev = con.execute("SELECT hash FROM requests WHERE id = ?", (int(request_id) - 1,)).fetchone()
        finally:
            con.execute("COMMIT")
    if row is None:
        raise StoreError(f"request #{request_id} is not in the store")
    return _row_to_request(row), row["hash"], prev[0] if prev else None


def state_record(path: str | Path) -> dict:
    """The committed state row plus its chain link (``head``)."""
    with _open(path) as (_, con, _static_):
        st = _read_state(con)
        st["head"] = con.execute("SELECT hash FROM state").fetchone()[0]
    return st


def request_links(path: str | Path) -> dict[int, str]:
    """{request id: its record-chain link}."""
    with _open(path) as (_, con, _static_):
        return {r[0]: r[1] for r in con.execute("SELECT id, hash FROM requests")}


# -- migration of the previous format ------------------------------------------------------------------

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
    if not isinstance(meta, dict) or meta.get("format") != "scrubnet-mlforget/1":
        raise StoreError(f"{path / LEGACY_STATE} is not a scrubnet-mlforget/1 state record{how}")
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
