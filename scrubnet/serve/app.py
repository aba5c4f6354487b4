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

Status codes: 401 missing or unknown bearer token, 403 a role the token lacks, 422 a malformed body, header
or id list (ids are checked as ``scrubnet mlforget forget`` checks them), 413 a body over ``max_body`` bytes,
404 an unknown request.

The store is the queue (its ``submissions`` table) and the source of truth: a POST inserts a queued row and
returns; the worker applies the oldest queued row through :func:`scrubnet.mlforget.store.apply_submission`
(marked applied in the request's own transaction), then signs the receipts not yet written, in request
order. Receipts are deterministic functions of the store (Ed25519 signatures are deterministic), so a kill
between applying and signing loses nothing: the next start signs them. A restart resumes queued rows.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import math
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from scrubnet.data.ids import IdsFormatError, parse_sample_ids
from scrubnet.mlforget import store
from scrubnet.serve import receipts

try:  # optional dependency: pip install "scrubnet[serve]"
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route
except ImportError:  # pragma: no cover - exercised only without the extra
    Starlette = None

ROLES = ("submit", "read", "admin")
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._:~-]{1,200}$")
MAX_BODY = 1 << 20
MAX_IDS = 100_000


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass(frozen=True)
class Token:
    name: str
    roles: frozenset

    def may(self, role: str) -> bool:
        return "admin" in self.roles or role in self.roles


def read_tokens(path: str | Path) -> dict[str, Token]:
    """Tokens from a file of lines ``TOKEN ROLES [NAME]`` (ROLES: comma-separated submit, read, admin;
    ``#`` starts a comment). Tokens are at least 16 characters and unique; the name defaults to
    ``token-<line>``. ``ValueError`` naming the line otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--tokens {path}: {e.strerror or e}") from None
    out: dict[str, Token] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"--tokens {path} line {n}: expected 'TOKEN ROLES [NAME]'")
        tok, roles = parts[0], frozenset(r for r in parts[1].split(",") if r)
        if len(tok) < 16:
            raise ValueError(f"--tokens {path} line {n}: a token must have at least 16 characters")
        if not roles or not roles <= set(ROLES):
            raise ValueError(f"--tokens {path} line {n}: roles must be among {', '.join(ROLES)}, got {parts[1]!r}")
        if tok in out:
            raise ValueError(f"--tokens {path} line {n}: this token is listed twice")
        out[tok] = Token(parts[2] if len(parts) == 3 else f"token-{n}", roles)
    if not out:
        raise ValueError(f"--tokens {path}: no tokens listed")
    return out


def issue_receipts(path: Path, key) -> int:
    """Sign and store the receipts of applied submissions that have none, in request order; returns how many."""
    n = 0
    for sub in store.applied_without_receipt(path):
        request, link, prev_link = store.request_with_link(path, sub["request_id"])
        prev = store.previous_receipt(path, sub["request_id"])
        receipt = receipts.build_receipt(request, sub, link, prev_link,
                                         receipts.receipt_sha256(prev) if prev else None, key)
        store.set_receipt(path, sub["id"], receipt)
        n += 1
    return n


class Worker(threading.Thread):
    """Applies queued submissions one at a time, in arrival order, and signs their receipts."""

    def __init__(self, path: Path, key, data_loader, idle_s: float = 0.5):
        super().__init__(name="scrubnet-serve-worker", daemon=True)
        self.path, self.key, self.data_loader, self.idle_s = path, key, data_loader, idle_s
        self.wake, self.stop = threading.Event(), threading.Event()
        self.last_error: str | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                issue_receipts(self.path, self.key)
                sid = store.oldest_queued(self.path)
                if sid is None:
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
                    continue
                store.apply_submission(self.path, sid, self.data_loader)
                self.last_error = None
            except Exception as e:  # noqa: BLE001 — a busy or damaged store: reported on /v1/log, retried
                self.last_error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)


def _public(sub: dict, full: bool) -> dict:
    """A submission as the API shows it; ``full`` (admin or the submitter) adds the ids and the salt."""
    out = {"id": sub["id"], "status": sub["status"], "kind": sub["kind"], "n_ids": len(sub["ids"]),
           "sigma": sub["sigma"], "submitted_utc": sub["submitted_utc"], "finished_utc": sub["finished_utc"],
           "reason": sub["reason"], "request_id": sub["request_id"], "ids_sha256": sub["ids_hash"],
           "receipt": sub["receipt"]}
    if full:
        out.update(ids=sub["ids"], salt=sub["salt"], idempotency_key=sub["idempotency_key"])
    return out


def _error(e: HTTPError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


def create_app(checkpoint: str | Path, tokens: dict[str, Token], key, data_loader, *, max_body: int = MAX_BODY,
               max_ids: int = MAX_IDS, start_worker: bool = True):
    """The Starlette application serving ``checkpoint``; its worker starts with the application."""
    if Starlette is None:
        raise ValueError('scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
    path = Path(checkpoint)
    store.verify(path)  # opens (and seals a store of the previous format) before serving
    worker = Worker(path, key, data_loader)
    pub_hex = receipts.public_key_hex(key)
    pub_pem = receipts.public_pem(key).decode()

    def authorise(request, role: str | None) -> Token:
        """The request's token (401 if missing or unknown); 403 if ``role`` is given and the token lacks it."""
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise HTTPError(401, "missing bearer token (header 'Authorization: Bearer TOKEN')",
                            {"WWW-Authenticate": "Bearer"})
        given = auth[7:].strip()
        found = None
        for tok, entry in tokens.items():
            if hmac.compare_digest(tok.encode(), given.encode()):
                found = entry
        if found is None:
            raise HTTPError(401, "unknown bearer token", {"WWW-Authenticate": "Bearer"})
        if role is not None and not found.may(role):
            raise HTTPError(403, f"token {found.name!r} lacks the {role} role")
        return found

    async def read_body(request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise HTTPError(413, f"request body over {max_body} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise HTTPError(413, f"request body over {max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_submission(raw: bytes, token: Token) -> tuple[str, list[int], float | None, str]:
        try:
            body = json.loads(raw, parse_constant=lambda c: c)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(422, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(422, "the body must be a JSON object {\"ids\": [...], \"sigma\": ..., \"salt\": ...}")
        unknown = sorted(set(body) - {"ids", "sigma", "kind", "salt"})
        if unknown:
            raise HTTPError(422, f"unknown field(s) {', '.join(unknown)} (allowed: ids, sigma, kind, salt)")
        kind = body.get("kind", "forget")
        if kind not in ("forget", "forget_all"):
            raise HTTPError(422, f"kind must be 'forget' or 'forget_all', got {kind!r}")
        if kind == "forget_all":
            if not token.may("admin"):
                raise HTTPError(403, f"token {token.name!r} lacks the admin role (forget_all)")
            if body.get("ids") not in (None, []) or body.get("sigma") is not None:
                raise HTTPError(422, "forget_all takes no ids and no sigma")
            ids = []
        else:
            if "ids" not in body:
                raise HTTPError(422, "ids is required: a JSON list of integer sample ids")
            if not isinstance(body["ids"], list):
                raise HTTPError(422, "ids must be a JSON list of integer sample ids")
            if len(body["ids"]) > max_ids:
                raise HTTPError(422, f"at most {max_ids} ids per request")
            try:
                ids = parse_sample_ids(json.dumps(body["ids"]), "ids")
            except IdsFormatError as e:
                raise HTTPError(422, str(e)) from None
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

    async def post_request(request):
        try:
            token = authorise(request, "submit")
            raw = await read_body(request)
            idem = request.headers.get("idempotency-key")
            if idem is None or not IDEMPOTENCY_KEY.match(idem):
                raise HTTPError(422, "header Idempotency-Key is required: 1 to 200 characters of A-Z a-z 0-9 . _ : ~ -")
            kind, ids, sigma, salt = parse_submission(raw, token)
            first = await run_in_threadpool(store.submission_by_key, path, idem)
            if first is not None:  # a replay: the first one's result, whatever happened since
                if (first["kind"], first["ids"], first["sigma"]) != (kind, sorted(ids), sigma):
                    raise HTTPError(422, "this Idempotency-Key was already used for a different request")
                return submitted(first, False, token)
            if kind == "forget":
                try:
                    ids = await run_in_threadpool(store.check_ids_now, path, ids)
                except store.StoreError as e:
                    raise HTTPError(422, str(e)) from None
            ids_hash = receipts.ids_sha256(ids, salt)
            try:
                sub, created = await run_in_threadpool(store.submit, path, idem, kind, ids, sigma, ids_hash, salt,
                                                       token.name)
            except store.StoreError as e:
                raise HTTPError(422, str(e)) from None
        except HTTPError as e:
            return _error(e)
        worker.wake.set()
        return submitted(sub, created, token)

    def submitted(sub: dict, created: bool, token: Token) -> JSONResponse:
        out = _public(sub, full=sub["client"] == token.name or token.may("admin"))
        out["status_url"] = f"/v1/requests/{sub['id']}"
        out["replayed"] = not created
        return JSONResponse(out, status_code=202 if sub["status"] == "queued" else 200)

    async def get_request(request):
        try:
            token = authorise(request, None)
            try:
                sid = int(request.path_params["sid"])
            except ValueError:
                raise HTTPError(404, "no such request") from None
            sub = await run_in_threadpool(store.submission, path, sid)
            if sub is None:
                raise HTTPError(404, f"no request {sid}")
            own = sub["client"] == token.name
            if not (own or token.may("read")):
                raise HTTPError(403, f"token {token.name!r} lacks the read role (and did not submit request {sid})")
        except HTTPError as e:
            return _error(e)
        return JSONResponse(_public(sub, full=own or token.may("admin")))

    def model_info() -> dict:
        st = store.state_record(path)
        return {"sha256": st["weights_sha256"], "request_id": st["request_id"], "record_head": st["head"],
                "user_weights_dropped": st["user_weights_dropped"], "weights_url": "/v1/model/weights"}

    def read_json(build):
        """A GET handler for the read role answering ``build()`` (run off the event loop) as JSON."""
        async def handler(request):
            try:
                authorise(request, "read")
            except HTTPError as e:
                return _error(e)
            return JSONResponse(await run_in_threadpool(build))
        return handler

    get_model = read_json(model_info)

    async def get_weights(request):
        try:
            authorise(request, "read")
        except HTTPError as e:
            return _error(e)
        _, meta = await run_in_threadpool(store.load, path)
        data = (path / store.WEIGHTS / f"{meta['weights_sha256']}.safetensors").read_bytes()
        return Response(data, media_type="application/octet-stream",
                        headers={"X-Weights-Sha256": meta["weights_sha256"]})

    async def get_key(request):
        if request.query_params.get("format") == "pem":
            return PlainTextResponse(pub_pem)
        return JSONResponse({"algorithm": "Ed25519", "public_key": pub_hex, "pem": pub_pem})

    def log_info() -> dict:
        rec = store.verify(path)
        subs = store.submissions(path, limit=500)
        return {"model": model_info(), "chain": {"valid": rec["valid"], "problems": rec["problems"],
                                                 "requests": len(rec["requests"])},
                "queued": sum(s["status"] == "queued" for s in subs), "worker_error": worker.last_error,
                "submissions": [{**_public(s, full=False), "remaining_information_bound_nats":
                                 (s["receipt"] or {}).get("remaining_information_bound_nats")} for s in subs]}

    get_log = read_json(log_info)

    async def operator(request):
        return HTMLResponse(OPERATOR_PAGE)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if start_worker:
            worker.start()
        try:
            yield
        finally:
            worker.stop.set()
            worker.wake.set()
            if worker.is_alive():
                worker.join(timeout=30)

    routes = [Route("/v1/requests", post_request, methods=["POST"]),
              Route("/v1/requests/{sid}", get_request, methods=["GET"]),
              Route("/v1/model", get_model, methods=["GET"]),
              Route("/v1/model/weights", get_weights, methods=["GET"]),
              Route("/v1/key", get_key, methods=["GET"]),
              Route("/v1/log", get_log, methods=["GET"]),
              Route("/operator", operator, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.worker = worker
    return app


OPERATOR_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>scrubnet — deletion requests</title>
<style>
body{font-family:sans-serif;margin:1.5em;color:#222} table{border-collapse:collapse;font-size:14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} .ok{color:#070} .bad{color:#b00}
code{font-size:13px}
</style></head>
<body>
<h1>Deletion requests</h1>
<p>Model sha256: <code id="model-sha">…</code> (request #<span id="model-request">…</span>)</p>
<p>Record chain: <strong id="chain-status">loading…</strong> <span id="chain-problems"></span></p>
<p>Queued: <span id="queued">…</span></p>
<table id="log"><thead><tr><th>id</th><th>status</th><th>submitted (UTC)</th><th>finished (UTC)</th>
<th>ids</th><th>σ</th><th>information bound (nats)</th><th>request #</th><th>receipt</th><th>reason</th></tr></thead>
<tbody></tbody></table>
<script>
const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
function cell(tr, text) { const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); return td; }
fetch("/v1/log", {headers: {"Authorization": "Bearer " + token}}).then(r => r.json().then(j => [r.status, j]))
.then(([status, log]) => {
  if (status !== 200) { document.getElementById("chain-status").textContent = "error: " + log.error; return; }
  document.getElementById("model-sha").textContent = log.model.sha256;
  document.getElementById("model-request").textContent = log.model.request_id;
  const cs = document.getElementById("chain-status");
  cs.textContent = log.chain.valid ? "valid" : "BROKEN";
  cs.className = log.chain.valid ? "ok" : "bad";
  document.getElementById("chain-problems").textContent = log.chain.problems.join("; ");
  document.getElementById("queued").textContent = log.queued;
  const body = document.querySelector("#log tbody");
  for (const s of log.submissions) {
    const tr = document.createElement("tr");
    tr.className = "row-" + s.status;
    cell(tr, s.id); cell(tr, s.status); cell(tr, s.submitted_utc); cell(tr, s.finished_utc || "");
    cell(tr, s.n_ids); cell(tr, s.sigma === null ? "default" : s.sigma);
    cell(tr, s.remaining_information_bound_nats === null || s.remaining_information_bound_nats === undefined
         ? "—" : s.remaining_information_bound_nats.toExponential(2));
    cell(tr, s.request_id === null ? "" : s.request_id);
    const rc = cell(tr, "");
    if (s.receipt) { const a = document.createElement("a"); a.href = "/v1/requests/" + s.id; a.textContent = "receipt";
                     rc.appendChild(a); }
    cell(tr, s.reason || "");
    body.appendChild(tr);
  }
  document.body.setAttribute("data-loaded", "yes");
});
</script>
</body></html>
"""
