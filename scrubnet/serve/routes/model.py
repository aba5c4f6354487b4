"""``GET /v1/model`` (the current weights' sha256, request id and record-chain head) and
``GET /v1/model/weights`` (the weights file, safetensors); role read."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from scrubnet.mlforget import store
from scrubnet.serve.auth import Token, authorised
from scrubnet.serve.http import Service, guard


def model_info(service: Service) -> dict:
    """The committed model: ``sha256``, ``request_id``, ``record_head``, ``user_weights_dropped``,
    ``weights_url``."""
    st = store.state_record(service.path)
    return {"sha256": st["weights_sha256"], "request_id": st["request_id"], "record_head": st["head"],
            "user_weights_dropped": st["user_weights_dropped"], "weights_url": "/v1/model/weights"}


@authorised("read")
async def get_model(request, service: Service, token: Token):
    """:func:`model_info` as JSON (503 once the service halted: a checkpoint restored under it is not served)."""
    await guard(service)
    return JSONResponse(await run_in_threadpool(model_info, service))


@authorised("read")
async def get_weights(request, service: Service, token: Token):
    """The committed weights file; header ``X-Weights-Sha256`` names its sha256 (503 once the service halted)."""
    await guard(service)
    _, meta = await run_in_threadpool(store.load, service.path)
    data = (service.path / store.WEIGHTS / f"{meta['weights_sha256']}.safetensors").read_bytes()
    return Response(data, media_type="application/octet-stream",
                    headers={"X-Weights-Sha256": meta["weights_sha256"]})
