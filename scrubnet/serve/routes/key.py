"""``GET /v1/key`` (no token): the receipts' Ed25519 public key, hex and PEM (``?format=pem``: PEM only)."""
from __future__ import annotations

from starlette.responses import JSONResponse, PlainTextResponse


async def get_key(request):
    """The public key that verifies the service's receipts."""
    service = request.app.state.service
    if request.query_params.get("format") == "pem":
        return PlainTextResponse(service.public_pem)
    return JSONResponse({"algorithm": "Ed25519", "public_key": service.public_hex, "pem": service.public_pem})
