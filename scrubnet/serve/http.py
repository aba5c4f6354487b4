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


def answer_errors(handler):
    """A public endpoint (no token) whose :class:`HTTPError` is answered as JSON."""
    @functools.wraps(handler)
    async def endpoint(request):
        try:
            return await handler(request)
        except HTTPError as e:
            return e.response()
    return endpoint


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
