"""``GET /v1/log`` (role read): the request log, the model and the record chain's verification."""
from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from scrubnet.mlforget import store
from scrubnet.serve import anchor
from scrubnet.serve.auth import Token, authorised
from scrubnet.serve.http import Service
from scrubnet.serve.routes.model import model_info
from scrubnet.serve.routes.requests import public_submission


def log_info(service: Service) -> dict:
    """The model, the record's verification (the chain, the signed receipts, head and tree heads under the
    service's key; read-only: it never changes the store), the number queued, the
    worker's last error (and whether it halted on a record that does not verify) and the latest 500
    submissions (without their ids, salts or idempotency keys); ``sigma_applied`` is the σ of the committed
    request (from its receipt), else the one asked (null: the checkpoint's default)."""
    rec = anchor.verify(service.path, service.public_key, getattr(service.worker, "retired", ()),
                        getattr(service.worker, "pins", None))
    subs = store.submissions(service.path, limit=500)
    return {"model": model_info(service), "chain": {"valid": rec["valid"], "problems": rec["problems"],
                                                    "requests": len(rec["requests"])},
            "queued": sum(s["status"] == "queued" for s in subs), "worker_error": service.worker.last_error,
            "worker_halted": service.worker.halted is not None,
            "submissions": [{**public_submission(s, full=False, secret=service.id_secret),
                             "remaining_information_bound_nats":
                             (s["receipt"] or {}).get("remaining_information_bound_nats"),
                             "sigma_applied": (s["receipt"] or {}).get("sigma", s["sigma"])} for s in subs]}


@authorised("read")
async def get_log(request, service: Service, token: Token):
    """:func:`log_info` as JSON."""
    return JSONResponse(await run_in_threadpool(log_info, service))
