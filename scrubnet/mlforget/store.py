"""ML checkpoints with an append-only request ledger, crash-safe at every point.

A checkpoint is a directory::

    state.json                   the commit record (replaced atomically): format, seq (requests applied),
                                 current weights file + sha256, core/user/forgotten ids, configs, last request
    weights-<seq>.safetensors    the ML module's state_dict (core weights w_c + user weights w_u)
    ledger.jsonl                 one JSON line per request (seq 0 = training): ids, sizes, σ, solver steps,
                                 residual norm, seconds, UTC time, sha256 of the weights before and after

Protocol of a request (seq k → k+1):

1. compute the new weights in memory (nothing on disk changes);
2. write ``weights-<k+1>.safetensors`` (temp file, fsync, rename) — not referenced yet;
3. **commit**: replace ``state.json`` atomically by one that points to the new weights, lists the new
   forgotten ids and carries the ledger record as ``last_request``;
4. append the record to ``ledger.jsonl`` (one ``write`` + fsync);
5. delete the old weights file.

A kill before 3 leaves the previous checkpoint and ledger as they were (an orphan weights file at most,
removed at the next load); a kill after 3 leaves a committed request whose ledger line may be missing or
torn: every load truncates a torn last line and appends ``last_request`` if the ledger lags behind ``seq``.
Re-running the request that was committed last is recognised by its key (kind, sorted ids, σ) and is a
no-op, so an interrupted request is applied exactly once; any other request naming an already forgotten
id, or a core id, is refused.

Test hook: ``SCRUBNET_MLFORGET_PAUSE_AT=<stage>`` makes the process print ``PAUSED <stage>`` and sleep at
that stage (stages: ``after_solve``, ``weights_partial``, ``after_weights``, ``state_partial``,
``after_commit``, ``ledger_partial``, ``after_ledger``), so a test can kill it there for real.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load, save

from scrubnet.mlforget.model import MLConfig, MLState, check_forget_ids, forget_all, forget_request
from scrubnet.models import build_model
from scrubnet.models.linearized import LinearizedModel, convert_relu_to_leaky

FORMAT = "scrubnet-mlforget/1"
STATE = "state.json"
LEDGER = "ledger.jsonl"
PAUSE_ENV = "SCRUBNET_MLFORGET_PAUSE_AT"


class StoreError(ValueError):
    """A checkpoint directory that is missing, corrupt or inconsistent, or a refused request."""


def _pause(stage: str) -> None:
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"PAUSED {stage}", flush=True)
        sys.stdout.flush()
        time.sleep(3600)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the renamed files themselves were fsynced
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, stage: str) -> None:
    """Temp file in the same folder, fsync, rename. ``stage`` names the pause point mid-write."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            _pause(f"{stage}_partial")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _weights_bytes(model: LinearizedModel) -> bytes:
    return save({k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()})


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def request_key(kind: str, ids, sigma: float | None) -> str:
    """Identity of a request: kind, sorted ids and σ."""
    payload = json.dumps({"kind": kind, "ids": sorted(int(i) for i in ids), "sigma": sigma}, sort_keys=True)
    return _sha(payload.encode())[:32]


# -- saving a freshly trained model --------------------------------------------------------------------

def save_new(path: str | Path, state: MLState, *, arch: str, in_shape, arch_options: dict | None = None,
             data: dict | None = None, data_fingerprint: str | None = None, extra: dict | None = None) -> dict:
    """Create checkpoint directory ``path`` (must not exist) for ``state``; built in a temporary directory
    and renamed, so an interrupted save leaves nothing at ``path``. Returns the state record."""
    path = Path(path)
    if path.exists():
        raise StoreError(f"{path} already exists; choose a new checkpoint directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        data_bytes = _weights_bytes(state.model)
        sha = _sha(data_bytes)
        wname = "weights-000000.safetensors"
        (tmp / wname).write_bytes(data_bytes)
        record = {"seq": 0, "kind": "train", "key": None, "time": _now(), "ids": [], "n_ids": 0,
                  "n_user": int(len(state.user_ids)), "n_core": int(len(state.core_ids)),
                  "n_remaining": int(len(state.remaining_ids())), "sigma": None,
                  "sha256_before": None, "sha256_after": sha, **{k: v for k, v in state.train_info.items()}}
        meta = {"format": FORMAT, "seq": 0, "weights_file": wname, "weights_sha256": sha,
                "arch": arch, "arch_options": arch_options or {}, "in_shape": list(in_shape),
                "num_classes": int(state.num_classes), "seed": int(state.seed), "ml_config": state.config.to_dict(),
                "data": data, "data_fingerprint": data_fingerprint,
                "core_ids": state.core_ids.tolist(), "user_ids": state.user_ids.tolist(),
                "forgotten_ids": state.forgotten_ids.tolist(), "last_request": record, **(extra or {})}
        (tmp / STATE).write_text(json.dumps(meta) + "\n")
        (tmp / LEDGER).write_text(json.dumps(record) + "\n")
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# -- loading, with ledger repair -----------------------------------------------------------------------

def read_state(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise StoreError(f"ML checkpoint directory not found: {path}")
    sf = path / STATE
    if not sf.is_file():
        raise StoreError(f"{path} is not an ML checkpoint (no {STATE})")
    try:
        meta = json.loads(sf.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{sf} is corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StoreError(f"{sf} is not a {FORMAT} state record")
    return meta


def read_ledger(path: str | Path) -> list[dict]:
    """The ledger's complete lines (a torn last line is ignored here; :func:`repair` removes it)."""
    lf = Path(path) / LEDGER
    if not lf.is_file():
        return []
    out = []
    for line in lf.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # torn tail
    return out


def repair(path: str | Path, meta: dict | None = None) -> dict:
    """Bring the ledger in line with the committed state and remove orphan files; returns the state."""
    path = Path(path)
    meta = read_state(path) if meta is None else meta
    lf = path / LEDGER
    raw = lf.read_bytes() if lf.is_file() else b""
    if raw and not raw.endswith(b"\n"):  # torn last line: drop it (its request is re-appended below)
        cut = raw.rfind(b"\n") + 1
        with open(lf, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
    entries = read_ledger(path)
    last_seq = entries[-1]["seq"] if entries else -1
    if last_seq > meta["seq"]:
        raise StoreError(f"ledger of {path} records request #{last_seq} but the checkpoint is at #{meta['seq']}")
    if last_seq < meta["seq"]:
        if last_seq != meta["seq"] - 1 or meta.get("last_request", {}).get("seq") != meta["seq"]:
            raise StoreError(f"ledger of {path} is missing requests {last_seq + 1}..{meta['seq']}")
        _append_line(lf, meta["last_request"])
    for f in path.iterdir():
        if (f.name.startswith("weights-") and f.name != meta["weights_file"]) or f.name.endswith(".tmp"):
            f.unlink(missing_ok=True)
    return meta


def _append_line(lf: Path, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    with open(lf, "ab") as f:
        half = len(line) // 2
        f.write(line[:half])
        f.flush()
        _pause("ledger_partial")
        f.write(line[half:])
        f.flush()
        os.fsync(f.fileno())


def load(path: str | Path) -> tuple[MLState, dict]:
    """Load (and repair) an ML checkpoint: returns the :class:`MLState` and the state record."""

    path = Path(path)
    meta = repair(path)
    wf = path / meta["weights_file"]
    if not wf.is_file():
        raise StoreError(f"weights file {wf} referenced by {STATE} is missing")
    data = wf.read_bytes()
    if _sha(data) != meta["weights_sha256"]:
        raise StoreError(f"{wf} does not match the sha256 in {STATE}: the checkpoint is corrupt")
    cfg = MLConfig.from_dict(meta["ml_config"])
    core = build_model(meta["arch"], meta["in_shape"], meta["num_classes"], seed=0, **meta["arch_options"])
    if cfg.leaky_slope is not None:
        convert_relu_to_leaky(core, cfg.leaky_slope)
    model = LinearizedModel(core, prefixes=cfg.linearize)
    try:
        model.load_state_dict(st_load(data), strict=True)
    except RuntimeError as e:
        raise StoreError(f"weights in {wf} do not fit the recorded architecture: {e}") from None
    state = MLState(model, torch.tensor(meta["core_ids"], dtype=torch.long),
                    torch.tensor(meta["user_ids"], dtype=torch.long),
                    torch.tensor(meta["forgotten_ids"], dtype=torch.long), cfg, meta["num_classes"], meta["seed"])
    return state, meta


# -- requests --------------------------------------------------------------------------------------------

def _commit(path: Path, meta: dict, state: MLState, record: dict) -> dict:
    data = _weights_bytes(state.model)
    sha = _sha(data)
    seq = meta["seq"] + 1
    record.update({"seq": seq, "sha256_before": meta["weights_sha256"], "sha256_after": sha})
    wname = f"weights-{seq:06d}.safetensors"
    _write_atomic(path / wname, data, "weights")
    _pause("after_weights")
    new_meta = dict(meta, seq=seq, weights_file=wname, weights_sha256=sha,
                    forgotten_ids=state.forgotten_ids.tolist(), last_request=record)
    _write_atomic(path / STATE, (json.dumps(new_meta) + "\n").encode(), "state")
    _pause("after_commit")
    _append_line(path / LEDGER, record)
    _pause("after_ledger")
    old = path / meta["weights_file"]
    if old.name != wname:
        old.unlink(missing_ok=True)
    return new_meta


def _already_applied(meta: dict, key: str) -> dict | None:
    last = meta.get("last_request") or {}
    return last if last.get("key") == key else None


def forget(path: str | Path, ids, *, sigma: float | None = None, x_all=None, y_all=None,
           data_loader=None) -> tuple[dict, bool]:
    """Apply one forgetting request to the checkpoint at ``path``; returns (ledger record, applied_now).

    The data D come from ``x_all, y_all`` or from ``data_loader(meta) -> (x, y)``. Re-running the request
    committed last returns its record with ``applied_now=False``.
    """
    path = Path(path)
    state, meta = load(path)
    ids = sorted(int(i) for i in ids)
    sig = state.config.sigma if sigma is None else float(sigma)
    key = request_key("forget", ids, sig)
    done = _already_applied(meta, key)
    if done is not None:
        return done, False
    check_forget_ids(state, ids)
    if x_all is None:
        if data_loader is None:
            raise StoreError("no data given for the forgetting request")
        x_all, y_all = data_loader(meta)
    t0 = time.perf_counter()
    out = forget_request(state, x_all, y_all, ids, sigma=sig, noise_seed=1_000_003 * state.seed + meta["seq"] + 1)
    _pause("after_solve")
    info = out.info.as_dict()
    record = {"kind": "forget", "key": key, "time": _now(), "ids": ids, "n_ids": len(ids),
              "n_remaining": int(len(state.remaining_ids())), "sigma": sig,
              "steps": info["iterations"], "solver": info["solver"], "residual_norm": info["relative_residual"],
              "grad_norm": info["grad_norm"], "seconds": time.perf_counter() - t0}
    _commit(path, meta, state, record)
    return record, True


def forget_everything(path: str | Path) -> tuple[dict, bool]:
    """Forget all user data (w_u ← 0); idempotent like :func:`forget`."""
    path = Path(path)
    state, meta = load(path)
    key = request_key("forget_all", [], None)
    done = _already_applied(meta, key)
    if done is not None:
        return done, False
    if len(state.remaining_ids()) == 0:
        raise StoreError("all user data were already forgotten")
    t0 = time.perf_counter()
    n = int(len(state.remaining_ids()))
    forget_all(state)
    record = {"kind": "forget_all", "key": key, "time": _now(), "ids": [], "n_ids": n, "n_remaining": 0,
              "sigma": 0.0, "steps": 0, "solver": "zero", "residual_norm": 0.0, "grad_norm": 0.0,
              "seconds": time.perf_counter() - t0}
    _commit(path, meta, state, record)
    return record, True
