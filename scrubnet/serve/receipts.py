"""Signed receipts of applied deletion requests, and their offline verification.

A receipt is a JSON object (format ``RECEIPT_FORMAT``, ``scrubnet-receipt/2``)::

    request_id, time_utc                     the committed request (its row in the store); request_id is also
                                             its leaf index in the transparency log
    kind, n_ids, ids_sha256                  ids_sha256 = sha256("scrubnet-ids/1" ‖ 0x00 ‖ salt ‖ canonical JSON
                                             of the sorted ids): the requester holds the salt and can check
                                             their ids; the receipt reveals no id to anyone else
    sha256_before, sha256_after              the weights file before and after the request
    sigma, remaining_information_bound_nats  σ and the bound on the information left (see below)
    solver                                   the solver's figures (the store's info dict without the keys that
                                             count other tenants' samples, ``PRIVATE_SOLVER_KEYS``)
    verdict                                  what the deletion is (:func:`verdict_of`): ``exact`` for
                                             ML-Forgetting's closed-form deletion, with the certificate's numbers
    record_hash, previous_record_hash        the request's link in the store's record chain and its predecessor's
    previous_receipt_sha256                  sha256 of the previous receipt this server issued (null for the first)
    leaf_index, tree_head, inclusion_proof   the transparency log (:mod:`scrubnet.serve.tlog`): the signed tree
                                             head the request was logged in and the audit path of its leaf
    public_key                               the signer's Ed25519 public key (hex, 32 bytes)
    signature                                Ed25519 over the canonical JSON of every other field (hex)

Canonical JSON: RFC 8785 (:mod:`scrubnet.serve.canonical`), so that any JCS implementation, or ``jq -cS``
with the exponent rule of the service guide, reproduces the signed bytes. The receipt's own sha256 is taken
over the canonical JSON of the whole signed object. Receipts of format ``scrubnet-receipt/1`` (signed over
``json.dumps(sort_keys=True)``, carrying ``submission_id`` and ``record_digests``) still verify.

The remaining-information bound (:func:`information_bound`): KL(N(w', σ²I) ‖ N(w*, σ²I)) ≤ ε²/(2σ²) from the
solver's certificate or its proven weight error ε; null, with ``bound_basis`` saying why, when the solver
recorded no proof (the dual solve reports its residual, not a bound).
"""
from __future__ import annotations

import hashlib
import json
import math
import os

from scrubnet.serve import tlog
from scrubnet.serve.canonical import canonical

try:  # optional dependency: pip install "scrubnet[serve]"
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError:  # pragma: no cover - exercised only without the extra
    Ed25519PrivateKey = Ed25519PublicKey = serialization = InvalidSignature = None

RECEIPT_FORMAT = "scrubnet-receipt/2"
RECEIPT_FORMAT_V1 = "scrubnet-receipt/1"
#: solver keys left out of a receipt: they count other tenants' samples
PRIVATE_SOLVER_KEYS = ("n_remaining",)
IDS_DOMAIN = b"scrubnet-ids/1\x00"
MISSING_EXTRA = 'signed receipts need the serve extra: pip install "scrubnet[serve]"'


class ReceiptError(ValueError):
    """A key or receipt that cannot be read."""


def _require() -> None:
    if Ed25519PrivateKey is None:
        raise ReceiptError(MISSING_EXTRA)


def canonical_v1(obj) -> bytes:
    """The canonical form of format 1 (receipts ``scrubnet-receipt/1``, heads ``scrubnet-record-head/1``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def canonical_for(obj: dict) -> bytes:
    """The signed bytes of a receipt or head ``obj`` (without its signature): RFC 8785 JSON, or the old form
    for objects of format 1."""
    fmt = obj.get("format") if isinstance(obj, dict) else None
    old = fmt in (RECEIPT_FORMAT_V1, "scrubnet-record-head/1")
    return canonical_v1(obj) if old else canonical(obj)


def ids_sha256(ids, salt_hex: str) -> str:
    """sha256 of the domain tag, the salt's bytes and the canonical JSON of the sorted ids."""
    try:
        salt = bytes.fromhex(salt_hex)
    except (ValueError, TypeError):
        raise ReceiptError("the salt must be a hex string") from None
    return hashlib.sha256(IDS_DOMAIN + salt + canonical(sorted(int(i) for i in ids))).hexdigest()


def information_bound(solver: dict, sigma: float | None) -> tuple[float | None, str]:
    """(bound in nats or None, basis) on KL(N(w', σ²I) ‖ N(w*, σ²I)) = ‖w' − w*‖²/(2σ²), the information about
    the forgotten samples left in the noisy weights: the solver's certificate when it records one
    (``certificate.kl_bound_nats``), else ε²/(2σ²) from its proven weight error ε (``weight_error_bound``);
    None, with the reason, when the solver recorded neither."""
    cert = solver.get("certificate")
    if isinstance(cert, dict):
        b = cert.get("kl_bound_nats")
        if isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b):
            return float(b), "the solver's certificate (kl_bound_nats)"
    web = solver.get("weight_error_bound")
    if isinstance(web, (int, float)) and not isinstance(web, bool) and math.isfinite(web) and sigma:
        return float(web) ** 2 / (2.0 * float(sigma) ** 2), "ε²/(2σ²) from the solver's weight_error_bound ε"
    if not sigma:
        return None, "σ = 0: the weights carry no noise, no information bound"
    return None, "the solver recorded no proven bound on its weight error"


def receipt_sha256(receipt: dict) -> str:
    """sha256 (hex) of the receipt's canonical JSON, signature included."""
    return hashlib.sha256(canonical_for(receipt)).hexdigest()


def receipt_solver(solver: dict) -> dict:
    """The solver dict as a receipt states it: without :data:`PRIVATE_SOLVER_KEYS`."""
    return {k: v for k, v in json.loads(json.dumps(solver)).items() if k not in PRIVATE_SOLVER_KEYS}


def verdict_of(request: dict) -> dict:
    """The verdict a receipt signs for committed ``request`` (a store row).

    The worker has no held-out data to run the membership verdict of :mod:`scrubnet.readouts.forgetting`; what
    it has is the deletion itself: ML-Forgetting removes the ids in closed form (the user weights become those
    of training without them, up to the solver's numbers), and ``forget_all`` sets the user weights to 0.
    So the verdict is ``exact`` with the certificate's numbers (None where the solver recorded none).

    Parameters
    ----------
    request : dict
        The committed request row (``kind``, ``sigma``, ``solver``).

    Returns
    -------
    dict
        ``{"verdict": "exact", "basis", "kl_bound_nats", "weight_error_bound", "relative_residual", "sigma"}``.
    """
    solver = request.get("solver") or {}
    cert = solver.get("certificate") if isinstance(solver.get("certificate"), dict) else {}
    bound, _ = information_bound(solver, request.get("sigma"))

    def num(v):
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
    if solver.get("engine") == "sharded":  # isolation: the touched shards retrained without the ids
        basis = ("forget_all: every shard back at the pretrained point" if request.get("kind") == "forget_all" else
                 "sharded isolation: the shards holding the ids (shards_retrained) were retrained without them from "
                 "their last slice checkpoint before the earliest one (from_slice); the model equals a sharded "
                 "fine-tune of the remaining data with the same seeds")
    elif request.get("kind") == "forget_all":
        basis = "forget_all: the user weights are set to 0, the model is the core model (never trained on user data)"
    else:
        basis = ("ML-Forgetting's closed-form deletion: the user weights are those of training without the ids, "
                 "up to the solver's error below (no membership verdict: the worker holds no held-out data)")
    return {"verdict": "exact", "basis": basis, "kl_bound_nats": bound,
            "weight_error_bound": num(cert.get("weight_error_bound", solver.get("weight_error_bound"))),
            "relative_residual": num(solver.get("relative_residual")), "sigma": num(request.get("sigma"))}


def public_key_hex(key) -> str:
    pub = key.public_key() if hasattr(key, "public_key") else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def build_receipt(request: dict, record_hash: str, previous_record_hash: str | None,
                  previous_receipt_sha256: str | None, key, *, ids_hash: str, tree_head: dict,
                  inclusion_proof: list[str]) -> dict:
    """The signed receipt (format 2) of committed ``request`` (a store row).

    Parameters
    ----------
    request : dict
        The committed request row.
    record_hash, previous_record_hash : str
        Its record-chain link and its predecessor's.
    previous_receipt_sha256 : str or None
        sha256 of the previous receipt this server signed.
    key : Ed25519PrivateKey
        The service's signing key.
    ids_hash : str
        The salted hash of the submission's ids.
    tree_head : dict
        The signed tree head whose tree holds the request's leaf (:func:`scrubnet.serve.tlog.sign_tree_head`).
    inclusion_proof : list of str
        The audit path of the request's leaf in that tree (hex).

    Returns
    -------
    dict
        The receipt; the submitter's idempotency key and the submission's number are not in it (receipts are
        shown to the read role), nor any count of other tenants' samples.
    """
    _require()
    bound, basis = information_bound(request["solver"], request["sigma"])
    body = {"format": RECEIPT_FORMAT, "request_id": request["id"], "time_utc": request["time_utc"],
            "kind": request["kind"], "n_ids": request["n_ids"], "ids_sha256": ids_hash,
            "sha256_before": request["sha256_before"], "sha256_after": request["sha256_after"],
            "sigma": request["sigma"], "remaining_information_bound_nats": bound, "bound_basis": basis,
            "solver": receipt_solver(request["solver"]), "verdict": verdict_of(request),
            "record_hash": record_hash, "previous_record_hash": previous_record_hash,
            "previous_receipt_sha256": previous_receipt_sha256, "leaf_index": request["id"],
            "tree_head": tree_head, "inclusion_proof": list(inclusion_proof), "public_key": public_key_hex(key)}
    return {**body, "signature": key.sign(canonical(body)).hex()}


def write_key_pair(private_path, public_path) -> None:
    """A new Ed25519 key: PKCS#8 PEM (mode 0600) and SubjectPublicKeyInfo PEM."""
    _require()
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    with open(public_path, "wb") as f:
        f.write(public_pem(key))


def public_pem(key) -> bytes:
    pub = key.public_key() if hasattr(key, "public_key") else key
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_private_key(path):
    _require()
    try:
        key = serialization.load_pem_private_key(open(path, "rb").read(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ReceiptError(f"cannot read the private key {path}: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ReceiptError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path):
    """An Ed25519 public key from a PEM file or a file holding its 64 hex digits."""
    _require()
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise ReceiptError(f"cannot read the public key {path}: {e.strerror}") from None
    try:
        if data.strip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data)
        else:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(data.decode().strip()))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ReceiptError(f"{path} is not an Ed25519 public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ReceiptError(f"{path} is not an Ed25519 public key")
    return key


REQUIRED = ("format", "request_id", "time_utc", "kind", "n_ids", "ids_sha256", "sha256_before",
            "sha256_after", "sigma", "remaining_information_bound_nats", "solver", "record_hash",
            "previous_record_hash", "previous_receipt_sha256", "public_key", "signature")


def verify_receipt(receipt, public_key, *, weights: bytes | None = None, ids=None, salt: str | None = None,
                   previous: dict | None = None) -> list[str]:
    """Every mismatch, named: the format and fields, the signature under ``public_key``, and where given the
    weights file (its sha256 must be the receipt's ``sha256_after``), the requester's ids with their salt,
    and the previous receipt (its sha256 and record link must be the ones this receipt chains to, its
    weights after must be this one's weights before). An empty list: the receipt verifies."""
    _require()
    if not isinstance(receipt, dict):
        return ["the receipt is not a JSON object"]
    missing = [k for k in REQUIRED if k not in receipt]
    if missing:
        return [f"the receipt lacks field(s) {', '.join(missing)}"]
    problems = []
    if receipt["format"] not in (RECEIPT_FORMAT, RECEIPT_FORMAT_V1):
        problems.append(f"format {receipt['format']!r} is not {RECEIPT_FORMAT}")
    elif receipt["format"] == RECEIPT_FORMAT:
        problems += _log_problems(receipt, public_key)
    body = {k: v for k, v in receipt.items() if k != "signature"}
    if receipt["public_key"] != public_key_hex(public_key):
        problems.append("key: the receipt was signed by another key than the one given")
    try:
        public_key.verify(bytes.fromhex(receipt["signature"]), canonical_for(body))
    except (InvalidSignature, ValueError, TypeError):
        problems.append("signature: does not verify under the given key (the receipt was altered or signed "
                        "by another key)")
    if weights is not None:
        sha = hashlib.sha256(weights).hexdigest()
        if sha != receipt["sha256_after"]:
            problems.append(f"weights: sha256 {sha[:16]}… is not the receipt's sha256_after "
                            f"{str(receipt['sha256_after'])[:16]}…")
    if ids is not None or salt is not None:
        if ids is None or salt is None:
            problems.append("ids: give both --ids and --salt to check the ids")
        elif ids_sha256(ids, salt) != receipt["ids_sha256"]:
            problems.append("ids: these ids with this salt do not hash to the receipt's ids_sha256")
    if previous is not None:
        if receipt["previous_receipt_sha256"] != receipt_sha256(previous):
            problems.append("chain: previous_receipt_sha256 is not the sha256 of the previous receipt given")
        if previous.get("request_id") is not None and previous["request_id"] >= receipt["request_id"]:
            problems.append("chain: the previous receipt's request does not come before this one")
        if previous.get("request_id") == receipt["request_id"] - 1:
            if previous.get("record_hash") != receipt["previous_record_hash"]:
                problems.append("chain: previous_record_hash is not the previous receipt's record_hash")
            if previous.get("sha256_after") != receipt["sha256_before"]:
                problems.append("chain: sha256_before is not the previous receipt's sha256_after")
    return problems


def _log_problems(receipt: dict, public_key) -> list[str]:
    """A format-2 receipt's log fields: the tree head signed by the key, the leaf in it, the verdict stated."""
    missing = [k for k in ("leaf_index", "tree_head", "inclusion_proof", "verdict") if k not in receipt]
    if missing:
        return [f"the receipt lacks field(s) {', '.join(missing)}"]
    problems = tlog.tree_head_problems(receipt["tree_head"], public_key, "log: the receipt's tree head")
    if receipt["leaf_index"] != receipt["request_id"]:
        problems.append("log: leaf_index is not the request's id")
    if not problems:
        problems += [f"log: {p}" for p in tlog.inclusion_problems(receipt["leaf_index"], receipt["record_hash"],
                                                                  receipt["tree_head"], receipt["inclusion_proof"])]
    if not isinstance(receipt["verdict"], dict) or receipt["verdict"].get("verdict") not in ("exact",):
        problems.append("verdict: not a verdict this service signs")
    return problems
