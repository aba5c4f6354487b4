"""The HTTP service over one ML checkpoint: a Starlette application and its single worker thread.

Endpoints (JSON; errors are ``{"error": "..."}``):

    POST /v1/requests        role submit (kind ``forget``) or admin (``forget_all``); header Idempotency-Key;
                             body {"ids": [...], "sigma": optional, "kind": optional, "salt": optional hex}
                             → 202 {"id", "status": "queued", "salt", "ids_sha256", "status_url"}
    GET  /v1/requests/{id}   role read, or the submitting token: status (queued | applied | refused | failed),
                             reason, request id in the store, and the signed receipt once applied
    GET  /v1/model           role read: the current weights' sha256, request id and record-chain head
    GET  /v1/model/weights   role read: the weights file (safetensors)
    GET  /v1/key             no token: the receipts' Ed25519 public key (hex and PEM; ``?format=pem``: PEM)
    GET  /v1/log             role read: the request log, the model and the chain's verification
    GET  /operator           the operator page (HTML; it reads /v1/log with the token given after ``#``)

Status codes: 401 missing or unknown bearer token, 403 a role the token lacks, 422 a malformed body (JSON
nested deeper than 16 levels included), header or id list (ids are checked as ``scrubnet mlforget forget``
checks them; whether an id is already forgotten only for admin, so no answer depends on other tenants'
requests), 413 a body over ``max_body`` bytes, 404 an unknown request or another submitter's (the same
answer), 503 once the worker halted on a record that does not verify.

Tenants: a token's name is its identity (unique; an unnamed token is named by a hash of itself). An
Idempotency-Key is scoped to the identity that sent it (stored under a tag of the identity): a replay finds
only the sender's own submission. The ids are shown to their submitter and admin; the salt and the
idempotency key to their submitter only. Trust in the record: :mod:`scrubnet.serve.anchor` (signed receipts
and signed head, verified at start and before each pass of the worker).

The store is the queue (its ``submissions`` table) and the source of truth: a POST inserts a queued row and
returns; the worker applies the oldest queued row through :func:`scrubnet.mlforget.store.apply_submission`
(marked applied in the request's own transaction), then signs the receipts not yet written, in request
order. Receipts are deterministic functions of the store (Ed25519 signatures are deterministic), so a kill
between applying and signing loses nothing: the next start signs them. A restart resumes queued rows.

Layout: the routes are module-level functions grouped per resource in :mod:`scrubnet.serve.routes`; each
authorised one is wrapped by :func:`scrubnet.serve.auth.authorised` (token → identity, 401/403); they read
the service's context (:class:`~scrubnet.serve.http.Service`) from ``app.state.service``; the worker is
:mod:`scrubnet.serve.worker`. :func:`create_app` only assembles them. A checkpoint of a previous store format
is refused at start (``scrubnet mlforget upgrade`` first): serving never upgrades a store.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from scrubnet.mlforget import store
from scrubnet.serve import anchor, receipts, tlog
from scrubnet.serve.auth import ROLES, Token, authorised, read_tokens, resolve_token
from scrubnet.serve.http import HTTPError, SecurityHeaders, Service
from scrubnet.serve.limits import Limits
from scrubnet.serve.worker import Worker, issue_receipts

try:  # optional dependency: pip install "scrubnet[serve]"
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
except ImportError:  # pragma: no cover - exercised only without the extra
    Starlette = None
if Starlette is not None:
    from scrubnet.serve.routes.key import get_key
    from scrubnet.serve.routes.log import get_log
    from scrubnet.serve.routes.model import get_model, get_weights
    from scrubnet.serve.routes.pages import OPERATOR_PAGE, operator
    from scrubnet.serve.routes.requests import IDEMPOTENCY_KEY, get_request, post_request
    from scrubnet.serve.routes.transparency import get_consistency, get_head

__all__ = ["IDEMPOTENCY_KEY", "MAX_BODY", "MAX_IDS", "OPERATOR_PAGE", "ROLES", "HTTPError", "Service", "Token",
           "Worker", "authorised", "create_app", "issue_receipts", "read_tokens", "resolve_token"]

MAX_BODY = 1 << 20
MAX_IDS = 100_000


@contextlib.asynccontextmanager
async def _lifespan(app):
    """Starts the worker with the application (unless ``app.state.start_worker`` is False); stops it after."""
    worker = app.state.worker
    if app.state.start_worker:
        worker.start()
    try:
        yield
    finally:
        worker.stop.set()
        worker.wake.set()
        if worker.is_alive():
            worker.join(timeout=30)


def _routes() -> list:
    return [Route("/v1/requests", post_request, methods=["POST"]),
            Route("/v1/requests/{sid}", get_request, methods=["GET"]),
            Route("/v1/model", get_model, methods=["GET"]),
            Route("/v1/model/weights", get_weights, methods=["GET"]),
            Route("/v1/key", get_key, methods=["GET"]),
            Route("/v1/log", get_log, methods=["GET"]),
            Route("/v1/log/head", get_head, methods=["GET"]),
            Route("/v1/log/consistency", get_consistency, methods=["GET"]),
            Route("/operator", operator, methods=["GET"])]


def id_secret(key) -> bytes:
    """The secret of the opaque submission ids: a hash of the private signing key under a domain tag."""
    raw = key.private_bytes(receipts.serialization.Encoding.Raw, receipts.serialization.PrivateFormat.Raw,
                            receipts.serialization.NoEncryption())
    return hashlib.sha256(b"scrubnet-submission-id/1\x00" + raw).digest()


def _retirements(path: Path, key, retired_keys, head: dict | None, witnessed: dict | None,
                 witness_statements: list) -> list[dict]:
    """The retirement statements of ``retired_keys``: those already signed by ``key`` (in the signed head or
    the witness), and for a key retired now a new one pinning it to the largest tree head it signed (the
    head's or the witness's). Recorded at the rotation, kept in the head and the witness from then on."""
    known = [st for st in [*((head or {}).get("retired_keys") or []), *witness_statements]
             if tlog.retired_pins([st], key.public_key())]
    pinned = tlog.retired_pins(known, key.public_key())
    out = list({st["retired_key_fingerprint"]: st for st in known}.values())
    for old in retired_keys:
        fp = tlog.fingerprint(old)
        if fp in pinned:
            continue
        sizes = [sth["tree_size"] for sth in ((head or {}).get("tree_head"), witnessed)
                 if isinstance(sth, dict) and sth.get("key_fingerprint") == fp
                 and isinstance(sth.get("tree_size"), int)]
        out.append(tlog.retire_statement(key, old, max(sizes, default=0)))
    return out


def _witness_start(path: Path, witness, check: dict, key, retired_keys, head: dict | None, init: bool):
    """The witness's state at start (fail closed): ``(statements, witnessed head, warnings)``;
    ``StoreError`` (one line) when it cannot be read, holds nothing although the checkpoint's signed head
    shows its log was published (unless ``init``, a new witness), holds something although ``init``, or
    holds a head the log does not extend."""
    try:
        state, witnessed, statements = witness.read()
    except ValueError as e:
        raise store.StoreError(f"{path}: refusing to serve it: {e}") from None
    sth = (head or {}).get("tree_head")
    warnings = []
    if witnessed is None:
        if init:
            warnings.append(f"--witness-init: the {witness} held no tree head ({state}); it is initialised with "
                            f"this checkpoint's log ({len(check['leaf_hashes'])} entries): do this once, for a "
                            "new witness")
        elif isinstance(sth, dict):
            raise store.StoreError(
                f"{path}: refusing to serve it: its {witness} holds no tree head ({state}), though the checkpoint's "
                f"signed head shows its log was published (a tree head of {sth.get('tree_size')} requests, signed "
                f"{sth.get('timestamp')}): a restored checkpoint against a lost witness; for a genuinely new "
                "witness start once with --witness-init")
    elif init:
        raise store.StoreError(f"{path}: refusing --witness-init: the {witness} already holds a tree head of "
                               f"{witnessed.get('tree_size')} requests (initialise only a new, empty witness)")
    return statements, witnessed, warnings


def create_app(checkpoint: str | Path, tokens: dict[str, Token], key, data_loader, *, max_body: int = MAX_BODY,
               max_ids: int = MAX_IDS, start_worker: bool = True, witness=None, limits=None,
               verify_every_s: float = 30.0, retired_keys=(), witness_init: bool = False):
    """The Starlette application serving ``checkpoint``; its worker starts with the application.

    Parameters
    ----------
    checkpoint : str or Path
        An ML checkpoint of the current store format, verified read-only here against its chain, its signed
        receipts and its signed head (:func:`scrubnet.serve.anchor.verify`): a record that does not verify
        is refused with a ``StoreError`` naming every problem; a previous format is refused with one naming
        ``scrubnet mlforget upgrade``.
    tokens : dict
        ``{bearer token: Token}`` (:func:`read_tokens`).
    key : Ed25519PrivateKey
        Signs the receipts.
    data_loader : callable
        ``data_loader(static) -> (x, y)``: the data D of a request (:func:`scrubnet.mlforget.store.forget`).
    max_body : int
        Largest request body, bytes.
    max_ids : int
        Most ids per request.
    start_worker : bool
        Start the worker thread with the application.
    witness : scrubnet.serve.tlog.Witness or None
        Where the signed tree heads are published; the checkpoint's log must extend the head it holds, else
        ``StoreError`` (a restored older copy of the checkpoint). A witness holding no head (deleted, empty,
        null, a command printing nothing) is refused when the checkpoint's signed head shows that its log was
        published; a witness that cannot be read (a failing or hanging command) is refused.
    limits : scrubnet.serve.limits.Limits or None
        Per-tenant rate limits and queue quotas (None: the defaults).
    verify_every_s : float
        While idle, the worker verifies the record this often.
    retired_keys : sequence of Ed25519PublicKey
        Keys the service signed with before a rotation (their signatures stay valid up to the tree size each
        had signed when retired, recorded in a statement ``key`` signs; new ones use ``key``).
    witness_init : bool
        The witness is new: it may hold nothing whatever the checkpoint's head shows (it must hold nothing);
        it is given the checkpoint's head at once (a warning line says so).

    Returns
    -------
    Starlette
        ``app.state.service`` the routes' context, ``app.state.worker`` the worker thread,
        ``app.state.warnings`` lines for the operator (requests committed outside the service since the last
        signed head: the start-up vouches for them).
    """
    if Starlette is None:
        raise ValueError('scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
    path = Path(checkpoint)
    head = anchor.read_head(path)
    pins = tlog.retired_pins((head or {}).get("retired_keys"), key.public_key())
    check = anchor.verify(path, key.public_key(), retired_keys, pins)  # read-only; an old format: StoreError
    if not check["valid"]:
        raise store.StoreError(f"{path}: the record does not verify, refusing to serve it: "
                               + "; ".join(check["problems"]))
    warnings, statements, witnessed = [], [], None
    if witness is not None:
        w_statements, witnessed, warnings = _witness_start(path, witness, check, key, retired_keys, head,
                                                           witness_init)
        statements = _retirements(path, key, retired_keys, head, witnessed, w_statements)
        pins = tlog.retired_pins(statements, key.public_key())
        problems = tlog.witness_problems(witnessed, check["leaf_hashes"], key.public_key(), retired_keys, pins)
        if problems:
            raise store.StoreError(f"{path}: refusing to serve it against its {witness}: " + "; ".join(problems))
    elif retired_keys:
        statements = _retirements(path, key, retired_keys, head, None, [])
    sizes = [sth["tree_size"] for sth in ((head or {}).get("tree_head"), witnessed)
             if isinstance(sth, dict) and isinstance(sth.get("tree_size"), int)]
    if witness is not None and witness_init and isinstance((head or {}).get("tree_head"), dict):
        try:  # the new witness holds the checkpoint's head from now on
            witness.publish(head["tree_head"], statements)
        except ValueError as e:
            raise store.StoreError(f"{path}: refusing to serve it: {e}") from None
    log_size = max(sizes, default=0)
    links = {r["id"]: r["hash"] for r in check["requests"]}
    worker = Worker(path, key, data_loader, witness=witness, verify_every_s=verify_every_s,
                    retired=retired_keys, statements=statements, log_size=log_size,
                    published=witnessed is not None or (witness_init and bool(sizes)),
                    signed_link=(log_size - 1, links[log_size - 1]) if log_size - 1 in links else None)
    service = Service(path=path, tokens=tokens, worker=worker, public_hex=receipts.public_key_hex(key),
                      public_pem=receipts.public_pem(key).decode(), max_body=max_body, max_ids=max_ids,
                      public_key=key.public_key(), limits=limits or Limits(), id_secret=id_secret(key))
    app = Starlette(routes=_routes(), lifespan=_lifespan, middleware=[Middleware(SecurityHeaders)])
    late = [i for i in check["unanchored"] if i > check["anchored_through"] >= 0]
    if late:
        warnings.append(f"requests {', '.join(f'#{i}' for i in late)} were committed outside the service since its "
                        "last signed head; the worker signs the record with them now")
    app.state.warnings = warnings
    app.state.service, app.state.worker, app.state.start_worker = service, worker, start_worker
    return app
