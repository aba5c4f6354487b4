"""The field's reference estimators, reproduced exactly (``estimator="reference"``), as pure NumPy functions.

* :func:`lira_reference` — LiRA as tensorflow/privacy's ``research/mi_lira_2021/plot.py`` scores it
  (``generate_ours`` online, ``generate_ours_offline``, their fixed-variance forms, ``sweep`` and ``do_plot``'s
  TPR rule). Per example j, IN_j and OUT_j are the valid shadow values in model order, **truncated** to
  ``in_size = min_j |IN_j|`` and ``out_size = min_j |OUT_j|``; centres are **medians**, spreads population
  std (ddof 0) + 1e-30 (fixed variance: the std of all kept IN values, or OUT values offline, pooled over the
  examples about the grand mean). Online: prediction = −log N(φ; μ_in, σ_in) + log N(φ; μ_out, σ_out);
  offline: log N(φ; μ_out, σ_out). Membership score = −prediction.
* :func:`roc_reference` — scikit-learn's ``roc_curve`` with ``drop_intermediate=True``; ``acc`` = the best
  balanced accuracy over the ROC points; TPR at X % FPR = the TPR of the *last* point with FPR **strictly**
  below X.
* :func:`ulira_game_reference` — DeepUnlearn's U-LiRA membership probabilities for the U-MIA game: per
  example, "forgotten" = the unlearned models (s, f) whose forget set held j, "never" = the unlearned models of
  every (s, f) whose split never trained on j; p(z) = N(z; forgotten) / (N(z; forgotten) + N(z; never)) with
  ``np.mean`` / ``np.std`` (ddof 0) fitted on the very models that are scored; σ = 0 gives NaN.

The tests reproduce the reference outputs stored in ``tests/fixtures/audit-references`` (their README gives
every definition). The NeurIPS-2023 ε is in :mod:`scrubnet.audit.stats` (its default already uses the
reference's threshold construction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: added to every σ by tensorflow/privacy's LiRA before the density
REFERENCE_STD_FLOOR = 1e-30
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def norm_logpdf(x, mu, sd) -> np.ndarray:
    """log N(x; μ, σ) as ``scipy.stats.norm.logpdf`` evaluates it: −((x−μ)/σ)²/2 − log √(2π) − log σ."""
    z = (np.asarray(x, float) - mu) / sd
    return -z ** 2 / 2.0 - _LOG_SQRT_2PI - np.log(sd)


def roc_reference(answers, score) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) of "score ≥ t ⇒ member" as ``sklearn.metrics.roc_curve(answers, score)`` returns them
    (``drop_intermediate=True``): one point per distinct score (descending), collinear points dropped, (0, 0)
    prepended."""
    y = np.asarray(answers, bool)
    s = np.asarray(score, float)
    order = np.argsort(s, kind="mergesort")[::-1]
    s, y = s[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], y.size - 1]  # last index of each distinct score
    tps = np.cumsum(y)[last].astype(float)
    fps = (1 + last - tps).astype(float)
    if tps.size > 2:
        keep = np.nonzero(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])[0]
        tps, fps = tps[keep], fps[keep]
    tps, fps = np.r_[0.0, tps], np.r_[0.0, fps]
    n_pos, n_neg = tps[-1], fps[-1]
    fpr = fps / n_neg if n_neg > 0 else np.full_like(fps, np.nan)
    tpr = tps / n_pos if n_pos > 0 else np.full_like(tps, np.nan)
    return fpr, tpr


def roc_metrics_reference(fpr: np.ndarray, tpr: np.ndarray) -> dict[str, float]:
    """``auc`` (trapezoid), ``acc`` (best balanced accuracy over the points) and the strict-rule
    ``tpr_at_1pct_fpr`` / ``tpr_at_01pct_fpr`` (TPR of the last point with FPR < X)."""
    out = {"auc": float(np.trapezoid(tpr, fpr)) if hasattr(np, "trapezoid") else float(np.trapz(tpr, fpr)),
           "acc": float(np.max(1 - (fpr + (1 - tpr)) / 2))}
    for key, level in (("tpr_at_1pct_fpr", 0.01), ("tpr_at_01pct_fpr", 0.001)):
        idx = np.nonzero(fpr < level)[0]
        out[key] = float(tpr[idx[-1]]) if idx.size else float("nan")
    return out


@dataclass
class ReferenceFit:
    """Fitted centres and spreads ``[n]`` and the truncation sizes (``-1`` / NaN on the IN side offline)."""

    mean_in: np.ndarray
    std_in: np.ndarray
    mean_out: np.ndarray
    std_out: np.ndarray
    in_size: int
    out_size: int


def _kept(values: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, int]:
    """The first ``size = min_j |{m: member[m, j]}|`` member values of every column, in row order, laid out
    ``[n, size]`` (C order) as the reference holds them: its sums, and so its std, run in that order."""
    counts = member.sum(0)
    size = int(counts.min()) if counts.size else 0
    if size < 1:
        raise ValueError("LiRA (reference): some example has no shadow value on one side")
    # rank of each member entry within its column (0-based, row order); keep ranks < size
    rank = np.cumsum(member, 0) - 1
    kept = np.empty((size, values.shape[1]))
    rows, cols = np.nonzero(member & (rank < size))
    kept[rank[rows, cols], cols] = values[rows, cols]
    return np.ascontiguousarray(kept.T), size


def fit_reference(values_in: np.ndarray, member_in: np.ndarray, values_out: np.ndarray, member_out: np.ndarray,
                  *, online: bool = True, fixed_variance: bool = False) -> ReferenceFit:
    """tensorflow/privacy's fit (module docstring) from ``[rows, n]`` values with boolean membership masks."""
    n = values_out.shape[1]
    out_kept, out_size = _kept(values_out, member_out)
    mean_out = np.median(out_kept, 1)
    if online:
        in_kept, in_size = _kept(values_in, member_in)
        mean_in = np.median(in_kept, 1)
        if fixed_variance:
            sd = float(np.std(in_kept))
            std_in = std_out = np.full(n, sd)
        else:
            std_in, std_out = np.std(in_kept, 1), np.std(out_kept, 1)
    else:
        in_size, mean_in, std_in = -1, np.full(n, np.nan), np.full(n, np.nan)
        std_out = np.full(n, float(np.std(out_kept))) if fixed_variance else np.std(out_kept, 1)
    return ReferenceFit(mean_in, std_in, mean_out, std_out, in_size, out_size)


def predict_reference(fit: ReferenceFit, phi, *, online: bool = True) -> np.ndarray:
    """The reference's ``prediction`` for φ ``[..., n]`` (higher = *less* likely a member)."""
    out = norm_logpdf(phi, fit.mean_out, fit.std_out + REFERENCE_STD_FLOOR)
    if not online:
        return out
    return -norm_logpdf(phi, fit.mean_in, fit.std_in + REFERENCE_STD_FLOOR) + out


@dataclass
class LiRAReferenceResult:
    """Outcome of :func:`lira_reference` (names as in the fixtures)."""

    prediction: np.ndarray
    answers: np.ndarray
    pair_model: np.ndarray
    pair_example: np.ndarray
    fit: ReferenceFit
    roc_fpr: np.ndarray = field(repr=False)
    roc_tpr: np.ndarray = field(repr=False)
    auc: float = float("nan")
    acc: float = float("nan")
    tpr_at_1pct_fpr: float = float("nan")
    tpr_at_01pct_fpr: float = float("nan")


def lira_reference(shadow_phi, shadow_in, target_phi, target_in, shadow_valid=None, target_valid=None, *,
                   online: bool = True, fixed_variance: bool = False) -> LiRAReferenceResult:
    """LiRA exactly as tensorflow/privacy scores it (module docstring).

    ``shadow_phi`` ``[M, n]``, ``shadow_in`` ``[M, n]`` (True: trained on j), ``target_phi``/``target_in``
    ``[T, n]``; ``*_valid`` masks (default all True) mark entries that are neither IN nor OUT. Pairs are the
    valid target entries, target-major then example."""
    sp, si = np.asarray(shadow_phi, float), np.asarray(shadow_in, bool)
    tp, ti = np.asarray(target_phi, float), np.asarray(target_in, bool)
    sv = np.ones_like(si) if shadow_valid is None else np.asarray(shadow_valid, bool)
    tv = np.ones_like(ti) if target_valid is None else np.asarray(target_valid, bool)
    if sp.ndim != 2 or tp.ndim != 2 or sp.shape[1] != tp.shape[1] or si.shape != sp.shape or \
            ti.shape != tp.shape or sv.shape != sp.shape or tv.shape != tp.shape:
        raise ValueError("lira_reference: shadow and target arrays must be [models, examples] with the same examples")
    fit = fit_reference(sp, si & sv, sp, ~si & sv, online=online, fixed_variance=fixed_variance)
    pm, pe = np.nonzero(tv)
    pred = predict_reference(fit, tp, online=online)[pm, pe]
    answers = ti[pm, pe]
    fpr, tpr = roc_reference(answers, -pred)
    return LiRAReferenceResult(pred, answers, pm.astype(np.int64), pe.astype(np.int64), fit, fpr, tpr,
                               **roc_metrics_reference(fpr, tpr))


# ------------------------------------------------------------------------------------------ U-MIA game
@dataclass
class GameReferenceResult:
    """DeepUnlearn's membership probabilities (``p_forgotten``, NaN where not forgotten) and the extensions
    of the fixtures (``p_never``; per-example accuracies at p > 0.5)."""

    in_mask: np.ndarray
    out_mask: np.ndarray
    forget_mean: np.ndarray
    forget_std: np.ndarray
    never_mean: np.ndarray
    never_std: np.ndarray
    p_forgotten: np.ndarray
    p_never: np.ndarray
    acc_forgotten: np.ndarray
    acc_never: np.ndarray
    acc_balanced: np.ndarray

    @property
    def n_forgotten(self) -> np.ndarray:
        return self.in_mask.sum((0, 1))

    @property
    def n_never(self) -> np.ndarray:
        return self.out_mask.sum((0, 1))


def _masked_mean_std(v: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cnt = m.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mu = np.where(m, v, 0.0).sum(0) / cnt
        sd = np.sqrt(np.where(m, (v - mu) ** 2, 0.0).sum(0) / cnt)
    return np.where(cnt > 0, mu, np.nan), np.where(cnt > 0, sd, np.nan)


def _norm_pdf(z, mu, sd) -> np.ndarray:
    """``scipy.stats.norm.pdf``: NaN for σ ≤ 0 or NaN parameters."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        y = (z - mu) / sd
        p = np.exp(-y ** 2 / 2.0) / math.sqrt(2 * math.pi) / sd
    return np.where(np.isfinite(sd) & (sd > 0), p, np.nan)


def ulira_game_reference(phi, train, forget) -> GameReferenceResult:
    """DeepUnlearn's U-LiRA on the U-MIA game (module docstring).

    ``phi`` ``[S, F, n]``: the statistic of unlearned model (s, f) on example j; ``train`` ``[S, n]``: j ∈ T_s;
    ``forget`` ``[S, F, n]``: j ∈ F_{s,f} (⊂ T_s)."""
    v = np.asarray(phi, float)
    tr, fg = np.asarray(train, bool), np.asarray(forget, bool)
    if v.ndim != 3 or fg.shape != v.shape or tr.shape != (v.shape[0], v.shape[2]):
        raise ValueError("ulira_game_reference: phi/forget [S, F, n] and train [S, n] are required")
    if np.any(fg & ~tr[:, None, :]):
        raise ValueError("ulira_game_reference: a forget set holds an example outside its split's training half")
    in_mask = fg
    out_mask = np.broadcast_to(~tr[:, None, :], v.shape).copy()
    S, F, n = v.shape
    flat_v = v.reshape(S * F, n)
    fm, fs = _masked_mean_std(flat_v, in_mask.reshape(S * F, n))
    nm, ns = _masked_mean_std(flat_v, out_mask.reshape(S * F, n))
    with np.errstate(invalid="ignore"):
        a, b = _norm_pdf(v, fm, fs), _norm_pdf(v, nm, ns)
        p = a / (a + b)
    p_f = np.where(in_mask, p, np.nan)
    p_n = np.where(out_mask, p, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        ok_f, ok_n = np.isfinite(p_f), np.isfinite(p_n)
        acc_f = np.where(ok_f.sum((0, 1)) > 0, (ok_f & (p_f > 0.5)).sum((0, 1)) / ok_f.sum((0, 1)), np.nan)
        acc_n = np.where(ok_n.sum((0, 1)) > 0, (ok_n & (p_n <= 0.5)).sum((0, 1)) / ok_n.sum((0, 1)), np.nan)
    return GameReferenceResult(in_mask, out_mask, fm, fs, nm, ns, p_f, p_n, acc_f, acc_n, (acc_f + acc_n) / 2)
