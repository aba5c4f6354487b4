"""The HTTP service's queue (the ``submissions`` table): submitting, applying in arrival order, receipts.

A submission is ``queued`` → ``applied`` (``request_id`` names the committed request, set in the request's
own transaction) | ``refused`` (``reason``) | ``failed`` (``reason``); ``receipt`` is the signed receipt of
an applied one. Reads open the database read-only; the writes take the write lock.
"""
from __future__ import annotations

import errno
import json
import sqlite3
from pathlib import Path

import torch

from scrubnet.mlforget.model import MLConfig, MLState, check_forget_ids
from scrubnet.mlforget.store.apply import forget, forget_everything
from scrubnet.mlforget.store.db import _open, _write_transaction
from scrubnet.mlforget.store.schema import (SUBMISSION_COLUMNS, StoreError, _now, _read_state,
                                            _row_to_submission)


def check_ids_now(path: str | Path, ids, forgotten: bool = True) -> list[int]:
    """The checks of :func:`forget` that need no weights, against the committed state.

    Parameters
    ----------
    path : str or Path
        The checkpoint.
    ids : sequence of int
        The sample ids of a request.
    forgotten : bool
        Also refuse ids already forgotten (and a request leaving no sample). False: only the checks that do
        not depend on earlier requests (empty, duplicated, core, unknown), so the answer reveals nothing about
        what others asked to forget; the request is then refused when applied.

    Returns
    -------
    list of int
        The sorted ids. ``StoreError`` naming the problem otherwise.
    """
    with _open(path) as (_, con, static):
        st = _read_state(con)
    if not forgotten:
        st["forgotten_ids"] = []
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
    with _open(path, write=True) as (_, con, _static_):
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


def submissions(path: str | Path, status: str | None = None, limit: int = 1000,
                client: str | None = None) -> list[dict]:
    """Submissions in arrival order (``status``, ``client`` filter), at most ``limit`` (the latest ones)."""
    conds = [c for c, v in (("status = ?", status), ("client = ?", client)) if v is not None]
    args = tuple(v for v in (status, client) if v is not None)
    with _open(path) as (_, con, _static_):
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        rows = con.execute(f"SELECT {', '.join(SUBMISSION_COLUMNS)} FROM submissions {where} ORDER BY id DESC "
                           "LIMIT ?", args + (int(limit),)).fetchall()
    return [_row_to_submission(r) for r in reversed(rows)]


#: the reason of every refusal that depends on other requests: it names no id and no other request, so a
#: submitter (or the read role) learns nothing of what others asked to forget from it
REFUSED = "not every id of this request can be forgotten now (already forgotten, or forget-all was applied)"
#: errors that leave a submission queued, to be retried: the disk is full (the request was not committed)
RETRYABLE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def queued_count(path: str | Path, client: str) -> int:
    """How many submissions of ``client`` wait in the queue."""
    with _open(path) as (_, con, _static_):
        return con.execute("SELECT COUNT(*) FROM submissions WHERE client = ? AND status = 'queued'",
                           (client,)).fetchone()[0]


def _finish(con: sqlite3.Connection, sid: int, status: str, reason: str | None, request_id: int | None) -> None:
    con.execute("UPDATE submissions SET status = ?, reason = ?, request_id = ?, finished_utc = ? "
                "WHERE id = ? AND status = 'queued'", (status, reason, request_id, _now(), sid))


def apply_submission(path: str | Path, sid: int, data_loader) -> dict:
    """Apply queued submission ``sid`` through :func:`forget` / :func:`forget_everything`: marked ``applied``
    in the request's own transaction (so a kill leaves either both or neither), ``refused`` with the reason
    when the store refuses it (ids already forgotten, the same request already applied, …), ``failed`` with
    the error on anything else; a full disk leaves it queued (the error propagates; the worker retries).
    A refusal's reason is :data:`REFUSED`, naming no id. Returns the submission as it ends."""
    sub = submission(path, sid)
    if sub is None or sub["status"] != "queued":
        return sub

    def on_commit(con, record):
        _finish(con, sid, "applied", None, record["id"])

    def on_duplicate(con, record):
        _finish(con, sid, "refused", REFUSED, None)

    try:
        if sub["kind"] == "forget_all":
            forget_everything(path, on_commit=on_commit, on_duplicate=on_duplicate)
        else:
            forget(path, sub["ids"], sigma=sub["sigma"], data_loader=data_loader, on_commit=on_commit,
                   on_duplicate=on_duplicate)
    except (StoreError, ValueError):
        _mark(path, sid, "refused", REFUSED)
    except (OSError, sqlite3.OperationalError) as e:
        if getattr(e, "errno", None) in RETRYABLE_ERRNOS or "disk is full" in str(e):
            raise  # left queued: the worker retries it once there is room
        _mark(path, sid, "failed", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 — recorded on the submission, the worker goes on
        _mark(path, sid, "failed", f"{type(e).__name__}: {e}")
    return submission(path, sid)


def _mark(path: str | Path, sid: int, status: str, reason: str) -> None:
    with _open(path, write=True) as (_, con, _static_):
        with _write_transaction(con):
            _finish(con, sid, status, reason, None)


def set_receipt(path: str | Path, sid: int, receipt: dict) -> None:
    with _open(path, write=True) as (_, con, _static_):
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
