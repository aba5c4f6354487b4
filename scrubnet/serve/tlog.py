"""The transparency log: every committed request of the checkpoint is a leaf of an RFC 9162 Merkle tree,
the service signs tree heads, publishes them to a witness outside the checkpoint, and any client holding a
receipt checks that the log it sees now extends the one its receipt was signed in.

* **Leaf** of request #i: the canonical JSON (RFC 8785) of ``{"format": LEAF_FORMAT, "request_id": i,
  "record_hash": <its record-chain link>}``. The link hashes every field of the row and the previous link
  (:mod:`scrubnet.mlforget.store.chain`), so the tree commits to the whole record; a client sees only hashes.
* **Signed tree head** (STH): ``{"format": TREE_HEAD_FORMAT, "tree_size", "root_hash" (hex), "timestamp"
  (UTC), "key_fingerprint" (sha256 of the raw Ed25519 public key)}`` and ``signature`` (Ed25519 over the
  canonical JSON of the other fields).
* **Witness**: a file (``--witness PATH``) or a command (``--witness-cmd CMD``: ``CMD publish`` reads a
  witness document on stdin, ``CMD latest`` prints the last one or nothing) that keeps the latest head the
  service published, and the retirement statements of its rotated keys: ``{"format": WITNESS_FORMAT,
  "tree_head": STH, "retired": [statement, ...]}`` (a bare STH, as published by earlier versions, is read
  too). At start-up the service refuses a checkpoint whose log is smaller than, or not an extension of, the
  witnessed head (:func:`witness_problems`): a restored older copy of the whole checkpoint. A witness that
  holds nothing (deleted, empty, ``"tree_head": null``, a command printing nothing) is :attr:`Witness.EMPTY`:
  the service refuses it when the checkpoint shows its log was published before (fail closed).
* **Retired keys** (:func:`retire_statement`): at a rotation the new key signs ``{"format": RETIRED_FORMAT,
  "retired_key_fingerprint", "last_tree_size", "timestamp", "key_fingerprint"}``: the retired key signed no
  tree head larger than ``last_tree_size``. A tree head signed by a retired key past its pin is refused
  (:func:`pin_problems`) everywhere a retired key is accepted.
* **Client check** (:func:`audit`): the receipt's leaf is in the receipt's head (inclusion proof), both heads
  are signed by the pinned key, and the current head extends the receipt's (consistency proof); a current
  head smaller than the receipt's is a rollback.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

from scrubnet.atomic_io import atomic_write_bytes
from scrubnet.serve import merkle
from scrubnet.serve.canonical import canonical

LEAF_FORMAT = "scrubnet-log-leaf/1"
TREE_HEAD_FORMAT = "scrubnet-tree-head/1"
WITNESS_FORMAT = "scrubnet-witness/1"
RETIRED_FORMAT = "scrubnet-key-retired/1"
#: seconds a witness command may take to answer before the service gives up on it (fail closed)
WITNESS_TIMEOUT_S = 10.0
STH_FIELDS = ("format", "tree_size", "root_hash", "timestamp", "key_fingerprint", "signature")


def fingerprint(key) -> str:
    """sha256 (hex) of the raw 32-byte Ed25519 public key of ``key`` (a private or a public key)."""
    from cryptography.hazmat.primitives import serialization
    pub = key.public_key() if hasattr(key, "public_key") else key
    return hashlib.sha256(pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).hexdigest()


def leaf(request_id: int, record_hash: str) -> bytes:
    """The leaf of a request: canonical JSON of its id and record-chain link."""
    return canonical({"format": LEAF_FORMAT, "request_id": int(request_id), "record_hash": record_hash})


def leaf_hashes(links: dict[int, str]) -> list[bytes]:
    """The leaf hashes of requests 0..n−1 from ``{request id: link}`` (ids must run 0..n−1 without a gap)."""
    if sorted(links) != list(range(len(links))):
        raise ValueError("the request ids do not run 0..n-1: the record has a gap")
    return [merkle.leaf_hash(leaf(i, links[i])) for i in range(len(links))]


def _utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sign_tree_head(key, hashes: list[bytes], timestamp: str | None = None) -> dict:
    """The signed tree head of the tree of ``hashes`` under private ``key``.

    Parameters
    ----------
    key : Ed25519PrivateKey
        The service's signing key.
    hashes : list of bytes
        The leaf hashes.
    timestamp : str or None
        UTC time (ISO 8601); now when None.

    Returns
    -------
    dict
        The STH (module docstring).
    """
    body = {"format": TREE_HEAD_FORMAT, "tree_size": len(hashes), "root_hash": merkle.root(hashes).hex(),
            "timestamp": timestamp or _utc(), "key_fingerprint": fingerprint(key)}
    return {**body, "signature": key.sign(canonical(body)).hex()}


def tree_head_problems(sth, public_key, what: str = "tree head") -> list[str]:
    """Why ``sth`` is not a tree head signed by ``public_key`` (empty: it is)."""
    from cryptography.exceptions import InvalidSignature
    if not isinstance(sth, dict) or sorted(sth) != sorted(STH_FIELDS) or sth.get("format") != TREE_HEAD_FORMAT:
        return [f"{what}: not a {TREE_HEAD_FORMAT} object"]
    if not isinstance(sth["tree_size"], int) or isinstance(sth["tree_size"], bool) or sth["tree_size"] < 0:
        return [f"{what}: tree_size is not a count"]
    problems = []
    if sth["key_fingerprint"] != fingerprint(public_key):
        problems.append(f"{what}: signed by another key (fingerprint {str(sth['key_fingerprint'])[:16]}…) than "
                        "the one given")
    body = {k: v for k, v in sth.items() if k != "signature"}
    try:
        public_key.verify(bytes.fromhex(sth["signature"]), canonical(body))
    except (InvalidSignature, ValueError, TypeError):
        problems.append(f"{what}: the signature does not verify")
    return problems


def _hex_list(proof) -> list[bytes] | None:
    try:
        out = [bytes.fromhex(p) for p in proof]
    except (TypeError, ValueError):
        return None
    return out if all(len(p) == 32 for p in out) else None


def inclusion_problems(request_id, record_hash, sth: dict, proof) -> list[str]:
    """Why the leaf of (``request_id``, ``record_hash``) is not shown by ``proof`` (hex list) to be in the tree
    of ``sth`` (empty: it is)."""
    path = _hex_list(proof)
    if path is None or not isinstance(request_id, int):
        return ["inclusion proof: not a list of 32-byte hex hashes"]
    h = merkle.leaf_hash(leaf(request_id, record_hash))
    if not merkle.verify_inclusion(request_id, sth["tree_size"], h, path, bytes.fromhex(sth["root_hash"])):
        return [f"inclusion proof: request #{request_id} is not in the signed tree head of size {sth['tree_size']}"]
    return []


def consistency_problems(old: dict, new: dict, proof) -> list[str]:
    """Why the signed head ``new`` is not an extension of ``old`` by ``proof`` (hex list); a smaller ``new``
    is named as a rollback."""
    m, n = old["tree_size"], new["tree_size"]
    if n < m:
        return [f"rollback: the log's head has {n} entries, fewer than the {m} of the head in your receipt "
                f"(signed {old['timestamp']}): the service's record was restored to an older state or cut short"]
    path = _hex_list(proof)
    if path is None or not merkle.verify_consistency(m, n, bytes.fromhex(old["root_hash"]),
                                                     bytes.fromhex(new["root_hash"]), path):
        return [f"inconsistent: the log's head (size {n}) does not extend the head in your receipt (size {m}): "
                "the record was rewritten"]
    return []


def signer_of(sth, public_key, retired=()):
    """The key of ``public_key`` and ``retired`` whose fingerprint ``sth`` names (``public_key`` when none does,
    so that its check names the other key)."""
    fp = sth.get("key_fingerprint") if isinstance(sth, dict) else None
    return next((k for k in retired if fingerprint(k) == fp), public_key)


def retire_statement(key, retired_public, last_tree_size: int, timestamp: str | None = None) -> dict:
    """The statement, signed by the new private ``key``, that ``retired_public`` signed no tree head larger than
    ``last_tree_size`` (recorded at the rotation; kept in the signed head, the witness and ``GET /v1/key``)."""
    body = {"format": RETIRED_FORMAT, "retired_key_fingerprint": fingerprint(retired_public),
            "last_tree_size": int(last_tree_size), "timestamp": timestamp or _utc(),
            "key_fingerprint": fingerprint(key)}
    return {**body, "signature": key.sign(canonical(body)).hex()}


def retired_pins(statements, public_key) -> dict[str, int]:
    """``{retired key fingerprint: last tree size}`` from the statements signed by ``public_key`` (others are
    ignored: a statement proves something only under the pinned current key); the smallest size when a key is
    pinned twice."""
    from cryptography.exceptions import InvalidSignature
    pins: dict[str, int] = {}
    for st in statements or ():
        if not isinstance(st, dict) or st.get("format") != RETIRED_FORMAT or \
                st.get("key_fingerprint") != fingerprint(public_key):
            continue
        body = {k: v for k, v in st.items() if k != "signature"}
        try:
            public_key.verify(bytes.fromhex(st.get("signature", "")), canonical(body))
        except (InvalidSignature, ValueError, TypeError):
            continue
        size, fp = st.get("last_tree_size"), st.get("retired_key_fingerprint")
        if isinstance(size, int) and not isinstance(size, bool) and isinstance(fp, str):
            pins[fp] = min(size, pins.get(fp, size))
    return pins


def pin_problems(sth, pins: dict | None, what: str = "tree head") -> list[str]:
    """Why ``sth`` is a head a retired key signed after its retirement: its size is past the key's pin."""
    if not pins or not isinstance(sth, dict):
        return []
    pin, size = pins.get(sth.get("key_fingerprint")), sth.get("tree_size")
    if isinstance(pin, int) and isinstance(size, int) and size > pin:
        return [f"{what}: signed by a retired key (fingerprint {str(sth['key_fingerprint'])[:16]}…) for {size} "
                f"requests, past the {pin} it had signed when it was retired: a retired key signs nothing new"]
    return []


def audit(receipt: dict, current: dict, proof, public_key, retired=(), pins: dict | None = None) -> list[str]:
    """The client's check of a receipt against the log as it stands now.

    Parameters
    ----------
    receipt : dict
        A signed receipt (format 2: ``leaf_index``, ``tree_head``, ``inclusion_proof``).
    current : dict
        The current signed tree head (``GET /v1/log/head``).
    proof : list of str
        The consistency proof from the receipt's head to ``current`` (``GET /v1/log/consistency``).
    public_key : Ed25519PublicKey
        The pinned key of the service.
    retired : sequence of Ed25519PublicKey
        Keys the service signed with before a rotation: the receipt and its head may be signed by one of them.
    pins : dict or None
        ``{retired fingerprint: last tree size}`` (:func:`retired_pins` of the statements ``GET /v1/key``
        serves): the current head may be signed by a retired key only up to its pin, never without one.

    Returns
    -------
    list of str
        Every problem, named; empty when the receipt's request is in a log the current head extends.
    """
    sth = receipt.get("tree_head") if isinstance(receipt, dict) else None
    problems = tree_head_problems(sth, signer_of(sth, public_key, retired), "the receipt's tree head")
    signer = signer_of(current, public_key, retired)
    problems += tree_head_problems(current, signer, "the current tree head")
    if not problems and signer is not public_key:
        if (pins or {}).get(current.get("key_fingerprint")) is None:
            problems.append("the current tree head: signed by a retired key the service's current key has not "
                            "pinned (no retirement statement): a retired key signs nothing new")
        problems += pin_problems(current, pins, "the current tree head")
    if problems:
        return problems
    problems += inclusion_problems(receipt.get("leaf_index"), receipt.get("record_hash"), sth,
                                   receipt.get("inclusion_proof"))
    return problems + consistency_problems(sth, current, proof)


class Witness:
    """Where the service publishes its signed tree heads, outside the checkpoint: a file or a command.

    Parameters
    ----------
    path : str or Path or None
        A file holding the witness document (written atomically).
    command : str or None
        A command line: ``CMD publish`` gets the witness document's canonical JSON on stdin; ``CMD latest``
        prints the last one published (or nothing). Exactly one of ``path`` and ``command``.
    timeout_s : float
        Seconds the command may take; past them (or on a non-zero exit) ``ValueError``, one line.
    """

    #: what :meth:`read` returns for a witness that holds no head, by cause
    EMPTY = ("missing", "empty", "null")

    def __init__(self, path: str | Path | None = None, command: str | None = None,
                 timeout_s: float = WITNESS_TIMEOUT_S):
        if (path is None) == (command is None):
            raise ValueError("a witness is a path or a command")
        self.path, self.command = (Path(path) if path is not None else None), command
        self.timeout_s = float(timeout_s)

    def __str__(self) -> str:
        return f"witness {self.path}" if self.path is not None else f"witness command {self.command!r}"

    def _run(self, action: str, data: bytes = b"") -> bytes:
        try:  # its own session: a timeout kills the command and whatever it started
            p = subprocess.Popen(shlex.split(self.command) + [action], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise ValueError(f"{self} {action}: {e.strerror or e}") from None
        try:
            out, err = p.communicate(data, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            raise ValueError(f"{self} {action}: no answer within {self.timeout_s:g} s") from None
        if p.returncode != 0:
            tail = " ".join(err.decode(errors="replace").split())[-300:]
            raise ValueError(f"{self} {action} exited {p.returncode}" + (f": {tail}" if tail else ""))
        return out

    def read(self) -> tuple[str, dict | None, list]:
        """``(state, head, statements)``: state ``"head"`` with the last head published, or one of
        :attr:`EMPTY` (``missing``: no file; ``empty``: no bytes, or a command printing nothing; ``null``: a
        document whose head is null) with None; ``statements`` the retirement statements it keeps.
        ``ValueError`` when the witness cannot be read or holds something else than a witness document."""
        if self.path is not None:
            if not self.path.exists():
                return "missing", None, []
            try:
                raw = self.path.read_bytes()
            except OSError as e:
                raise ValueError(f"{self}: {e.strerror or e}") from None
        else:
            raw = self._run("latest")
        if not raw.strip():
            return "empty", None, []
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{self} holds no readable tree head") from None
        if obj is None:
            return "null", None, []
        if isinstance(obj, dict) and obj.get("format") == WITNESS_FORMAT:
            retired = obj.get("retired") if isinstance(obj.get("retired"), list) else []
            if obj.get("tree_head") is None:
                return "null", None, retired
            return "head", obj["tree_head"], retired
        return "head", obj, []

    def latest(self) -> dict | None:
        """The last head published (None: none yet); ``ValueError`` when the witness cannot be read."""
        return self.read()[1]

    def publish(self, sth: dict, retired=()) -> None:
        """Hand ``sth`` (and the retirement statements ``retired``) to the witness (a file: replaced
        atomically)."""
        doc = canonical({"format": WITNESS_FORMAT, "tree_head": sth, "retired": list(retired)})
        if self.path is not None:
            atomic_write_bytes(self.path, doc + b"\n")
        else:
            self._run("publish", doc)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.wait()


def witness_problems(witnessed: dict | None, hashes: list[bytes], public_key, retired=(),
                     pins: dict | None = None) -> list[str]:
    """Why the checkpoint's log (leaf ``hashes``) does not extend the witnessed head (empty: it does).

    Parameters
    ----------
    witnessed : dict or None
        The witness's latest head (None: nothing witnessed yet; whether that is allowed is the caller's
        decision, see :attr:`Witness.EMPTY`).
    hashes : list of bytes
        The checkpoint's leaf hashes now.
    public_key : Ed25519PublicKey
        The service's key.
    retired : sequence of Ed25519PublicKey
        Keys retired by a rotation: a head they signed is accepted too, up to their pin.
    pins : dict or None
        ``{retired fingerprint: last tree size}`` (:func:`retired_pins`).

    Returns
    -------
    list of str
        The problems, named.
    """
    if witnessed is None:
        return []
    problems = tree_head_problems(witnessed, signer_of(witnessed, public_key, retired), "the witnessed tree head")
    problems += pin_problems(witnessed, pins, "the witnessed tree head")
    if problems:
        return problems
    m = witnessed["tree_size"]
    if len(hashes) < m:
        return [f"the checkpoint's log has {len(hashes)} entries, fewer than the {m} of the head its witness "
                f"holds (signed {witnessed['timestamp']}): the checkpoint was restored from an older copy or its "
                "requests were removed"]
    if merkle.root(hashes[:m]).hex() != witnessed["root_hash"]:
        return [f"the checkpoint's first {m} log entries are not those of the head its witness holds (signed "
                f"{witnessed['timestamp']}): the record was rewritten"]
    return []
