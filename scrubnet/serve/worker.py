"""The service's single worker thread: applies queued submissions in arrival order and signs their receipts.

Receipts are deterministic functions of the store (Ed25519 signatures are deterministic), so a kill between
applying and signing loses nothing: :func:`issue_receipts` signs them at the next pass or start.

Before each pass with work (a queued submission, or receipts to sign) the worker verifies the record against
the chain, the stored receipts and the signed head (:func:`scrubnet.serve.anchor.verify`); when that fails it
stops for good (``halted`` names the problems): it applies nothing more and signs nothing more, and a restart
is refused until the record is restored. After signing it re-signs the head over the record it verified.
"""
from __future__ import annotations

import threading
from pathlib import Path

from scrubnet.mlforget import store
from scrubnet.serve import anchor, receipts


def issue_receipts(path: Path, key) -> int:
    """Sign and store the receipts of applied submissions that have none, in request order; returns how many."""
    n = 0
    for sub in store.applied_without_receipt(path):
        request, link, prev_link = store.request_with_link(path, sub["request_id"])
        prev = store.previous_receipt(path, sub["request_id"])
        digests = store.field_digests({k: request[k] for k in store.REQUEST_COLUMNS})
        receipt = receipts.build_receipt(request, sub, link, prev_link,
                                         receipts.receipt_sha256(prev) if prev else None, key, digests)
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
        self.halted: list[str] | None = None
        self.anchored = False

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                sid = store.oldest_queued(self.path)
                if sid is None and self.anchored and not store.applied_without_receipt(self.path):
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
                    continue
                rec = anchor.verify(self.path, self.key.public_key())
                if not rec["valid"]:
                    self.halted = rec["problems"]
                    self.last_error = "halted: the record does not verify: " + "; ".join(rec["problems"])
                    return
                issue_receipts(self.path, self.key)
                anchor.sign_head(self.path, self.key, rec)
                self.anchored = True
                if sid is not None:
                    store.apply_submission(self.path, sid, self.data_loader)
                self.last_error = None
            except Exception as e:  # noqa: BLE001 — a busy or damaged store: reported on /v1/log, retried
                self.last_error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)
