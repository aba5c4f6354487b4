"""The transparency log, public (no token: a client learns only hashes): ``GET /v1/log/head`` (the latest
signed tree head) and ``GET /v1/log/consistency?first=M[&second=N]`` (the RFC 9162 consistency proof from the
tree of M leaves to the tree of N, by default the latest head's size)."""
from __future__ import annotations

import re

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from scrubnet.mlforget import store
from scrubnet.serve import anchor, merkle, tlog
from scrubnet.serve.http import HTTPError, Service, answer_errors, guard

#: an ASCII count of at most 18 digits (a Unicode digit, a sign or a huge number is refused with 422)
COUNT = re.compile(r"^[0-9]{1,18}$")


def parse_count(value: str | None, name: str) -> int:
    """A non-negative ASCII integer query or path value; 422 naming ``name`` otherwise."""
    if value is None or not COUNT.match(value):
        raise HTTPError(422, f"{name} must be a count: 1 to 18 ASCII digits")
    return int(value)


def latest_head(service: Service) -> dict:
    """The latest signed tree head; 404 before the first one."""
    sth = (anchor.read_head(service.path) or {}).get("tree_head")
    if not isinstance(sth, dict):
        raise HTTPError(404, "no tree head signed yet")
    return sth


def consistency(service: Service, first: int, second: int | None) -> dict:
    """``{"first", "second", "proof"}`` (hex) from the tree of ``first`` leaves to the tree of ``second``
    (the latest signed head's size when None); 422 for sizes the log has not signed."""
    size = latest_head(service)["tree_size"]
    second = size if second is None else second
    if not first <= second <= size:
        raise HTTPError(422, f"sizes must satisfy first ≤ second ≤ {size} (the latest signed tree head's size)")
    hashes = tlog.leaf_hashes(store.request_links(service.path))[:second]
    return {"first": first, "second": second, "proof": [h.hex() for h in merkle.consistency_proof(first, hashes)]}


@answer_errors
async def get_head(request):
    """The latest signed tree head (public; 503 once the service halted: a head shrunk by a restore is not
    served)."""
    service = request.app.state.service
    await guard(service)
    return JSONResponse(await run_in_threadpool(latest_head, service))


@answer_errors
async def get_consistency(request):
    """The consistency proof between two sizes of the log (public; 503 once the service halted)."""
    service = request.app.state.service
    await guard(service)
    q = request.query_params
    first = parse_count(q.get("first"), "first")
    second = parse_count(q.get("second"), "second") if "second" in q else None
    return JSONResponse(await run_in_threadpool(consistency, service, first, second))
