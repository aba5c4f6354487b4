"""The service's single worker thread: applies queued submissions in arrival order, logs them in the
transparency log and signs their receipts.

Receipts are functions of the store and of the tree head they are logged in, so a kill between applying and
signing loses nothing: :func:`issue_receipts` signs them at the next pass or start.

Each pass with work (a queued submission, or receipts to sign), and every ``verify_every_s`` seconds while
idle, the worker verifies the record against the chain, the stored receipts and the signed head
(:func:`scrubnet.serve.anchor.verify`); when that fails it stops for good (``halted`` names the problems):
it applies nothing more and signs nothing more, POSTs are answered 503, and a restart is refused until the
record is restored. When the log grew it signs a new tree head, hands it to the witness (after checking that
it extends the witnessed one) and only then signs the receipts that carry it; then it re-signs the head.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from scrubnet.mlforget import store
from scrubnet.serve import anchor, merkle, receipts, tlog


def issue_receipts(path: Path, key, tree_head: dict, hashes: list[bytes]) -> int:
    """Sign and store the receipts of applied submissions that have none, in request order, each logged in
    ``tree_head`` (the signed head of the tree of leaf ``hashes``); returns how many."""
    n = 0
    for sub in store.applied_without_receipt(path):
        request, link, prev_link = store.request_with_link(path, sub["request_id"])
        if request["id"] >= tree_head["tree_size"]:
            continue  # committed after this pass's verification: the next pass logs it
        prev = store.previous_receipt(path, sub["request_id"])
        proof = [h.hex() for h in merkle.inclusion_proof(request["id"], hashes[:tree_head["tree_size"]])]
        receipt = receipts.build_receipt(request, link, prev_link, receipts.receipt_sha256(prev) if prev else None,
                                         key, ids_hash=sub["ids_hash"], tree_head=tree_head, inclusion_proof=proof)
        store.set_receipt(path, sub["id"], receipt)
        n += 1
    return n


def current_tree_head(path: Path, key, rec: dict, witness=None, retired=()) -> dict:
    """The tree head of the record ``rec`` (a valid :func:`anchor.verify` result): the signed head's when it
    covers the whole log, else a new one, handed to ``witness`` first (``ValueError`` when it does not extend
    the witnessed head)."""
    hashes = rec["leaf_hashes"]
    old = (anchor.read_head(path) or {}).get("tree_head")
    if isinstance(old, dict) and old.get("tree_size") == len(hashes) and \
            old.get("root_hash") == merkle.root(hashes).hex() and not tlog.tree_head_problems(old, key.public_key()):
        return old
    sth = tlog.sign_tree_head(key, hashes)
    if witness is not None:
        problems = tlog.witness_problems(witness.latest(), hashes, key.public_key(), retired)
        if problems:
            raise ValueError("; ".join(problems))
        witness.publish(sth)
    return sth


class Worker(threading.Thread):
    """Applies queued submissions one at a time, in arrival order, and signs their receipts."""

    def __init__(self, path: Path, key, data_loader, idle_s: float = 0.5, witness=None,
                 verify_every_s: float = 30.0, retired=()):
        super().__init__(name="scrubnet-serve-worker", daemon=True)
        self.path, self.key, self.data_loader, self.idle_s = path, key, data_loader, idle_s
        self.witness, self.verify_every_s, self.verified_at = witness, verify_every_s, time.monotonic()
        self.retired = tuple(retired)
        self.wake, self.stop = threading.Event(), threading.Event()
        self.last_error: str | None = None
        self.halted: list[str] | None = None
        self.anchored = False

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                sid = store.oldest_queued(self.path)
                idle = sid is None and self.anchored and not store.applied_without_receipt(self.path)
                if idle and time.monotonic() - self.verified_at < self.verify_every_s:
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
                    continue
                rec = anchor.verify(self.path, self.key.public_key(), self.retired)
                self.verified_at = time.monotonic()
                if not rec["valid"]:
                    self.halt(rec["problems"])
                    return
                if idle:
                    continue
                try:
                    sth = current_tree_head(self.path, self.key, rec, self.witness, self.retired)
                except ValueError as e:
                    self.halt([f"the {self.witness} refuses the log: {e}"])
                    return
                issue_receipts(self.path, self.key, sth, rec["leaf_hashes"])
                anchor.sign_head(self.path, self.key, rec, sth)
                self.anchored = True
                if sid is not None:
                    store.apply_submission(self.path, sid, self.data_loader)
                self.last_error = None
            except Exception as e:  # noqa: BLE001 — a busy or damaged store: reported on /v1/log, retried
                self.last_error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)

    def halt(self, problems: list[str]) -> None:
        """Stop for good: nothing more is applied or signed; POSTs get 503."""
        self.halted = problems
        self.last_error = "halted: the record does not verify: " + "; ".join(problems)
