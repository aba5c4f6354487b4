"""The record anchored outside the database: signed receipts and a signed head, checked against the chain.

The record chain (:mod:`scrubnet.mlforget.store.chain`) catches an edit of the database that does not
re-seal, but anyone who can write the database can also recompute every digest and link with the store's own
sealing function. What they cannot do is sign: the receipts (one per applied submission) and the signed head
(``CHECKPOINT/record-head.json``, written by the service's worker) carry Ed25519 signatures over

* receipt: the request's fields, its chain link and the previous one, and the digest of every field of its
  row (``record_digests``);
* head: the digest of every static field, and for every request its chain link, the sha256 of its receipt
  (null for a request made outside the service) and, for a request without a receipt, its field digests.

:func:`verify` checks the chain (:func:`scrubnet.mlforget.store.verify`), then every stored receipt (signature
under the key, fields equal to the row, links equal to the chain, receipts chained) and the head (signature,
every pinned link and digest, every receipt it names still stored). A re-sealed edit of any covered row is
named by the field that changed. The head file is outside the database, so a database writer cannot roll it
back; see ``docs/decisions/trust.md`` for what such a writer can still do.
"""
from __future__ import annotations

import json
from pathlib import Path

from scrubnet.atomic_io import atomic_write_bytes
from scrubnet.mlforget import store
from scrubnet.serve import receipts

HEAD = "record-head.json"
HEAD_FORMAT = "scrubnet-record-head/1"
PUBLIC_KEY = "receipt-key.pub"
#: the row fields a receipt states directly
RECEIPT_FIELDS = ("kind", "n_ids", "sigma", "sha256_before", "sha256_after", "time_utc", "solver")


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def read_head(path: str | Path) -> dict | None:
    """The signed head of the checkpoint at ``path``, or None when there is none; ``StoreError`` when the file
    is unreadable."""
    f = Path(path) / HEAD
    if not f.is_file():
        return None
    try:
        head = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise store.StoreError(f"{f} is not a readable signed head: {e}") from None
    if not isinstance(head, dict):
        raise store.StoreError(f"{f} is not a readable signed head")
    return head


def _key_of(path: Path, public_key, head: dict | None, subs: list[dict]):
    """The key to check against: the one given, else ``CHECKPOINT/receipt-key.pub``, else the head's, else the
    first receipt's (None when there is nothing signed)."""
    if public_key is not None:
        return public_key
    if (path / PUBLIC_KEY).is_file():
        return receipts.load_public_key(path / PUBLIC_KEY)
    hexkey = (head or {}).get("public_key") or next((s["receipt"].get("public_key") for s in subs), None)
    if not isinstance(hexkey, str):
        return None
    try:
        return receipts.Ed25519PublicKey.from_public_bytes(bytes.fromhex(hexkey))
    except (ValueError, TypeError):
        raise store.StoreError(f"the signing key {hexkey[:16]}… named by the record is not an Ed25519 key") from None


def _receipt_problems(subs: list[dict], reqs: dict, key) -> list[str]:
    """Every disagreement between the stored receipts and the record (the field named)."""
    problems, prev_sha = [], None
    for s in sorted(subs, key=lambda s: s["receipt"].get("request_id") or 0):
        r, what = s["receipt"], f"signed receipt of submission {s['id']}"
        problems += [f"{what}: {p}" for p in receipts.verify_receipt(r, key)]
        rid = r.get("request_id")
        row = reqs.get(rid)
        if row is None:
            problems.append(f"request #{rid}, named by the {what}, is missing from the record")
            continue
        for field, mine in (("request_id", rid), ("ids_hash", r.get("ids_sha256"))):
            if s[field] != mine:
                problems.append(f"submission {s['id']}: field {field!r} disagrees with its signed receipt")
        named = [f for f in RECEIPT_FIELDS if not _same(row[f], r.get(f))]
        stored = r.get("record_digests")
        if isinstance(stored, dict):
            now = store.field_digests({k: row[k] for k in store.REQUEST_COLUMNS})
            named += [k for k in sorted(now) if k not in named and now[k] != stored.get(k)]
        problems += [f"request #{rid}: field {f!r} disagrees with its {what}" for f in named]
        if r.get("record_hash") != row["hash"]:
            problems.append(f"request #{rid}: its record-chain link is not the one its {what} names "
                            "(the record was edited and re-sealed)")
        before = reqs.get(rid - 1) if isinstance(rid, int) else None
        if before is not None and r.get("previous_record_hash") != before["hash"]:
            problems.append(f"request #{rid - 1}: its record-chain link is not the one the {what} names")
        if r.get("previous_receipt_sha256") != prev_sha:
            problems.append(f"{what}: previous_receipt_sha256 is not the sha256 of the receipt before it "
                            "(a receipt was removed or altered)")
        prev_sha = receipts.receipt_sha256(r)
    return problems


def _head_problems(head: dict, key, rec: dict, subs: list[dict]) -> list[str]:
    """Every disagreement between the signed head and the record."""
    body = {k: v for k, v in head.items() if k != "signature"}
    if head.get("format") != HEAD_FORMAT or not isinstance(head.get("requests"), list):
        return [f"signed head: not a {HEAD_FORMAT} object"]
    problems = []
    if head.get("public_key") != receipts.public_key_hex(key):
        problems.append("signed head: signed by another key than the one given")
    try:
        key.verify(bytes.fromhex(head.get("signature", "")), receipts.canonical(body))
    except (receipts.InvalidSignature, ValueError, TypeError):
        problems.append("signed head: the signature does not verify (the head file was altered)")
    for k, d in sorted((head.get("static_digests") or {}).items()):
        if rec["static_digests"].get(k) != d:
            problems.append(f"checkpoint record: field {k!r} differs from the signed head")
    reqs = {r["id"]: r for r in rec["requests"]}
    shas = {receipts.receipt_sha256(s["receipt"]) for s in subs}
    for e in head["requests"]:
        row = reqs.get(e.get("id"))
        if row is None:
            problems.append(f"request #{e.get('id')} of the signed head is missing from the record "
                            "(requests removed or rolled back)")
            continue
        if isinstance(e.get("digests"), dict):
            now = store.field_digests({k: row[k] for k in store.REQUEST_COLUMNS})
            problems += [f"request #{row['id']}: field {k!r} differs from the signed head"
                         for k in sorted(now) if now[k] != e["digests"].get(k)]
        if e.get("link") != row["hash"]:
            problems.append(f"request #{row['id']}: its record-chain link differs from the signed head "
                            "(the record was edited and re-sealed)")
        if e.get("receipt_sha256") and e["receipt_sha256"] not in shas:
            problems.append(f"request #{row['id']}: its signed receipt is no longer in the store (removed or "
                            "replaced)")
    return problems


def verify(path: str | Path, public_key=None) -> dict:
    """Verify the checkpoint's record against the chain and against what was signed outside the database.

    Parameters
    ----------
    path : str or Path
        The ML checkpoint.
    public_key : Ed25519PublicKey or None
        The signer's key; None: ``CHECKPOINT/receipt-key.pub``, else the key the head or the receipts name
        (unpinned: an attacker who can replace files, not only the database, can replace it too).

    Returns
    -------
    dict
        :func:`scrubnet.mlforget.store.verify`'s record with ``valid``/``problems`` extended, plus
        ``anchored_through`` (the last request the signed head covers; −1: no head), ``receipts`` (how many
        were checked) and ``unanchored`` (ids of requests covered by neither a receipt nor the head).
    """
    path = Path(path)
    rec = store.verify(path)
    subs = [s for s in store.submissions(path, limit=1 << 62) if isinstance(s["receipt"], dict)]
    head = read_head(path)
    problems = list(rec["problems"])
    key = _key_of(path, public_key, head, subs) if (head is not None or subs) else None
    if key is None and (head is not None or subs):
        problems.append("the record is signed but no signing key is known")
    elif key is not None:
        reqs = {r["id"]: r for r in rec["requests"]}
        problems += _receipt_problems(subs, reqs, key)
        if head is not None:
            problems += _head_problems(head, key, rec, subs)
    through = max((e.get("id", -1) for e in (head or {}).get("requests", [])), default=-1)
    signed = {s["receipt"].get("request_id") for s in subs}
    return {**rec, "valid": not problems, "problems": problems, "anchored_through": through,
            "receipts": len(subs), "unanchored": [r["id"] for r in rec["requests"]
                                                  if r["id"] > through and r["id"] not in signed]}


def sign_head(path: str | Path, key, rec: dict) -> bool:
    """Write ``CHECKPOINT/record-head.json`` signed by ``key`` over ``rec`` (a valid :func:`verify` result
    of this checkpoint) and the receipts stored now; atomic. Returns whether the file changed."""
    path = Path(path)
    shas = {}
    for s in store.submissions(path, status="applied", limit=1 << 62):
        if isinstance(s["receipt"], dict):
            shas[s["request_id"]] = receipts.receipt_sha256(s["receipt"])
    entries = []
    for r in rec["requests"]:
        e = {"id": r["id"], "link": r["hash"], "receipt_sha256": shas.get(r["id"])}
        if e["receipt_sha256"] is None:
            e["digests"] = store.field_digests({k: r[k] for k in store.REQUEST_COLUMNS})
        entries.append(e)
    body = {"format": HEAD_FORMAT, "state_hash": rec["head"], "static_digests": rec["static_digests"],
            "requests": entries, "public_key": receipts.public_key_hex(key)}
    head = {**body, "signature": key.sign(receipts.canonical(body)).hex()}
    try:
        if read_head(path) == head:
            return False
    except store.StoreError:
        pass
    atomic_write_bytes(path / HEAD, json.dumps(head, sort_keys=True).encode())
    return True
