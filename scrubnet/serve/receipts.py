"""Signed receipts of applied deletion requests, and their offline verification.

A receipt is a JSON object (format ``RECEIPT_FORMAT``)::

    request_id, submission_id, time_utc      the committed request (its row in the store) and its submission
    kind, n_ids, ids_sha256                  ids_sha256 = sha256("scrubnet-ids/1" ‖ 0x00 ‖ salt ‖ canonical JSON
                                             of the sorted ids): the requester holds the salt and can check
                                             their ids; the receipt reveals no id to anyone else
    sha256_before, sha256_after              the weights file before and after the request
    sigma, remaining_information_bound_nats  σ and the bound on the information left (see below)
    solver                                   every figure the solver recorded (the store's whole info dict)
    record_hash, previous_record_hash        the request's link in the store's record chain and its predecessor's
    record_digests                           sha256 of every field of the request's row (as the chain computes
                                             them): a verifier names the field edited after signing
    previous_receipt_sha256                  sha256 of the previous receipt this server issued (null for the first)
    public_key                               the signer's Ed25519 public key (hex, 32 bytes)
    signature                                Ed25519 over the canonical JSON of every other field (hex)

Canonical JSON: keys sorted, separators ``,`` and ``:``, UTF-8. The receipt's own sha256 is taken over the
canonical JSON of the whole signed object.

The remaining-information bound (:func:`information_bound`): KL(N(w', σ²I) ‖ N(w*, σ²I)) ≤ ε²/(2σ²) from the
solver's certificate or its proven weight error ε; null, with ``bound_basis`` saying why, when the solver
recorded no proof (the dual solve reports its residual, not a bound).
"""
from __future__ import annotations

import hashlib
import json
import math
import os

try:  # optional dependency: pip install "scrubnet[serve]"
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError:  # pragma: no cover - exercised only without the extra
    Ed25519PrivateKey = Ed25519PublicKey = serialization = InvalidSignature = None

RECEIPT_FORMAT = "scrubnet-receipt/1"
IDS_DOMAIN = b"scrubnet-ids/1\x00"
MISSING_EXTRA = 'signed receipts need the serve extra: pip install "scrubnet[serve]"'


class ReceiptError(ValueError):
    """A key or receipt that cannot be read."""


def _require() -> None:
    if Ed25519PrivateKey is None:
        raise ReceiptError(MISSING_EXTRA)


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


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
    return hashlib.sha256(canonical(receipt)).hexdigest()


def public_key_hex(key) -> str:
    pub = key.public_key() if hasattr(key, "public_key") else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def build_receipt(request: dict, submission: dict, record_hash: str, previous_record_hash: str | None,
                  previous_receipt_sha256: str | None, key, record_digests: dict | None = None) -> dict:
    """The signed receipt of committed ``request`` (a store row) for ``submission`` (a queue row).

    ``record_digests`` (the sha256 of every field of the request's row, as the record chain computes them)
    lets a verifier name the field of the row that was edited after signing. The submitter's idempotency key
    is not in the receipt: receipts are shown to the read role, keys belong to their submitter."""
    _require()
    bound, basis = information_bound(request["solver"], request["sigma"])
    body = {"format": RECEIPT_FORMAT, "request_id": request["id"], "submission_id": submission["id"],
            "time_utc": request["time_utc"],
            "kind": request["kind"], "n_ids": request["n_ids"], "ids_sha256": submission["ids_hash"],
            "sha256_before": request["sha256_before"], "sha256_after": request["sha256_after"],
            "sigma": request["sigma"], "remaining_information_bound_nats": bound, "bound_basis": basis,
            "solver": json.loads(json.dumps(request["solver"])), "record_hash": record_hash,
            "previous_record_hash": previous_record_hash, "previous_receipt_sha256": previous_receipt_sha256,
            "public_key": public_key_hex(key)}
    if record_digests is not None:
        body["record_digests"] = dict(record_digests)
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


REQUIRED = ("format", "request_id", "submission_id", "time_utc", "kind", "n_ids", "ids_sha256", "sha256_before",
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
    if receipt["format"] != RECEIPT_FORMAT:
        problems.append(f"format {receipt['format']!r} is not {RECEIPT_FORMAT}")
    body = {k: v for k, v in receipt.items() if k != "signature"}
    if receipt["public_key"] != public_key_hex(public_key):
        problems.append("key: the receipt was signed by another key than the one given")
    try:
        public_key.verify(bytes.fromhex(receipt["signature"]), canonical(body))
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
