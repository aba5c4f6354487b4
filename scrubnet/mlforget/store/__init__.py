"""ML checkpoints as a transactional request store: SQLite (WAL) for the record, safetensors for the weights.

One module per concern:

* :mod:`.schema` — the directory layout, the tables, the constants, :class:`StoreError`;
* :mod:`.blobs` — the content-addressed weights files and the persisted dual/primal factors;
* :mod:`.chain` — the record chain binding every stored field (:func:`field_digests`, :func:`link_hash`);
* :mod:`.db` — opening (read-only or for writing; never upgrading) and creating the database;
* :mod:`.record` — :func:`save_new`, :func:`load`, :func:`requests`, :func:`verify` and the rows the service
  signs;
* :mod:`.apply` — the request protocol: :func:`forget` and :func:`forget_everything`, each applied exactly
  once under concurrency and kills;
* :mod:`.queue` — the HTTP service's queue (:func:`submit`, :func:`apply_submission`, receipts);
* :mod:`.migrate` — :func:`upgrade`, the only function that changes a checkpoint's format.

The record chain binds every stored field: the ``checkpoint`` values are sealed (``record_seal``: one sha256
per value and a link over them), request #0's link chains to that seal, request #k's to request #k−1's, the
state's to the last request's; each link hashes the sha256 of every column of its row (the whole solver dict
included) and the previous link. :func:`verify` recomputes them all and names any edited field.

Reading never writes: :func:`load`, :func:`requests`, :func:`verify` and the service's reads open the
database read-only. A checkpoint of a previous format (``scrubnet-mlforget/1``: ``state.json`` +
``ledger.jsonl``; ``scrubnet-mlforget/2``: the tables without the chain) is refused by every open with an
error naming ``scrubnet mlforget upgrade``; :func:`upgrade` migrates or seals it.
"""
from scrubnet.mlforget.store.apply import (DUAL_RESIDUAL_TOL, forget, forget_everything, forgotten_by_request,
                                           request_key, solver_result_problem)
from scrubnet.mlforget.store.blobs import _read_factor, _read_primal, _write_factor, factor_key, weights_bytes
from scrubnet.mlforget.store.chain import field_digests, link_hash
from scrubnet.mlforget.store.migrate import migrate_legacy, upgrade
from scrubnet.mlforget.store.queue import (REFUSED, applied_without_receipt, apply_submission, check_ids_now,
                                           oldest_queued, previous_receipt, queued_count, set_receipt, submission,
                                           submission_by_key, submissions, submit)
from scrubnet.mlforget.store.record import (load, request_links, request_with_link, requests, save_new,
                                            state_record, verify)
from scrubnet.mlforget.store.schema import (CHAIN_FORMAT, DB, FACTOR, FACTOR_FORMAT, FORMAT, FORMAT_UNSEALED,
                                            LEGACY_FORMAT, LEGACY_LEDGER, LEGACY_STATE, LOCK_TIMEOUT_S, PAUSE_ENV,
                                            PRIMAL, PRIMAL_FORMAT, REQUEST_COLUMNS, SCHEMA, SEAL_KEY,
                                            SUBMISSION_COLUMNS, SUBMISSIONS_SCHEMA, WEIGHTS, StoreError,
                                            needs_upgrade)

__all__ = ["CHAIN_FORMAT", "DB", "DUAL_RESIDUAL_TOL", "FACTOR", "FACTOR_FORMAT", "FORMAT", "FORMAT_UNSEALED",
           "LEGACY_FORMAT", "LEGACY_LEDGER", "LEGACY_STATE", "LOCK_TIMEOUT_S", "PAUSE_ENV", "PRIMAL",
           "PRIMAL_FORMAT", "REFUSED",
           "REQUEST_COLUMNS", "SCHEMA", "SEAL_KEY", "SUBMISSION_COLUMNS", "SUBMISSIONS_SCHEMA",
           "WEIGHTS", "StoreError", "applied_without_receipt", "apply_submission", "check_ids_now", "factor_key",
           "field_digests", "forget", "forget_everything", "forgotten_by_request", "link_hash", "load",
           "migrate_legacy", "needs_upgrade", "oldest_queued", "previous_receipt",
           "queued_count", "request_key", "request_links",
           "request_with_link", "requests", "save_new", "set_receipt", "solver_result_problem", "state_record",
           "submission", "submission_by_key", "submissions", "submit", "upgrade", "verify", "weights_bytes",
           "_read_factor", "_read_primal", "_write_factor"]
