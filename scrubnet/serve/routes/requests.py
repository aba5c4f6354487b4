"""``POST /v1/requests`` (submit a deletion request) and ``GET /v1/requests/{id}`` (its status and receipt)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import re
import secrets
import sqlite3

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from scrubnet.data.ids import IdsFormatError, parse_sample_ids
from scrubnet.mlforget import store
from scrubnet.serve import receipts
from scrubnet.serve.auth import Token, authorised
from scrubnet.serve.http import HTTPError, Service, guard

IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:~-]{1,200}$")
#: deepest JSON nesting a body may have (a valid body needs 2: the object and its ids list)
MAX_DEPTH = 16
#: an opaque submission id: ``s`` and 24 hex digits of an HMAC of the store's number (no count of anyone's
#: submissions can be read from it)
OPAQUE_ID = re.compile(r"^s[0-9a-f]{24}$")


def opaque_id(secret: bytes, sid: int) -> str:
    """The id the API shows for submission ``sid``: ``s`` + 24 hex of HMAC-SHA256(secret, sid)."""
    return "s" + hmac.new(secret, str(int(sid)).encode(), hashlib.sha256).hexdigest()[:24]


def scoped_key(token: Token, key: str) -> str:
    """The stored idempotency key: the client's key under a tag of the submitting identity, so one tenant's
    key never finds (or reveals) another tenant's submission. ``/`` cannot occur in a client's key."""
    return hashlib.sha256(token.name.encode()).hexdigest()[:16] + "/" + key


def public_submission(sub: dict, full: bool, owner: bool = False, secret: bytes = b"") -> dict:
    """A submission as the API shows it.

    Parameters
    ----------
    sub : dict
        The store's submission row.
    full : bool
        Add the ids (the submitter and admin).
    owner : bool
        The submitter: also the salt and the idempotency key (per-tenant secrets no other role sees).
    secret : bytes
        The service's id secret: ``id`` is the opaque id (:func:`opaque_id`), never the store's counter.

    Returns
    -------
    dict
        The JSON answer.
    """
    out = {"id": opaque_id(secret, sub["id"]), "status": sub["status"], "kind": sub["kind"], "n_ids": len(sub["ids"]),
           "sigma": sub["sigma"], "submitted_utc": sub["submitted_utc"], "finished_utc": sub["finished_utc"],
           "reason": sub["reason"], "request_id": sub["request_id"], "ids_sha256": sub["ids_hash"],
           "receipt": sub["receipt"]}
    if sub["status"] == "refused" and not full:
        out["reason"] = store.REFUSED  # rows refused before the reasons were made generic may name ids
    if full or owner:
        out["ids"] = sub["ids"]
    if owner:
        out.update(salt=sub["salt"], idempotency_key=sub["idempotency_key"].split("/", 1)[-1])
    return out


async def read_body(request, max_body: int) -> bytes:
    """The request's body; 413 over ``max_body`` bytes (declared or streamed)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_body):
        raise HTTPError(413, f"request body over {max_body} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise HTTPError(413, f"request body over {max_body} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client went away mid-body: nothing to answer, nothing to log
        raise HTTPError(400, "the client disconnected before sending its body") from None
    return b"".join(chunks)


def _parse_ids(body: dict, kind: str, token: Token, max_ids: int) -> list[int]:
    if kind == "forget_all":
        if not token.may("admin"):
            raise HTTPError(403, f"token {token.name!r} lacks the admin role (forget_all)")
        if body.get("ids") not in (None, []) or body.get("sigma") is not None:
            raise HTTPError(422, "forget_all takes no ids and no sigma")
        return []
    if "ids" not in body:
        raise HTTPError(422, "ids is required: a JSON list of integer sample ids")
    if not isinstance(body["ids"], list):
        raise HTTPError(422, "ids must be a JSON list of integer sample ids")
    if len(body["ids"]) > max_ids:
        raise HTTPError(422, f"at most {max_ids} ids per request")
    try:
        return parse_sample_ids(json.dumps(body["ids"]), "ids")
    except IdsFormatError as e:
        raise HTTPError(422, str(e)) from None


def _nesting(raw: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside strings (a bound checked before parsing: the parser recurses)."""
    stripped = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)
    depth = deepest = 0
    for ch in re.sub(rb"[^\[\]{}]", b"", stripped):
        depth += 1 if ch in b"[{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
    return deepest


def parse_submission(raw: bytes, token: Token, max_ids: int) -> tuple[str, list[int], float | None, str]:
    """(kind, ids, σ or None, salt in lower-case hex) of a POST body; 422 (or 403 for ``forget_all``
    without the admin role) naming what is wrong."""
    depth = _nesting(raw)
    if depth > MAX_DEPTH:
        raise HTTPError(422, f"the body is nested more than {MAX_DEPTH} levels deep")
    try:
        body = json.loads(raw, parse_constant=lambda c: c)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HTTPError(422, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPError(422, "the body must be a JSON object {\"ids\": [...], \"sigma\": ..., \"salt\": ...}")
    unknown = sorted(set(body) - {"ids", "sigma", "kind", "salt"})
    if unknown:
        raise HTTPError(422, f"unknown field(s) {', '.join(unknown)} (allowed: ids, sigma, kind, salt)")
    kind = body.get("kind", "forget")
    if kind not in ("forget", "forget_all"):
        raise HTTPError(422, f"kind must be 'forget' or 'forget_all', got {kind!r}")
    ids = _parse_ids(body, kind, token, max_ids)
    sigma = body.get("sigma")
    if sigma is not None and (isinstance(sigma, bool) or not isinstance(sigma, (int, float))
                              or not math.isfinite(sigma) or sigma < 0):
        raise HTTPError(422, f"sigma must be a finite number ≥ 0, got {json.dumps(sigma)}")
    salt = body.get("salt")
    if salt is None:
        salt = secrets.token_hex(16)
    elif not (isinstance(salt, str) and re.fullmatch(r"[0-9a-fA-F]{32,128}", salt) and len(salt) % 2 == 0):
        raise HTTPError(422, "salt must be 32 to 128 hex digits (16 to 64 bytes)")
    return kind, ids, None if sigma is None else float(sigma), salt.lower()


def submitted(sub: dict, created: bool, token: Token, secret: bytes) -> JSONResponse:
    """The answer to a POST: 202 while queued (200 for a replay of a finished one). Only the submitter's own
    submissions are ever found (keys are scoped to the identity), so the answer is the submitter's."""
    out = public_submission(sub, full=token.may("admin"), owner=sub["client"] == token.name, secret=secret)
    out["status_url"] = f"/v1/requests/{out['id']}"
    out["replayed"] = not created
    return JSONResponse(out, status_code=202 if sub["status"] == "queued" else 200)


def _full(e: Exception) -> bool:
    return getattr(e, "errno", None) in store.queue.RETRYABLE_ERRNOS or "disk is full" in str(e)


async def _admit(request, service: Service, token: Token) -> bytes:
    """The checks before a POST is parsed: the worker not halted and the checkpoint not rolled back under it
    (503, :func:`scrubnet.serve.http.guard`), the tenant's rate (429), the body read within the time limit
    (408)."""
    await guard(service)
    wait = service.limits.admit(token.name)
    if wait is not None:
        raise HTTPError(429, "too many requests from this token; retry later", service.limits.retry_after(wait))
    try:
        return await asyncio.wait_for(read_body(request, service.max_body), service.limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"the body took longer than {service.limits.body_timeout_s:g} s to arrive") from None


async def _queue(service: Service, token: Token, args: tuple):
    """``store.submit`` under the tenant's quota; a full disk is 503 with Retry-After (nothing queued)."""
    try:
        if await run_in_threadpool(store.queued_count, service.path, token.name) >= service.limits.max_queued:
            raise HTTPError(429, f"this token has {service.limits.max_queued} requests queued already; retry once "
                            "they are applied", service.limits.retry_after(5))
        return await run_in_threadpool(store.submit, service.path, *args, token.name)
    except store.StoreError as e:
        raise HTTPError(422, str(e)) from None
    except (OSError, sqlite3.OperationalError) as e:
        if _full(e):
            raise HTTPError(503, "the server's disk is full; retry later (nothing was queued)",
                            {"Retry-After": "30"}) from None
        raise


@authorised("submit")
async def post_request(request, service: Service, token: Token):
    """Queue a deletion request (idempotent per ``Idempotency-Key``); wakes the worker."""
    raw = await _admit(request, service, token)
    idem = request.headers.get("idempotency-key")
    if idem is None or not IDEMPOTENCY_KEY.match(idem):
        raise HTTPError(422, "header Idempotency-Key is required: 1 to 200 characters of A-Z a-z 0-9 . _ : ~ -")
    kind, ids, sigma, salt = parse_submission(raw, token, service.max_ids)
    path, idem = service.path, scoped_key(token, idem)
    first = await run_in_threadpool(store.submission_by_key, path, idem)
    if first is not None:  # a replay: the first one's result, whatever happened since
        if (first["kind"], first["ids"], first["sigma"]) != (kind, sorted(ids), sigma):
            raise HTTPError(422, "this Idempotency-Key was already used for a different request")
        return submitted(first, False, token, service.id_secret)
    if kind == "forget":
        try:  # whether an id is already forgotten is other tenants' business: checked for admin only
            ids = await run_in_threadpool(store.check_ids_now, path, ids, token.may("admin"))
        except store.StoreError as e:
            raise HTTPError(422, str(e)) from None
    ids_hash = receipts.ids_sha256(ids, salt)
    sub, created = await _queue(service, token, (idem, kind, ids, sigma, ids_hash, salt))
    service.worker.wake.set()
    return submitted(sub, created, token, service.id_secret)


@authorised(None)
async def get_request(request, service: Service, token: Token):
    """A submission's status (and receipt once applied): role read, or the token that submitted it."""
    raw = request.path_params["sid"]
    if not OPAQUE_ID.match(raw):  # ASCII only: no Unicode digit, no number, nothing huge
        raise HTTPError(404, "no such request")
    sub = await run_in_threadpool(_find, service, raw, None if token.may("read") else token.name)
    if sub is None:  # unknown, or another submitter's: the same answer
        raise HTTPError(404, f"no request {raw}")
    own = sub["client"] == token.name
    return JSONResponse(public_submission(sub, full=token.may("admin"), owner=own, secret=service.id_secret))


def _find(service: Service, public_id: str, client: str | None) -> dict | None:
    """The submission whose opaque id is ``public_id`` among ``client``'s (None: everyone's)."""
    for sub in store.submissions(service.path, limit=1 << 62, client=client):
        if hmac.compare_digest(opaque_id(service.id_secret, sub["id"]), public_id):
            return sub
    return None
