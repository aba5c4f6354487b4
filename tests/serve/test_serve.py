"""``scrubnet serve`` on 127.0.0.1 at a free port: submit, status, receipts and their offline verification,
idempotency, tokens and roles, bad bodies, restart with queued requests, and the operator page in a real
headless Chromium."""
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason='scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
pytest.importorskip("cryptography", reason='receipts need the serve extra: pip install "scrubnet[serve]"')

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from scrubnet.cli import app  # noqa: E402
from scrubnet.cli.mlforget import mlforget_app  # noqa: E402
from scrubnet.experiments.checkpoints import ml_data_loader as _data_loader  # noqa: E402
from scrubnet.mlforget import store  # noqa: E402
from scrubnet.serve import receipts  # noqa: E402
from scrubnet.serve.app import create_app  # noqa: E402
from scrubnet.serve.auth import Token, resolve_token  # noqa: E402
from scrubnet.serve.http import HTTPError  # noqa: E402
from tests.hang_guard import HANG_GUARD_S  # noqa: E402

DATA = '{"num_samples": 1000, "n_train_per_class": 20, "n_test_per_class": 10, "forget_count": 2}'
TRAIN = '{"pretrain_epochs": 2, "max_epochs": 5}'
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
SUBMIT, READ, ADMIN, OTHER = ("submit-token-alice-0001", "read-token-auditor-0001", "admin-token-ops-000001",
                              "submit-token-bob-000001")
TOKENS = f"{SUBMIT} submit alice\n{READ} read auditor\n{ADMIN} admin ops\n{OTHER} submit bob\n"


def train_tiny_checkpoint(tmp_path_factory, name: str) -> Path:
    """A tiny ML-Forgetting checkpoint (``mlforget train`` on :data:`DATA` / :data:`TRAIN`) in a new folder."""
    out = tmp_path_factory.mktemp(name) / "ckpt"
    res = CliRunner().invoke(mlforget_app, ["train", "--out", str(out), "--data-options", DATA, "--train-options",
                                            TRAIN, "--model-options", '{"hidden": 16}'])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory, "serve")


def deletable(path, k, skip=0):
    rec = store.verify(path)
    static_core = set(store.load(path)[0].core_ids.tolist())
    users = store.load(path)[0].user_ids.tolist()
    done = set(rec["state"]["forgotten_ids"])
    return [i for i in users if i not in static_core and i not in done][skip:skip + k]


def row(ck, sub):
    """The store's row of a submission the API answered with (its ``id`` is opaque; its salt is unique)."""
    return next(s for s in store.submissions(ck, limit=1 << 40) if s["salt"] == sub["salt"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: a guard against a hang only, never a measure of speed (the suite's one guard, tests/hang_guard.py): every wait
#: below polls for an event — an answer, a row, a head — and only gives up after this long
HANG_S = float(HANG_GUARD_S)
#: every server a test started and has not stopped (tests/serve/conftest.py stops any left at the session's end)
LIVE: set = set()


def until(condition, what: str, every: float = 0.1):
    """Poll ``condition()`` until it is truthy and return its value; ``AssertionError`` naming ``what`` after
    :data:`HANG_S` (a hang, not slowness)."""
    end = time.monotonic() + HANG_S
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not after {HANG_S:g} s (a hang)")
        time.sleep(every)


class Server:
    """``scrubnet serve`` in a subprocess on 127.0.0.1, in a process group of its own (stopped as a group, so a
    witness command it started goes too); its output goes to a file (a pipe nobody reads could fill and block
    it). A server that fails to start is stopped before the error is raised."""

    def __init__(self, ckpt, tmp, extra=(), env=None):
        self.ckpt, self.port = Path(ckpt), free_port()
        self.tokens = Path(tmp) / "tokens.txt"
        self.tokens.write_text(TOKENS)
        os.chmod(self.tokens, 0o600)
        # the signing key apart from the data, one per test directory (created on first start)
        self.key = Path(tmp) / "signing-key.pem"
        self.pub = self.key.with_suffix(".pub")
        key_args = () if "--key" in extra else ("--key", str(self.key))
        self.log = Path(tmp) / f"server-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "scrubnet.cli", "serve", str(ckpt), "--tokens",
                                          str(self.tokens), "--port", str(self.port), *key_args, *extra],
                                         stdout=out, stderr=subprocess.STDOUT, env=env or ENV,
                                         start_new_session=True)
        LIVE.add(self)
        try:
            until(self._answers, "the server answering GET /v1/key", every=0.2)
        except BaseException:
            self.stop(kill=True)
            raise

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited: {self.output_text()}")
        try:
            self.call("GET", "/v1/key")
            return True
        except OSError:
            return False

    def output_text(self) -> str:
        """What the server printed so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    def call(self, method, url, body=None, token=None, key=None, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{url}", data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if key:
            req.add_header("Idempotency-Key", key)
        try:
            with urllib.request.urlopen(req, timeout=HANG_S) as r:
                payload = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            payload, status = e.read(), e.code
        try:
            return status, json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return status, payload

    def wait(self, sid, token=SUBMIT):
        """The submission once it is no longer queued (and, applied, has its receipt)."""
        def done():
            code, out = self.call("GET", f"/v1/requests/{sid}", token=token)
            assert code == 200, out
            return out if out["status"] != "queued" and (out["status"] != "applied" or out["receipt"]) else None
        return until(done, f"request {sid} applied or refused")

    def stop(self, kill=False):
        """SIGTERM (SIGKILL with ``kill``) to the server's process group, then reap it; SIGKILL when SIGTERM is
        not enough (a guard against a hang)."""
        try:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=HANG_S)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            try:  # whatever the server started in its group (a witness command) goes with it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        finally:
            LIVE.discard(self)


@pytest.fixture(scope="module")
def server(base_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    ck = tmp / "ckpt"
    shutil.copytree(base_ckpt, ck)
    srv = Server(ck, tmp, extra=("--max-body", "4096"))
    yield srv
    srv.stop()


def verify_cli(*args):
    r = CliRunner().invoke(app, ["receipt", "verify", *map(str, args)])
    return r.exit_code, r.output


def test_submit_status_receipt_and_offline_verification(server, tmp_path):
    ids = deletable(server.ckpt, 2)
    code, out = server.call("POST", "/v1/requests", {"ids": ids}, token=SUBMIT, key="first")
    assert code == 202 and out["status"] == "queued" and out["ids"] == sorted(ids) and len(out["salt"]) == 32
    done = server.wait(out["id"])
    assert done["status"] == "applied" and done["reason"] is None
    rec = done["receipt"]
    # the receipt states what the store committed
    req, link, prev_link = store.request_with_link(server.ckpt, done["request_id"])
    assert (rec["sha256_before"], rec["sha256_after"], rec["record_hash"], rec["previous_record_hash"]) == \
        (req["sha256_before"], req["sha256_after"], link, prev_link)
    # the solver's figures without the count of other tenants' samples; the verdict with the certificate's numbers
    assert rec["solver"] == {k: v for k, v in req["solver"].items() if k != "n_remaining"}
    assert "n_remaining" in req["solver"] and "n_remaining" not in json.dumps(rec) and "submission_id" not in rec
    assert rec["sigma"] == req["sigma"] and rec["n_ids"] == 2
    assert rec["verdict"]["verdict"] == "exact" and rec["verdict"]["sigma"] == req["sigma"]
    assert rec["verdict"]["kl_bound_nats"] == rec["remaining_information_bound_nats"]
    assert rec["verdict"]["relative_residual"] == req["solver"]["relative_residual"]
    assert rec["ids_sha256"] == receipts.ids_sha256(ids, out["salt"]) and "ids" not in rec  # no id in clear
    assert store.verify(server.ckpt)["valid"]
    # offline verification: the key from GET /v1/key, the weights from GET /v1/model/weights
    code, pem = server.call("GET", "/v1/key?format=pem")
    key = tmp_path / "key.pub"
    key.write_bytes(pem)
    code, model = server.call("GET", "/v1/model", token=READ)
    assert code == 200 and model["sha256"] == rec["sha256_after"]
    code, weights = server.call("GET", "/v1/model/weights", token=READ)
    wfile = tmp_path / "w.safetensors"
    wfile.write_bytes(weights)
    rfile = tmp_path / "receipt.json"
    rfile.write_text(json.dumps(rec))
    code, text = verify_cli(rfile, "--key", key, "--weights", wfile, "--ids", ",".join(map(str, ids)), "--salt",
                            out["salt"])
    assert code == 0 and "verifies" in text, text
    # tampered receipts: any field
    for field, value in [("sigma", 1.0), ("sha256_after", "0" * 64), ("n_ids", 3), ("previous_receipt_sha256", "x"),
                         ("solver", {**rec["solver"], "relative_residual": 0.0}),
                         ("verdict", {**rec["verdict"], "verdict": "exact", "kl_bound_nats": 0.0})]:
        bad = tmp_path / f"bad_{field}.json"
        bad.write_text(json.dumps({**rec, field: value}))
        code, text = verify_cli(bad, "--key", key)
        assert code == 2 and "signature" in text, (field, text)
    # wrong key
    other = tmp_path / "other.pub"
    other.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    code, text = verify_cli(rfile, "--key", other)
    assert code == 2 and "key:" in text and "signature" in text
    # wrong weights: the weights one byte off
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
    code, text = verify_cli(rfile, "--key", key, "--weights", wrong)
    assert code == 2 and "weights:" in text
    # someone else's ids, or the wrong salt
    code, text = verify_cli(rfile, "--key", key, "--ids", str(deletable(server.ckpt, 1)[0]), "--salt", out["salt"])
    assert code == 2 and "ids:" in text
    code, text = verify_cli(rfile, "--key", key, "--ids", ",".join(map(str, ids)), "--salt", "00" * 16)
    assert code == 2 and "ids:" in text
    # a second request chains to the first receipt
    code, out2 = server.call("POST", "/v1/requests", {"ids": deletable(server.ckpt, 1), "sigma": 0.01},
                             token=SUBMIT, key="second")
    rec2 = server.wait(out2["id"])["receipt"]
    assert rec2["previous_receipt_sha256"] == receipts.receipt_sha256(rec)
    r2 = tmp_path / "r2.json"
    r2.write_text(json.dumps(rec2))
    assert verify_cli(r2, "--key", key, "--previous", rfile)[0] == 0
    code, text = verify_cli(r2, "--key", key, "--previous", tmp_path / "bad_sigma.json")
    assert code == 2 and "chain:" in text
    code, text = verify_cli(tmp_path / "missing.json", "--key", key)
    assert code == 2 and text.startswith("error: receipt not found")


def test_idempotency_key_returns_the_first_result(server):
    ids = deletable(server.ckpt, 1, skip=3)
    code, a = server.call("POST", "/v1/requests", {"ids": ids}, token=SUBMIT, key="idem-1")
    code2, b = server.call("POST", "/v1/requests", {"ids": ids}, token=SUBMIT, key="idem-1")
    assert code == 202 and code2 in (200, 202) and b["id"] == a["id"] and b["replayed"] and b["salt"] == a["salt"]
    server.wait(a["id"])
    code, c = server.call("POST", "/v1/requests", {"ids": ids}, token=SUBMIT, key="idem-1")
    assert code == 200 and c["id"] == a["id"] and c["status"] == "applied" and c["receipt"]
    code, d = server.call("POST", "/v1/requests", {"ids": deletable(server.ckpt, 1)}, token=SUBMIT, key="idem-1")
    assert code == 422 and "Idempotency-Key" in d["error"]
    forgets = [r for r in store.requests(server.ckpt) if r["kind"] == "forget" and r["ids"] == sorted(ids)]
    assert len(forgets) == 1  # applied once


def test_tokens_and_roles(server):
    ids = deletable(server.ckpt, 1, skip=5)
    assert server.call("POST", "/v1/requests", {"ids": ids}, key="r1")[0] == 401
    assert server.call("POST", "/v1/requests", {"ids": ids}, token="not-a-token-at-all", key="r1")[0] == 401
    code, out = server.call("POST", "/v1/requests", {"ids": ids}, token=READ, key="r1")
    assert code == 403 and "submit" in out["error"]
    assert server.call("GET", "/v1/model", token=SUBMIT)[0] == 403
    assert server.call("GET", "/v1/model/weights", token=SUBMIT)[0] == 403
    assert server.call("GET", "/v1/log")[0] == 401
    code, out = server.call("POST", "/v1/requests", {"kind": "forget_all"}, token=SUBMIT, key="r2")
    assert code == 403 and "admin" in out["error"]
    code, sub = server.call("POST", "/v1/requests", {"ids": ids}, token=SUBMIT, key="r3")
    assert code == 202
    code, out = server.call("GET", f"/v1/requests/{sub['id']}", token=OTHER)
    assert code == 404  # another submitter may not read it: the answer of an unknown id
    code, out = server.call("GET", f"/v1/requests/{sub['id']}", token=READ)
    assert code == 200 and "ids" not in out and "salt" not in out  # a reader sees no ids
    code, out = server.call("GET", f"/v1/requests/{sub['id']}", token=ADMIN)
    assert code == 200 and out["ids"] == ids
    assert server.call("GET", "/v1/requests/999999", token=READ)[0] == 404
    assert server.call("GET", "/v1/key")[0] == 200  # public


def test_bad_bodies_are_refused(server):
    core = store.load(server.ckpt)[0].core_ids.tolist()
    forgotten = store.verify(server.ckpt)["state"]["forgotten_ids"]
    cases = [(b"not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'{"ids": "3"}', "JSON list"),
             (b'{"ids": [3.5]}', "not an integer"), (b'{"ids": [true]}', "not an integer"),
             (b'{"ids": ["7"]}', "not an integer"), (b'{"ids": []}', "empty"), (b'{}', "ids is required"),
             (json.dumps({"ids": [core[0]]}).encode(), "core data"), (b'{"ids": [999999]}', "not user data"),
             (json.dumps({"ids": forgotten[:1]}).encode(), "already forgotten"),
             (b'{"ids": [2], "sigma": -1}', "sigma"), (b'{"ids": [2], "sigma": NaN}', "sigma"),
             (b'{"ids": [2], "salt": "xyz"}', "salt"), (b'{"ids": [2], "extra": 1}', "unknown field"),
             (b'{"ids": [2, 2]}', "duplicated"), (b'{"kind": "delete"}', "kind")]
    before = [s["id"] for s in store.submissions(server.ckpt)]
    for raw, needle in cases:
        code, out = server.call("POST", "/v1/requests", token=ADMIN, key="bad", raw=raw)
        assert code == 422 and needle in out["error"], (raw, out)
    code, out = server.call("POST", "/v1/requests", {"ids": deletable(server.ckpt, 1)}, token=SUBMIT)
    assert code == 422 and "Idempotency-Key" in out["error"]
    code, out = server.call("POST", "/v1/requests", token=SUBMIT, key="big",
                            raw=json.dumps({"ids": list(range(2000))}).encode())
    assert code == 413
    assert [s["id"] for s in store.submissions(server.ckpt)] == before  # nothing queued


def test_a_duplicate_queued_request_is_refused_with_its_reason(base_ckpt, tmp_path):
    """Two submissions of the same ids (different keys) queued before either is applied: the first is
    applied, the second refused naming the first; the store holds one request."""
    ck = tmp_path / "ck"
    shutil.copytree(base_ckpt, ck)
    ids = deletable(ck, 2)
    a, _ = store.submit(ck, "a", "forget", ids, None, "h", "00" * 16, "alice")
    b, _ = store.submit(ck, "b", "forget", ids, None, "h", "00" * 16, "bob")
    c, _ = store.submit(ck, "c", "forget", [ids[0], deletable(ck, 1, skip=5)[0]], None, "h", "00" * 16, "carol")
    assert [store.apply_submission(ck, s["id"], _data_loader)["status"] for s in (a, b, c)] == \
        ["applied", "refused", "refused"]
    # one reason for both, naming no id and no other request: a submitter learns nothing of others' requests
    assert store.submission(ck, b["id"])["reason"] == store.submission(ck, c["id"])["reason"] == store.REFUSED
    assert [r["kind"] for r in store.requests(ck)] == ["train", "forget"]


def test_restart_resumes_queued_requests(base_ckpt, tmp_path, servers):
    ck = tmp_path / "ck"
    shutil.copytree(base_ckpt, ck)
    # the worker stops right after committing the first request, before signing its receipt
    srv = servers(ck, tmp_path, env={**ENV, store.PAUSE_ENV: "after_commit"})
    id_sets = [deletable(ck, 1, skip=k) for k in range(3)]
    subs = [srv.call("POST", "/v1/requests", {"ids": s}, token=SUBMIT, key=f"q{k}")[1]
            for k, s in enumerate(id_sets)]
    assert all(s["status"] == "queued" for s in subs)
    until(lambda: row(ck, subs[0])["status"] == "applied", "the first request committed")
    assert [row(ck, s)["status"] for s in subs] == ["applied", "queued", "queued"]
    assert row(ck, subs[0])["receipt"] is None
    assert all(re.fullmatch("s[0-9a-f]{24}", s["id"]) for s in subs)  # opaque: no counter of anyone's requests
    srv.stop(kill=True)
    srv = servers(ck, tmp_path)
    done = [srv.wait(s["id"]) for s in subs]
    srv.stop()
    assert [d["status"] for d in done] == ["applied"] * 3
    assert [d["request_id"] for d in done] == [1, 2, 3]
    rec = store.verify(ck)
    assert rec["valid"] and [r["ids"] for r in rec["requests"][1:]] == [sorted(s) for s in id_sets]
    key = receipts.load_public_key(srv.pub)
    prev = None
    for d, s in zip(done, subs):
        assert receipts.verify_receipt(d["receipt"], key, ids=s["ids"], salt=s["salt"], previous=prev) == []
        prev = d["receipt"]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_operator_page_in_a_headless_browser(server, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium found (install Debian's chromium package: apt-get install -y chromium)")
    code, sub = server.call("POST", "/v1/requests", {"ids": deletable(server.ckpt, 1)}, token=SUBMIT, key="page")
    server.wait(sub["id"])
    url = f"http://127.0.0.1:{server.port}/operator#token={READ}"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000"]
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=HANG_S).stdout
    assert 'data-loaded="yes"' in dom, dom[-2000:]
    model = server.call("GET", "/v1/model", token=READ)[1]
    assert f'<code id="model-sha">{model["sha256"]}</code>' in dom
    assert '<strong id="chain-status" class="ok">valid</strong>' in dom
    subs = store.submissions(server.ckpt)
    assert dom.count('<tr class="row-') == len(subs)
    assert dom.count('class="row-applied"') == sum(s["status"] == "applied" for s in subs) >= 1
    assert f'href="/v1/requests/{sub["id"]}"' in dom
    shot = tmp_path / "operator.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,800", url], capture_output=True,
                   timeout=HANG_S)
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a wrong token: the page says so
    dom = subprocess.run(flags + ["--dump-dom", f"http://127.0.0.1:{server.port}/operator#token=wrong"],
                         capture_output=True, text=True, timeout=HANG_S).stdout
    assert "error: unknown bearer token" in dom


def test_serve_refuses_bad_options_before_binding(base_ckpt, tmp_path):
    tokens = tmp_path / "tokens.txt"
    for text, needle in [("short submit\n", "at least 16 characters"), (f"{SUBMIT} delete x\n", "roles must be"),
                         (f"{SUBMIT} submit a\n{SUBMIT} read b\n", "listed twice"), ("# nothing\n", "no tokens"),
                         (f"{SUBMIT}\n", "TOKEN ROLES")]:
        tokens.write_text(text)
        r = CliRunner().invoke(app, ["serve", str(base_ckpt), "--tokens", str(tokens)])
        assert r.exit_code == 2 and r.output.startswith("error:") and needle in r.output, (text, r.output)
    tokens.write_text(TOKENS)
    for args, needle in [(["--host", "localhost"], "not an IP address"), (["--port", "0"], "--port"),
                         (["--max-body", "10"], "--max-body")]:
        r = CliRunner().invoke(app, ["serve", str(base_ckpt), "--tokens", str(tokens), *args])
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
    r = CliRunner().invoke(app, ["serve", str(tmp_path / "none"), "--tokens", str(tokens)])
    assert r.exit_code == 2 and "not found" in r.output
    r = CliRunner().invoke(app, ["serve", str(base_ckpt), "--tokens", str(tmp_path / "none.txt")])
    assert r.exit_code == 2 and "--tokens" in r.output
    assert not (base_ckpt / "receipt-key.pem").exists()  # nothing written before the options are checked


def test_the_token_dependency_resolves_identities_and_refuses():
    tokens = {SUBMIT: Token("alice", frozenset({"submit"})), ADMIN: Token("ops", frozenset({"admin"}))}
    assert resolve_token({"authorization": f"Bearer {SUBMIT}"}, tokens, "submit").name == "alice"
    assert resolve_token({"authorization": f"bearer  {ADMIN} "}, tokens, "read").name == "ops"  # admin: every role
    for headers, role, status, needle in [({}, None, 401, "missing bearer token"),
                                          ({"authorization": f"Basic {SUBMIT}"}, None, 401, "missing bearer"),
                                          ({"authorization": "Bearer not-a-known-token-000"}, None, 401, "unknown"),
                                          ({"authorization": f"Bearer {SUBMIT}"}, "read", 403, "lacks the read")]:
        with pytest.raises(HTTPError) as e:
            resolve_token(headers, tokens, role)
        assert e.value.status == status and needle in e.value.message, headers
        assert (e.value.headers == {"WWW-Authenticate": "Bearer"}) == (status == 401)


def test_serving_a_store_of_the_previous_format_needs_upgrade_and_writes_nothing(base_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(base_ckpt, ck)
    con = sqlite3.connect(str(ck / store.DB))
    for table in ("requests", "state"):
        for col in ("digests", "hash"):
            con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    con.execute("DELETE FROM checkpoint WHERE key = ?", (store.SEAL_KEY,))
    con.execute("UPDATE checkpoint SET value = ? WHERE key = 'format'", (json.dumps(store.FORMAT_UNSEALED),))
    con.commit()
    con.close()
    before = (ck / store.DB).read_bytes()
    with pytest.raises(store.StoreError, match=f"run `scrubnet mlforget upgrade {ck}`"):
        create_app(ck, {}, Ed25519PrivateKey.generate(), _data_loader, start_worker=False)
    assert (ck / store.DB).read_bytes() == before
    assert store.upgrade(ck)["upgraded"]
    app_ = create_app(ck, {}, Ed25519PrivateKey.generate(), _data_loader, start_worker=False)
    assert app_.state.service.path == ck and not app_.state.worker.is_alive()
