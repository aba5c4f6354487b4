"""A record that fails closed, over HTTP against a live ``scrubnet serve``: a restored checkpoint against a lost
witness is refused at start, a restore under a running server halts it before anything is applied or served,
retired keys are pinned to the last tree size they signed, one client cannot hold the server's connections,
and a receipt's tree head is served before the receipt is."""
import asyncio
import json
import os
import shlex
import shutil
import socket
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason='scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
pytest.importorskip("cryptography", reason='receipts need the serve extra: pip install "scrubnet[serve]"')

from starlette.requests import Request  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from scrubnet.cli import app  # noqa: E402
from scrubnet.experiments.checkpoints import ml_data_loader  # noqa: E402
from scrubnet.mlforget import store  # noqa: E402
from scrubnet.serve import anchor, merkle, receipts, startup, tlog  # noqa: E402
from scrubnet.serve.app import create_app  # noqa: E402
from scrubnet.serve.auth import Token  # noqa: E402
from scrubnet.serve.limits import Limits  # noqa: E402
from scrubnet.serve.routes.model import get_model  # noqa: E402
from test_serve import HANG_S, deletable, row, train_tiny_checkpoint, until  # noqa: E402
from test_trust import ALICE, BOB, CAROL, OPS, READER, TOKENS, TrustServer, _copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WITNESS_CMD = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tests' / 'serve' / 'witness_cmd.py'))}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory, "closed")


def _apply(srv, token, key, skip):
    """One request applied through the server; returns the GET answer with its receipt."""
    code, sub = srv.call("POST", "/v1/requests", {"ids": deletable(srv.ckpt, 1, skip=skip)}, token=token, key=key)
    assert code == 202, sub
    done = srv.wait(sub["id"], token=token)
    assert done["status"] == "applied", done
    size = done["request_id"] + 1
    until(lambda: (anchor.read_head(srv.ckpt) or {}).get("tree_head", {}).get("tree_size", 0) >= size,
          "the signed head covering the request")
    return done


@pytest.fixture(scope="module")
def served(base, tmp_path_factory):
    """A server with a file witness: Alice's request applied, a backup of the whole checkpoint, Bob's applied."""
    tmp = tmp_path_factory.mktemp("closed-served")
    (tmp / "keys").mkdir(mode=0o700)
    ck = tmp / "ckpt"
    shutil.copytree(base, ck)
    srv = TrustServer(ck, tmp, extra=("--witness", str(tmp / "keys" / "witness.json"), "--verify-every", "3600"))
    try:
        srv.tmp, srv.witness = tmp, tmp / "keys" / "witness.json"
        srv.alice = _apply(srv, ALICE, "alice-1", 0)
        srv.backup = _copy(ck, tmp / "backup")
        srv.bob = _apply(srv, BOB, "bob-1", 3)
        yield srv
    finally:
        srv.stop()


def _serve_cli(ck, tmp, key, *extra):
    tokens = Path(tmp) / "tokens.txt"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    return CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens), "--key", str(key), "--port", "9",
                                    *map(str, extra)])


def _one_error_line(r):
    lines = [ln for ln in r.output.strip().splitlines() if not ln.startswith("warning:")]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert "serving" not in r.output and "Traceback" not in r.output
    return lines[0]


def test_a_restore_against_a_lost_witness_is_refused_at_start(served, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(served.backup, ck)
    (tmp_path / "w").mkdir(mode=0o700)
    w = tmp_path / "w" / "witness.json"
    for state, content in (("missing", None), ("empty", b""), ("null", b'{"format": "scrubnet-witness/1", '
                                                                       b'"tree_head": null}'), ("null", b"null")):
        w.unlink(missing_ok=True)
        if content is not None:
            w.write_bytes(content)
        line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", w))
        assert f"holds no tree head ({state})" in line and "shows its log was published" in line, line
        assert "--witness-init" in line
    # a witness command that prints nothing (it never published), that fails, or that hangs
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness-cmd", f"{WITNESS_CMD} {tmp_path / 'none'}"))
    assert "holds no tree head (empty)" in line, line
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness-cmd",
                                      f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(\"no witness\")'"))
    assert "exited 1: no witness" in line, line
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness-timeout", "1", "--witness-cmd",
                                      f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(3600)'"))
    assert "no answer within 1 s" in line, line
    # the real witness still refuses the restored copy; --witness-init is refused on a witness that holds a head
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", served.witness))
    assert "fewer than the 3 of the head its witness holds" in line, line
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", served.witness, "--witness-init"))
    assert "refusing --witness-init" in line, line
    # a genuinely new witness: --witness-init starts (logged) and gives it the checkpoint's head at once
    w.unlink()
    app_ = create_app(ck, {}, receipts.load_private_key(served.key), ml_data_loader, start_worker=False,
                      witness=tlog.Witness(path=w), witness_init=True)
    assert any("--witness-init" in x and "held no tree head (missing)" in x for x in app_.state.warnings)
    assert tlog.Witness(path=w).latest() == anchor.read_head(ck)["tree_head"]
    assert tlog.Witness(path=w).latest()["tree_size"] == 2



def test_witness_and_checkpoint_operator_errors_are_refused_like_the_key(served, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    shutil.copytree(served.backup, ck)
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", ck / "witness.json"))
    assert "lies inside the checkpoint" in line, line
    (tmp_path / "w").mkdir(mode=0o700)
    w = tmp_path / "w" / "witness.json"
    shutil.copy(served.witness, w)
    os.chmod(w, 0o666)
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", w))
    assert "has mode 0666" in line and "chmod go-w" in line, line
    os.chmod(w, 0o600)
    os.chmod(tmp_path / "w", 0o777)
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", w))
    assert "its directory" in line and "mode 0777" in line, line
    os.chmod(tmp_path / "w", 0o700)
    # a read-only checkpoint: refused at start with one line (simulated: the tests run as root, for whom modes
    # forbid nothing; os.access answers False on a read-only mount for root too)
    monkeypatch.setattr(startup, "os", types.SimpleNamespace(name=os.name, access=lambda p, mode: False,
                                                             W_OK=os.W_OK))
    line = _one_error_line(_serve_cli(ck, tmp_path, served.key, "--witness", w))
    assert "cannot be written" in line and "read-only" in line, line


def test_an_immediate_audit_never_reports_a_rollback(served, tmp_path):
    """The head a receipt names is served before the receipt is visible: audit at the first sight of it."""
    pub = tmp_path / "key.pub"
    shutil.copy(served.pub, pub)
    for k in range(3):
        code, sub = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=10 + k)}, token=CAROL,
                                key=f"carol-{k}")
        assert code == 202, sub
        done = served.wait(sub["id"], token=CAROL)  # returns as soon as the receipt is visible
        rfile = tmp_path / f"r{k}.json"
        rfile.write_text(json.dumps(done))
        r = CliRunner().invoke(app, ["receipt", "audit", str(rfile), "--key", str(pub), "--url",
                                     f"http://127.0.0.1:{served.port}"])
        assert r.exit_code == 0 and "extends the one in the receipt" in r.output, r.output


def _hog(port, n, source="127.0.0.2"):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def _reopen_closed(socks, port, source="127.0.0.2"):
    """Reopen every hog connection the server closed (the issue's attacker); returns how many."""
    import select
    n = 0
    for i, s in enumerate(socks):
        readable, _, _ = select.select([s], [], [], 0)
        if readable:
            try:
                closed = s.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                closed = True
            if closed:
                s.close()
                socks[i] = _hog(port, 1, source)[0]
                n += 1
    return n


def test_one_client_holding_300_idle_connections_does_not_lock_others_out(served):
    socks = _hog(served.port, 300)
    try:
        codes, reopened = [], 0
        for k in range(20):
            reopened += _reopen_closed(socks, served.port)
            codes.append(served.call("GET", "/v1/model", token=READER)[0])
        assert codes == [200] * 20, codes
        assert reopened > 0  # the server closed the hog's excess connections (and they were reopened)
        # a POST of another tenant is served too
        code, sub = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=20)}, token=OPS,
                                key="ops-during-hog")
        assert code == 202, sub
        assert served.wait(sub["id"], token=OPS)["status"] == "applied"
    finally:
        for s in socks:
            s.close()


def test_security_headers_on_the_page_and_every_answer(served):
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/operator", timeout=HANG_S) as r:
        h = r.headers
        page = r.read().decode()
    assert h["X-Content-Type-Options"] == "nosniff" and h["X-Frame-Options"] == "DENY"
    assert h["Referrer-Policy"] == "no-referrer" and h["Cache-Control"] == "no-store"
    csp = h["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
    import base64
    import hashlib
    import re
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    assert f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'" in csp
    with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/v1/key", timeout=HANG_S) as r:
        assert r.headers["X-Content-Type-Options"] == "nosniff"


def test_reads_are_rate_limited_per_tenant(served):
    """The read bucket in the route's decorator (called in process: a tiny rate, no clock in the test)."""
    served_app = create_app(served.backup, {ALICE: Token("alice", frozenset({"read"})),
                                                      BOB: Token("bob", frozenset({"read"}))},
                                      receipts.load_private_key(served.key), ml_data_loader, start_worker=False,
                                      limits=Limits(read_rate=1e-9, read_burst=2))

    def get(token):
        scope = {"type": "http", "method": "GET", "path": "/v1/model", "headers": [
            (b"authorization", f"Bearer {token}".encode())], "app": served_app, "query_string": b""}
        return asyncio.run(get_model(Request(scope))).status_code
    assert [get(ALICE) for _ in range(3)] == [200, 200, 429]
    assert get(BOB) == 200  # another tenant is not held back
    lim = Limits(read_rate=2.0, read_burst=1)
    assert lim.admit_read("a", now=0.0) is None and lim.admit_read("a", now=0.0) == pytest.approx(0.5)
    assert lim.admit("a", now=0.0) is None  # reads never use up POSTs


def test_a_rotated_key_is_pinned_and_old_receipts_audit(served, tmp_path, servers):
    """Rotate the key: every receipt handed out before audits with --retired-key; a head the retired key signs
    past the size it had signed when retired is refused (by the running worker, by verify, by audit)."""
    until(lambda: store.oldest_queued(served.ckpt) is None and not store.applied_without_receipt(served.ckpt),
          "the queue drained")
    n = store.state_record(served.ckpt)["request_id"] + 1
    until(lambda: anchor.read_head(served.ckpt)["tree_head"]["tree_size"] == n, "the head covering the log")
    ck = _copy(served.ckpt, tmp_path / "ckpt")
    (tmp_path / "keys").mkdir(mode=0o700)
    w = tmp_path / "keys" / "witness.json"
    shutil.copy(served.witness, w)
    new_key, new_pub = tmp_path / "keys" / "new.pem", tmp_path / "keys" / "new.pub"
    receipts.write_key_pair(new_key, new_pub)
    old, new = receipts.load_private_key(served.key), receipts.load_private_key(new_key)
    srv = servers(ck, tmp_path, cls=TrustServer, extra=("--key", str(new_key), "--retired-key", str(served.pub),
                                                        "--witness", str(w), "--verify-every", "3600"))
    code, key = srv.call("GET", "/v1/key")
    assert code == 200 and len(key["retired"]) == 1
    assert tlog.retired_pins(key["retired"], new.public_key()) == {tlog.fingerprint(old): n}  # recorded at rotation
    after = _apply(srv, ALICE, "after-rotation", 40)
    assert after["receipt"]["public_key"] == receipts.public_key_hex(new) and after["request_id"] == n
    assert tlog.retired_pins(tlog.Witness(path=w).read()[2], new.public_key()) == {tlog.fingerprint(old): n}
    assert tlog.retired_pins(anchor.read_head(ck)["retired_keys"], new.public_key()) == {tlog.fingerprint(old): n}
    # every receipt handed out before the rotation audits against the rotated service
    url = f"http://127.0.0.1:{srv.port}"
    for name, answer in (("alice", served.alice), ("bob", served.bob), ("after", after)):
        rfile = tmp_path / f"{name}.json"
        rfile.write_text(json.dumps(answer))
        r = CliRunner().invoke(app, ["receipt", "audit", str(rfile), "--key", str(new_pub), "--retired-key",
                                     str(served.pub), "--url", url])
        assert r.exit_code == 0 and "extends the one in the receipt" in r.output, (name, r.output)
    r = CliRunner().invoke(app, ["receipt", "audit", str(tmp_path / "bob.json"), "--key", str(new_pub), "--url", url])
    assert r.exit_code == 2 and "another key" in r.output, r.output  # without the retired key: not the pinned key
    # the retired key signs a head past its pin (a consistent one: the log as it is now)
    hashes = anchor.verify(ck, new.public_key(), [old.public_key()])["leaf_hashes"]
    forged = tlog.sign_tree_head(old, hashes)
    assert forged["tree_size"] == n + 1
    pins = {tlog.fingerprint(old): n}
    proof = [h.hex() for h in merkle.consistency_proof(served.bob["receipt"]["tree_head"]["tree_size"], hashes)]
    problems = tlog.audit(served.bob["receipt"], forged, proof, new.public_key(), [old.public_key()], pins)
    assert any("past the" in p and "retired" in p for p in problems), problems
    assert tlog.audit(served.bob["receipt"], forged, proof, new.public_key(), [old.public_key()], {}) != []
    # in the signed head of a copy (re-signed by the retired key, its statements kept): verify names it
    ck2 = _copy(ck, tmp_path / "ck2")
    head = anchor.read_head(ck2)
    anchor.sign_head(ck2, old, anchor.verify(ck2, new.public_key(), [old.public_key()]), forged,
                     head["retired_keys"])
    rec = anchor.verify(ck2, new.public_key(), [old.public_key()])
    assert any("signed by a retired key" in p and f"past the {n}" in p for p in rec["problems"]), rec["problems"]
    # in the witness of the running service: its worker refuses it before applying the next request
    tlog.Witness(path=w).publish(forged, tlog.Witness(path=w).read()[2])
    code, sub = srv.call("POST", "/v1/requests", {"ids": deletable(ck, 1, skip=41)}, token=BOB, key="past-pin")
    assert code == 202
    log = until(lambda: (lambda o: o if o["worker_halted"] else None)(srv.call("GET", "/v1/log", token=READER)[1]),
                "the worker halted")
    assert "signed by a retired key" in log["worker_error"] and f"past the {n}" in log["worker_error"]
    assert row(ck, sub)["status"] == "queued"


def test_a_restore_under_the_running_server_halts_it_before_anything_is_applied_or_served(served):
    """It halts the module's server: the tests after it use its files and key only, not the server."""
    until(lambda: store.oldest_queued(served.ckpt) is None, "the queue drained")
    shutil.rmtree(served.ckpt)
    shutil.copytree(served.backup, served.ckpt)  # the whole checkpoint, as a restore of a backup does
    before = (store.requests(served.ckpt), store.submissions(served.ckpt, limit=1 << 40))
    code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=30)}, token=BOB,
                            key="after-restore")
    assert code == 503 and "restored under the running service" in out["error"], out
    assert served.call("GET", "/v1/model", token=READER)[0] == 503  # the pre-deletion weights are not served
    assert served.call("GET", "/v1/model/weights", token=READER)[0] == 503
    assert served.call("GET", "/v1/log/head")[0] == 503  # nor the shrunk head
    log = served.call("GET", "/v1/log", token=READER)[1]
    assert log["worker_halted"] and "restored under the running service" in log["worker_error"]
    assert (store.requests(served.ckpt), store.submissions(served.ckpt, limit=1 << 40)) == before  # nothing applied


def test_a_checkpoint_never_served_starts_against_an_empty_witness(base, served, tmp_path):
    """Nothing was published (no signed head): an empty witness is what a first start looks like."""
    assert anchor.read_head(base) is None
    w = tmp_path / "witness.json"
    w.write_bytes(b"")
    app_ = create_app(base, {}, receipts.load_private_key(served.key), ml_data_loader, start_worker=False,
                      witness=tlog.Witness(path=w))
    assert app_.state.warnings == [] and not app_.state.worker.published


def test_the_routes_guard_refuses_a_fork_of_the_same_size(served, base, tmp_path):
    """Another copy with as many requests as the service signed, but another last request: the routes' cheap
    check (two reads of the store) halts the worker before anything is queued or served."""
    ck = tmp_path / "ck"
    shutil.copytree(served.backup, ck)  # Alice's request signed: a log of 2
    app_ = create_app(ck, {}, receipts.load_private_key(served.key), ml_data_loader, start_worker=False)
    worker = app_.state.worker
    assert worker.log_size == 2 and worker.signed_link[0] == 1
    worker.guard()  # the checkpoint it started on passes
    fork = tmp_path / "fork"  # the checkpoint as trained, then another request than Alice's: a log of 2 too
    shutil.copytree(base, fork)
    store.forget(fork, deletable(fork, 1, skip=50), sigma=None, data_loader=ml_data_loader)
    shutil.rmtree(ck)
    shutil.copytree(fork, ck)
    problems = worker.rollback_problems(anchor.verify(ck, receipts.load_private_key(served.key).public_key()))
    assert any("request #1 of the checkpoint is not the one this service signed" in p for p in problems)  # the worker
    with pytest.raises(RuntimeError, match="request #1 of the checkpoint is not the one this service signed"):
        worker.guard()  # the routes
    assert worker.halted


def test_the_worker_consults_the_witness_before_applying(served, tmp_path):
    """A witness emptied under the running service: the worker's pass (run here in the test's thread: one
    pass, then it halts) checks it before applying, and the queued request stays queued. Over HTTP the same
    check refuses a retired key's head in the witness (the rotation test below)."""
    ck = tmp_path / "ck"
    shutil.copytree(served.backup, ck)
    w = tlog.Witness(path=tmp_path / "witness.json")
    w.publish(anchor.read_head(ck)["tree_head"])
    worker = create_app(ck, {}, receipts.load_private_key(served.key), ml_data_loader, start_worker=False,
                        witness=w).state.worker
    assert worker.published and worker.log_size == 2
    sub, _ = store.submit(ck, "k", "forget", deletable(ck, 1, skip=5), None, "h", "00" * 16, "bob")
    w.path.write_bytes(b"")  # emptied under the running service
    worker.run()
    assert worker.halted and "holds no tree head any more (empty)" in "; ".join(worker.halted), worker.halted
    assert store.submission(ck, sub["id"])["status"] == "queued"  # nothing applied
    assert [r["id"] for r in store.requests(ck)] == [0, 1]

