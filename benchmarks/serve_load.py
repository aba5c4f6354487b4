"""Load and faults: N concurrent clients against ``scrubnet serve`` on 127.0.0.1 while the server is killed
(SIGKILL) and restarted at random moments.

A small ML checkpoint is trained (``scrubnet mlforget train``); each of ``--clients`` client threads sends
``--requests`` deletion requests of ``--ids`` disjoint sample ids, each with its own Idempotency-Key, and
retries a request (same key, same body) on any connection error until it gets a 202/200 or the deadline
passes. A killer thread SIGKILLs the server ``--kills`` times at random moments (seeded) while the clients
run and restarts it at once. At the end (the server running again until every request is applied):

* every request that got a 202/200 is applied exactly once: its submission is ``applied``, and the store
  holds exactly one forget request with its ids (none twice, none missing);
* the store's record chain verifies, and so do the signed receipts and head against it
  (:func:`scrubnet.serve.anchor.verify`);
* every receipt verifies: signature under the server's key, the requester's ids with their salt, the chain
  link to the previous receipt and sha256_before = the previous sha256_after;
* the weights equal a replay of the store's requests, in its order, on a copy of the trained checkpoint.

Each client is a tenant with a token of its own; the signing key and the witness of the transparency log
live outside the checkpoint. While the clients run, one more tenant floods the server with ``--flood`` POSTs
as fast as it can: the per-tenant rate limit and queue quota answer it 429 (with ``Retry-After``) while the
other tenants' requests complete. A client that gets a 429 waits ``Retry-After`` and resends (same key).
And one client without a token, from another loopback address (127.0.0.2), holds ``--hog`` idle connections
and reopens every one the server closes, for as long as the others run: the server's per-client connection
cap closes its excess at once, so the tenants' requests are still served (any 503 they get is a failure).

Prints ``requests_per_second:`` (applied requests / wall time from the first request to the last one
applied, kills and restarts included), ``lost:`` (accepted requests not applied exactly once; must be 0),
``flood:`` (the flooding tenant's POSTs answered 429 / accepted) and ``hog:`` (connections the hog opened,
how many the server closed), then ``ok`` or the failed checks (exit 1).

    python benchmarks/serve_load.py [--clients 32 --requests 2 --ids 1 --kills 3 --flood 60 --hog 300 --seed 0]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from scrubnet.experiments.checkpoints import ml_data_loader as _data_loader
from scrubnet.mlforget import store
from scrubnet.serve import anchor, receipts

FLOOD = "flood"
#: the server's limits in this benchmark: a tenant may send 10 POSTs at once, 2 per second after, and keep 8 queued;
#: one client address may hold 64 connections (the tenants all connect from 127.0.0.1, up to 257 threads)
LIMITS = ("--burst", "10", "--rate", "2", "--max-queued", "8", "--max-connections-per-client", "64")


def token(client) -> str:
    return f"load-benchmark-token-{client}-0001"
DATA = {"num_samples": 1000, "n_train_per_class": 40, "n_test_per_class": 10, "forget_count": 2}
TRAIN = {"pretrain_epochs": 2, "max_epochs": 5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, ckpt: Path, tokens: Path, port: int, env: dict, keys: Path):
        self.ckpt, self.tokens, self.port, self.env, self.keys = ckpt, tokens, port, env, keys
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def start(self, timeout_s: float = 180.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "scrubnet.cli", "serve", str(self.ckpt), "--tokens",
                                      str(self.tokens), "--port", str(self.port), "--key",
                                      str(self.keys / "key.pem"), "--witness", str(self.keys / "witness.json"),
                                      *LIMITS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/key", timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit("the server exited at start")
                time.sleep(0.1)
        raise SystemExit(f"the server did not answer within {timeout_s:.0f} s")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def post(port: int, key: str, body: dict, client) -> tuple[int, dict, float]:
    """(status, answer, Retry-After in seconds or 0)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/requests", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {token(client)}",
                                                         "Idempotency-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), 0.0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), float(e.headers.get("Retry-After") or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--ids", type=int, default=1, help="sample ids per request")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--flood", type=int, default=60, help="POSTs of the flooding tenant")
    ap.add_argument("--hog", type=int, default=300, help="idle connections the connection hog holds (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds the clients may take, at most")
    args = ap.parse_args()
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 100 and 1 <= args.ids <= 100
            and 0 <= args.kills <= 20 and 10 <= args.deadline <= 3600 and 0 <= args.flood <= 1000
            and 0 <= args.hog <= 2000):
        raise SystemExit("error: --clients 1..256, --requests 1..100, --ids 1..100, --kills 0..20, "
                         "--deadline 10..3600, --flood 0..1000, --hog 0..2000")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    work = Path(tempfile.mkdtemp(prefix="serve_load."))
    try:
        base, ckpt = work / "base", work / "served"
        r = subprocess.run([sys.executable, "-m", "scrubnet.cli", "mlforget", "train", "--out", str(base),
                            "--data-options", json.dumps(DATA), "--train-options", json.dumps(TRAIN),
                            "--model-options", '{"hidden": 16}'], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"training failed: {r.stderr}")
        shutil.copytree(base, ckpt)
        state, _ = store.load(base)
        deletable = state.deletable_ids().tolist()
        need = args.clients * args.requests * args.ids
        if need + args.flood * args.ids >= len(deletable):
            raise SystemExit(f"error: {need} ids needed, the checkpoint has {len(deletable)} deletable samples")
        rng.shuffle(deletable)
        plan = {(c, k): sorted(deletable[(c * args.requests + k) * args.ids:(c * args.requests + k + 1) * args.ids])
                for c in range(args.clients) for k in range(args.requests)}
        plan.update({(FLOOD, k): sorted(deletable[need + k * args.ids:need + (k + 1) * args.ids])
                     for k in range(args.flood)})
        tokens = work / "tokens.txt"
        tokens.write_text("".join(f"{token(c)} submit client{c}\n" for c in [*range(args.clients), FLOOD]))
        os.chmod(tokens, 0o600)
        keys = work / "keys"
        keys.mkdir(mode=0o700)
        server = Server(ckpt, tokens, free_port(), env, keys)
        server.start()
        accepted: dict[str, dict] = {}
        failures: list[str] = []
        lock = threading.Lock()
        t_end = time.monotonic() + args.deadline

        flood_codes: list[int] = []

        def client(c) -> None:
            for k in range(args.flood if c == FLOOD else args.requests):
                key, ids = f"client{c}-request{k}", plan[(c, k)]
                while time.monotonic() < t_end:
                    try:
                        code, out, wait = post(server.port, key, {"ids": ids}, c)
                    except (OSError, http.client.HTTPException):
                        time.sleep(0.2)  # the server is down (killed, maybe mid-answer): retry the same request
                        continue
                    if c == FLOOD:
                        flood_codes.append(code)
                        if code == 429:
                            break  # the flood moves on to its next request at once
                    if code == 429:
                        time.sleep(wait)  # rate limited: wait as told, then resend the same request
                        continue
                    if code in (200, 202):
                        with lock:
                            accepted[key] = {"ids": ids, **out}
                    else:
                        with lock:
                            failures.append(f"{key}: HTTP {code} {out}")
                    break

        kills_done: list[float] = []

        def killer() -> None:
            # every kill happens: while clients send, or (if they are done) while the queue is being applied
            for _ in range(args.kills):
                time.sleep(rng.uniform(0.2, 2.0))
                server.kill()
                kills_done.append(time.monotonic() - t0)
                server.start()

        clients_done = threading.Event()
        hog_stats = {"opened": 0, "closed_by_server": 0, "held_max": 0}

        def hog() -> None:
            """Hold ``--hog`` idle connections from 127.0.0.2; reopen every one the server closes (bounded by
            the clients' end and the deadline; loopback only)."""
            socks: list = []
            while not clients_done.is_set() and time.monotonic() < t_end:
                alive = []
                for s in socks:
                    r, _, _ = select.select([s], [], [], 0)
                    if r and not _peek_open(s):
                        s.close()
                        hog_stats["closed_by_server"] += 1
                    else:
                        alive.append(s)
                socks = alive
                while len(socks) < args.hog and not clients_done.is_set():
                    s = socket.socket()
                    try:
                        s.bind(("127.0.0.2", 0))
                        s.connect(("127.0.0.1", server.port))
                    except OSError:
                        s.close()
                        break  # the server is down (killed): try again on the next round
                    socks.append(s)
                    hog_stats["opened"] += 1
                hog_stats["held_max"] = max(hog_stats["held_max"], len(socks))
                clients_done.wait(0.2)
            for s in socks:
                s.close()

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(c,)) for c in [*range(args.clients), FLOOD]]
        kt = threading.Thread(target=killer)
        ht = threading.Thread(target=hog)
        if args.hog:
            ht.start()
        kt.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        clients_done.set()
        kt.join()
        if args.hog:
            ht.join()
        # let the (running) server apply every queued request and sign every receipt
        while time.monotonic() < t_end and (store.oldest_queued(ckpt) is not None
                                            or store.applied_without_receipt(ckpt)):
            time.sleep(0.1)
        wall = time.monotonic() - t0
        key_hex = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/key", timeout=30).read())
        server.stop()
        pub = receipts.load_public_key(_write(work / "key.pub", key_hex["pem"]))

        problems = list(failures)
        reqs = store.requests(ckpt)
        forgets = [r for r in reqs if r["kind"] == "forget"]
        by_ids: dict[tuple, int] = {}
        for r in forgets:
            by_ids[tuple(r["ids"])] = by_ids.get(tuple(r["ids"]), 0) + 1
        lost = 0
        # stored keys are scoped to the submitting identity ("<tag>/<client key>")
        subs = {s["idempotency_key"].split("/", 1)[-1]: s for s in store.submissions(ckpt, limit=1_000_000)}
        for key, acc in accepted.items():
            s = subs.get(key)
            if s is None or s["status"] != "applied" or by_ids.get(tuple(acc["ids"]), 0) != 1:
                lost += 1
        if lost:
            problems.append(f"{lost} accepted requests not applied exactly once")
        twice = sum(n > 1 for n in by_ids.values())
        not_planned = [r["id"] for r in forgets if tuple(r["ids"]) not in {tuple(a["ids"]) for a in accepted.values()}]
        if twice:
            problems.append(f"{twice} id sets applied more than once")
        if not_planned:
            problems.append(f"requests {not_planned[:5]} applied without an accepted submission")
        others = [k for k in accepted if not k.startswith(f"client{FLOOD}-")]
        never = need // args.ids - len(others)
        if never:
            problems.append(f"{never} requests of the ordinary tenants never got a 202 before the deadline")
        n429 = flood_codes.count(429)
        if args.flood and not n429:
            problems.append("the flooding tenant never got a 429")
        rec = anchor.verify(ckpt, pub)  # the chain, the signed receipts, head and tree heads, under the key
        if not rec["valid"]:
            problems.append("record chain: " + "; ".join(rec["problems"]))
        prev, bad_receipts = None, 0
        for s in sorted((s for s in subs.values() if s["status"] == "applied"), key=lambda s: s["request_id"]):
            if s["receipt"] is None or receipts.verify_receipt(s["receipt"], pub, ids=s["ids"], salt=s["salt"],
                                                               previous=prev):
                bad_receipts += 1
            prev = s["receipt"]
        if bad_receipts:
            problems.append(f"{bad_receipts} receipts do not verify")
        replay = work / "replay"
        shutil.copytree(base, replay)
        for r in forgets:
            store.forget(replay, r["ids"], sigma=r["sigma"], data_loader=_data_loader)
        if store.load(replay)[1]["weights_sha256"] != rec["state"]["weights_sha256"]:
            problems.append("the served weights differ from a replay of the store in order")
        applied = sum(s["status"] == "applied" for s in subs.values())
        print(f"clients: {args.clients}  requests: {need // args.ids}  kills: {len(kills_done)} at "
              f"{', '.join(f'{t:.1f}' for t in kills_done)} s  "
              f"accepted: {len(accepted)}  applied: {applied}  wall_s: {wall:.1f}  (loaded shared 2-core machine)")
        print(f"requests_per_second: {applied / wall:.2f}")
        print(f"lost: {lost}")
        print(f"flood: {n429} of {len(flood_codes)} POSTs answered 429, "
              f"{len(accepted) - len(others)} accepted; the other tenants' {len(others)} requests all accepted"
              if not never else f"flood: {n429} of {len(flood_codes)} POSTs answered 429")
        if args.hog:
            print(f"hog: {hog_stats['opened']} idle connections opened from 127.0.0.2 (at most {args.hog} at once), "
                  f"{hog_stats['closed_by_server']} closed by the server and reopened; the tenants got "
                  f"{sum('HTTP 503' in f for f in failures)} answers 503")
        if problems:
            print("FAILED: " + "; ".join(problems))
            raise SystemExit(1)
        print("ok: every accepted request applied exactly once; chain, receipts and replay verify")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _peek_open(s: socket.socket) -> bool:
    """Whether a readable socket is still open (the server closed it when it reads as EOF or errors)."""
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


if __name__ == "__main__":
    main()
