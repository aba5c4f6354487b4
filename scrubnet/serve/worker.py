"""The service's single worker thread: applies queued submissions in arrival order and signs their receipts.

Receipts are deterministic functions of the store (Ed25519 signatures are deterministic), so a kill between
applying and signing loses nothing: :func:`issue_receipts` signs them at the next pass or start.
"""
from __future__ import annotations

import threading
from pathlib import Path

from scrubnet.mlforget import store
from scrubnet.serve import receipts


def issue_receipts(path: Path, key) -> int:
    """Sign and store the receipts of applied submissions that have none, in request order; returns how many."""
    n = 0
    for sub in store.applied_without_receipt(path):
        request, link, prev_link = store.request_with_link(path, sub["request_id"])
        prev = store.previous_receipt(path, sub["request_id"])
        receipt = receipts.build_receipt(request, sub, link, prev_link,
                                         receipts.receipt_sha256(prev) if prev else None, key)
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

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                issue_receipts(self.path, self.key)
                sid = store.oldest_queued(self.path)
                if sid is None:
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
                    continue
                store.apply_submission(self.path, sid, self.data_loader)
                self.last_error = None
            except Exception as e:  # noqa: BLE001 — a busy or damaged store: reported on /v1/log, retried
                self.last_error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)
