"""``scrubnet serve`` (deletion requests over HTTP, optional extra ``scrubnet[serve]``),
``scrubnet receipt verify`` (offline check of a signed receipt) and ``scrubnet receipt audit`` (a receipt
against the service's transparency log now).

    scrubnet serve CHECKPOINT --tokens tokens.txt --key FILE [--witness FILE | --witness-cmd CMD]
        [--witness-init] [--retired-key OLD.pub] [--host 127.0.0.1 --port 8000]
                                                (or the key's PEM in SCRUBNET_RECEIPT_KEY instead of --key)
    scrubnet receipt verify RECEIPT.json --key KEY.pub [--weights W.safetensors] [--ids IDS --salt S]
        [--previous PREVIOUS_RECEIPT.json]
    scrubnet receipt audit RECEIPT.json --key KEY.pub [--retired-key OLD.pub] --url http://HOST:PORT

Bad input gives one line ``error: …`` on stderr and exit code 2; a receipt that does not verify exits 2
naming every mismatch.
"""
from __future__ import annotations

import ipaddress
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

import typer

from scrubnet.cli.common import UserError, fail, read_ids, read_json_file, threads_option
from scrubnet.experiments.checkpoints import ml_data_loader
from scrubnet.mlforget import store
from scrubnet.serve import receipts, startup, tlog
from scrubnet.serve.app import create_app, read_tokens
from scrubnet.serve.limits import Limits

try:  # optional dependency: pip install "scrubnet[serve]"
    import uvicorn
except ImportError:  # pragma: no cover - exercised only without the extra
    uvicorn = None

receipt_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Signed receipts of deletion requests.")


def _cached_loader():
    """The checkpoint's data D, loaded once per process (they depend only on the static record)."""
    cache: dict = {}

    def load(meta: dict):
        if "xy" not in cache:
            cache["xy"] = ml_data_loader(meta)
        return cache["xy"]
    return load


KEY_ENV = "SCRUBNET_RECEIPT_KEY"


def _signing_key(checkpoint: Path, key: Optional[Path]):
    """The private key: ``--key FILE`` (created with FILE.pub beside it when missing) or the PEM in
    ``SCRUBNET_RECEIPT_KEY``; never inside the checkpoint (every copy of the data would carry it)."""
    if key is None:
        pem = os.environ.get(KEY_ENV)
        if not pem:
            old = checkpoint / "receipt-key.pem"
            hint = (f"; the key of earlier versions lies inside the checkpoint: move it out (mv {old} "
                    "~/scrubnet-keys/) and give that path") if old.exists() else ""
            raise UserError(f"give the signing key: --key FILE outside the checkpoint (created when missing) or "
                            f"its PEM in {KEY_ENV}{hint}")
        try:
            return receipts.serialization.load_pem_private_key(pem.encode(), password=None), []
        except (ValueError, TypeError) as e:
            raise UserError(f"{KEY_ENV} is not a PEM private key: {e}") from None
    ck, k = checkpoint.resolve(), key.resolve()
    if ck == k.parent or ck in k.parents:
        raise UserError(f"--key {key} lies inside the checkpoint: keep the signing key apart from the data "
                        "(every copy of the checkpoint would carry it)")
    if not key.exists():
        receipts.write_key_pair(key, key.with_suffix(".pub"))
    warnings = startup.check_modes(key=key)
    return receipts.load_private_key(key), warnings


def _witness(checkpoint: Path, path: Optional[Path], command: Optional[str], init: bool, timeout_s: float):
    """The witness of the options; a witness file inside the checkpoint or writable by others is refused like
    the key (:func:`scrubnet.serve.startup.check_witness`)."""
    if path is not None and command is not None:
        raise UserError("give --witness or --witness-cmd, not both")
    if path is None and command is None:
        if init:
            raise UserError("--witness-init needs --witness or --witness-cmd")
        return None
    if not timeout_s > 0:
        raise UserError("--witness-timeout must be > 0 seconds")
    if path is not None:
        startup.check_witness(checkpoint, path)
    return tlog.Witness(path=path, command=command, timeout_s=timeout_s)


def serve(checkpoint: Path = typer.Argument(..., help="ML checkpoint directory (scrubnet mlforget train)"),
          tokens: Path = typer.Option(..., "--tokens", help="file of lines 'TOKEN ROLES [NAME]'; roles: "
                                      "submit, read, admin (comma-separated)"),
          host: str = typer.Option("127.0.0.1", help="address to bind (loopback by default)"),
          port: int = typer.Option(8000, help="TCP port"),
          key: Optional[Path] = typer.Option(None, "--key", help="Ed25519 private key (PEM) signing receipts and "
                                             "tree heads, outside the checkpoint; created with its .pub when "
                                             f"missing (or the PEM in {KEY_ENV})"),
          witness: Optional[Path] = typer.Option(None, "--witness", help="file outside the checkpoint keeping the "
                                                 "latest signed tree head; start-up refuses a checkpoint whose "
                                                 "log does not extend it"),
          witness_cmd: Optional[str] = typer.Option(None, "--witness-cmd", help="command instead of a file: "
                                                    "'CMD publish' reads the witness document (JSON) on stdin, "
                                                    "'CMD latest' prints the last one"),
          witness_init: bool = typer.Option(False, "--witness-init", help="the witness is new and empty: start "
                                            "with it although the checkpoint's log was published before (once; "
                                            "logged)"),
          witness_timeout: float = typer.Option(tlog.WITNESS_TIMEOUT_S, "--witness-timeout", help="seconds a "
                                                "--witness-cmd may take before the service refuses (fail closed)"),
          max_body: int = typer.Option(1 << 20, help="largest request body accepted, bytes (413 above)"),
          rate: float = typer.Option(2.0, help="POSTs per second one token may sustain (429 above)"),
          burst: int = typer.Option(20, help="POSTs one token may send at once"),
          max_queued: int = typer.Option(16, help="submissions one token may have queued (429 above)"),
          verify_every: float = typer.Option(30.0, help="seconds between verifications of the record while idle"),
          read_rate: float = typer.Option(20.0, help="GETs per second one token (or, without a token, one client "
                                          "address) may sustain (429 above)"),
          read_burst: int = typer.Option(100, help="GETs one token or address may send at once"),
          max_connections_per_client: int = typer.Option(32, help="connections one client address may hold open "
                                                         "(more are closed at once; behind a proxy, see the guide)"),
          idle_timeout: float = typer.Option(5.0, help="seconds a connection may stay without sending a whole "
                                             "request head (idle keep-alive included) before it is closed"),
          retired_key: Optional[List[Path]] = typer.Option(None, "--retired-key", help="public key (PEM or hex) the "
                                                           "service signed with before a key rotation; repeatable"),
          threads: int = threads_option("torch CPU threads")):
    """Serve one ML checkpoint: queue deletion requests, apply them in order, log each in a transparency log
    and sign a receipt for it."""
    if uvicorn is None:
        raise UserError('scrubnet serve needs the serve extra: pip install "scrubnet[serve]"')
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise UserError(f"--host {host!r} is not an IP address") from None
    if not 0 < port < 65536:
        raise UserError(f"--port must be in 1..65535, got {port}")
    if not 1024 <= max_body <= 1 << 30:
        raise UserError("--max-body must be in 1024..2^30 bytes")
    if not (rate > 0 and burst >= 1 and max_queued >= 1 and verify_every > 0):
        raise UserError("--rate and --verify-every must be > 0, --burst and --max-queued ≥ 1")
    if not (read_rate > 0 and read_burst >= 1 and max_connections_per_client >= 1 and idle_timeout > 0):
        raise UserError("--read-rate and --idle-timeout must be > 0, --read-burst and "
                        "--max-connections-per-client ≥ 1")
    token_table = read_tokens(tokens)
    store.verify(checkpoint)  # a missing or damaged checkpoint is refused before binding
    warnings = startup.check_modes(checkpoint, tokens)  # refused before anything is written
    startup.check_writable(checkpoint)
    wit = _witness(checkpoint, witness, witness_cmd, witness_init, witness_timeout)
    private, key_warnings = _signing_key(checkpoint, key)
    if wit is None:
        key_warnings.append("no --witness: a restore of the whole checkpoint to an older copy is detected only by "
                            "clients holding later receipts (scrubnet receipt audit)")
    retired = [receipts.load_public_key(k) for k in retired_key or []]
    app = create_app(checkpoint, token_table, private, _cached_loader(), max_body=max_body, witness=wit,
                     limits=Limits(rate=rate, burst=burst, max_queued=max_queued, read_rate=read_rate,
                                   read_burst=read_burst),
                     verify_every_s=verify_every, retired_keys=retired, witness_init=witness_init)
    for w in warnings + key_warnings + app.state.warnings:
        typer.echo(f"warning: {w}", err=True)
    sock = startup.bind(host, port)  # a busy port: one error line, exit 2, before claiming to serve
    typer.echo(f"serving {checkpoint} on http://{host}:{port} (public key {receipts.public_key_hex(private)}, "
               f"fingerprint {tlog.fingerprint(private)})")
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                  timeout_keep_alive=max(1, int(idle_timeout)), limit_concurrency=256,
                                  http=startup.guarded_http(idle_timeout, max_connections_per_client))
                   ).run(sockets=[sock])


def verify_cmd(receipt: Path = typer.Argument(..., help="receipt JSON (the 'receipt' of GET /v1/requests/ID)"),
               key: Path = typer.Option(..., "--key", help="the server's public key (PEM or hex; GET /v1/key)"),
               weights: Optional[Path] = typer.Option(None, "--weights", help="weights file whose sha256 must be "
                                                      "the receipt's sha256_after"),
               ids: Optional[str] = typer.Option(None, "--ids", help="your sample ids ('3,17' or '[3, 17]')"),
               ids_file: Optional[Path] = typer.Option(None, "--ids-file", help="file of your sample ids"),
               salt: Optional[str] = typer.Option(None, "--salt", help="the salt returned with your request"),
               previous: Optional[Path] = typer.Option(None, "--previous", help="the previous receipt, to check the "
                                                       "chain link"),
               threads: int = threads_option("torch CPU threads (verifying a receipt needs one)")):
    """Check a receipt offline: signature, key, chain link, weights hash and your ids (exit 2 naming any
    mismatch)."""

    rec = read_json_file(receipt, "receipt")
    if isinstance(rec, dict) and "receipt" in rec and isinstance(rec["receipt"], dict):
        rec = rec["receipt"]  # the whole GET /v1/requests/ID answer
    pub = receipts.load_public_key(key)
    id_list = read_ids(ids, ids_file, "--ids or --ids-file") if (ids is not None or ids_file is not None) else None
    if weights is not None and not weights.is_file():
        raise UserError(f"weights file not found: {weights}")
    prev = read_json_file(previous, "previous receipt") if previous is not None else None
    problems = receipts.verify_receipt(rec, pub, weights=weights.read_bytes() if weights else None, ids=id_list,
                                       salt=salt, previous=prev)
    if problems:
        for p in problems:
            typer.echo(f"MISMATCH {p}")
        fail(f"receipt {receipt} does not verify: " + "; ".join(problems))
    checked = ["signature", "key"] + (["weights"] if weights else []) + (["ids"] if id_list is not None else []) \
        + (["chain link"] if prev is not None else [])
    typer.echo(f"receipt {receipt}: request #{rec['request_id']} verifies ({', '.join(checked)})")


def _fetch(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise UserError(f"{url}: HTTP {e.code} {e.read()[:200].decode(errors='replace')}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{url}: {e}") from None


def audit_cmd(receipt: Path = typer.Argument(..., help="receipt JSON (the 'receipt' of GET /v1/requests/ID)"),
              key: Path = typer.Option(..., "--key", help="the service's public key (PEM or hex), pinned"),
              url: str = typer.Option(..., "--url", help="the service's address, e.g. http://127.0.0.1:8000"),
              retired_key: Optional[List[Path]] = typer.Option(None, "--retired-key", help="a public key (PEM or "
                                                               "hex) the service signed with before a rotation: "
                                                               "receipts it signed are audited too; repeatable"),
              threads: int = threads_option("torch CPU threads (auditing a receipt needs one)")):
    """Check a receipt against the service's log now: its request is in the head it was signed in, and the
    current head extends that one (a smaller or different log: the service was rolled back; exit 2). A receipt
    signed before a key rotation is checked under its --retired-key; the current head may be signed by a
    retired key only up to the size the current key pinned it to (GET /v1/key's retirement statements)."""
    rec = read_json_file(receipt, "receipt")
    if isinstance(rec, dict) and isinstance(rec.get("receipt"), dict):
        rec = rec["receipt"]
    pub = receipts.load_public_key(key)
    retired = [receipts.load_public_key(k) for k in retired_key or []]
    signer = next((k for k in retired if isinstance(rec, dict)
                   and rec.get("public_key") == receipts.public_key_hex(k)), pub)
    problems = receipts.verify_receipt(rec, signer)
    sth = rec.get("tree_head") if isinstance(rec, dict) else None
    if not problems and isinstance(sth, dict):
        base = url.rstrip("/")
        pins = {}
        if retired:
            served = _fetch(f"{base}/v1/key")
            pins = tlog.retired_pins(served.get("retired") if isinstance(served, dict) else None, pub)
        current = _fetch(f"{base}/v1/log/head")
        proof = {"proof": []}
        if isinstance(current, dict) and isinstance(current.get("tree_size"), int) \
                and current["tree_size"] >= sth["tree_size"]:
            proof = _fetch(f"{base}/v1/log/consistency?first={sth['tree_size']}&second={current['tree_size']}")
        problems = tlog.audit(rec, current, proof.get("proof"), pub, retired, pins)
    elif not problems:
        problems = ["the receipt carries no tree head (format 1): it cannot be audited against the log"]
    if problems:
        for p in problems:
            typer.echo(f"MISMATCH {p}")
        fail(f"receipt {receipt} does not audit: " + "; ".join(problems))
    typer.echo(f"receipt {receipt}: request #{rec['request_id']} is in the log, whose head now (size "
               f"{current['tree_size']}, root {current['root_hash'][:16]}…) extends the one in the receipt "
               f"(size {sth['tree_size']})")
