"""Trust in ``scrubnet serve``, over HTTP against a running server: tenants kept apart (idempotency keys scoped
to the submitter, no secret shown to another role, unique token identities), a record that cannot be re-sealed
(signed receipts and head checked by verify, show, serve start-up and the running worker), and robust edges
(deep JSON, a busy port, file modes)."""
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("starlette", reason='scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
pytest.importorskip("cryptography", reason='receipts need the serve extra: pip install "scrubnet[serve]"')

from typer.testing import CliRunner  # noqa: E402

from scrubnet.cli import app  # noqa: E402
from scrubnet.cli.mlforget import mlforget_app  # noqa: E402
from scrubnet.mlforget import store  # noqa: E402
from scrubnet.mlforget.store.chain import _seal_all  # noqa: E402
from scrubnet.serve import anchor  # noqa: E402
from scrubnet.serve.auth import read_tokens, token_name  # noqa: E402
from test_serve import ENV, HANG_S, Server, _chromium, deletable, row, train_tiny_checkpoint, until  # noqa: E402,E501

ALICE, BOB, CAROL, READER, OPS = ("alice-submit-token-0001", "bob-submit-token-000001", "carol-submit-token-00001",
                                  "reader-read-token-000001", "ops-admin-token-00000001")
TOKENS = (f"{ALICE} submit alice\n{BOB} submit bob\n{CAROL} submit carol\n{READER} read auditor\n"
          f"{OPS} admin ops\n")


class TrustServer(Server):
    """The suite's server with this module's tokens (mode 0600)."""

    def __init__(self, ckpt, tmp, extra=(), env=None):
        import test_serve
        old = test_serve.TOKENS
        test_serve.TOKENS = TOKENS
        try:
            super().__init__(ckpt, tmp, extra, env)
        finally:
            test_serve.TOKENS = old

    def output(self):
        self.stop()
        return self.output_text()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory, "trust")


@pytest.fixture(scope="module")
def served(base, tmp_path_factory):
    """A server on a copy of the checkpoint with one request of Alice applied (its receipt signed)."""
    tmp = tmp_path_factory.mktemp("served")
    ck = tmp / "ckpt"
    shutil.copytree(base, ck)
    srv = TrustServer(ck, tmp)
    try:
        ids = deletable(ck, 2)
        code, sub = srv.call("POST", "/v1/requests", {"ids": ids}, token=ALICE, key="alice-key-1")
        assert code == 202
        done = srv.wait(sub["id"], token=ALICE)
        assert done["status"] == "applied" and done["receipt"]
        _wait_for_head(ck, done["request_id"])
        srv.alice = {"ids": ids, "sub": sub, "done": done}
        yield srv
    finally:
        srv.stop()


def _wait_for_head(ck, rid):
    def covered():
        head = anchor.read_head(ck)
        return head and head["requests"][-1]["id"] >= rid and head["requests"][-1]["receipt_sha256"]
    until(covered, f"a signed head covering request #{rid}")


def _shape(code, out):
    """What an answer says, without the fields that differ between any two new submissions."""
    return code, sorted(out), out["status"], out["replayed"], out["receipt"], out["request_id"]


def test_replaying_another_tenants_idempotency_key_reveals_nothing(served):
    alice = served.alice
    right = served.call("POST", "/v1/requests", {"ids": alice["ids"]}, token=BOB, key="alice-key-1")
    wrong = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 2, skip=7)}, token=CAROL,
                        key="alice-key-1")
    assert _shape(*right) == _shape(*wrong) == (202, sorted(right[1]), "queued", False, None, None)
    for _, out in (right, wrong):
        assert out["id"] != alice["sub"]["id"] and out["salt"] != alice["sub"]["salt"]
        assert alice["sub"]["salt"] not in json.dumps(out)
    # Alice's own replay still finds her request
    code, mine = served.call("POST", "/v1/requests", {"ids": alice["ids"]}, token=ALICE, key="alice-key-1")
    assert code == 200 and mine["id"] == alice["sub"]["id"] and mine["replayed"]
    assert mine["idempotency_key"] == "alice-key-1" and mine["salt"] == alice["sub"]["salt"]
    # another submitter asking for her request: the answer of an unknown id
    sid = alice["sub"]["id"]
    assert served.call("GET", f"/v1/requests/{sid}", token=BOB) == (404, {"error": f"no request {sid}"})
    assert served.call("GET", "/v1/requests/s0123456789abcdef01234567", token=BOB) == \
        (404, {"error": "no request s0123456789abcdef01234567"})
    # the read and admin roles see neither her idempotency key nor her salt
    for token in (READER, OPS):
        code, log = served.call("GET", "/v1/log", token=token)
        text = json.dumps(log)
        assert code == 200 and "alice-key-1" not in text and alice["sub"]["salt"] not in text, token
        code, out = served.call("GET", f"/v1/requests/{sid}", token=token)
        assert code == 200 and "salt" not in out and "idempotency_key" not in out
        assert "alice-key-1" not in json.dumps(out)
    # σ applied is shown for every applied row (the checkpoint's default σ, not 'default')
    row = next(s for s in log["submissions"] if s["id"] == sid)
    assert row["sigma_applied"] == alice["done"]["receipt"]["sigma"] and row["sigma_applied"] is not None


def test_token_identities_are_unique_and_stable(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{ALICE} submit alice\n{BOB} submit alice\n")
    with pytest.raises(ValueError, match="line 2: the name 'alice' is already used on line 1"):
        read_tokens(tokens)
    os.chmod(tokens, 0o600)
    r = CliRunner().invoke(app, ["serve", str(tmp_path / "x"), "--tokens", str(tokens)])
    assert r.exit_code == 2 and r.output.startswith("error:") and "already used" in r.output
    # unnamed tokens are named by a hash of the token, not by their line
    tokens.write_text(f"{ALICE} submit\n{BOB} submit\n")
    first = {t: v.name for t, v in read_tokens(tokens).items()}
    tokens.write_text(f"# a comment\n\n{BOB} submit\n{ALICE} submit\n")
    assert {t: v.name for t, v in read_tokens(tokens).items()} == first == {ALICE: token_name(ALICE),
                                                                            BOB: token_name(BOB)}
    assert first[ALICE] != first[BOB]


def _forge(ck, rid, field, value):
    """Edit one field of request ``rid`` and re-seal the whole chain with the store's own sealing function."""
    con = sqlite3.connect(str(ck / store.DB), isolation_level=None)
    con.row_factory = sqlite3.Row
    con.execute("BEGIN IMMEDIATE")
    con.execute(f"UPDATE requests SET {field} = ? WHERE id = ?", (value, rid))
    _seal_all(con)
    con.execute("COMMIT")
    con.close()


def _copy(srv_ck, dest):
    """A consistent copy of a live checkpoint (the database through SQLite's backup)."""
    shutil.copytree(srv_ck, dest, ignore=shutil.ignore_patterns("store.sqlite*"))
    src, dst = sqlite3.connect(str(srv_ck / store.DB)), sqlite3.connect(str(dest / store.DB))
    src.backup(dst)
    src.close()
    dst.close()
    return dest


@pytest.mark.parametrize("rid, field, value, needle", [
    (1, "sigma", 123.0, "request #1: field 'sigma' disagrees with its signed receipt"),
    (1, "n_remaining", 1, "request #1: field 'n_remaining' differs from the signed head"),
    (0, "seconds", 0.5, "request #0: field 'seconds' differs from the signed head")])
def test_a_resealed_forged_row_fails_verify_show_and_serve_startup(served, tmp_path, rid, field, value, needle):
    ck = _copy(served.ckpt, tmp_path / "ck")
    assert anchor.verify(ck)["valid"]
    _forge(ck, rid, field, value)
    assert store.verify(ck)["valid"]  # the chain alone is fooled: the forger re-sealed it
    rec = anchor.verify(ck)
    assert not rec["valid"] and any(needle in p for p in rec["problems"]), rec["problems"]
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--key", str(served.pub)])
    assert r.exit_code == 2 and needle in r.output and "hash chain: BROKEN" in r.output, r.output
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    p = subprocess.run([sys.executable, "-m", "scrubnet.cli", "serve", str(ck), "--tokens", str(tokens), "--port",
                        "9", "--key", str(served.key)], capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert p.returncode == 2 and p.stderr.startswith("error:") and needle in p.stderr, p.stderr
    assert "serving" not in p.stdout and "Traceback" not in p.stderr


def test_deleting_a_receipt_or_the_signed_head_is_noticed(served, tmp_path):
    ck = _copy(served.ckpt, tmp_path / "ck")
    con = sqlite3.connect(str(ck / store.DB))
    con.execute("UPDATE submissions SET receipt = NULL")  # the worker would re-sign the record as it stands
    con.commit()
    con.close()
    rec = anchor.verify(ck)
    assert not rec["valid"] and any("signed receipt is no longer in the store" in p for p in rec["problems"])
    head = json.loads((ck / anchor.HEAD).read_text())
    head["requests"][0]["link"] = "0" * 64
    (ck / anchor.HEAD).write_text(json.dumps(head))
    assert any("the head file was altered" in p for p in anchor.verify(ck)["problems"])


def test_nested_json_is_refused_without_a_traceback(base, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    srv = TrustServer(ck, tmp_path)
    try:
        for raw in (b"[" * 100_000, b'{"ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                    b'{"ids": ' + b"[" * 17 + b"1" + b"]" * 17 + b"}"):
            code, out = srv.call("POST", "/v1/requests", token=ALICE, key="deep", raw=raw)
            assert code == 422 and "nested more than 16 levels" in out["error"], (raw[:20], out)
        code, out = srv.call("POST", "/v1/requests", token=ALICE, key="deep", raw=b'{"ids": [[1]]}')
        assert code == 422 and "not an integer" in out["error"]  # shallow: the usual check
        code, out = srv.call("POST", "/v1/requests", token=ALICE, key="brackets",
                             raw=json.dumps({"ids": deletable(ck, 1), "salt": None, "kind": "forget"}).encode())
        assert code == 202
    finally:
        log = srv.output()
    assert "Traceback" not in log and "RecursionError" not in log, log[-2000:]


def test_busy_port_and_file_modes_are_refused_before_serving(base, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o666)
    r = CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens)])
    assert r.exit_code == 2 and "mode 0666" in r.output and "others may add a token" in r.output, r.output
    os.chmod(tokens, 0o600)
    key = tmp_path / "k.pem"
    from scrubnet.serve import receipts
    receipts.write_key_pair(key, tmp_path / "k.pub")
    os.chmod(key, 0o644)
    r = CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens), "--key", str(key)])
    assert r.exit_code == 2 and "must be private" in r.output and "chmod 600" in r.output, r.output
    os.chmod(key, 0o600)
    os.chmod(ck / store.DB, 0o666)
    r = CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens), "--key", str(key)])
    assert r.exit_code == 2 and "others may edit the record" in r.output, r.output
    os.chmod(ck / store.DB, 0o644)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "scrubnet.cli", "serve", str(ck), "--tokens", str(tokens),
                            "--key", str(key), "--port", str(port)], capture_output=True, text=True, env=ENV,
                           timeout=HANG_S)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "serving" not in p.stdout, (p.stdout, p.stderr)
    assert [ln for ln in lines if not ln.startswith("warning:")] == \
        [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], lines
    assert any("store.sqlite has mode 0644" in ln and "read every submitter" in ln for ln in lines)


def test_operator_page_shows_receipts_with_its_token_and_the_sigma_applied(served, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium found (install Debian's chromium package: apt-get install -y chromium)")
    sid = served.alice["sub"]["id"]
    url = f"http://127.0.0.1:{served.port}/operator#token={READER}&receipt={sid}"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000"]
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=HANG_S).stdout
    assert 'data-loaded="yes"' in dom and served.alice["done"]["receipt"]["signature"] in dom, dom[-2000:]
    assert f"<td>{served.alice['done']['receipt']['sigma']}</td>" in dom and "<td>default</td>" not in dom


def test_a_worker_stops_when_the_record_breaks_under_it(served):
    """Last in the module: it halts the module's server."""
    until(lambda: store.oldest_queued(served.ckpt) is None, "the queue drained")
    before = (store.requests(served.ckpt), store.submissions(served.ckpt))
    _forge(served.ckpt, 1, "sigma", 7.0)
    # the re-sealed chain changed the link of the last request the service signed: the POST's own check
    # refuses it before anything is queued, and the worker is halted
    code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=11)}, token=ALICE,
                            key="after-forgery")
    assert code == 503 and "is not the one this service signed" in out["error"], out
    log = served.call("GET", "/v1/log", token=READER)[1]
    assert log["worker_halted"] and not log["chain"]["valid"]
    assert any("field 'sigma' disagrees with its signed receipt" in p for p in log["chain"]["problems"])
    assert [r["id"] for r in store.requests(served.ckpt)] == [r["id"] for r in before[0]]  # nothing applied
    assert [s["receipt"] for s in store.submissions(served.ckpt)] == [s["receipt"] for s in before[1]]
    assert len(store.submissions(served.ckpt)) == len(before[1])  # nothing queued
    code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=12)}, token=ALICE,
                            key="after-halt")
    assert code == 503 and "does not verify" in out["error"]
