"""Audit a pool trained anywhere: a documented logits/margins file that the statistics read.

**Format** (``scrubnet-audit-logits/1``): one NumPy ``.npz`` per method, read with ``allow_pickle=False``.
M models, n examples, c classes:

| array | shape, dtype | meaning |
|---|---|---|
| ``format`` | 0-d str | ``"scrubnet-audit-logits/1"`` |
| ``method`` | 0-d str | optional: the method's name (default: the file's stem) |
| ``logits`` + ``labels`` | [M, n, c] float, [n] int | the models' logits and the true labels, **or** |
| ``margins`` | [M, n] float | φ = z_y − logsumexp_{y'≠y} z_{y'} directly (LiRA's logit-scaled confidence) |
| ``trained`` | [M, n] bool | x was in model m's training set (before any unlearning) |
| ``unlearned`` | [M, n] bool | x was in the forget set model m unlearned (⊂ ``trained``); all False for originals |
| ``split`` | [M] int | optional: the original each model comes from (models of one split share it; default: one each) |
| ``shadow`` | [M] bool | optional: models that fit the Gaussians (default: the splits of the first ¾ of split ids) |
| ``oracle_logits`` / ``oracle_margins`` | [R, n, c] / [R, n] | optional: R models retrained without one forget set |
| ``ensemble_logits`` / ``ensemble_margins`` | [U, n, c] / [U, n] | with the oracle: the method run U times on one original, for that forget set |
| ``ensemble_forget`` | [n] bool | with the oracle: that forget set; ``ensemble_retain`` [n] bool optional (its retained examples) |

**Statistics**: the U-MIA game (IN = ``unlearned``, OUT = not ``trained``, per model; with no unlearned entry
at all the file holds originals and the game is plain LiRA membership, IN = ``trained``) with its two-way
bootstrap interval; with the oracle block, KLoM on the forget set, the retained set (when given) and the
other examples, and the ε forget score on the forget set (U = R required). Retain-set leakage needs the
originals of the same splits and is computed by the pool audit only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scrubnet.audit.stats import epsilon_score, klom, lira_pairs, logit_confidence
from scrubnet.audit.uncertainty import BOOTSTRAP_PAIRS, bootstrap_pairs, summarize

FORMAT = "scrubnet-audit-logits/1"


@dataclass
class LogitsPool:
    """One method's pool read from a file (:data:`FORMAT`)."""

    method: str
    phi: np.ndarray            # [M, n]
    trained: np.ndarray        # [M, n] bool
    unlearned: np.ndarray      # [M, n] bool
    split: np.ndarray          # [M] int, 0 … S−1
    shadow: np.ndarray         # [M] bool
    oracle: np.ndarray | None = None     # [R, n]
    ensemble: np.ndarray | None = None   # [U, n]
    ensemble_forget: np.ndarray | None = None
    ensemble_retain: np.ndarray | None = None


def _phi(z, logits_key: str, margins_key: str, labels, what: str) -> np.ndarray | None:
    if margins_key in z.files:
        phi = np.asarray(z[margins_key], float)
        if phi.ndim != 2:
            raise ValueError(f"{what}: {margins_key} must be [models, examples]")
    elif logits_key in z.files:
        lg = np.asarray(z[logits_key], float)
        if lg.ndim != 3 or labels is None:
            raise ValueError(f"{what}: {logits_key} must be [models, examples, classes] with labels [examples]")
        if np.any(labels < 0) or np.any(labels >= lg.shape[2]):
            raise ValueError(f"{what}: labels outside 0 … {lg.shape[2] - 1}")
        phi = logit_confidence(lg, labels)
    else:
        return None
    if not np.all(np.isfinite(phi)):
        raise ValueError(f"{what}: {margins_key if margins_key in z.files else logits_key} holds NaN or inf")
    return phi


def read_logits_file(path: Path) -> LogitsPool:
    """Read and check a :data:`FORMAT` file; ``ValueError`` with one clear message on any problem."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"--logits {path}: not a readable .npz file ({e})") from None
    what = f"--logits {path}"
    if "format" not in z.files or str(z["format"]) != FORMAT:
        raise ValueError(f"{what}: missing or unknown 'format' (expected {FORMAT!r})")
    labels = np.asarray(z["labels"]).astype(np.int64) if "labels" in z.files else None
    phi = _phi(z, "logits", "margins", labels, what)
    if phi is None:
        raise ValueError(f"{what}: needs 'margins' [M, n] or 'logits' [M, n, c] with 'labels' [n]")
    M, n = phi.shape
    for k in ("trained", "unlearned"):
        if k not in z.files or z[k].shape != (M, n) or z[k].dtype != bool:
            raise ValueError(f"{what}: '{k}' must be a bool array of shape {(M, n)}")
    trained, unlearned = np.asarray(z["trained"]), np.asarray(z["unlearned"])
    if np.any(unlearned & ~trained):
        raise ValueError(f"{what}: an 'unlearned' entry is outside the model's 'trained' set")
    split = np.asarray(z["split"]).astype(np.int64) if "split" in z.files else np.arange(M)
    if split.shape != (M,):
        raise ValueError(f"{what}: 'split' must have one entry per model")
    ids, split = np.unique(split, return_inverse=True)
    S = len(ids)
    if "shadow" in z.files:
        shadow = np.asarray(z["shadow"])
        if shadow.shape != (M,) or shadow.dtype != bool:
            raise ValueError(f"{what}: 'shadow' must be a bool array with one entry per model")
    else:
        shadow = split < max(1, (3 * S) // 4)
    if shadow.all() or not shadow.any():
        raise ValueError(f"{what}: needs shadow and target models (set 'shadow' or give ≥ 2 splits)")
    method = str(z["method"]) if "method" in z.files else path.stem
    pool = LogitsPool(method, phi, trained, unlearned, split, shadow)
    oracle = _phi(z, "oracle_logits", "oracle_margins", labels, what)
    if oracle is not None:
        ens = _phi(z, "ensemble_logits", "ensemble_margins", labels, what)
        if ens is None or "ensemble_forget" not in z.files:
            raise ValueError(f"{what}: an oracle needs 'ensemble_margins' (or _logits) and 'ensemble_forget'")
        if oracle.shape[1] != n or ens.shape[1] != n or z["ensemble_forget"].shape != (n,):
            raise ValueError(f"{what}: oracle, ensemble and ensemble_forget must cover the same {n} examples")
        pool.oracle, pool.ensemble = oracle, ens
        pool.ensemble_forget = np.asarray(z["ensemble_forget"], bool)
        if "ensemble_retain" in z.files:
            pool.ensemble_retain = np.asarray(z["ensemble_retain"], bool)
    return pool


def write_logits_file(path: Path, *, margins=None, logits=None, labels=None, trained, unlearned, method=None,
                      split=None, shadow=None, **oracle) -> None:
    """Write a :data:`FORMAT` file (``oracle``: the optional oracle-block arrays by name)."""
    arrays = {"format": np.array(FORMAT), "trained": np.asarray(trained, bool),
              "unlearned": np.asarray(unlearned, bool)}
    if margins is not None:
        arrays["margins"] = np.asarray(margins, float)
    if logits is not None:
        arrays["logits"], arrays["labels"] = np.asarray(logits, float), np.asarray(labels, np.int64)
    for k, v in (("method", method), ("split", split), ("shadow", shadow)):
        if v is not None:
            arrays[k] = np.array(v) if k == "method" else np.asarray(v)
    arrays.update({k: np.asarray(v) for k, v in oracle.items()})
    np.savez(path, **arrays)


def audit_logits_pool(pool: LogitsPool, replicates: int = BOOTSTRAP_PAIRS, seed: int = 0) -> dict:
    """The statistics of one file (module docstring), keyed as in the pool audit's ``audit.json``."""
    phi, S = pool.phi, int(pool.split.max()) + 1
    plain = not pool.unlearned.any()
    in_mask = pool.trained if plain else pool.unlearned
    out_mask = ~pool.trained
    phi_in, phi_out = np.where(in_mask, phi, np.nan), np.where(out_mask, phi, np.nan)
    first_target = int(pool.split[~pool.shadow].min())
    cluster = pool.split - first_target
    p, _ = lira_pairs(phi_in, phi_out, pool.shadow, pool.shadow, cluster, cluster)
    n_clusters = S - first_target
    reps = bootstrap_pairs(p, n_clusters, phi.shape[1], replicates, seed)
    d: dict = {f"ulira_game_{k}": v for k, v in summarize(p, reps).items()}
    d["ulira_game_kind"] = "plain LiRA (no unlearned entries)" if plain else "U-MIA game"
    d["models"] = int(phi.shape[0])
    if pool.oracle is not None:
        f = pool.ensemble_forget
        groups = {"forget": f}
        if pool.ensemble_retain is not None:
            groups["retain"] = pool.ensemble_retain & ~f
            groups["other"] = ~pool.ensemble_retain & ~f
        else:
            groups["other"] = ~f
        kl = {}
        for name, mask in groups.items():
            if mask.any():
                v = klom(pool.ensemble[:, mask], pool.oracle[:, mask])
                kl[name] = {"mean": float(v.mean()), "p95": float(np.percentile(v, 95)), "points": int(mask.sum())}
        d["klom"] = kl
        d["klom_forget"] = kl.get("forget", {}).get("mean")
        U, R = pool.ensemble.shape[0], pool.oracle.shape[0]
        d["epsilon_u"], d["epsilon_r"] = U, R
        if U == R and U >= 3 and f.any():
            d["epsilon_forget_score"] = epsilon_score(pool.ensemble[:, f], pool.oracle[:, f]).forget_score
        else:
            d["epsilon_forget_score"] = None
    return d


def audit_logits_files(paths: list[Path], replicates: int = BOOTSTRAP_PAIRS, seed: int = 0) -> dict:
    """``{"methods": {name: statistics}}`` for every file; two files may not name the same method."""
    out: dict = {}
    for path in paths:
        pool = read_logits_file(path)
        if pool.method in out:
            raise ValueError(f"--logits: two files hold method {pool.method!r}")
        out[pool.method] = audit_logits_pool(pool, replicates, seed)
    return {"methods": out}


__all__ = ["FORMAT", "LogitsPool", "audit_logits_files", "audit_logits_pool", "read_logits_file",
           "write_logits_file"]
