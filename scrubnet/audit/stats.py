"""Per-example forgetting statistics as pure NumPy functions: usable on logits from models trained anywhere.

* :func:`logit_confidence` — the LiRA statistic φ(x, y) = log p_y − log Σ_{y'≠y} p_{y'}, computed stably from
  logits as z_y − logsumexp_{y'≠y} z_{y'}.
* :func:`ulira` — U-LiRA (Hayes et al. 2024, "Inexact unlearning needs more careful evaluations"): per-example
  Gaussians of φ for IN (models that *unlearned* x) and OUT (models that never trained on x), fitted on shadow
  models, a likelihood-ratio test on held-out target models. 0.5 balanced accuracy = the unlearned models are
  indistinguishable from never having trained on x.
* :func:`example_epsilons`, :func:`forget_score`, :func:`epsilon_score` — the NeurIPS-2023 unlearning
  challenge's per-example ε from U unlearned and R retrained models of one original and one forget set, its
  bucketed forget score and the final score scaled by retain and test accuracy relative to retraining.

Missing values: in the φ matrices ``[models, examples]`` a NaN marks "this model does not belong to this
group for this example" (e.g. the model did not unlearn x), so one matrix can hold a whole pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from scrubnet.audit.reference import fit_reference, predict_reference
from scrubnet.audit.uncertainty import ScoredPairs, bootstrap_pairs, difference_ci, pair_statistics
from scrubnet.readouts.roc import auc_score, roc_curve, tpr_at_fpr  # noqa: F401  (re-exported: the audit's API)

#: δ of the (ε, δ) definition, as in the challenge's metric code
DELTA = 1e-5
#: ε reported for perfectly separated samples (both error rates 0) or a degenerate spread; the challenge's cap
EPSILON_CAP = 50.0
#: threshold grid density of the challenge: 100 thresholds per unit of φ
THRESHOLDS_PER_UNIT = 100
#: the two-sided (interval) rule scans left ends within ±2 of the right end minus the peakier sample's range,
#: and right ends from min + range − 2 to max + 2 of the peakier sample (the challenge's "buffer")
INTERVAL_BUFFER = 2.0
#: if one sample's range is below 1 % of the other's, the challenge returns the cap (a point mass is not private)
RANGE_RATIO_MIN = 0.01
#: ε buckets of width 0.5 worth 1, ½, ¼, …; the last bucket ends at ceil(ln(U − 1)) (7 at U = 512)
BUCKET_WIDTH = 0.5
#: smallest standard deviation of a fitted Gaussian (φ units): keeps the likelihood finite for point masses
MIN_STD = 1e-3


def logit_confidence(logits, labels) -> np.ndarray:
    """φ = z_y − logsumexp_{y'≠y} z_{y'} = log p_y − log(1 − p_y).

    ``logits``: ``[..., n, c]``; ``labels``: ``[n]`` ints. Returns ``[..., n]`` (float64).
    """
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim < 2 or z.shape[-2] != len(y):
        raise ValueError(f"logits {z.shape} do not match {len(y)} labels")
    zy = np.take_along_axis(z, np.broadcast_to(y[:, None], z.shape[:-1] + (1,)), axis=-1)[..., 0]
    others = z.copy()
    np.put_along_axis(others, np.broadcast_to(y[:, None], z.shape[:-1] + (1,)), -np.inf, axis=-1)
    m = np.max(others, axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.sum(np.exp(others - m), axis=-1))
    return zy - lse


# ----------------------------------------------------------------------------------------------- U-LiRA
@dataclass
class ULiRAResult:
    """Outcome of :func:`ulira`. Rates are fractions; ``per_example_accuracy`` is NaN for an example without
    both a positive and a negative target sample."""

    balanced_accuracy: float
    auc: float
    tpr_at_1pct_fpr: float
    tpr_at_01pct_fpr: float
    per_example_accuracy: np.ndarray
    fpr: np.ndarray = field(repr=False)
    tpr: np.ndarray = field(repr=False)
    n_positive: int = 0
    n_negative: int = 0

    def spread(self) -> dict[str, float]:
        """mean, std, 10th/50th/90th percentile of the per-example balanced accuracies."""
        a = self.per_example_accuracy[np.isfinite(self.per_example_accuracy)]
        if a.size == 0:
            return {k: float("nan") for k in ("mean", "std", "p10", "p50", "p90")}
        return {"mean": float(a.mean()), "std": float(a.std()), "p10": float(np.percentile(a, 10)),
                "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def _fit(phi: np.ndarray, fixed_variance: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column mean and std of the non-NaN entries of ``phi`` ``[M, n]``, and the count per column.

    The std is per column (ddof=1) where a column has ≥ 2 entries, else the pooled std of all residuals;
    ``fixed_variance`` uses the pooled std everywhere (one σ per side, robust with few models)."""
    ok = np.isfinite(phi)
    cnt = ok.sum(0)
    mu = np.where(cnt > 0, np.nansum(np.where(ok, phi, 0.0), 0) / np.maximum(cnt, 1), np.nan)
    resid = np.where(ok, phi - mu, 0.0)
    dof = max(int(cnt.sum() - np.count_nonzero(cnt)), 1)
    pooled = math.sqrt(float(np.sum(resid ** 2)) / dof) if cnt.sum() > np.count_nonzero(cnt) else 1.0
    if fixed_variance:
        sd = np.full(phi.shape[1], pooled)
    else:
        sd = np.where(cnt >= 2, np.sqrt(np.sum(resid ** 2, 0) / np.maximum(cnt - 1, 1)), pooled)
    return mu, np.maximum(sd, MIN_STD), cnt


def _log_normal(x, mu, sd):
    return -0.5 * ((x - mu) / sd) ** 2 - np.log(sd) - 0.5 * math.log(2 * math.pi)


def ulira(phi_in, phi_out, shadow_in, shadow_out, *, fixed_variance: bool = False) -> ULiRAResult:
    """U-LiRA on φ matrices.

    ``phi_in``  ``[M_in, n]``: φ of example j under model i if model i *unlearned* j (j was in its forget set),
                NaN otherwise;
    ``phi_out`` ``[M_out, n]``: φ of j under model i if model i never trained on j, NaN otherwise;
    ``shadow_in`` ``[M_in]``, ``shadow_out`` ``[M_out]``: True for shadow models (used to fit), False for
                target models (used to test).

    Per example j, N(μ_in, σ_in²) and N(μ_out, σ_out²) are fitted on the shadow rows (per-example σ, or one
    pooled σ per side with ``fixed_variance``); a target φ gets the score log N_in(φ) − log N_out(φ).
    Positives are target IN entries, negatives target OUT entries. Balanced accuracy = ½(TPR + TNR) of the
    likelihood-ratio test "score > 0 ⇒ unlearned", pooled over every (example, target model) pair; the ROC,
    AUC and TPR at 1 % and 0.1 % FPR sweep the threshold over the pooled scores; the per-example accuracy is
    the same balanced accuracy restricted to one example. Examples without a shadow IN and a shadow OUT
    sample are left out.
    """
    phi_in, phi_out = np.asarray(phi_in, float), np.asarray(phi_out, float)
    shadow_in, shadow_out = np.asarray(shadow_in, bool), np.asarray(shadow_out, bool)
    if phi_in.ndim != 2 or phi_out.ndim != 2 or phi_in.shape[1] != phi_out.shape[1]:
        raise ValueError(f"phi_in {phi_in.shape} and phi_out {phi_out.shape} must be [models, examples] "
                         "with the same examples")
    if shadow_in.shape != (phi_in.shape[0],) or shadow_out.shape != (phi_out.shape[0],):
        raise ValueError("shadow_in / shadow_out must have one flag per model row")
    mu_i, sd_i, c_i = _fit(phi_in[shadow_in], fixed_variance)
    mu_o, sd_o, c_o = _fit(phi_out[shadow_out], fixed_variance)
    usable = (c_i > 0) & (c_o > 0)
    s_in = _log_normal(phi_in[~shadow_in], mu_i, sd_i) - _log_normal(phi_in[~shadow_in], mu_o, sd_o)
    s_out = _log_normal(phi_out[~shadow_out], mu_i, sd_i) - _log_normal(phi_out[~shadow_out], mu_o, sd_o)
    s_in[:, ~usable] = np.nan
    s_out[:, ~usable] = np.nan
    pos, neg = s_in[np.isfinite(s_in)], s_out[np.isfinite(s_out)]
    if pos.size == 0 or neg.size == 0:
        raise ValueError("U-LiRA needs target models with IN and OUT samples of examples seen by the shadows")
    bal = 0.5 * (float(np.mean(pos > 0)) + float(np.mean(neg <= 0)))
    fpr, tpr = roc_curve(pos, neg)
    with np.errstate(invalid="ignore"):
        tp = np.sum(s_in > 0, 0) / np.sum(np.isfinite(s_in), 0)
        tn = np.sum(s_out <= 0, 0) / np.sum(np.isfinite(s_out), 0)
    return ULiRAResult(bal, auc_score(pos, neg), tpr_at_fpr(fpr, tpr, 0.01), tpr_at_fpr(fpr, tpr, 0.001),
                       0.5 * (tp + tn), fpr, tpr, int(pos.size), int(neg.size))


# ----------------------------------------------------------------------------------------- ε-score
def _epsilon_from_counts(tp: np.ndarray, n_pos: int, fp: np.ndarray, n_neg: int, delta: float) -> float:
    """max over thresholds of ε_t = max(log(1 − δ − FPR) − log FNR, log(1 − δ − FNR) − log FPR), clipped ≥ 0,
    with the challenge's float32 arithmetic (its rates are torch means of float32 0/1 tensors).

    ``tp`` / ``fp``: number of positives / negatives classified positive by each threshold. Thresholds with
    exactly one of FPR, FNR equal to 0 are dropped (too few samples to tell); both 0 is a perfect separation,
    ε = ∞ (capped by the caller). Returns NaN when no threshold is kept."""
    code = tp.astype(np.int64) * (n_neg + 1) + fp.astype(np.int64)
    pairs = np.flatnonzero(np.bincount(code, minlength=(n_pos + 1) * (n_neg + 1)))  # ε depends on the counts only
    tp_u, fp_u = pairs // (n_neg + 1), pairs % (n_neg + 1)
    f32 = np.float32
    tpr = tp_u.astype(f32) / f32(n_pos)
    fpr = fp_u.astype(f32) / f32(n_neg)
    fnr = (n_pos - tp_u).astype(f32) / f32(n_pos)
    tnr = (n_neg - fp_u).astype(f32) / f32(n_neg)
    if np.any((fpr + fnr == 0) & (tpr + tnr == 2)):
        return math.inf
    keep = (fpr * fnr) != 0
    if not np.any(keep):
        return float("nan")
    f, n = fpr[keep], fnr[keep]
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.fmax(np.log((1 - delta) - f) - np.log(n), np.log((1 - delta) - n) - np.log(f))
    e = np.clip(e, f32(0), None)
    return float(np.nanmax(e)) if np.any(np.isfinite(e)) else float("nan")


def _count_in(sorted_v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """#{v : lo ≤ v ≤ hi} for sorted ``v`` (0 where lo > hi)."""
    return np.maximum(np.searchsorted(sorted_v, hi, "right") - np.searchsorted(sorted_v, lo, "left"), 0)


def _left_ends(rights: np.ndarray, width: float, num: int) -> np.ndarray:
    """``[np.linspace(tr − width − B, tr − width + B, num) for tr in rights]`` bit for bit, vectorised
    (numpy's linspace: start + i·((stop − start)/(num − 1)), the last element set to stop)."""
    start = rights - width - INTERVAL_BUFFER
    stop = rights - width + INTERVAL_BUFFER
    step = (stop - start) / (num - 1)
    out = np.arange(num, dtype=float)[None, :] * step[:, None] + start[:, None]
    out[:, -1] = stop
    return out


def _left_counts(v: np.ndarray, start: np.ndarray, stop: np.ndarray, num: int) -> np.ndarray | None:
    """``lt[k, i] = #{v : v < l_{k,i}}`` for the left-end grids of :func:`_left_ends` (row k: start[k] …
    stop[k], ``num`` points), without materialising a search per grid point: for each sorted sample value,
    its cut index c = #{i : l_i ≤ v} is estimated from the arithmetic grid and corrected against the grid's
    exact values; then lt[k, i] = #{v : c_v ≤ i}. None if a cut cannot be confirmed (the caller searches)."""
    step = (stop - start) / (num - 1)
    if v.size == 0 or not np.all(step > 0):
        return None

    def l_at(idx):  # the exact grid values at integer positions idx [K, m]
        val = idx.astype(float) * step[:, None] + start[:, None]
        return np.where(idx == num - 1, stop[:, None], val)

    est = np.floor((v[None, :] - start[:, None]) / step[:, None]) + 1
    c = np.clip(est, 0, num).astype(np.int64)
    for _ in range(3):
        c = c + ((c < num) & (l_at(np.minimum(c, num - 1)) <= v[None, :]))
        c = c - ((c > 0) & (l_at(np.maximum(c - 1, 0)) > v[None, :]))
    ok = ((c == num) | (l_at(np.minimum(c, num - 1)) > v[None, :])) & \
         ((c == 0) | (l_at(np.maximum(c - 1, 0)) <= v[None, :]))
    if not ok.all():
        return None
    K = start.size
    hist = np.bincount((np.arange(K)[:, None] * (num + 1) + c).ravel(), minlength=K * (num + 1))
    return np.cumsum(hist.reshape(K, num + 1), 1)[:, :num]


def _interval_counts(sample: np.ndarray, rights: np.ndarray, width: float, num: int) -> np.ndarray:
    """#{v ∈ sample : l_{k,i} ≤ v ≤ r_k} ``[K·num]`` (right-major) for the two-sided family's grid."""
    start, stop = rights - width - INTERVAL_BUFFER, rights - width + INTERVAL_BUFFER
    lt = _left_counts(sample, start, stop, num)
    if lt is None:
        left = _left_ends(rights, width, num).ravel()
        return _count_in(sample, left, np.repeat(rights, num))
    le = np.searchsorted(sample, rights, "right")
    return np.maximum(le[:, None] - lt, 0).ravel()


def _single_thresholds(lo: float, hi: float) -> np.ndarray:
    """The challenge's one-sided grid: ``torch.linspace(lo, hi, ceil((hi − lo)·100))`` in torch's default
    float32, widened to float64 for the comparisons."""
    num = int(math.ceil((hi - lo) * THRESHOLDS_PER_UNIT))
    return torch.linspace(lo, hi, num, dtype=torch.float32).double().numpy() if num > 0 else np.zeros(0)


def example_epsilon(unlearned, retrained, delta: float = DELTA, cap: float = EPSILON_CAP, *,
                    estimator: str = "default") -> float:
    """ε of one example from its φ under U unlearned and R retrained models (1-D arrays), with the
    threshold families of the challenge's released ``metric.py``, built exactly as it builds them:

    1. Orientation: the positive sample P is the retrained one if median(r) > median(u), else the unlearned.
    2. Range rule: if the smaller range (max − min) is below ``RANGE_RATIO_MIN`` × the larger, ε = ``cap``
       (0/0 does not trigger it).
    3. Two-sided: P becomes the peakier sample (swap if range(P) ≥ range(N)), width = the smaller range;
       right ends ``linspace(min P + width − 2, max P + 2, ceil(·100))``; for each, 400 left ends
       ``linspace(tr − width − 2, tr − width + 2, 400)``; "positive" iff left ≤ φ ≤ right.
    4. One-sided: "positive" iff φ ≥ t on the float32 grid of :func:`_single_thresholds` (P of step 1).
    5. ε = max over both families of :func:`_epsilon_from_counts` (float32 rates), clipped to [0, cap].

    ``estimator="reference"`` raises where the released code raises (no threshold kept: two identical point
    masses); the default returns 0 there (the two samples cannot be told apart) and accepts U ≠ R.
    """
    a, b = np.asarray(unlearned, float), np.asarray(retrained, float)
    if estimator not in ("default", "reference"):
        raise ValueError(f"unknown estimator {estimator!r}: use 'default' or 'reference'")
    if a.size < 1 or b.size < 1:
        raise ValueError("example_epsilon needs at least one unlearned and one retrained value")
    pos, neg = (b, a) if np.median(b) > np.median(a) else (a, b)
    pos, neg = np.sort(pos), np.sort(neg)
    d_pos, d_neg = pos[-1] - pos[0], neg[-1] - neg[0]
    largest, smallest = (d_pos, d_neg) if d_pos > d_neg else (d_neg, d_pos)
    with np.errstate(invalid="ignore", divide="ignore"):
        if smallest / largest < RANGE_RATIO_MIN:
            return float(cap)
    eps = []
    # two-sided family, around the peakier sample
    peak, other = (neg, pos) if d_pos >= d_neg else (pos, neg)
    width = smallest
    r_lo, r_hi = peak[0] + width - INTERVAL_BUFFER, peak[-1] + INTERVAL_BUFFER
    rights = np.linspace(r_lo, r_hi, int(math.ceil((r_hi - r_lo) * THRESHOLDS_PER_UNIT)))
    n_left = int(math.ceil(2 * INTERVAL_BUFFER * THRESHOLDS_PER_UNIT))
    for chunk in np.array_split(rights, max(1, len(rights) // 256)):
        if chunk.size == 0:
            continue
        eps.append(_epsilon_from_counts(_interval_counts(peak, chunk, width, n_left), peak.size,
                                        _interval_counts(other, chunk, width, n_left), other.size, delta))
        if math.isinf(eps[-1]):
            break
    # one-sided family
    t = _single_thresholds(min(pos[0], neg[0]), max(pos[-1], neg[-1]))
    eps.append(_epsilon_from_counts(pos.size - np.searchsorted(pos, t, "left"), pos.size,
                                    neg.size - np.searchsorted(neg, t, "left"), neg.size, delta))
    kept = [e for e in eps if not math.isnan(e)]
    if not kept:
        if estimator == "reference":
            raise ValueError("ε (reference): no threshold kept (the released metric raises here)")
        return 0.0
    return float(min(max(max(kept), 0.0), cap))


def example_epsilons(unlearned, retrained, delta: float = DELTA, cap: float = EPSILON_CAP, *,
                     estimator: str = "default") -> np.ndarray:
    """Per-example ε (:func:`example_epsilon`) for φ matrices ``unlearned`` ``[U, n]`` and ``retrained``
    ``[R, n]`` (NaNs ignored; ``estimator="reference"`` requires U = R and no NaN, as the released code)."""
    u, r = np.asarray(unlearned, float), np.asarray(retrained, float)
    if u.ndim != 2 or r.ndim != 2 or u.shape[1] != r.shape[1]:
        raise ValueError(f"unlearned {u.shape} and retrained {r.shape} must be [models, examples]")
    if estimator == "reference" and (u.shape != r.shape or not (np.all(np.isfinite(u)) and np.all(np.isfinite(r)))):
        raise ValueError("ε (reference): the released metric needs U = R models and finite φ")
    return np.array([example_epsilon(u[:, j][np.isfinite(u[:, j])], r[:, j][np.isfinite(r[:, j])], delta, cap,
                                     estimator=estimator) for j in range(u.shape[1])])


def bucket_points(num_models: int) -> list[tuple[float, float]]:
    """(lower edge, points) of each ε bucket: width 0.5, points 1, ½, ¼, …, last bucket ending at
    ceil(ln(num_models − 1)); ε beyond it earns 0."""
    if num_models < 3:
        raise ValueError(f"the ε buckets need at least 3 models per side, got {num_models}")
    max_eps = math.ceil(math.log(num_models - 1))
    out, k = [], 0
    while (k + 1) * BUCKET_WIDTH <= max_eps + 1e-12:
        out.append((k * BUCKET_WIDTH, 0.5 ** k))
        k += 1
    return out


def forget_score(epsilons, num_models: int) -> float:
    """Mean over examples of the points of each ε's bucket (:func:`bucket_points`); 1 = perfect."""
    buckets = bucket_points(num_models)
    pts = []
    for e in np.asarray(epsilons, float):
        p = 0.0
        for lo, v in buckets:
            if e < lo + BUCKET_WIDTH:
                p = v
                break
        pts.append(p)
    return float(np.mean(pts)) if pts else float("nan")


@dataclass
class EpsilonResult:
    """Outcome of :func:`epsilon_score`: per-example ε, the forget score F, the final score
    F·(RA_U/RA_R)·(TA_U/TA_R) and the number of models per side the buckets were sized for."""

    epsilons: np.ndarray
    forget_score: float
    score: float
    num_models: int
    accuracy_ratio_retain: float
    accuracy_ratio_test: float


def epsilon_score(unlearned, retrained, *, retain_accuracy: tuple[float, float] = (1.0, 1.0),
                  test_accuracy: tuple[float, float] = (1.0, 1.0), delta: float = DELTA,
                  cap: float = EPSILON_CAP, estimator: str = "default") -> EpsilonResult:
    """The NeurIPS-2023 score from φ of the forget examples under U unlearned (``[U, n]``) and R retrained
    (``[R, n]``) models of one original and one forget set.

    ``retain_accuracy`` / ``test_accuracy``: (unlearned, retrained) accuracies averaged over the models.
    The buckets are sized for min(U, R) models (the challenge has U = R = 512; ``estimator="reference"``
    requires U = R, as the released code does).
    """
    u, r = np.asarray(unlearned, float), np.asarray(retrained, float)
    eps = example_epsilons(u, r, delta, cap, estimator=estimator)
    n_models = min(u.shape[0], r.shape[0])
    f = forget_score(eps, n_models)
    ra = retain_accuracy[0] / retain_accuracy[1] if retain_accuracy[1] > 0 else float("nan")
    ta = test_accuracy[0] / test_accuracy[1] if test_accuracy[1] > 0 else float("nan")
    return EpsilonResult(eps, f, f * ra * ta, n_models, ra, ta)


# ----------------------------------------------------------------------------------------------- KLoM
#: KLoM's constants (Easy Data-Unlearning-Bench; Georgiev et al. 2024): bins per example, the floor of the
#: oracle's bin probability where the unlearned ensemble has mass, and the clip of the margins
KLOM_BINS = 20
KLOM_EPS = 1e-5
KLOM_CLIP = 100.0
#: the choices that tell the two KLoM modes apart: ``edges`` ("fraction": lo + span·k/bins, or "linspace":
#: numpy's linspace, whose rounding can move a value lying on an interior edge), ``top`` ("closed": the
#: maximum is in the last bin, or "drop": np.digitize's index past the last edge is not counted, so a value
#: equal to the top edge is dropped and an example whose unlearned values all sit there is NaN), ``normalise``
#: ("floor": q floored where p > 0 and used as is, or "scipy": scipy.stats.entropy renormalises p and the
#: floored q to sum 1)
KLOM_MODES = {"default": {"edges": "fraction", "top": "closed", "normalise": "floor"},
              "reference": {"edges": "linspace", "top": "drop", "normalise": "scipy"}}


def _klom_hist(v: np.ndarray, w: np.ndarray, lo: np.ndarray, hi: np.ndarray, bins: int, edges: str,
               top: str) -> np.ndarray:
    """Weighted counts ``[bins, n]`` of ``v`` ``[M, n]`` (model weights ``w`` ``[M]``) in the bins of [lo, hi]."""
    if edges == "linspace":
        e = np.linspace(lo, hi, bins + 1, axis=0)                 # [bins + 1, n], as np.linspace per column
    else:
        e = np.concatenate([lo[None], lo[None, :] + (hi - lo)[None, :] * (np.arange(1, bins)[:, None] / bins),
                            hi[None]])
    idx = np.sum(v[:, None, :] >= e[None, :, :], axis=1)         # np.digitize(right=False): #edges ≤ v
    if top == "closed":
        idx = np.minimum(idx, bins)                              # the top edge belongs to the last bin
    h = np.zeros((bins + 2, v.shape[1]))
    np.add.at(h, (idx, np.broadcast_to(np.arange(v.shape[1]), idx.shape)), w[:, None])
    return h[1:bins + 1]                                         # indices 1..bins: bin k = [e_{k−1}, e_k)


def klom(unlearned, oracle, *, bins: int = KLOM_BINS, eps: float = KLOM_EPS, clip: float = KLOM_CLIP,
         weights_unlearned=None, weights_oracle=None, mode: str = "default", choices: dict | None = None) -> np.ndarray:
    """KL divergence of margins, per example: KL(p ‖ q) with p, q the histograms of the margins
    (φ = z_y − logsumexp_{y'≠y} z_{y'}) of the unlearned ensemble and the oracle (retrained) ensemble.

    Parameters
    ----------
    unlearned, oracle : array ``[U, n]`` and ``[R, n]``
        Margins (nats) of the unlearned and of the oracle models on n examples; finite.
    bins, eps, clip : int, float, float
        Equal-width bins spanning the example's clipped (±``clip``) values of both ensembles (a zero-width
        span becomes [lo, lo + 1]); ``eps`` floors q where p > 0.
    weights_unlearned, weights_oracle : array ``[U]`` / ``[R]``, optional
        Non-negative model weights (bootstrap counts); a model with weight 0 is left out of the span too.
    mode : {"default", "reference"}
        ``"default"``: the maximum is in the last bin, p = counts / total, KLoM = Σ_{p_k > 0} p_k
        log(p_k / max(q_k, eps)). ``"reference"``: data-unlearning-bench's ``compute_binned_KL_div`` —
        edges ``np.linspace(lo, hi, bins + 1)``, bins by ``np.digitize`` counting indices 1..bins only (a
        value equal to the top edge is dropped), p and q = counts over their counted totals, q floored at
        ``eps`` where p > 0, then ``scipy.stats.entropy(p, q)``, which renormalises both to sum 1; NaN where
        p has no counted value (every unlearned margin on the top edge).
    choices : dict, optional
        Overrides of single choices of :data:`KLOM_MODES` (``edges``, ``top``, ``normalise``) on top of
        ``mode``, to measure each difference on its own.

    Returns
    -------
    array ``[n]``
        KLoM per example (nats); 0 = the unlearned margins fall in the oracle's bins in the same proportions.
    """
    if mode not in KLOM_MODES:
        raise ValueError(f"klom: unknown mode {mode!r}: use 'default' or 'reference'")
    ch = {**KLOM_MODES[mode], **(choices or {})}
    u = np.clip(np.asarray(unlearned, float), -clip, clip)
    r = np.clip(np.asarray(oracle, float), -clip, clip)
    if u.ndim != 2 or r.ndim != 2 or u.shape[1] != r.shape[1]:
        raise ValueError(f"klom: unlearned {u.shape} and oracle {r.shape} must be [models, examples]")
    if not (np.all(np.isfinite(u)) and np.all(np.isfinite(r))):
        raise ValueError("klom: margins must be finite")
    wu = np.ones(u.shape[0]) if weights_unlearned is None else np.asarray(weights_unlearned, float)
    wr = np.ones(r.shape[0]) if weights_oracle is None else np.asarray(weights_oracle, float)
    both = np.concatenate([u[wu > 0], r[wr > 0]])
    lo, hi = both.min(0), both.max(0)
    hi = np.where(hi > lo, hi, lo + 1.0)
    hu = _klom_hist(u, wu, lo, hi, bins, ch["edges"], ch["top"])
    hr = _klom_hist(r, wr, lo, hi, bins, ch["edges"], ch["top"])
    with np.errstate(divide="ignore", invalid="ignore"):
        tu, tr = hu.sum(0), hr.sum(0)
        p, q = np.where(tu > 0, hu / tu, 0.0), np.where(tr > 0, hr / tr, 0.0)   # no counted value: zeros
        q = np.where(p > 0, np.maximum(q, eps), q)
        if ch["normalise"] == "scipy":
            p, q = p / p.sum(0), q / q.sum(0)
        terms = np.where(p > 0, p * np.log(p / q), 0.0)
    out = terms.sum(0)
    out[~(tu > 0)] = np.nan                 # p has no counted value (only when the top edge is dropped): 0/0
    return out


# ------------------------------------------------------------------------------------ scored pairs
def lira_pairs(phi_in, phi_out, shadow_in, shadow_out, cluster_in, cluster_out, *, fixed_variance: bool = False,
               estimator: str = "default"):
    """The target pairs of a per-example likelihood-ratio test, as :class:`~scrubnet.audit.uncertainty.ScoredPairs`.

    Same inputs as :func:`ulira`, plus the cluster (e.g. the split) of every row. ``estimator="default"``:
    score = log N_in(φ) − log N_out(φ) with :func:`ulira`'s fit (means, ddof-1 σ, σ ≥ ``MIN_STD``, no
    truncation); ``"reference"``: −prediction of tensorflow/privacy's online LiRA (medians, ddof-0 σ + 1e-30,
    every example truncated to the smallest IN and OUT counts; :mod:`scrubnet.audit.reference`). Returns
    (pairs, usable) with ``usable`` ``[n]`` the examples that have shadow IN and OUT values."""
    phi_in, phi_out = np.asarray(phi_in, float), np.asarray(phi_out, float)
    shadow_in, shadow_out = np.asarray(shadow_in, bool), np.asarray(shadow_out, bool)
    if estimator == "default":
        mu_i, sd_i, c_i = _fit(phi_in[shadow_in], fixed_variance)
        mu_o, sd_o, c_o = _fit(phi_out[shadow_out], fixed_variance)
        usable = (c_i > 0) & (c_o > 0)

        def score(x):
            return _log_normal(x, mu_i, sd_i) - _log_normal(x, mu_o, sd_o)
    elif estimator == "reference":
        vi, vo = phi_in[shadow_in], phi_out[shadow_out]
        usable = np.isfinite(vi).any(0) & np.isfinite(vo).any(0)
        fit = fit_reference(vi[:, usable], np.isfinite(vi[:, usable]), vo[:, usable], np.isfinite(vo[:, usable]),
                            online=True, fixed_variance=fixed_variance)

        def score(x):
            s = np.full(x.shape, np.nan)
            s[:, usable] = -predict_reference(fit, x[:, usable], online=True)
            return s
    else:
        raise ValueError(f"unknown estimator {estimator!r}: use 'default' or 'reference'")
    s_in, s_out = score(phi_in[~shadow_in]), score(phi_out[~shadow_out])
    s_in[:, ~usable], s_out[:, ~usable] = np.nan, np.nan
    ci, co = np.asarray(cluster_in)[~shadow_in], np.asarray(cluster_out)[~shadow_out]
    ri, ji = np.nonzero(np.isfinite(s_in))
    ro, jo = np.nonzero(np.isfinite(s_out))
    pairs = ScoredPairs(np.r_[s_in[ri, ji], s_out[ro, jo]], np.r_[np.ones(ri.size, bool), np.zeros(ro.size, bool)],
                        np.r_[ci[ri], co[ro]], np.r_[ji, jo])
    return pairs, usable


# ------------------------------------------------------------------------------- retain-set leakage
def retain_accuracy(rows: tuple, n_clusters: int, n_examples: int, replicates: int, seed: int
                    ) -> tuple[float, np.ndarray]:
    """Balanced accuracy of per-example LiRA on retained examples, and its bootstrap replicates.

    Parameters
    ----------
    rows : (phi_in, phi_out, shadow, cluster)
        ``[M, n]`` φ matrices (NaN outside IN / OUT), ``[M]`` shadow flags and clusters (target split index),
        one row per split.
    n_clusters, n_examples, replicates, seed : int
        The two-way bootstrap's sizes (:func:`~scrubnet.audit.uncertainty.bootstrap_pairs`): the same sizes and
        seed give common replicates.

    Returns
    -------
    (float, array ``[replicates]``)
        The point value and the replicates (fractions)."""
    phi_in, phi_out, sh, cl = rows
    p, _ = lira_pairs(phi_in, phi_out, sh, sh, cl, cl)
    return (float(pair_statistics(p)["balanced_accuracy"][0]),
            bootstrap_pairs(p, n_clusters, n_examples, replicates, seed)["balanced_accuracy"])


def retain_leakage(before: tuple, after: list[tuple], n_clusters: int, n_examples: int, replicates: int,
                   seed: int) -> dict:
    """Retain-set leakage: LiRA's balanced accuracy on retained examples under the method's models minus under
    the models it started from, each side with **one row per split**.

    A method run on F forget sets per split gives F row sets (``after``); each has the law of ``before`` when
    nothing leaks, so their mean is compared (stacking them would put F near-duplicate rows per split against
    one, which shrinks the fitted spreads on one side only and biases the difference).

    Parameters
    ----------
    before : rows (:func:`retain_accuracy`)
        The original's (or the method's own family's original) rows, one per split.
    after : list of rows
        The method's rows of each forget set, one per split each.
    n_clusters, n_examples, replicates, seed : int
        Bootstrap sizes and seed, common to both sides.

    Returns
    -------
    dict
        ``leakage`` (after − before, fraction), ``ci95`` (its 95 % interval over common replicates, or None),
        ``after`` and ``before`` (the two balanced accuracies)."""
    if not after:
        raise ValueError("retain leakage needs the method's rows of at least one forget set")
    b, b_reps = retain_accuracy(before, n_clusters, n_examples, replicates, seed)
    a = [retain_accuracy(r, n_clusters, n_examples, replicates, seed) for r in after]
    a_point = sum(x for x, _ in a) / len(a)
    a_reps = np.mean([r for _, r in a], axis=0)
    return {"leakage": a_point - b, "ci95": difference_ci(a_reps, b_reps), "after": a_point, "before": b}
