"""What every route shares: the service's context (:class:`Service`, on ``app.state.service``) and
:class:`HTTPError`, the one way a route refuses (answered as JSON ``{"error": "..."}``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # optional dependency: pip install "scrubnet[serve]"
    from starlette.responses import JSONResponse
except ImportError:  # pragma: no cover - exercised only without the extra
    JSONResponse = None


class HTTPError(Exception):
    """A refusal: ``status`` (HTTP code), ``message`` (the JSON body's ``error``), extra ``headers``."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def response(self) -> "JSONResponse":
        """The JSON answer ``{"error": message}`` with this status and headers."""
        return JSONResponse({"error": self.message}, status_code=self.status, headers=self.headers)


async def guard(service: "Service") -> None:
    """503 once the worker halted, or when the checkpoint's log became smaller than what the service signed
    (an older copy restored under it: the worker halts): nothing is queued on, or served from, such a
    checkpoint (:meth:`scrubnet.serve.worker.Worker.guard`)."""
    from starlette.concurrency import run_in_threadpool
    try:
        await run_in_threadpool(service.worker.guard)
    except RuntimeError as e:
        raise HTTPError(503, f"the service stopped: its record does not verify ({e}); see GET /v1/log") from None


def admit_public(request) -> None:
    """Take a GET of a public route (no token) from the client address's read bucket; 429 when empty."""
    service = request.app.state.service
    if service.limits is None:
        return
    addr = request.client.host if request.client is not None else "?"
    wait = service.limits.admit_read("addr:" + addr)
    if wait is not None:
        raise HTTPError(429, "too many reads from this address; retry later", service.limits.retry_after(wait))


def answer_errors(handler):
    """A public endpoint (no token), read-limited per client address, whose :class:`HTTPError` is answered as
    JSON."""
    @functools.wraps(handler)
    async def endpoint(request):
        try:
            admit_public(request)
            return await handler(request)
        except HTTPError as e:
            return e.response()
    return endpoint


#: headers on every answer: no sniffing, no framing, no referrer, no caching of tokens' answers
SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-store"),
                    (b"cross-origin-opener-policy", b"same-origin"), (b"cross-origin-resource-policy", b"same-origin"))


class SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every HTTP answer (a route's own value wins)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *((k, v) for k, v in SECURITY_HEADERS if k not in have)]}
            await send(message)
        await self.app(scope, receive, send_with_headers)


@dataclass(frozen=True)
class Service:
    """The state the routes read, one per application (``request.app.state.service``).

    Parameters
    ----------
    path : Path
        The ML checkpoint served (its request store is the queue and the source of truth).
    tokens : dict
        ``{bearer token: Token}`` (:func:`scrubnet.serve.auth.read_tokens`).
    worker : Worker
        The thread applying queued submissions (:class:`scrubnet.serve.worker.Worker`); woken by a POST.
    public_hex, public_pem : str
        The receipts' Ed25519 public key, hex and PEM.
    max_body : int
        Largest request body, bytes (413 above).
    max_ids : int
        Most ids in one request (422 above).
    public_key : Ed25519PublicKey or None
        The key the service signs with (its public half), to verify the record with.
    limits : object or None
        Per-tenant rate limits and queue quotas (:class:`scrubnet.serve.limits.Limits`).
    id_secret : bytes
        The secret behind the opaque submission ids (derived from the signing key).
    """
    path: Path
    tokens: dict
    worker: Any
    public_hex: str
    public_pem: str
    max_body: int
    max_ids: int
    public_key: Any = None
    limits: Any = field(default=None)
    id_secret: bytes = b""
