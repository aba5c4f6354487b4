"""``GET /operator`` (no token): the operator page. It reads ``/v1/log`` with the token given after ``#``
(``/operator#token=…``), so the token never reaches the server's logs; a receipt link fetches
``/v1/requests/{id}`` with the same token and shows the receipt on the page (a plain link would carry no
token and get 401); ``#token=…&receipt=ID`` shows receipt ID on opening. The σ column shows the σ the committed request applied (from its receipt)."""
from __future__ import annotations

import base64
import hashlib
import re

from starlette.responses import HTMLResponse

from scrubnet.serve.http import answer_errors


def content_security_policy(page: str) -> str:
    """The page's Content-Security-Policy: nothing but its own inline script and style (by their sha256, CSP
    level 2), fetches to this origin only, no framing, no forms, no base URL."""
    def digests(tag):
        return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
                        for body in re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S))
    return (f"default-src 'none'; script-src {digests('script')}; style-src {digests('style')}; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@answer_errors
async def operator(request):
    """The operator page (static HTML; its script fetches the log), with its Content-Security-Policy."""
    return HTMLResponse(OPERATOR_PAGE, headers={"Content-Security-Policy": OPERATOR_CSP})


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
<p>Worker: <strong id="worker">…</strong></p>
<table id="log"><thead><tr><th>id</th><th>status</th><th>submitted (UTC)</th><th>finished (UTC)</th>
<th>ids</th><th>σ</th><th>information bound (nats)</th><th>request #</th><th>receipt</th><th>reason</th></tr></thead>
<tbody></tbody></table>
<h2>Receipt</h2>
<pre id="receipt-view">(click a receipt link)</pre>
<script>
const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
function showReceipt(id) {
  fetch("/v1/requests/" + id, {headers: {"Authorization": "Bearer " + token}}).then(r => r.json())
  .then(j => { document.getElementById("receipt-view").textContent =
                 j.receipt ? JSON.stringify(j.receipt, null, 1) : "error: " + (j.error || "no receipt");
               document.body.setAttribute("data-loaded", "yes"); });
}
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
  const wk = document.getElementById("worker");
  wk.textContent = log.worker_halted ? log.worker_error : (log.worker_error ? "retrying: " + log.worker_error : "running");
  wk.className = log.worker_halted ? "bad" : "ok";
  const body = document.querySelector("#log tbody");
  for (const s of log.submissions) {
    const tr = document.createElement("tr");
    tr.className = "row-" + s.status;
    cell(tr, s.id); cell(tr, s.status); cell(tr, s.submitted_utc); cell(tr, s.finished_utc || "");
    cell(tr, s.n_ids);
    // a row that applied nothing (refused, duplicate, queued) has no σ to show
    cell(tr, s.status !== "applied" ? "—"
             : (s.sigma_applied === null || s.sigma_applied === undefined ? "default" : s.sigma_applied));
    cell(tr, s.remaining_information_bound_nats === null || s.remaining_information_bound_nats === undefined
         ? "—" : s.remaining_information_bound_nats.toExponential(2));
    cell(tr, s.request_id === null ? "" : s.request_id);
    const rc = cell(tr, "");
    if (s.receipt) { const a = document.createElement("a"); a.href = "/v1/requests/" + s.id; a.textContent = "receipt";
                     a.addEventListener("click", ev => { ev.preventDefault(); showReceipt(s.id); });
                     rc.appendChild(a); }
    cell(tr, s.reason || "");
    body.appendChild(tr);
  }
  const shown = new URLSearchParams(location.hash.slice(1)).get("receipt");
  if (shown) { showReceipt(shown); } else { document.body.setAttribute("data-loaded", "yes"); }
});
</script>
</body></html>
"""

OPERATOR_CSP = content_security_policy(OPERATOR_PAGE)
