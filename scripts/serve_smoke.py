"""One deletion request through ``scrubnet serve`` in a venv with only the ``serve`` extra: train a tiny
ML-Forgetting checkpoint, start the server on a free loopback port with a signing key kept outside the
checkpoint, POST a request, wait until it is applied and its receipt is signed, stop the server.

    python scripts/serve_smoke.py VENV/bin/scrubnet WORK_DIR

Exit 0 when the request was applied with a receipt; otherwise the server's output and a non-zero exit.
Only the standard library is used here, so the check sees exactly what the extra installs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, token: str | None = None, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if key:
        req.add_header("Idempotency-Key", key)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def main(scrubnet: str, work: str) -> int:
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SCRUBNET_TINY="1", OMP_NUM_THREADS="1")
    ckpt = work_dir / "ml"
    subprocess.run([scrubnet, "mlforget", "train", "--out", str(ckpt)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    key = work_dir / "keys" / "receipt-key.pem"
    key.parent.mkdir(mode=0o700)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    key.write_bytes(pem)
    key.chmod(0o600)
    tokens = work_dir / "tokens.txt"
    tokens.write_text("smoke-submit-token-0123456789 submit smoke\n")
    tokens.chmod(0o600)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([scrubnet, "serve", str(ckpt), "--tokens", str(tokens), "--port", str(port),
                               "--key", str(key)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            try:
                if _call(f"{base}/v1/key")[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not answer within 120 s")
        if server.poll() is not None:
            raise RuntimeError("the server exited at start")
        code, body = _call(f"{base}/v1/requests", "smoke-submit-token-0123456789", {"ids": [33, 34]}, "smoke-1")
        if code != 202:
            raise RuntimeError(f"POST /v1/requests answered {code}")
        rid = body.get("id")
        for _ in range(240):
            code, state = _call(f"{base}/v1/requests/{rid}", "smoke-submit-token-0123456789")
            if state.get("status") in ("applied", "refused", "failed"):
                break
            time.sleep(0.5)
        if state.get("status") != "applied" or "receipt" not in state:
            raise RuntimeError(f"request {rid} ended as {state.get('status')!r}, not applied with a receipt")
        print(f"serve smoke: request {rid} applied with a signed receipt")
        return 0
    except Exception as e:  # noqa: BLE001 - reported with the server's output
        server.terminate()
        out = server.communicate(timeout=30)[0].decode(errors="replace")
        print(f"serve smoke failed: {e}\n--- server output ---\n{out}", file=sys.stderr)
        return 1
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
