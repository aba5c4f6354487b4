"""The record chain: one chain of sha256 links binding every stored field of the checkpoint.

:func:`_seal_all` seals a whole database (a new one, or one of the previous format in ``upgrade``); a request
seals its own row and the state (:func:`_seal_request`, :func:`_seal_state`); :func:`_chain_problems`
recomputes every digest and link and names any edited field.
"""
from __future__ import annotations

import json
import sqlite3

from scrubnet.mlforget.store.schema import (CHAIN_FORMAT, REQUEST_COLUMNS, SEAL_KEY, _json_safe, _read_state,
                                            _row_to_request, _sha)


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
