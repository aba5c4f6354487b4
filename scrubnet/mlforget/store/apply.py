"""Applying a request: :func:`forget` and :func:`forget_everything`, each committed exactly once.

Protocol of a request:

1. outside any lock: load the data D (they depend only on the static ``checkpoint`` table), so the lock is
   held for the computation only;
2. ``BEGIN IMMEDIATE`` — the write lock is taken *before* the state is read, so concurrent requests
   serialise: each sees the weights its predecessor committed, none is lost, none is applied twice;
3. if a request with the same key is already stored, stop: it was applied (``applied_now=False``);
4. read the state, load the weights named by its sha256 (verified), check the ids;
5. compute the new weights in memory; refuse a non-finite result;
6. write ``weights/<new sha256>.safetensors`` (temp file, fsync, rename) — not referenced yet;
7. insert the request row and update the state row; ``COMMIT`` (SQLite makes this atomic and durable);
8. in a second short write transaction, delete weights files the state no longer names.

A process killed anywhere before 7 completes leaves the previous committed state (SQLite discards an
uncommitted transaction; an unreferenced weights file at most, deleted at the next request); killed after
it, the request is committed. Re-running the request then applies it exactly once: step 3 recognises it.

The factor file is read in step 1 (outside the lock), verified against the content hash in its metadata
(:mod:`scrubnet.integrity`), and used in step 5 when its key matches the checkpoint's core weights, data
fingerprint and the settings the Gram depends on (``factor_file: loaded`` in the request's record). Absent, it
is rebuilt from the data as before (``factor_file: absent``, ``factor_rebuilt: missing``). Damaged (truncated,
not safetensors, hash mismatch, non-finite), foreign (``key mismatch``) or giving a solve above the residual
tolerance (``bad solve``), it is rebuilt from the data, the problem is recorded with the file's name
(``factor_file_problem``) and the file is replaced by the rebuilt factor (``factor_file_rewritten``). It never
changes otherwise: the factor covers all user data and a request's Schur complement removes the forgotten
rows, so it is the same for every state of the checkpoint.

A request is committed only when its solver reached its tolerance (:func:`solver_result_problem`: the dual's
relative residual ≤ :data:`DUAL_RESIDUAL_TOL`, CG converged); otherwise it is refused and nothing is written.

Test hook: ``SCRUBNET_MLFORGET_PAUSE_AT=<stage>`` makes the process print ``PAUSED <stage>`` and sleep at
that stage (``locked``, ``after_solve``, ``weights_partial``, ``after_weights``, ``before_commit``,
``after_commit``), so a test can kill it there for real.
"""
from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

import torch

from scrubnet.data.stream import inputs_finite
from scrubnet.mlforget.model import MLConfig, check_forget_ids, forget_all, forget_request
from scrubnet.mlforget.store.blobs import (_check_finite_model, _read_factor, _read_primal, _write_factor,
                                           _write_weights, factor_key, weights_bytes)
from scrubnet.mlforget.store.chain import _seal_request, _seal_state
from scrubnet.mlforget.store.db import _empty_model, _load_state, _open, _write_transaction
from scrubnet.mlforget.ftstore import with_root
from scrubnet.mlforget.sharded import ENGINE as SHARDED
from scrubnet.mlforget.store.schema import (FACTOR, PRIMAL_FORMAT, REQUEST_COLUMNS, WEIGHTS, StoreError,
                                            _insert_request, _now, _pause, _read_state, _row_to_request, _sha)


#: the largest relative residual of the dual system a request may commit (a sound factor gives ~1e-14)
DUAL_RESIDUAL_TOL = 1e-8


def solver_result_problem(info: dict) -> str | None:
    """Why a request's solver result must not be committed, or None: the dual's relative residual above
    :data:`DUAL_RESIDUAL_TOL` (dual or primal), or CG (plain or certified) stopped before its tolerance. The papers' SGD is inexact by design
    (no tolerance) and is accepted."""
    raw = info.get("relative_residual")
    res = float(raw) if isinstance(raw, (int, float)) else float("nan")
    if info.get("solver") in ("dual", "primal"):
        if not math.isfinite(res) or res > DUAL_RESIDUAL_TOL:
            return (f"the {info.get('solver')} solver's relative residual {res:.3g} exceeds its tolerance "
                    f"{DUAL_RESIDUAL_TOL:g}")
    elif info.get("solver") in ("cg", "cg-certified"):
        if not info.get("converged", False) or not math.isfinite(res):
            return (f"CG stopped after {info.get('iterations')} iterations at relative residual {res:.3g} "
                    "without reaching its tolerance")
    return None


def request_key(kind: str, ids, sigma: float | None) -> str:
    """Identity of a request: kind, sorted ids and σ."""
    payload = json.dumps({"kind": kind, "ids": sorted(int(i) for i in ids), "sigma": sigma}, sort_keys=True)
    return _sha(payload.encode())[:32]


# -- requests --------------------------------------------------------------------------------------------

def _apply(path: str | Path, kind: str, key: str, compute, prepare=None, on_commit=None,
           on_duplicate=None) -> tuple[dict, bool]:
    """The request protocol of the module docstring. ``prepare(static)`` runs before the lock (data loading);
    ``compute(state, record_state, prepared) -> record fields`` runs under it and updates ``state`` in place.
    ``on_commit(con, record)`` runs inside the committing transaction (the service marks its submission
    applied there, atomically with the request); ``on_duplicate(con, record)`` inside the transaction that
    found the request already stored."""
    with _open(path, write=True) as (p, con, static):
        prepared = prepare(static) if prepare is not None else None
        model = _empty_model(static, p)
        with _write_transaction(con):
            _pause("locked")
            row = con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests WHERE key = ?", (key,)).fetchone()
            if row is not None:
                if on_duplicate is not None:
                    on_duplicate(con, _row_to_request(row))
                return _row_to_request(row), False
            st = _read_state(con)
            state = _load_state(p, static, st, model)
            if st["user_weights_dropped"]:
                raise StoreError(f"forget-all already dropped the user weights (request #{st['request_id']}); "
                                 "there is nothing left to forget")
            t0 = time.perf_counter()
            fields = compute(state, st, prepared)
            seconds = time.perf_counter() - t0
            _check_finite_model(state.model, f"the {kind} request produced a model that")
            _pause("after_solve")
            data = weights_bytes(state.model)
            sha = _sha(data)
            _write_weights(p, data, sha)
            _pause("after_weights")
            rid = st["request_id"] + 1
            record = {"id": rid, "key": key, "kind": kind, "seconds": seconds, "time_utc": _now(),
                      "sha256_before": st["weights_sha256"], "sha256_after": sha, "status": "applied", **fields}
            _insert_request(con, record)
            prev = con.execute("SELECT hash FROM requests WHERE id = ?", (st["request_id"],)).fetchone()[0]
            record["hash"] = _seal_request(con, rid, prev)
            dropped = kind == "forget_all"
            con.execute("UPDATE state SET request_id = ?, weights_sha256 = ?, forgotten_ids = ?, "
                        "user_weights_dropped = ? WHERE one = 1",
                        (rid, sha, json.dumps(state.forgotten_ids.tolist()), int(dropped)))
            _seal_state(con, record["hash"])
            if on_commit is not None:
                on_commit(con, record)
            _pause("before_commit")
        _pause("after_commit")
        _collect_garbage(p, con)
        return record, True


def _collect_garbage(path: Path, con: sqlite3.Connection) -> None:
    """Delete weights files and temp files the state does not name; under the write lock, so no request is
    between writing its weights and committing them."""
    with _write_transaction(con):
        keep = f"{_read_state(con)['weights_sha256']}.safetensors"
        for f in (path / WEIGHTS).iterdir():
            if f.name != keep:
                f.unlink(missing_ok=True)


def forget(path: str | Path, ids, *, sigma: float | None = None, x_all=None, y_all=None,
           data_loader=None, on_commit=None, on_duplicate=None, budget_nats: float | None = None
           ) -> tuple[dict, bool]:
    """Apply one forgetting request to the checkpoint at ``path``; returns (request record, applied_now).

    The data D come from ``x_all, y_all`` or from ``data_loader(static) -> (x, y)`` (called before the lock).
    A request whose key (kind, sorted ids, σ) is already stored is not applied again: its record is
    returned with ``applied_now=False``. ``on_commit``/``on_duplicate``: see :func:`_apply`. The noise of request #k is drawn from seed 1 000 003·seed + k.
    """
    ids = sorted(int(i) for i in ids)
    with _open(path) as (_, _con, static):
        sig = MLConfig.from_dict(static["ml_config"]).sigma if sigma is None else float(sigma)
    if not (math.isfinite(sig) and sig >= 0):
        raise StoreError(f"sigma must be a finite number ≥ 0, got {sig}")
    key = request_key("forget", ids, sig)

    def prepare(static):
        if x_all is not None:
            data = x_all, y_all
        elif data_loader is None:
            raise StoreError("no data given for the forgetting request")
        else:
            data = data_loader(with_root(static, path))  # a fine-tune's data: relative to the checkpoint
        return data, _read_factor(Path(path)), _read_primal(Path(path))

    def compute(state, st, prepared):
        ids_t = check_forget_ids(state, ids)
        if getattr(state.model, "engine", None) == SHARDED:
            return _sharded_compute(state, ids_t, prepared[0], sig)
        (x, y), (factor, factor_status, key, factor_problem), (primal, primal_status, pkey) = prepared
        if primal is not None:
            if pkey == factor_key(state.model, static, primal.ids, PRIMAL_FORMAT):
                state.primal, primal_status = primal, "loaded"
            else:
                primal_status = "key mismatch"
        if not inputs_finite(x):
            raise StoreError("the data D contain non-finite values (NaN or inf); nothing was changed")
        if factor is not None:
            if key == factor_key(state.model, static, factor.ids):
                state.factor, factor_status = factor, "loaded"
            else:
                factor_status = "key mismatch"
                factor_problem = (f"{Path(path) / FACTOR}: key mismatch (built for other core weights, data or "
                                  "settings)")
        noise_seed = 1_000_003 * state.seed + st["request_id"] + 1
        out = forget_request(state, x, y, ids, sigma=sig, noise_seed=noise_seed, apply=False,
                             budget_nats=budget_nats)
        problem = solver_result_problem(out.info.as_dict())
        if problem and factor_status == "loaded":
            # the verified file gave a bad solve: rebuild the factor from the data once and solve again
            state.factor, factor_status = None, "bad solve"
            factor_problem = f"{Path(path) / FACTOR}: {problem}"
            out = forget_request(state, x, y, ids, sigma=sig, noise_seed=noise_seed, apply=False,
                             budget_nats=budget_nats)
            problem = solver_result_problem(out.info.as_dict())
        if problem:
            raise StoreError(f"request refused, nothing was committed: {problem}")
        state.model.set_delta_flat(out.w_after)
        state.forgotten_ids = torch.sort(torch.cat([state.forgotten_ids, ids_t])).values  # as forget_request
        rewritten = False
        if factor_problem and state.factor is not None and state.factor.source == "built":
            # the file was damaged, foreign or gave a bad solve: replace it by the factor rebuilt from the data
            _write_factor(Path(path), state.factor, factor_key(state.model, static, state.factor.ids))
            rewritten = True
        extra = {"factor_file_problem": factor_problem, "factor_file_rewritten": rewritten} if factor_problem else {}
        return {"ids": ids, "n_ids": len(ids), "n_remaining": int(len(state.deletable_ids())), "sigma": sig,
                "solver": {"engine": "linearised", **out.info.as_dict(), "factor_file": factor_status, "primal_file": primal_status,
                           **extra}}

    return _apply(path, "forget", key, compute, prepare, on_commit, on_duplicate)


def _sharded_compute(state, ids_t, data, sigma: float) -> dict:
    """A request to a sharded checkpoint (:mod:`scrubnet.mlforget.sharded`): the touched shards retrained
    from their slice checkpoints; the solver record names the engine, the shards and slices retrained and the
    cost (sample-passes of this request and of the whole training)."""
    if sigma:
        raise StoreError(f"the sharded engine deletes by retraining and adds no noise: sigma must be 0, got {sigma:g}")
    x, y = data
    if not inputs_finite(x):
        raise StoreError("the data D contain non-finite values (NaN or inf); nothing was changed")
    info = state.model.forget(ids_t.tolist(), x, y)
    state.forgotten_ids = state.model.forgotten.clone()
    return {"ids": ids_t.tolist(), "n_ids": int(len(ids_t)), "n_remaining": int(len(state.deletable_ids())),
            "sigma": 0.0, "solver": info}


def forget_everything(path: str | Path, on_commit=None, on_duplicate=None) -> tuple[dict, bool]:
    """Forget all user data: w_u ← 0. The request lists no ids (it names no samples); the state records that
    the user weights were dropped and adds the deletable user ids to the forgotten ones — never the core ids,
    whose information lives in the core weights and stays. Idempotent like :func:`forget`."""
    key = request_key("forget_all", [], None)

    def compute(state, st, _):
        n = int(len(state.deletable_ids()))
        if getattr(state.model, "engine", None) == SHARDED:
            state.model.reset()  # every shard back at the pretrained point
        else:
            forget_all(state)
        state.forgotten_ids = state.user_ids[~torch.isin(state.user_ids, state.core_ids)]
        engine = SHARDED if getattr(state.model, "engine", None) == SHARDED else "linearised"
        return {"ids": [], "n_ids": n, "n_remaining": 0, "sigma": 0.0,
                "solver": {"engine": engine, "solver": "zero", "iterations": 0, "user_weights_dropped": True}}

    return _apply(path, "forget_all", key, compute, None, on_commit, on_duplicate)


def forgotten_by_request(reqs: list[dict]) -> list[int]:
    """The union of the ids of the ``forget`` requests (the state's forgotten ids unless ``forget_all``
    dropped the user weights)."""
    return sorted(i for r in reqs if r["kind"] == "forget" for i in r["ids"])
