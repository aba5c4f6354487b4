"""``GET /v1/key`` (no token): the receipts' Ed25519 public key, hex and PEM (``?format=pem``: PEM only), and
``retired``: the retirement statements of the keys it replaced, signed by it (each pins a retired key to the
largest tree head it signed; ``scrubnet receipt audit --retired-key`` reads them)."""
from __future__ import annotations

from starlette.responses import JSONResponse, PlainTextResponse

from scrubnet.serve.http import answer_errors


@answer_errors
async def get_key(request):
    """The public key that verifies the service's receipts."""
    service = request.app.state.service
    if request.query_params.get("format") == "pem":
        return PlainTextResponse(service.public_pem)
    return JSONResponse({"algorithm": "Ed25519", "public_key": service.public_hex, "pem": service.public_pem,
                         "retired": list(getattr(service.worker, "statements", []))})
