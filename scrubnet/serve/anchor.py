"""The record anchored outside the database: signed receipts, a signed head and the transparency log's signed
tree heads, checked against the chain.

The record chain (:mod:`scrubnet.mlforget.store.chain`) catches an edit of the database that does not
re-seal, but anyone who can write the database can also recompute every digest and link with the store's own
sealing function. What they cannot do is sign: the receipts (one per applied submission), the signed head
(``CHECKPOINT/record-head.json``, written by the service's worker) and the tree heads of the transparency log
(:mod:`scrubnet.serve.tlog`, inside receipts and the head) carry Ed25519 signatures over

* receipt: the request's fields, its chain link and the previous one, its verdict, the tree head it was
  logged in and its leaf's inclusion proof;
* head (format 2): the digest of every static field, and for every request its chain link, the sha256 of its
  receipt (null for a request made outside the service) and the digest of every field; the latest tree head.

:func:`verify` checks the chain (:func:`scrubnet.mlforget.store.verify`), then every stored receipt (signature
under the key, fields equal to the row, links equal to the chain, receipts chained, its tree head's root
equal to the tree of the record's first leaves) and the head (signature, every pinned link and digest, every
receipt it names still stored, its tree head at least as large as any receipt's). A missing head, where
receipts prove one was written, is named. The key is the one given (pinned); without one, the key the record
names, and the result says ``key_pinned: False``: the file ``receipt-key.pub`` beside the data is never read.
Heads of format ``scrubnet-record-head/1`` and receipts of format 1 still verify. See
``docs/decisions/trust.md``.
"""
from __future__ import annotations

import json
from pathlib import Path

from scrubnet.atomic_io import atomic_write_bytes
from scrubnet.mlforget import store
from scrubnet.serve import merkle, receipts, tlog
from scrubnet.serve.canonical import canonical

HEAD = "record-head.json"
HEAD_FORMAT = "scrubnet-record-head/2"
HEAD_FORMAT_V1 = "scrubnet-record-head/1"
#: the file the service of earlier versions wrote beside the data; never read to verify
PUBLIC_KEY = "receipt-key.pub"
#: the row fields a receipt states directly
RECEIPT_FIELDS = ("kind", "n_ids", "sigma", "sha256_before", "sha256_after", "time_utc", "solver")


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _digests(row: dict) -> dict:
    return store.field_digests({k: row[k] for k in store.REQUEST_COLUMNS})


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


def _key_of(public_key, head: dict | None, subs: list[dict]):
    """The key to check against: the one given (pinned), else the one the head or the first receipt names
    (None when there is nothing signed). Never the file beside the data."""
    if public_key is not None:
        return public_key
    hexkey = (head or {}).get("public_key") or next((s["receipt"].get("public_key") for s in subs), None)
    if not isinstance(hexkey, str):
        return None
    try:
        return receipts.Ed25519PublicKey.from_public_bytes(bytes.fromhex(hexkey))
    except (ValueError, TypeError):
        raise store.StoreError(f"the signing key {hexkey[:16]}… named by the record is not an Ed25519 key") from None


def _pick(keys: list, hexkey) -> object:
    """The key of ``keys`` (the current one first, then retired ones) whose hex is ``hexkey``; else the
    current one (whose check then names the other key)."""
    return next((k for k in keys if receipts.public_key_hex(k) == hexkey), keys[0])


def _tree_problems(sth: dict, hashes: list[bytes], what: str) -> list[str]:
    """Whether the record's first leaves are the tree of a signed tree head handed out."""
    m = sth.get("tree_size") if isinstance(sth, dict) else None
    if not isinstance(m, int):
        return []
    if len(hashes) < m:
        return [f"{what}: its tree head holds {m} requests, the record only {len(hashes)} (requests removed or "
                "the record rolled back)"]
    if merkle.root(hashes[:m]).hex() != sth.get("root_hash"):
        return [f"{what}: the record's first {m} requests are not those of its tree head (the record was edited "
                "and re-sealed)"]
    return []


def _stated(r: dict, row: dict) -> list[str]:
    """The fields a receipt states that disagree with the row (format 2: the solver without the private keys,
    the verdict recomputed from the row)."""
    named = [f for f in RECEIPT_FIELDS if f != "solver" and not _same(row[f], r.get(f))]
    if r.get("format") == receipts.RECEIPT_FORMAT_V1:
        named += [] if _same(row["solver"], r.get("solver")) else ["solver"]
        stored = r.get("record_digests")
        if isinstance(stored, dict):
            now = _digests(row)
            named += [k for k in sorted(now) if k not in named and now[k] != stored.get(k)]
        return named
    if not _same(receipts.receipt_solver(row["solver"]), r.get("solver")):
        named.append("solver")
    if not _same(receipts.verdict_of(row), r.get("verdict")):
        named.append("verdict")
    return named


def _receipt_problems(subs: list[dict], reqs: dict, keys: list, hashes: list[bytes], pins: dict) -> list[str]:
    """Every disagreement between the stored receipts and the record (the field named)."""
    problems, prev_sha = [], None
    for s in sorted(subs, key=lambda s: s["receipt"].get("request_id") or 0):
        r, what = s["receipt"], f"signed receipt of submission {s['id']}"
        problems += [f"{what}: {p}" for p in receipts.verify_receipt(r, _pick(keys, r.get("public_key")))]
        rid = r.get("request_id")
        row = reqs.get(rid)
        if row is None:
            problems.append(f"request #{rid}, named by the {what}, is missing from the record")
            continue
        for field, mine in (("request_id", rid), ("ids_hash", r.get("ids_sha256"))):
            if s[field] != mine:
                problems.append(f"submission {s['id']}: field {field!r} disagrees with its signed receipt")
        problems += [f"request #{rid}: field {f!r} disagrees with its {what}" for f in _stated(r, row)]
        if "tree_head" in r:
            problems += tlog.pin_problems(r["tree_head"], pins, f"{what}: its tree head")
            problems += _tree_problems(r["tree_head"], hashes, what)
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


def _logged_problems(head: dict | None, subs: list[dict], keys: list, hashes: list[bytes], pins: dict) -> list[str]:
    """The head against the tree heads the receipts handed out prove: it must exist and be as large."""
    sizes = [s["receipt"]["tree_head"].get("tree_size") for s in subs
             if isinstance(s["receipt"].get("tree_head"), dict)]
    largest = max((m for m in sizes if isinstance(m, int)), default=None)
    if largest is None:
        return []
    if head is None:
        return [f"the signed head {HEAD} is missing, though receipts handed out prove a signed tree head of "
                f"{largest} requests was written (deleted, or the checkpoint restored without it)"]
    sth = head.get("tree_head")
    if head.get("format") != HEAD_FORMAT or not isinstance(sth, dict):
        return [f"signed head: holds no tree head, though receipts prove one of {largest} requests was written"]
    problems = tlog.tree_head_problems(sth, _pick(keys, head.get("public_key")), "signed head: its tree head")
    problems += tlog.pin_problems(sth, pins, "signed head: its tree head")
    if not problems and sth["tree_size"] < largest:
        problems.append(f"signed head: its tree head holds {sth['tree_size']} requests, fewer than the {largest} of "
                        "a receipt handed out (the head file was rolled back)")
    return problems + (_tree_problems(sth, hashes, "signed head") if not problems else [])


def _head_problems(head: dict, key, rec: dict, subs: list[dict]) -> list[str]:
    """Every disagreement between the signed head and the record."""
    body = {k: v for k, v in head.items() if k != "signature"}
    if head.get("format") not in (HEAD_FORMAT, HEAD_FORMAT_V1) or not isinstance(head.get("requests"), list):
        return [f"signed head: not a {HEAD_FORMAT} object"]
    problems = []
    if head.get("public_key") != receipts.public_key_hex(key):
        problems.append("signed head: signed by another key than the one given")
    try:
        key.verify(bytes.fromhex(head.get("signature", "")), receipts.canonical_for(body))
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
            now = _digests(row)
            problems += [f"request #{row['id']}: field {k!r} differs from the signed head"
                         for k in sorted(now) if now[k] != e["digests"].get(k)]
        if e.get("link") != row["hash"]:
            problems.append(f"request #{row['id']}: its record-chain link differs from the signed head "
                            "(the record was edited and re-sealed)")
        if e.get("receipt_sha256") and e["receipt_sha256"] not in shas:
            problems.append(f"request #{row['id']}: its signed receipt is no longer in the store (removed or "
                            "replaced)")
    return problems


def pins_of(head: dict | None, public_key, pins: dict | None = None) -> dict:
    """The retired keys' pins: ``pins`` given, with those of the retirement statements the signed ``head``
    keeps (``retired_keys``) that ``public_key`` signed; the smaller size where both pin a key."""
    out = dict(pins or {})
    if public_key is not None:
        for fp, size in tlog.retired_pins((head or {}).get("retired_keys"), public_key).items():
            out[fp] = min(size, out.get(fp, size))
    return out


def verify(path: str | Path, public_key=None, retired=(), pins: dict | None = None) -> dict:
    """Verify the checkpoint's record against the chain and against what was signed outside the database.

    Parameters
    ----------
    path : str or Path
        The ML checkpoint.
    public_key : Ed25519PublicKey or None
        The signer's pinned key; None: the key the head or the receipts name (``key_pinned`` False: an
        attacker who can replace files, not only the database, can re-sign with a key of their own).
    retired : sequence of Ed25519PublicKey
        Keys the service signed with before a rotation: receipts, heads and tree heads they signed are
        accepted too (the service signs everything new with ``public_key``), up to their pin.
    pins : dict or None
        ``{retired key fingerprint: last tree size it signed}`` known to the caller (the running service's);
        with the pins of the retirement statements the head keeps (:func:`pins_of`). A tree head a retired
        key signed past its pin is a problem.

    Returns
    -------
    dict
        :func:`scrubnet.mlforget.store.verify`'s record with ``valid``/``problems`` extended, plus
        ``anchored_through`` (the last request the signed head covers; −1: no head), ``receipts`` (how many
        were checked), ``unanchored`` (ids of requests covered by neither a receipt nor the head),
        ``key_pinned``, ``key_fingerprint`` (of the key checked against) and ``leaf_hashes`` (the transparency
        log's leaves, bytes).
    """
    path = Path(path)
    rec = store.verify(path)
    subs = [s for s in store.submissions(path, limit=1 << 62) if isinstance(s["receipt"], dict)]
    head = read_head(path)
    problems = list(rec["problems"])
    key = _key_of(public_key, head, subs) if (head is not None or subs) else None
    hashes = record_leaves(rec)
    if key is None and (head is not None or subs):
        problems.append("the record is signed but no signing key is known")
    elif key is not None:
        reqs = {r["id"]: r for r in rec["requests"]}
        keys = [key, *retired]
        pinned = pins_of(head, key, pins) if retired else {}
        problems += _receipt_problems(subs, reqs, keys, hashes, pinned)
        problems += _logged_problems(head, subs, keys, hashes, pinned)
        if head is not None:
            problems += _head_problems(head, _pick(keys, head.get("public_key")), rec, subs)
    through = max((e.get("id", -1) for e in (head or {}).get("requests", [])), default=-1)
    signed = {s["receipt"].get("request_id") for s in subs}
    return {**rec, "valid": not problems, "problems": problems, "anchored_through": through,
            "key_pinned": public_key is not None,
            "key_fingerprint": tlog.fingerprint(key) if key is not None else None, "leaf_hashes": hashes,
            "receipts": len(subs), "unanchored": [r["id"] for r in rec["requests"]
                                                  if r["id"] > through and r["id"] not in signed]}


def record_leaves(rec: dict) -> list[bytes]:
    """The transparency log's leaf hashes of a :func:`scrubnet.mlforget.store.verify` result (request order)."""
    return [merkle.leaf_hash(tlog.leaf(r["id"], r["hash"])) for r in sorted(rec["requests"], key=lambda r: r["id"])]


def sign_head(path: str | Path, key, rec: dict, tree_head: dict, retired_keys=()) -> bool:
    """Write ``CHECKPOINT/record-head.json`` signed by ``key`` over ``rec`` (a valid :func:`verify` result
    of this checkpoint), the receipts stored now, ``tree_head`` (the latest signed tree head) and the
    retirement statements ``retired_keys`` (:func:`scrubnet.serve.tlog.retire_statement`; the field is left
    out when there are none); atomic. Returns whether the file changed."""
    path = Path(path)
    shas = {}
    for s in store.submissions(path, status="applied", limit=1 << 62):
        if isinstance(s["receipt"], dict):
            shas[s["request_id"]] = receipts.receipt_sha256(s["receipt"])
    entries = [{"id": r["id"], "link": r["hash"], "receipt_sha256": shas.get(r["id"]), "digests": _digests(r)}
               for r in rec["requests"]]
    body = {"format": HEAD_FORMAT, "state_hash": rec["head"], "static_digests": rec["static_digests"],
            "requests": entries, "tree_head": tree_head, "public_key": receipts.public_key_hex(key)}
    if retired_keys:
        body["retired_keys"] = list(retired_keys)
    head = {**body, "signature": key.sign(canonical(body)).hex()}
    try:
        if read_head(path) == head:
            return False
    except store.StoreError:
        pass
    atomic_write_bytes(path / HEAD, canonical(head))
    return True


FINGERPRINT_ENV = "SCRUBNET_RECEIPT_FINGERPRINT"


def verify_pinned(path: str | Path, public_key=None, fingerprint: str | None = None, retired=(),
                  pins: dict | None = None) -> dict:
    """:func:`verify` against a pinned key: ``public_key``, or the key the record names if its fingerprint is
    ``fingerprint``. A signed record checked against neither is not valid (a key the data names proves
    nothing: whoever rewrote the data can re-sign it with a key of their own).

    Parameters
    ----------
    path : str or Path
        The ML checkpoint.
    public_key : Ed25519PublicKey or None
        The service's public key (``GET /v1/key``, kept apart from the data).
    fingerprint : str or None
        sha256 (hex) of the service's raw public key (``scrubnet serve`` prints it).
    retired : sequence of Ed25519PublicKey
        Keys retired by a rotation (with ``public_key``; see :func:`verify`).

    Returns
    -------
    dict
        :func:`verify`'s result; ``key_pinned`` says whether a pin was checked.
    """
    rec = verify(path, public_key, retired, pins)
    if public_key is not None or rec["key_fingerprint"] is None:
        return rec
    problems = list(rec["problems"])
    if fingerprint is None:
        problems.append(f"the record is signed (key fingerprint {rec['key_fingerprint']}) but no key is pinned: "
                        "give the service's public key (--key, from GET /v1/key) or its fingerprint "
                        f"(--fingerprint or {FINGERPRINT_ENV}); a key named by the data proves nothing")
    elif fingerprint.strip().lower() != rec["key_fingerprint"]:
        problems.append(f"the record is signed by the key with fingerprint {rec['key_fingerprint']}, not by the "
                        f"pinned {fingerprint.strip().lower()} (re-signed by someone else, or a rotated key)")
    return {**rec, "valid": not problems, "problems": problems, "key_pinned": fingerprint is not None}
