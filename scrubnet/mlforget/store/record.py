"""Creating a checkpoint and reading its record: :func:`save_new`, :func:`load`, :func:`requests`,
:func:`verify` and the record rows the service signs (:func:`request_with_link`, :func:`state_record`).

Reading never writes: every function here except :func:`save_new` opens the database read-only, and a
reader (``show``, ``load``) needs no lock: WAL gives it a consistent snapshot of the record.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from scrubnet.mlforget.model import MLState
from scrubnet.mlforget.store.blobs import (_check_finite_model, _weights_path, _write_factor, _write_primal,
                                           factor_key, weights_bytes)
from scrubnet.mlforget.store.chain import _chain_problems, field_digests
from scrubnet.mlforget.store.db import _create_db, _load_state, _open
from scrubnet.mlforget.store.schema import (DB, FORMAT, PRIMAL_FORMAT, REQUEST_COLUMNS, SEAL_KEY, WEIGHTS, StoreError,
                                            _fsync_dir, _now, _read_state, _row_to_request, _sha)


def save_new(path: str | Path, state: MLState, *, arch: str, in_shape, arch_options: dict | None = None,
             data: dict | None = None, data_fingerprint: str | None = None, extra: dict | None = None,
             files: dict | None = None) -> dict:
    """Create checkpoint directory ``path`` (must not exist) for ``state``; built in a temporary directory
    and renamed, so an interrupted save leaves nothing at ``path``. ``files`` ({name in the checkpoint: file
    or directory}) are moved into it before the rename (a fine-tune's base model and data, kept beside the
    record). Returns the training request's record."""
    path = Path(path)
    if path.exists():
        raise StoreError(f"{path} already exists; choose a new checkpoint directory")
    _check_finite_model(state.model, "the trained ML model")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a checkpoint gets the usual permissions
    try:
        for name, src in (files or {}).items():
            shutil.move(str(src), str(tmp / name))
        data_bytes = weights_bytes(state.model)
        sha = _sha(data_bytes)
        (tmp / WEIGHTS).mkdir()
        _weights_path(tmp, sha).write_bytes(data_bytes)
        if state.factor is not None:
            _write_factor(tmp, state.factor, factor_key(state.model, {
                "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                "num_classes": int(state.num_classes), "ml_config": state.config.to_dict(),
                "data_fingerprint": data_fingerprint}, state.factor.ids))
        if state.primal is not None:
            _write_primal(tmp, state.primal, factor_key(state.model, {
                "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                "num_classes": int(state.num_classes), "ml_config": state.config.to_dict(),
                "data_fingerprint": data_fingerprint}, state.primal.ids, PRIMAL_FORMAT))
        static = {"format": FORMAT, "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                  "num_classes": int(state.num_classes), "seed": int(state.seed), "ml_config": state.config.to_dict(),
                  "data": data, "data_fingerprint": data_fingerprint, "core_ids": state.core_ids.tolist(),
                  "user_ids": state.user_ids.tolist(), **(extra or {})}
        record = {"id": 0, "key": None, "kind": "train", "ids": [], "n_ids": 0,
                  "n_remaining": int(len(state.deletable_ids())), "sigma": None, "solver": dict(state.train_info),
                  "seconds": float(state.train_info.get("train_seconds", 0.0) or 0.0), "time_utc": _now(),
                  "sha256_before": None, "sha256_after": sha}
        _create_db(tmp / DB, static, record, {"request_id": 0, "weights_sha256": sha,
                                               "forgotten_ids": state.forgotten_ids.tolist(),
                                               "user_weights_dropped": False})
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def load(path: str | Path) -> tuple[MLState, dict]:
    """The committed :class:`MLState` of the checkpoint at ``path`` and its record: the static
    ``checkpoint`` values plus ``request_id``, ``weights_sha256``, ``forgotten_ids``, ``user_weights_dropped``.
    Reads a consistent snapshot without taking the write lock."""
    with _open(path) as (p, con, static):
        for attempt in range(5):
            con.execute("BEGIN")  # a read transaction: one snapshot of the record
            try:
                st = _read_state(con)
            finally:
                con.execute("COMMIT")
            try:
                return _load_state(p, static, st), {**static, **st}
            except StoreError:
                # a concurrent request may have committed and removed the file between the two reads
                if attempt == 4 or _read_state(con)["weights_sha256"] == st["weights_sha256"]:
                    raise
    raise AssertionError("unreachable")


def requests(path: str | Path) -> list[dict]:
    """Every committed request, in commit order (``id`` 0 = training)."""
    with _open(path) as (_, con, _static_):
        return [_row_to_request(r) for r in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                                        "ORDER BY id")]


def verify(path: str | Path) -> dict:
    """Check the record: every field of the static record, of each request and of the state matches the
    record chain (the edited field is named); ids 0, 1, 2, … without gaps; request 0 is the training; each
    request's ``sha256_before`` is its predecessor's ``sha256_after``; the state names the last request and
    its weights, whose file hashes to that sha256; the forgotten ids are the union of the forget requests' ids
    (disjoint), and ``forget_all`` is the last request when present. Returns ``{"valid", "problems",
    "requests", "state", "head", "static_digests"}`` (``head``: the state's chain hash; ``static_digests``: the
    digest of every static field, which a signed head outside the database pins). Read-only: verifying never changes the
    checkpoint (one of a previous format is refused with a ``StoreError`` naming ``scrubnet mlforget upgrade``)."""
    with _open(path) as (p, con, static):
        con.execute("BEGIN")
        try:
            reqs = [_row_to_request(r) for r in con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                                            "ORDER BY id")]
            hashes = {r[0]: r[1] for r in con.execute("SELECT id, hash FROM requests")}
            st = _read_state(con)
            head = con.execute("SELECT hash FROM state").fetchone()[0]
            chain = _chain_problems(con)
        finally:
            con.execute("COMMIT")
    for r in reqs:
        r["hash"] = hashes[r["id"]]
    problems = chain + _consistency_problems(p, static, reqs, st)
    return {"valid": not problems, "problems": problems, "requests": reqs, "state": st, "head": head,
            "n_user": len(static["user_ids"]), "n_core": len(static["core_ids"]),
            "static_digests": field_digests({k: v for k, v in static.items() if k != SEAL_KEY})}


def _consistency_problems(p: Path, static: dict, reqs: list[dict], st: dict) -> list[str]:
    """The checks of the record that do not need the chain (weights chain, state, forgotten ids, files)."""
    problems = []
    if not reqs or reqs[0]["kind"] != "train" or reqs[0]["sha256_before"] is not None:
        problems.append("request #0 is not the training")
    forgotten: list[int] = []
    for k, r in enumerate(reqs):
        if r["id"] != k:
            problems.append(f"request ids jump from #{k - 1} to #{r['id']}")
            break
        if k and r["sha256_before"] != reqs[k - 1]["sha256_after"]:
            problems.append(f"request #{k}: sha256_before {str(r['sha256_before'])[:12]} is not the sha256_after "
                            f"{reqs[k - 1]['sha256_after'][:12]} of request #{k - 1}")
        if r["kind"] == "forget":
            dup = set(r["ids"]) & set(forgotten)
            if dup:
                problems.append(f"request #{k} forgets id(s) {sorted(dup)[:10]} a second time")
            forgotten += r["ids"]
        if r["kind"] == "forget_all" and k != len(reqs) - 1:
            problems.append(f"request #{k} is forget_all but later requests follow it")
    if reqs:
        last = reqs[-1]
        if st["request_id"] != last["id"]:
            problems.append(f"the state is at request #{st['request_id']} but the last request is #{last['id']}")
        if st["weights_sha256"] != last["sha256_after"]:
            problems.append("the state's weights are not those of the last request")
        if any(r["kind"] == "forget_all" for r in reqs) != st["user_weights_dropped"]:
            problems.append("the state's user_weights_dropped flag disagrees with the requests")
    if st["user_weights_dropped"]:
        core = set(static["core_ids"])
        forgotten = [i for i in static["user_ids"] if i not in core]
    if sorted(forgotten) != sorted(st["forgotten_ids"]):
        problems.append("the state's forgotten ids are not the union of the forget requests' ids")
    wf = _weights_path(p, st["weights_sha256"])
    if not wf.is_file():
        problems.append(f"weights file {wf.name} is missing")
    elif _sha(wf.read_bytes()) != st["weights_sha256"]:
        problems.append(f"weights file {wf.name} does not hash to its name")
    return problems


def request_with_link(path: str | Path, request_id: int) -> tuple[dict, str, str | None]:
    """(request row, its record-chain link, its predecessor's link)."""
    with _open(path) as (_, con, _static_):
        con.execute("BEGIN")
        try:
            row = con.execute(f"SELECT {', '.join(REQUEST_COLUMNS)}, hash FROM requests WHERE id = ?",
                              (int(request_id),)).fetchone()
            prev = con.execute("SELECT hash FROM requests WHERE id = ?", (int(request_id) - 1,)).fetchone()
        finally:
            con.execute("COMMIT")
    if row is None:
        raise StoreError(f"request #{request_id} is not in the store")
    return _row_to_request(row), row["hash"], prev[0] if prev else None


def state_record(path: str | Path) -> dict:
    """The committed state row plus its chain link (``head``)."""
    with _open(path) as (_, con, _static_):
        st = _read_state(con)
        st["head"] = con.execute("SELECT hash FROM state").fetchone()[0]
    return st


def request_links(path: str | Path) -> dict[int, str]:
    """{request id: its record-chain link}."""
    with _open(path) as (_, con, _static_):
        return {r[0]: r[1] for r in con.execute("SELECT id, hash FROM requests")}
