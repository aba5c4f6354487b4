"""``scrubnet serve`` (deletion requests over HTTP, optional extra ``scrubnet[serve]``) and
``scrubnet receipt verify`` (offline check of a signed receipt).

    scrubnet serve CHECKPOINT --tokens tokens.txt [--host 127.0.0.1 --port 8000 --key FILE]
    scrubnet receipt verify RECEIPT.json --key KEY.pub [--weights W.safetensors] [--ids IDS --salt S]
        [--previous PREVIOUS_RECEIPT.json]

Bad input gives one line ``error: …`` on stderr and exit code 2; a receipt that does not verify exits 2
naming every mismatch.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Optional

import typer

from scrubnet.cli.common import UserError, fail, read_ids, read_json_file, threads_option
from scrubnet.experiments.checkpoints import ml_data_loader
from scrubnet.mlforget import store
from scrubnet.serve import receipts, startup
from scrubnet.serve.app import create_app, read_tokens

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


def serve(checkpoint: Path = typer.Argument(..., help="ML checkpoint directory (scrubnet mlforget train)"),
          tokens: Path = typer.Option(..., "--tokens", help="file of lines 'TOKEN ROLES [NAME]'; roles: "
                                      "submit, read, admin (comma-separated)"),
          host: str = typer.Option("127.0.0.1", help="address to bind (loopback by default)"),
          port: int = typer.Option(8000, help="TCP port"),
          key: Optional[Path] = typer.Option(None, "--key", help="Ed25519 private key (PEM) signing the receipts; "
                                             "default CHECKPOINT/receipt-key.pem, created with its .pub on first "
                                             "start"),
          max_body: int = typer.Option(1 << 20, help="largest request body accepted, bytes (413 above)"),
          threads: int = threads_option("torch CPU threads")):
    """Serve one ML checkpoint: queue deletion requests, apply them in order, sign a receipt for each."""
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
    token_table = read_tokens(tokens)
    store.verify(checkpoint)  # a missing or damaged checkpoint is refused before binding
    warnings = startup.check_modes(checkpoint, tokens)  # refused before anything is written
    key = key or checkpoint / "receipt-key.pem"
    if not key.exists():
        receipts.write_key_pair(key, key.with_suffix(".pub"))
    warnings += startup.check_modes(key=key)
    private = receipts.load_private_key(key)
    app = create_app(checkpoint, token_table, private, _cached_loader(), max_body=max_body)  # anchored verify
    for w in warnings + app.state.warnings:
        typer.echo(f"warning: {w}", err=True)
    sock = startup.bind(host, port)  # a busy port: one error line, exit 2, before claiming to serve
    typer.echo(f"serving {checkpoint} on http://{host}:{port} (public key {receipts.public_key_hex(private)})")
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


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
