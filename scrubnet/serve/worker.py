"""The service's single worker thread: applies queued submissions in arrival order, logs them in the
transparency log and signs their receipts.

Receipts are functions of the store and of the tree head they are logged in, so a kill between applying and
signing loses nothing: :func:`issue_receipts` signs them at the next pass or start.

Each pass with work (a queued submission, or receipts to sign), and every ``verify_every_s`` seconds while
idle, the worker verifies the record against the chain, the stored receipts and the signed head
(:func:`scrubnet.serve.anchor.verify`), then against what this service already signed and published
(:meth:`Worker.rollback_problems`: the checkpoint's log and its head file no smaller than the largest tree
head it signed, the witness still holding a head that the log extends). When either fails it stops for good
(``halted`` names the problems): it applies nothing more and signs nothing more, POSTs and the model's routes
are answered 503, and a restart is refused until the record is restored. So an older copy of the checkpoint
restored under the running service is never applied to nor served: the routes check the cheap half
(:meth:`Worker.guard`: the log's size and the link of the last request signed) on every call, the worker
the whole before it applies a request.

When the log grew it signs a new tree head, hands it to the witness (after checking that it extends the
witnessed one), writes the signed head that carries it (so ``GET /v1/log/head`` serves it), and only then
signs the receipts that name it; then it re-signs the head over them.
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


def current_tree_head(path: Path, key, rec: dict, witness=None, retired=(), statements=(),
                      pins: dict | None = None) -> dict:
    """The tree head of the record ``rec`` (a valid :func:`anchor.verify` result): the signed head's when it
    covers the whole log under ``key``, else a new one, handed to ``witness`` first with the retirement
    ``statements`` (``ValueError`` when the log does not extend the witnessed head)."""
    hashes = rec["leaf_hashes"]
    old = (anchor.read_head(path) or {}).get("tree_head")
    if isinstance(old, dict) and old.get("tree_size") == len(hashes) and \
            old.get("root_hash") == merkle.root(hashes).hex() and not tlog.tree_head_problems(old, key.public_key()):
        return old
    sth = tlog.sign_tree_head(key, hashes)
    if witness is not None:
        problems = tlog.witness_problems(witness.latest(), hashes, key.public_key(), retired, pins)
        if problems:
            raise ValueError("; ".join(problems))
        witness.publish(sth, statements)
    return sth


class Worker(threading.Thread):
    """Applies queued submissions one at a time, in arrival order, and signs their receipts.

    ``log_size`` is the largest tree head this service signed or found signed at start (witness or head file);
    ``statements`` the retirement statements of its retired keys and ``pins`` their sizes
    (:func:`scrubnet.serve.tlog.retired_pins`); ``published`` whether the witness holds a head (from then on it
    must keep one)."""

    def __init__(self, path: Path, key, data_loader, idle_s: float = 0.5, witness=None,
                 verify_every_s: float = 30.0, retired=(), statements=(), log_size: int = 0,
                 published: bool = False, signed_link: tuple[int, str] | None = None):
        super().__init__(name="scrubnet-serve-worker", daemon=True)
        self.path, self.key, self.data_loader, self.idle_s = path, key, data_loader, idle_s
        self.witness, self.verify_every_s, self.verified_at = witness, verify_every_s, time.monotonic()
        self.retired, self.statements = tuple(retired), list(statements)
        self.pins = tlog.retired_pins(self.statements, key.public_key())
        self.log_size, self.published, self.signed_link = int(log_size), bool(published), signed_link
        self.wake, self.stop = threading.Event(), threading.Event()
        self.last_error: str | None = None
        self.halted: list[str] | None = None
        self.anchored = False
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.is_set() and self.halted is None:
            try:
                sid = store.oldest_queued(self.path)
                idle = sid is None and self.anchored and not store.applied_without_receipt(self.path)
                if idle and time.monotonic() - self.verified_at < self.verify_every_s:
                    self.wake.wait(self.idle_s)
                    self.wake.clear()
                    continue
                rec = anchor.verify(self.path, self.key.public_key(), self.retired, self.pins)
                self.verified_at = time.monotonic()
                problems = rec["problems"] if not rec["valid"] else self.rollback_problems(rec)
                if problems:
                    self.halt(problems)
                    return
                if idle:
                    continue
                try:
                    sth = current_tree_head(self.path, self.key, rec, self.witness, self.retired, self.statements,
                                            self.pins)
                except ValueError as e:
                    self.halt([f"the {self.witness} refuses the log: {e}"])
                    return
                self._signed(sth, rec)
                # the head naming the new tree head is written before any receipt naming it is stored
                anchor.sign_head(self.path, self.key, rec, sth, self.statements)
                if issue_receipts(self.path, self.key, sth, rec["leaf_hashes"]):
                    anchor.sign_head(self.path, self.key, rec, sth, self.statements)
                self.anchored = True
                if sid is not None and self.halted is None:
                    store.apply_submission(self.path, sid, self.data_loader)
                self.last_error = None
            except Exception as e:  # noqa: BLE001 — a busy or damaged store: reported on /v1/log, retried
                self.last_error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)

    def _signed(self, sth: dict, rec: dict) -> None:
        with self._lock:
            if int(sth["tree_size"]) >= self.log_size and sth["tree_size"] > 0:
                links = {r["id"]: r["hash"] for r in rec["requests"]}
                self.signed_link = (sth["tree_size"] - 1, links[sth["tree_size"] - 1])
            self.log_size = max(self.log_size, int(sth["tree_size"]))
            self.published = self.published or self.witness is not None

    def rollback_problems(self, rec: dict) -> list[str]:
        """What the checkpoint lost of what this service signed (``rec``: a valid :func:`anchor.verify`
        result): its log or its head file smaller than :attr:`log_size`, another request where the largest
        signed tree head ends (``signed_link``), and against the witness: no head held any more once one was
        published, or a head the log does not extend."""
        n, problems = len(rec["leaf_hashes"]), []
        if n < self.log_size:
            problems.append(f"the checkpoint's log has {n} entries, fewer than the {self.log_size} this service "
                            "signed: an older copy of the checkpoint was restored under the running service")
        if self.signed_link is not None and n >= self.log_size:
            i, link = self.signed_link
            if {r["id"]: r["hash"] for r in rec["requests"]}.get(i) != link:
                problems.append(f"request #{i} of the checkpoint is not the one this service signed in its log: the "
                                "record was rewritten, or another copy restored under the running service")
        sth = (anchor.read_head(self.path) or {}).get("tree_head")
        size = sth.get("tree_size") if isinstance(sth, dict) else None
        if self.log_size and (not isinstance(size, int) or size < self.log_size):
            problems.append(f"the signed head file holds a tree head of {size} requests, not the {self.log_size} "
                            "this service signed: it was replaced by an older one or removed")
        if self.witness is not None:
            try:
                state, witnessed, _ = self.witness.read()
            except ValueError as e:
                return problems + [str(e)]
            if witnessed is None and self.published:
                problems.append(f"the {self.witness} holds no tree head any more ({state}), though this service "
                                "published to it: deleted, emptied or replaced under the running service")
            problems += tlog.witness_problems(witnessed, rec["leaf_hashes"], self.key.public_key(), self.retired,
                                              self.pins)
        return problems

    def guard(self) -> None:
        """The routes' cheap check, before a POST is queued or the model served: ``RuntimeError`` naming the
        problems once halted; halts (and raises) when the checkpoint's log is smaller than :attr:`log_size`, or
        its request at the end of the largest signed tree head (``signed_link``) has another record-chain link
        (an older or another copy restored under the running service). Two reads of the store."""
        if self.halted is None:
            n = store.state_record(self.path)["request_id"] + 1
            if n < self.log_size:
                self.halt([f"the checkpoint's log has {n} entries, fewer than the {self.log_size} this service "
                           "signed: an older copy of the checkpoint was restored under the running service"])
            elif self.signed_link is not None:
                i, link = self.signed_link
                try:
                    now = store.request_with_link(self.path, i)[1]
                except store.StoreError:
                    now = None
                if now != link:
                    self.halt([f"request #{i} of the checkpoint is not the one this service signed in its log: "
                               "the record was rewritten, or another copy restored under the running service"])
        if self.halted is not None:
            raise RuntimeError("; ".join(self.halted))

    def halt(self, problems: list[str]) -> None:
        """Stop for good: nothing more is applied or signed; POSTs get 503."""
        self.halted = problems
        self.last_error = "halted: the record does not verify: " + "; ".join(problems)
        self.wake.set()
