"""The ROC and its area for a score that should rank positives above negatives: shared by the audit's
membership games and the mix-DP experiment's attack readout."""
from __future__ import annotations

import numpy as np


def roc_curve(pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ROC of "score ≥ t ⇒ positive" over every threshold t.

    Parameters
    ----------
    pos, neg : array (n_pos,), (n_neg,)
        Scores of the positives and of the negatives.

    Returns
    -------
    (fpr, tpr) : arrays (k + 1,)
        Starting at (0, 0), one point per distinct score, thresholds decreasing.
    """
    pos, neg = np.sort(np.asarray(pos, float)), np.sort(np.asarray(neg, float))
    thr = np.unique(np.concatenate([pos, neg]))[::-1]
    tpr = (len(pos) - np.searchsorted(pos, thr, "left")) / max(len(pos), 1)
    fpr = (len(neg) - np.searchsorted(neg, thr, "left")) / max(len(neg), 1)
    return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, level: float) -> float:
    """Largest TPR among the thresholds whose FPR ≤ ``level`` (0 when none)."""
    ok = fpr <= level + 1e-12
    return float(np.max(tpr[ok])) if np.any(ok) else 0.0


def auc_score(pos: np.ndarray, neg: np.ndarray) -> float:
    """Area under the ROC: P(score_pos > score_neg) + ½ P(tie) (Mann–Whitney, average ranks of ties).

    Parameters
    ----------
    pos : array (n_pos,)
        Scores of the positives (members).
    neg : array (n_neg,)
        Scores of the negatives (non-members).

    Returns
    -------
    float
        In [0, 1]; NaN when either set is empty.
    """
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    allv = np.concatenate([pos, neg])
    order = np.argsort(allv, kind="mergesort")
    ranks = np.empty(len(allv))
    sorted_v = allv[order]
    # average ranks of ties
    _, start, counts = np.unique(sorted_v, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    r_pos = ranks[:len(pos)].sum()
    return float((r_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))
