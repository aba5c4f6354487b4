"""Scored (model, example) pairs of a membership test, their statistics with weights, and two-way bootstrap
confidence intervals (over examples and over models), as pure NumPy functions.

A membership test on a pool ends in P scored pairs: ``score`` (higher = "member" / "unlearned"), ``label``
(True = positive), the ``cluster`` of the model (its target split: models of one split share an original)
and the ``example``. One bootstrap replicate draws the clusters with replacement (counts ``Wc``) and the
examples with replacement (counts ``We``); pair (c, j) then weighs ``Wc[c]·We[j]`` and every statistic is
recomputed with those weights. The 95 % interval is the 2.5th–97.5th percentile of the replicates.
Replicates drawn from one seed with the same numbers of clusters and examples are *common* to every method,
so the difference of two methods has its own interval (:func:`difference_ci`).

Statistics (:func:`pair_statistics`), all weighted:

* balanced accuracy of the likelihood-ratio test "score > 0 ⇒ positive": ½(TPR + TNR);
* AUC = P(score_pos > score_neg) + ½ P(tie);
* TPR at FPR ≤ 1 % and ≤ 0.1 % over every threshold. A rate at FPR level α is reported only with at least
  ``MIN_FALSE_POSITIVES / α`` negatives (5 false positives at that rate): below that it is one or two pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: number of false positives a "TPR at FPR α" needs to mean something: negatives ≥ this / α
MIN_FALSE_POSITIVES = 5
#: default numbers of bootstrap replicates: scored pairs, KLoM, ε forget score (ε is ~10 ms per example)
BOOTSTRAP_PAIRS = 1000
BOOTSTRAP_KLOM = 200
BOOTSTRAP_EPSILON = 50
FPR_LEVELS = {"tpr_at_1pct_fpr": 0.01, "tpr_at_01pct_fpr": 0.001}


@dataclass
class ScoredPairs:
    """P scored pairs: ``score``, ``label`` (bool), ``cluster`` and ``example`` (ints, 0-based)."""

    score: np.ndarray
    label: np.ndarray
    cluster: np.ndarray
    example: np.ndarray

    def __post_init__(self):
        self.score = np.asarray(self.score, float)
        self.label = np.asarray(self.label, bool)
        self.cluster = np.asarray(self.cluster, np.int64)
        self.example = np.asarray(self.example, np.int64)
        if not (self.score.shape == self.label.shape == self.cluster.shape == self.example.shape) or \
                self.score.ndim != 1:
            raise ValueError("ScoredPairs: score, label, cluster and example must be 1-D of one length")
        if not np.all(np.isfinite(self.score)):
            raise ValueError("ScoredPairs: scores must be finite")

    @property
    def n_positive(self) -> int:
        return int(self.label.sum())

    @property
    def n_negative(self) -> int:
        return int((~self.label).sum())


def enough_negatives(n_negative: int, level: float) -> bool:
    """True when ``n_negative`` negatives give at least :data:`MIN_FALSE_POSITIVES` false positives at FPR ``level``."""
    return n_negative * level >= MIN_FALSE_POSITIVES - 1e-9


def pair_statistics(p: ScoredPairs, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Weighted statistics of ``p``; ``weights`` ``[B, P]`` (default: one replicate of ones). Returns arrays ``[B]``:
    ``balanced_accuracy``, ``auc``, ``tpr_at_1pct_fpr``, ``tpr_at_01pct_fpr`` (module docstring)."""
    if p.n_positive == 0 or p.n_negative == 0:
        raise ValueError("the membership test needs target pairs of both kinds (IN and OUT); the pool is too small")
    w = np.ones((1, p.score.size)) if weights is None else np.asarray(weights, float)
    order = np.argsort(p.score, kind="mergesort")  # ascending
    s, lab, w = p.score[order], p.label[order], w[:, order]
    wp, wn = w * lab, w * ~lab
    tot_p, tot_n = wp.sum(1), wn.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpr0 = (wp * (s > 0)).sum(1) / tot_p
        tnr0 = (wn * (s <= 0)).sum(1) / tot_n
        starts = np.r_[0, np.nonzero(np.diff(s))[0] + 1]       # tie groups, ascending score
        gp, gn = np.add.reduceat(wp, starts, axis=1), np.add.reduceat(wn, starts, axis=1)
        below = np.cumsum(gn, 1) - gn
        auc = (gp * (below + 0.5 * gn)).sum(1) / (tot_p * tot_n)
        # "score ≥ t ⇒ positive" at every group's score, from the top: cumulative counts in descending order
        tp = np.cumsum(gp[:, ::-1], 1) / tot_p[:, None]
        fp = np.cumsum(gn[:, ::-1], 1) / tot_n[:, None]
    out = {"balanced_accuracy": 0.5 * (tpr0 + tnr0), "auc": auc}
    for key, level in FPR_LEVELS.items():
        ok = fp <= level + 1e-12
        out[key] = np.max(np.where(ok, tp, 0.0), 1)
    return out


def bootstrap_weights(n_clusters: int, n_examples: int, replicates: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial resampling counts ``Wc`` ``[B, n_clusters]`` and ``We`` ``[B, n_examples]`` (seeded)."""
    rng = np.random.default_rng(seed)
    wc = rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters), size=replicates).astype(float)
    we = rng.multinomial(n_examples, np.full(n_examples, 1.0 / n_examples), size=replicates).astype(float)
    return wc, we


def pair_weights(p: ScoredPairs, wc: np.ndarray, we: np.ndarray) -> np.ndarray:
    """``[B, P]`` weights ``Wc[:, cluster]·We[:, example]`` of the pairs of ``p``."""
    return wc[:, p.cluster] * we[:, p.example]


def ci95(replicates: np.ndarray) -> list[float] | None:
    """[2.5th, 97.5th] percentile of the finite replicates (None if there are none)."""
    r = np.asarray(replicates, float)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return None
    return [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]


def centered_ci95(replicates: np.ndarray, point: float) -> list[float] | None:
    """The percentile interval moved by the replicates' bias (their mean minus ``point``).

    For plug-in divergences of samples (KLoM's histograms, the ε thresholds), drawing models *with
    replacement* duplicates values, which alone shifts every replicate (e.g. KLoM of retrain vs retrain:
    1.6 on the default pool, replicates around 3.2); the spread is the information, the shift is an artefact
    of the resampling. Pair statistics (balanced accuracy, AUC, TPR) do not need this."""
    r = np.asarray(replicates, float)
    r = r[np.isfinite(r)]
    if r.size == 0 or not np.isfinite(point):
        return None
    shift = float(r.mean()) - float(point)
    return [float(np.percentile(r, 2.5)) - shift, float(np.percentile(r, 97.5)) - shift]


def difference_ci(a: np.ndarray, b: np.ndarray) -> list[float] | None:
    """95 % interval of a − b over common replicates (same index = same resample)."""
    return ci95(np.asarray(a, float) - np.asarray(b, float))


def bootstrap_pairs(p: ScoredPairs, n_clusters: int, n_examples: int, replicates: int = BOOTSTRAP_PAIRS,
                    seed: int = 0, chunk: int = 100) -> dict[str, np.ndarray]:
    """Replicates ``[B]`` of every :func:`pair_statistics` under common two-way resampling (module docstring)."""
    wc, we = bootstrap_weights(n_clusters, n_examples, replicates, seed)
    parts = [pair_statistics(p, pair_weights(p, wc[i:i + chunk], we[i:i + chunk]))
             for i in range(0, replicates, chunk)]
    return {k: np.concatenate([d[k] for d in parts]) for k in parts[0]}


def summarize(p: ScoredPairs, reps: dict[str, np.ndarray] | None) -> dict:
    """Point values, 95 % intervals and counts; TPR at an FPR level without enough negatives is None."""
    point = {k: float(v[0]) for k, v in pair_statistics(p).items()}
    out: dict = {"positives": p.n_positive, "negatives": p.n_negative}
    for k, v in point.items():
        if k in FPR_LEVELS and not enough_negatives(p.n_negative, FPR_LEVELS[k]):
            out[k], out[f"{k}_ci95"] = None, None
            continue
        out[k] = v
        out[f"{k}_ci95"] = ci95(reps[k]) if reps is not None else None
    return out
