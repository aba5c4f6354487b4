"""The transparency log of ``scrubnet serve`` (RFC 9162 Merkle tree, signed tree heads, a witness), the key kept
apart from the data, receipts anyone can verify (RFC 8785, a shell script with openssl, a second verifier written
here without the package's code), tenants who learn nothing, and the service's limits — over HTTP against a live
server where it matters."""
import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason='scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
pytest.importorskip("cryptography", reason='receipts need the serve extra: pip install "scrubnet[serve]"')

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from scrubnet.cli import app  # noqa: E402
from scrubnet.cli.mlforget import mlforget_app  # noqa: E402
from scrubnet.experiments.checkpoints import ml_data_loader  # noqa: E402
from scrubnet.mlforget import store  # noqa: E402
from scrubnet.serve import anchor, merkle, receipts, tlog  # noqa: E402
from scrubnet.serve.app import create_app  # noqa: E402
from scrubnet.serve.canonical import canonical, number  # noqa: E402
from scrubnet.serve.limits import Limits  # noqa: E402
from scrubnet.serve.worker import issue_receipts  # noqa: E402
from test_serve import ENV, HANG_S, deletable, train_tiny_checkpoint, until  # noqa: E402
from test_trust import ALICE, BOB, CAROL, OPS, READER, TOKENS, TrustServer, _copy, _forge  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# --- the Merkle tree and the canonical form against references written here ---------------------------------

def _mth(leaves):
    """RFC 9162 §2.1.1, recursively, on the leaves themselves (the slow, obvious twin)."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1 << (len(leaves) - 1).bit_length() - 1
    return hashlib.sha256(b"\x01" + _mth(leaves[:k]) + _mth(leaves[k:])).digest()


def test_merkle_proofs_against_the_recursive_definition():
    leaves = [f"leaf {i}".encode() for i in range(21)]
    hashes = [merkle.leaf_hash(x) for x in leaves]
    for n in range(22):
        assert merkle.root(hashes[:n]) == _mth(leaves[:n])
        for m in range(n):
            proof = merkle.inclusion_proof(m, hashes[:n])
            assert merkle.verify_inclusion(m, n, hashes[m], proof, _mth(leaves[:n]))
            assert not merkle.verify_inclusion(m, n, merkle.leaf_hash(b"other"), proof, _mth(leaves[:n]))
            assert n == 1 or not merkle.verify_inclusion((m + 1) % n, n, hashes[m], proof, _mth(leaves[:n]))
        for m in range(n + 1):
            proof = merkle.consistency_proof(m, hashes[:n])
            assert merkle.verify_consistency(m, n, _mth(leaves[:m]), _mth(leaves[:n]), proof), (m, n)
            if 0 < m < n:  # a rewritten prefix, or the sizes swapped (a rollback), never verifies
                assert not merkle.verify_consistency(m, n, _mth(leaves[1:m + 1]), _mth(leaves[:n]), proof)
                assert not merkle.verify_consistency(n, m, _mth(leaves[:n]), _mth(leaves[:m]), proof)
    # RFC 9162's empty-tree hash
    assert merkle.root([]).hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_canonical_json_is_rfc_8785():
    # RFC 8785 §3.2.2.3 / Appendix B number samples, and its §3.2.3 sorting example (UTF-16 order)
    for x, text in [(0.0, "0"), (-0.0, "0"), (1.0, "1"), (1e21, "1e+21"), (1e20, "100000000000000000000"),
                    (1e-6, "0.000001"), (1e-7, "1e-7"), (1.5e-5, "0.000015"), (5e-324, "5e-324"),
                    (1.7976931348623157e308, "1.7976931348623157e+308"), (9007199254740991, "9007199254740991"),
                    (333333333.3333333, "333333333.3333333"), (0.1 + 0.2, "0.30000000000000004"),
                    (-1e-7, "-1e-7"), (295147905179352830000.0, "295147905179352830000")]:
        assert number(x) == text, (x, number(x), text)
    assert canonical({"\u20ac": 1, "\r": 2, "\ufb33": 3, "1": 4, "\U0001f600": 5, "\u0080": 6, "\u00f6": 7}) == \
        '{"\\r":2,"1":4,"\u0080":6,"\u00f6":7,"\u20ac":1,"\U0001f600":5,"\ufb33":3}'.encode()
    assert canonical({"s": "é\u0001\n\"\\", "l": [None, True, False, 1.5e-7]}) == \
        '{"l":[null,true,false,1.5e-7],"s":"é\\u0001\\n\\"\\\\"}'.encode()
    for bad in (float("nan"), float("inf"), 2 ** 53 + 1):
        with pytest.raises(ValueError):
            canonical([bad])


# --- a second verifier, without the package's code ---------------------------------------------------------

def _num(x):
    """ECMAScript Number::toString, from the digits of repr (a second implementation, for the verifier)."""
    if x == 0:
        return "0"
    if isinstance(x, int):
        return str(x)
    m = re.fullmatch(r"(-?)(\d+)(?:\.(\d+))?(?:e([-+]\d+))?", repr(x))
    sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or "", int(m.group(4) or 0)
    digits = (whole + frac).lstrip("0")
    n = len(whole) + exp - (len(whole + frac) - len(digits))
    digits = digits.rstrip("0")
    if len(digits) <= n <= 21:
        return sign + digits + "0" * (n - len(digits))
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    return sign + digits[0] + ("." + digits[1:] if len(digits) > 1 else "") + "e" + ("+" if n > 1 else "-") \
        + str(abs(n - 1))


def _jcs(v):
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + _jcs(v[k])
                              for k in sorted(v, key=lambda k: k.encode("utf-16-be"))) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_jcs(x) for x in v) + "]"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return _num(v)
    return json.dumps(v, ensure_ascii=False)


def _tree(leaves_hashes):
    if len(leaves_hashes) == 1:
        return leaves_hashes[0]
    k = 1 << (len(leaves_hashes) - 1).bit_length() - 1
    return hashlib.sha256(b"\x01" + _tree(leaves_hashes[:k]) + _tree(leaves_hashes[k:])).digest()


def independent_verify(receipt: dict, pem: bytes) -> None:
    """Verify a receipt with ``cryptography`` and the functions above only: the receipt's and its tree head's
    Ed25519 signatures over their RFC 8785 form, and the leaf's audit path to the tree head's root."""
    key = serialization.load_pem_public_key(pem)
    assert isinstance(key, Ed25519PublicKey)
    for obj in (receipt, receipt["tree_head"]):
        body = {k: v for k, v in obj.items() if k != "signature"}
        key.verify(bytes.fromhex(obj["signature"]), _jcs(body).encode())  # raises InvalidSignature
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert receipt["tree_head"]["key_fingerprint"] == hashlib.sha256(raw).hexdigest()
    independent_path(receipt)


def independent_path(receipt: dict) -> None:
    """The receipt's leaf, hashed up its audit path, gives its tree head's root (RFC 9162 §2.1.3)."""
    leaf = _jcs({"format": "scrubnet-log-leaf/1", "request_id": receipt["leaf_index"],
                 "record_hash": receipt["record_hash"]}).encode()
    h = hashlib.sha256(b"\x00" + leaf).digest()
    index, size, path = receipt["leaf_index"], receipt["tree_head"]["tree_size"], list(receipt["inclusion_proof"])
    # walk down from the root: at each split, the audit path's last entry is the sibling subtree
    lo, hi, siblings = 0, size, []
    while hi - lo > 1:
        k = 1 << (hi - lo - 1).bit_length() - 1
        if index < lo + k:
            siblings.append(("right", path.pop()))
            hi = lo + k
        else:
            siblings.append(("left", path.pop()))
            lo = lo + k
    assert not path, "the audit path is longer than the tree is deep"
    for side, sib in reversed(siblings):
        h = hashlib.sha256(b"\x01" + (h + bytes.fromhex(sib) if side == "right" else bytes.fromhex(sib) + h)).digest()
    assert h.hex() == receipt["tree_head"]["root_hash"], "the leaf is not in the signed tree head"


# --- a live server with a witness --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return train_tiny_checkpoint(tmp_path_factory, "log")


def _serve_args(tmp):
    return ("--witness", str(Path(tmp) / "witness" / "head.json"), "--burst", "4", "--rate", "0.2",
            "--max-queued", "3", "--verify-every", "1")


@pytest.fixture(scope="module")
def served(base, tmp_path_factory):
    """Alice's request applied; a backup of the whole checkpoint taken then; Bob's request applied after it."""
    tmp = tmp_path_factory.mktemp("logged")
    ck = tmp / "ckpt"
    shutil.copytree(base, ck)
    srv = TrustServer(ck, tmp, extra=_serve_args(tmp))
    try:
        receipts_, subs = {}, {}
        for who, token, skip in (("alice", ALICE, 0), ("bob", BOB, 5)):
            ids = deletable(ck, 2, skip=skip)
            code, sub = srv.call("POST", "/v1/requests", {"ids": ids}, token=token, key=f"{who}-1")
            assert code == 202, sub
            done = srv.wait(sub["id"], token=token)
            assert done["status"] == "applied", done
            receipts_[who], subs[who] = done, dict(sub, ids=ids)
            size = done["request_id"] + 1
            until(lambda: (anchor.read_head(ck) or {}).get("tree_head", {}).get("tree_size", 0) >= size,
                  "a tree head covering the request")
            if who == "alice":
                srv.backup = _copy(ck, tmp / "backup")
        srv.tmp, srv.receipts, srv.subs = tmp, receipts_, subs
        yield srv
    finally:
        srv.stop()


def test_receipts_carry_their_leaf_the_signed_head_and_verify_independently(served, tmp_path):
    pem = served.pub.read_bytes()
    alice, bob = served.receipts["alice"]["receipt"], served.receipts["bob"]["receipt"]
    assert (alice["leaf_index"], alice["tree_head"]["tree_size"]) == (1, 2)
    assert (bob["leaf_index"], bob["tree_head"]["tree_size"]) == (2, 3)
    for r in (alice, bob):
        independent_verify(r, pem)
    bad = {**bob, "sigma": 0.5}
    with pytest.raises(Exception):
        independent_verify(bad, pem)
    forged_path = {**bob, "inclusion_proof": [hashlib.sha256(b"x").hexdigest()] * len(bob["inclusion_proof"])}
    with pytest.raises(Exception):
        independent_verify(forged_path, pem)  # the path is signed
    with pytest.raises(AssertionError, match="not in the signed tree head"):
        independent_path(forged_path)  # and does not lead to the root
    with pytest.raises(AssertionError, match="not in the signed tree head"):
        independent_path({**bob, "record_hash": alice["record_hash"]})
    # the public endpoints give only hashes: the head, and a consistency proof from Alice's head to it
    code, head = served.call("GET", "/v1/log/head")
    assert code == 200 and head["tree_size"] == 3 and set(head) == set(tlog.STH_FIELDS)
    code, proof = served.call("GET", "/v1/log/consistency?first=2")
    assert code == 200 and proof["second"] == 3 and all(re.fullmatch("[0-9a-f]{64}", p) for p in proof["proof"])
    assert tlog.audit(alice, head, proof["proof"], serialization.load_pem_public_key(pem)) == []
    for q in ("first=4", "first=abc", "first=%D9%A1", "first=1&second=99999999999999999999", "first=-1"):
        code, out = served.call("GET", f"/v1/log/consistency?{q}")
        assert code == 422, (q, out)
    # the documented client check, as a CLI
    rfile = tmp_path / "alice.json"
    rfile.write_text(json.dumps(served.receipts["alice"]))
    r = CliRunner().invoke(app, ["receipt", "audit", str(rfile), "--key", str(served.pub), "--url",
                                 f"http://127.0.0.1:{served.port}"])
    assert r.exit_code == 0 and "extends the one in the receipt" in r.output, r.output


def _docs_block(needle):
    text = (ROOT / "docs" / "guides" / "service.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return next(b for b in blocks if needle in b)


@pytest.mark.skipif(not all(shutil.which(t) for t in ("jq", "xxd", "openssl")), reason="needs jq, xxd and openssl")
def test_the_documented_shell_and_openssl_verification(served, tmp_path):
    script = _docs_block("verify-receipt.sh")
    (tmp_path / "answer.json").write_text(json.dumps(served.receipts["bob"]))
    shutil.copy(served.pub, tmp_path / "server-key.pub")
    p = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0 and p.stdout.count("Signature Verified Successfully") == 2, (p.stdout, p.stderr)
    for field, value in (("sigma", 0.25), ("n_ids", 3)):
        (tmp_path / "answer.json").write_text(json.dumps({**served.receipts["bob"]["receipt"], field: value}))
        p = subprocess.run(["bash", "-c", "sh verify-receipt.sh answer.json server-key.pub"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=HANG_S)
        assert p.returncode != 0 and "Signature Verification Failure" in p.stdout + p.stderr, field


@pytest.mark.skipif(shutil.which("jq") is None, reason="needs jq")
def test_the_guides_jcs_jq_writes_rfc_8785_on_unusual_strings_and_keys(tmp_path):
    """U+007F stays literal (jq's tojson escapes it), control characters are escaped as RFC 8785 says, and keys
    sort by UTF-16 code units (a key above U+FFFF before one in U+E000..U+FFFF; jq sorts by code point)."""
    program = re.search(r"cat > jcs.jq <<'EOF'\n(.*?)\nEOF\n", _docs_block("jcs.jq"), re.S).group(1)
    (tmp_path / "jcs.jq").write_text(program)
    value = {"a": "\u007f\u2028é\u0001\b\t\n\f\r\u001f\"\\/", "\U0001f600": 1, "\ufb33": 2, "": [1.5e-7, 1e21],
             "\\u007f": "\\u007f", "x\u0000": "\u0080\ud7ff\ue000", "\r": {"\u20ac": None, "1": True}}
    out = subprocess.run(["jq", "-j", "-f", str(tmp_path / "jcs.jq")], input=json.dumps(value).encode(),
                         capture_output=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout == canonical(value) == _jcs(value).encode()


def _restore(backup, ck):
    shutil.rmtree(ck, ignore_errors=True)
    shutil.copytree(backup, ck)


def test_a_restored_checkpoint_is_refused_against_the_witness_and_caught_by_a_later_receipt(served, tmp_path):
    """Restore the backup taken after Alice's request (database, head, weights) over a copy of the live one."""
    ck = tmp_path / "ckpt"
    _restore(served.backup, ck)
    assert anchor.verify(ck, serialization.load_pem_public_key(served.pub.read_bytes()))["valid"]  # consistent
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    cmd = [sys.executable, "-m", "scrubnet.cli", "serve", str(ck), "--tokens", str(tokens), "--key",
           str(served.key), "--port", "9"]
    p = subprocess.run(cmd + ["--witness", str(served.tmp / "witness" / "head.json")], capture_output=True,
                       text=True, env=ENV, timeout=HANG_S)
    assert p.returncode == 2 and p.stderr.startswith("error:") and "fewer than the 3 of the head its witness" \
        in p.stderr and "restored from an older copy" in p.stderr, p.stderr
    assert "serving" not in p.stdout and "Traceback" not in p.stderr
    # a witness command: the same refusal (in process: create_app is what serve calls)
    wcmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tests' / 'serve' / 'witness_cmd.py'))} " \
           f"{shlex.quote(str(served.tmp / 'witness' / 'head.json'))}"
    with pytest.raises(store.StoreError, match="fewer than the 3 of the head its witness holds"):
        create_app(ck, {}, receipts.load_private_key(served.key), ml_data_loader, start_worker=False,
                   witness=tlog.Witness(command=wcmd))
    # an operator who drops the witness: the service starts, and Bob's client detects the rollback
    srv = TrustServer(ck, tmp_path, extra=("--key", str(served.key)))
    try:
        bob = tmp_path / "bob.json"
        bob.write_text(json.dumps(served.receipts["bob"]))
        r = CliRunner().invoke(app, ["receipt", "audit", str(bob), "--key", str(served.pub), "--url",
                                     f"http://127.0.0.1:{srv.port}"])
        assert r.exit_code == 2 and "rollback: the log's head has 2 entries, fewer than the 3" in r.output, r.output
        alice = tmp_path / "alice.json"
        alice.write_text(json.dumps(served.receipts["alice"]))
        r = CliRunner().invoke(app, ["receipt", "audit", str(alice), "--key", str(served.pub), "--url",
                                     f"http://127.0.0.1:{srv.port}"])
        assert r.exit_code == 0, r.output  # Alice's receipt predates the backup: nothing to detect for her
        # new requests after the restore: the log diverges from Bob's head; his check still fails
        code, sub = srv.call("POST", "/v1/requests", {"ids": deletable(ck, 1, skip=20)}, token=CAROL, key="c-1")
        srv.wait(sub["id"], token=CAROL)
        until(lambda: srv.call("GET", "/v1/log/head")[1]["tree_size"] >= 3, "the log grown to 3")
        r = CliRunner().invoke(app, ["receipt", "audit", str(bob), "--key", str(served.pub), "--url",
                                     f"http://127.0.0.1:{srv.port}"])
        assert r.exit_code == 2 and "inconsistent" in r.output, r.output
    finally:
        srv.stop()


def test_deleting_the_signed_head_is_detected(served, tmp_path):
    ck = _copy(served.ckpt, tmp_path / "ck")
    pub = serialization.load_pem_public_key(served.pub.read_bytes())
    assert anchor.verify(ck, pub)["valid"]
    (ck / anchor.HEAD).unlink()
    rec = anchor.verify(ck, pub)
    assert not rec["valid"] and any("record-head.json is missing, though receipts handed out prove a signed tree "
                                    "head of 3 requests" in p for p in rec["problems"]), rec["problems"]
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--key", str(served.pub)])
    assert r.exit_code == 2 and "is missing" in r.output
    # the head replaced by an older one (the backup's): named too
    shutil.copy(served.backup / anchor.HEAD, ck / anchor.HEAD)
    rec = anchor.verify(ck, pub)
    assert any("fewer than the 3 of a receipt handed out" in p for p in rec["problems"]), rec["problems"]


def test_swapping_the_public_key_beside_the_data_does_not_pass_a_forgery(served, tmp_path):
    ck = _copy(served.ckpt, tmp_path / "ck")
    real = serialization.load_pem_public_key(served.pub.read_bytes())
    _forge(ck, 1, "sigma", 9.0)
    # the forger re-signs everything with a key of their own and puts its public half beside the data
    mallory = Ed25519PrivateKey.generate()
    con = sqlite3.connect(str(ck / store.DB))
    con.execute("UPDATE submissions SET receipt = NULL")
    con.commit()
    con.close()
    rec = anchor.verify(ck, mallory.public_key())
    hashes = rec["leaf_hashes"]
    sth = tlog.sign_tree_head(mallory, hashes)
    issue_receipts(ck, mallory, sth, hashes)
    anchor.sign_head(ck, mallory, anchor.verify(ck, mallory.public_key()), sth)
    (ck / anchor.PUBLIC_KEY).write_bytes(mallory.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert anchor.verify(ck)["valid"]  # unpinned, the forgery is self-consistent: the pin is what catches it
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--key", str(served.pub)])
    assert r.exit_code == 2 and "signed by another key than the one given" in r.output, r.output
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--fingerprint", tlog.fingerprint(real)])
    assert r.exit_code == 2 and f"not by the pinned {tlog.fingerprint(real)}" in r.output, r.output
    r = CliRunner().invoke(mlforget_app, ["show", str(ck)], env={"SCRUBNET_RECEIPT_FINGERPRINT": ""})
    assert r.exit_code == 2 and "no key is pinned" in r.output, r.output
    r = CliRunner().invoke(mlforget_app, ["show", str(served.backup), "--fingerprint", tlog.fingerprint(real)])
    assert r.exit_code == 0 and "(pinned)" in r.output, r.output


def test_the_signing_key_stays_apart_from_the_data(base, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKENS)
    os.chmod(tokens, 0o600)
    r = CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens)], env={"SCRUBNET_RECEIPT_KEY": ""})
    assert r.exit_code == 2 and "give the signing key" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", str(ck), "--tokens", str(tokens), "--key", str(ck / "k.pem")])
    assert r.exit_code == 2 and "inside the checkpoint" in r.output, r.output
    assert not (ck / "k.pem").exists() and not (ck / "receipt-key.pem").exists()


# --- tenants learn nothing; the service stays up ------------------------------------------------------------

def test_a_tenant_naming_anothers_forgotten_ids_reads_no_id_in_any_answer(served):
    """The POST answer does not depend on others' requests; the reason of the refusal names no id and no other
    request; the read role sees no id in any reason. (The final status still differs: see trust.md, limit.)"""
    alice_ids = served.subs["alice"]["ids"]
    fresh = deletable(served.ckpt, 2, skip=30)
    posted, done = {}, {}
    for name, ids in (("known", [alice_ids[0], fresh[0]]), ("fresh", [fresh[1]])):
        code, sub = served.call("POST", "/v1/requests", {"ids": ids}, token=CAROL, key=f"probe-{name}")
        posted[name] = (code, sorted(sub), sub["status"], sub["reason"], sub["receipt"])
        done[name] = served.wait(sub["id"], token=CAROL)
    assert posted["known"] == posted["fresh"] and posted["known"][0] == 202  # the same answer at POST
    known = done["known"]
    assert known["status"] == "refused" and known["reason"] == store.REFUSED
    assert not re.search(r"\d", known["reason"])  # no id, no request number
    for token in (READER, OPS):  # the read role (and admin) see no ids in any reason on the log
        log = served.call("GET", "/v1/log", token=token)[1]
        reasons = [s["reason"] or "" for s in log["submissions"]]
        assert not any(re.search(r"\d", r) for r in reasons), reasons
        assert "n_remaining" not in json.dumps(log["submissions"])
    receipt = done["fresh"]["receipt"]
    assert "n_remaining" not in json.dumps(receipt) and "submission_id" not in receipt


def test_bad_path_values_are_4xx(served):
    for path in ("/v1/requests/%D9%A1", "/v1/requests/99999999999999999999999999", "/v1/requests/-1",
                 "/v1/requests/1e3", "/v1/requests/%EF%BC%91"):
        code, out = served.call("GET", path, token=READER)
        assert code == 404 and out == {"error": "no such request"}, (path, code, out)


def test_a_flood_from_one_tenant_gets_429_while_another_is_served(served):
    codes, retry = [], None
    for k in range(8):
        code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=40 + k)},
                                token=OPS, key=f"flood-{k}")
        codes.append(code)
    assert 429 in codes and codes[0] in (200, 202), codes
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{served.port}/v1/requests", method="POST",
                                 data=json.dumps({"ids": deletable(served.ckpt, 1, skip=60)}).encode(),
                                 headers={"Authorization": f"Bearer {OPS}", "Idempotency-Key": "flood-x"})
    try:
        urllib.request.urlopen(req, timeout=HANG_S)
    except urllib.error.HTTPError as e:
        assert e.code == 429
        retry = e.headers.get("Retry-After")
    assert retry is not None and int(retry) >= 1
    code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=50)}, token=BOB,
                            key="bob-after-flood")
    assert code == 202, out  # another tenant is not held back


def test_slow_clients_are_cut_off(served):
    """Half a request head is closed after 10 s, half a body answered 408 after 10 s; neither holds on."""
    import socket
    head = socket.create_connection(("127.0.0.1", served.port))
    head.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\n")
    body = socket.create_connection(("127.0.0.1", served.port))
    body.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nAuthorization: Bearer "
                 + BOB.encode() + b"\r\nIdempotency-Key: slow-1\r\n\r\n{\"ids\"")
    for s in (head, body):
        s.settimeout(HANG_S)  # a guard against a hang: the server's own deadlines close them
    assert body.recv(100).startswith(b"HTTP/1.1 408")
    assert head.recv(100) == b""  # closed by the server (this side never closes it)
    head.close()
    body.close()


def test_the_token_bucket():
    lim = Limits(rate=2.0, burst=3, max_queued=5)
    assert [lim.admit("a", now=0.0) for _ in range(3)] == [None, None, None]
    assert lim.admit("a", now=0.0) == pytest.approx(0.5)
    assert lim.admit("b", now=0.0) is None  # per tenant
    assert lim.admit("a", now=0.5) is None and lim.admit("a", now=0.5) == pytest.approx(0.5)
    assert Limits.retry_after(0.2) == {"Retry-After": "1"} and Limits.retry_after(2.1) == {"Retry-After": "3"}


def test_a_rotated_key_keeps_the_old_signatures_valid(served, tmp_path):
    ck = _copy(served.ckpt, tmp_path / "ck")
    old = serialization.load_pem_public_key(served.pub.read_bytes())
    new = Ed25519PrivateKey.generate()
    witness = tlog.Witness(path=tmp_path / "witness.json")
    shutil.copy(served.tmp / "witness" / "head.json", witness.path)
    with pytest.raises(store.StoreError, match="signed by another key"):
        create_app(ck, {}, new, ml_data_loader, start_worker=False, witness=witness)
    app_ = create_app(ck, {}, new, ml_data_loader, start_worker=False, witness=witness, retired_keys=[old])
    assert app_.state.worker.retired == (old,)
    new_pub = tmp_path / "new.pub"
    new_pub.write_bytes(new.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--key", str(new_pub), "--retired-key", str(served.pub)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(mlforget_app, ["show", str(ck), "--key", str(new_pub)])
    assert r.exit_code == 2 and "signed by another key" in r.output


def test_an_idle_worker_verifies_on_a_timer_and_posts_get_503(served):
    """Last in the module: it halts the module's server. No POST after the forgery: the timer finds it."""
    until(lambda: store.oldest_queued(served.ckpt) is None, "the queue drained")
    _forge(served.ckpt, 2, "seconds", 0.25)
    log = until(lambda: (lambda out: out if out["worker_halted"] else None)(
        served.call("GET", "/v1/log", token=READER)[1]), "the worker halted")
    assert log["worker_halted"] and not log["chain"]["valid"], log["worker_error"]
    assert "request #2" in log["worker_error"]
    code, out = served.call("POST", "/v1/requests", {"ids": deletable(served.ckpt, 1, skip=55)}, token=BOB,
                            key="after-forgery")
    assert code == 503 and "does not verify" in out["error"]


def test_a_full_disk_is_retryable(base, tmp_path, monkeypatch):
    import asyncio
    import errno
    from scrubnet.mlforget.store import queue
    from scrubnet.serve.auth import Token
    from scrubnet.serve.http import HTTPError
    from scrubnet.serve.routes import requests as routes
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    ids = deletable(ck, 1)
    sub, _ = store.submit(ck, "k", "forget", ids, None, "h", "00" * 16, "alice")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(queue, "forget", full)
    with pytest.raises(OSError):
        store.apply_submission(ck, sub["id"], ml_data_loader)
    assert store.submission(ck, sub["id"])["status"] == "queued"  # not failed for good: the worker retries
    monkeypatch.undo()
    assert store.apply_submission(ck, sub["id"], ml_data_loader)["status"] == "applied"
    # a POST that cannot be written: 503 with Retry-After, nothing queued
    service = create_app(ck, {}, Ed25519PrivateKey.generate(), ml_data_loader, start_worker=False).state.service

    def disk_full(*a, **k):
        raise sqlite3.OperationalError("database or disk is full")
    monkeypatch.setattr(store, "submit", disk_full)
    with pytest.raises(HTTPError) as e:
        asyncio.run(routes._queue(service, Token("alice", frozenset({"submit"})), ("k2", "forget", ids, None, "h",
                                                                                   "00" * 16)))
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "30" and "disk is full" in e.value.message


def test_show_reads_a_checkpoint_it_cannot_write_beside(base, tmp_path, monkeypatch):
    """On a read-only mount SQLite cannot create its side files: the database is opened immutable. Simulated
    (the tests run as root, for whom a directory's mode forbids nothing): the directory reads as unwritable."""
    from scrubnet.mlforget.store import db
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    expected = store.verify(ck)
    for side in ("store.sqlite-wal", "store.sqlite-shm"):
        (ck / side).unlink(missing_ok=True)
    opened = []
    real_connect = sqlite3.connect

    def spy(database, *a, **k):
        opened.append(str(database))
        return real_connect(database, *a, **k)
    import types
    monkeypatch.setattr(db, "os", types.SimpleNamespace(access=lambda p, mode: False, W_OK=os.W_OK))
    monkeypatch.setattr(db.sqlite3, "connect", spy)
    r = CliRunner().invoke(mlforget_app, ["show", str(ck)])
    assert r.exit_code == 0 and "hash chain: valid" in r.output, r.output
    assert opened and all("immutable=1" in u for u in opened)
    assert not (ck / "store.sqlite-wal").exists() and not (ck / "store.sqlite-shm").exists()
    assert store.verify(ck)["requests"] == expected["requests"]
