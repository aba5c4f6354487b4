"""The statistics core of the forgetting verdict: per-example membership tests combined over D_f, a paired
bootstrap, and the rules that turn intervals into a verdict (docs/decisions/verdict.md).

Each forget example x gets a per-example membership test against the held-out data scored by the same model:
u(x) = the (label-weighted, mid-rank) fraction of held-out scores below x's score — its rank among data the
model never saw — and z(x) = Φ⁻¹(u(x)), which is N(0, 1) when x is as unseen as the held-out data. D_f's
*membership gap* is the mean of z over D_f (0: looks unseen; ≈ 3 with 500 held-out examples: every forget
example scores above every held-out one); its mean of u is the AUC of D_f against held-out data. The gap is
measured under the input model (before) and the scrubbed model (after) on the same resamples, and the
*fraction of the distance closed* is f = 1 − gap_after / gap_before (1: D_f now looks unseen; 0: no move).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerdictRules:
    """Thresholds of the verdict (docs/decisions/verdict.md says how they were measured).

    Parameters
    ----------
    level : float
        Coverage of every interval (two-sided; 0.90 makes each one-sided test and the equivalence test
        (two one-sided tests) a 5 % test).
    margin : float
        Equivalence margin on the fraction of the distance closed: ``forgot`` needs that fraction's interval
        inside [1 − margin, 1 + margin] (the after gap within ``margin`` × the before gap of "unseen").
    abs_margin : float
        The equivalence margin in z units when larger than ``margin`` × the before gap (0.6: an AUC of ≈ 0.66
        against held-out data), so that a small before gap does not demand an impossible precision.
    point_margin : float
        ``forgot`` also needs the fraction's point estimate at least 1 − ``point_margin`` (a scrub that closed
        two thirds of the distance is ``partly`` however many examples there are).
    floor : float
        ``partly`` needs the fraction's interval above this floor; a fraction below it (whose interval
        excludes ``forgot``) is ``did_not_forget``.
    null_margin : float
        A before gap (z units) whose interval lies within ±``null_margin`` reads "D_f looked unseen already"
        (``nothing_to_measure``).
    class_margin : float
        A whole class reads forgotten at the outputs when the after interval of the mean probability the model
        gives the class on its held-out examples lies below this (a model that never saw the class gives ≈ 0).
    probe_fraction : float
        ``hidden`` when a linear probe fitted on the scrubbed model's features still recovers at least this
        fraction of the recall the same probe gets on the input model's features, above the floor (the probe's
        recall on a model that never saw the class where one is given, else chance, 1 / classes).
    probe_tolerance : float
        Without a model that never saw the class, ``hidden`` needs the probe on the scrubbed features to
        recover the class as well as on the input model's, within this much recall (a network that never saw
        the class can still separate it through the other classes' features; that case reads
        ``inconclusive``, never ``forgot``).
    wrong_way_floor : float
        ``moved_wrong_way`` also needs the move toward membership to be at least this large (z units; for a
        class, ``class_margin`` of probability): a significant but negligible move is not a failure.
    dnf_ceiling : float
        ``did_not_forget`` needs the fraction's interval below max(1 − margin, this): when the before gap is
        small the equivalence margin is wide, and without this ceiling a no-op could never fail.
    overshoot_fails : bool
        Whether D_f driven significantly *below* unseen-like (fraction's interval above 1 + ``margin``) reads
        ``moved_wrong_way`` (True) or ``partly`` (False, the default; an atypical D_f also does that).
    n_boot : int
        Bootstrap replicates.
    seed : int
        Seed of the bootstrap's resampling.
    """

    level: float = 0.90
    margin: float = 0.65
    abs_margin: float = 0.6
    point_margin: float = 0.3
    floor: float = 0.1
    null_margin: float = 0.25
    class_margin: float = 0.05
    probe_fraction: float = 0.5
    probe_tolerance: float = 0.05
    wrong_way_floor: float = 0.2
    dnf_ceiling: float = 0.35
    overshoot_fails: bool = False
    n_boot: int = 1000
    seed: int = 0


class Ranks:
    """Positive scores ranked once against sorted negative scores, so that each bootstrap replicate (counts of
    positives and negatives) costs one cumulative sum: F(s_i) = weighted fraction of negatives below s_i plus
    half the tied ones; AUC = Σ_i c_i F(s_i) / Σ_i c_i."""

    def __init__(self, pos: np.ndarray, neg: np.ndarray):
        self.order = np.argsort(neg, kind="stable")
        s = neg[self.order]
        self.lt = np.searchsorted(s, pos, side="left")
        self.le = np.searchsorted(s, pos, side="right")

    def cdf(self, w_neg: np.ndarray) -> np.ndarray:
        """F of every positive, shape (B, n_pos), for negative weights (B, n_neg)."""
        cum = np.concatenate([np.zeros((len(w_neg), 1)), np.cumsum(w_neg[:, self.order], axis=1)], axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample without negatives: NaN, dropped later
            return (cum[:, self.lt] + cum[:, self.le]) / (2.0 * cum[:, -1:])

    def auc(self, c_pos: np.ndarray, w_neg: np.ndarray) -> np.ndarray:
        """AUCs, shape (B,), for positive counts (B, n_pos) and negative weights (B, n_neg)."""
        return (c_pos * self.cdf(w_neg)).sum(1) / c_pos.sum(1)


def weighted_auc(pos: np.ndarray, neg: np.ndarray, neg_weight: np.ndarray | None = None) -> float:
    """P(pos score > neg score) + ½ P(tie), negatives weighted; shape-(n,) inputs, a float in [0, 1]."""
    w = np.ones(len(neg)) if neg_weight is None else np.asarray(neg_weight, dtype=np.float64)
    return float(Ranks(np.asarray(pos, float), np.asarray(neg, float)).auc(np.ones((1, len(pos))), w[None])[0])


def probit(u: np.ndarray, n_eff: float) -> np.ndarray:
    """z = Φ⁻¹(u) with u clipped to [1/(2(n+1)), 1 − 1/(2(n+1))] (n held-out examples cannot resolve further)."""
    from scipy.special import ndtri
    eps = 1.0 / (2.0 * (max(n_eff, 1.0) + 1.0))
    return ndtri(np.clip(u, eps, 1.0 - eps))


def counts(rng: np.random.Generator, n: int, b: int) -> np.ndarray:
    """Bootstrap multiplicities, shape (b, n): each row resamples n of n with replacement."""
    idx = rng.integers(0, n, size=(b, n)) + n * np.arange(b)[:, None]
    return np.bincount(idx.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)


def effective_n(w: np.ndarray) -> float:
    """Kish's effective sample size of weights: (Σw)² / Σw²."""
    return float(w.sum() ** 2 / (w ** 2).sum()) if w.sum() > 0 else 0.0


def paired_gaps(pos: tuple[np.ndarray, np.ndarray], neg: tuple[np.ndarray, np.ndarray], w: np.ndarray,
                rules: VerdictRules, block: int = 100, pos_weight: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Point estimates (index 0) and bootstrap replicates (1..n_boot) of the membership gap and the AUC of
    D_f against held-out data under both models, keys ``gap_b``, ``gap_a``, ``auc_b``, ``auc_a``. The same
    forget and held-out resamples score the two models, so their difference carries only the scrub's change.
    ``pos_weight`` weighs the forget examples in the gap (not in the AUC)."""
    rng = np.random.default_rng(rules.seed)
    pw = np.ones(len(pos[0])) if pos_weight is None else np.asarray(pos_weight, float)
    ranks = [Ranks(p, n) for p, n in zip(pos, neg)]
    n_eff = effective_n(w)
    out = {k: [] for k in ("gap_b", "gap_a", "auc_b", "auc_a")}
    sizes = [1] + [min(block, rules.n_boot - s) for s in range(0, rules.n_boot, block)]
    for i, b in enumerate(sizes):
        if i == 0:
            c_pos, c_neg = np.ones((1, len(pos[0]))), w[None]
        else:
            c_pos, c_neg = counts(rng, len(pos[0]), b), counts(rng, len(neg[0]), b) * w[None]
        for tag, r in zip("ba", ranks):
            u = r.cdf(c_neg)
            out[f"auc_{tag}"].append((c_pos * u).sum(1) / c_pos.sum(1))
            out[f"gap_{tag}"].append((c_pos * pw * probit(u, n_eff)).sum(1) / (c_pos * pw).sum(1))
    return {k: np.concatenate(v) for k, v in out.items()}


_RETAIN_BOOT: dict = {}


def retain_boot(retain: np.ndarray, held: np.ndarray, w: np.ndarray, rules: VerdictRules) -> np.ndarray:
    """Bootstrap AUCs of D_r against held-out data, shape (n_boot,) (resampled independently of D_f's).
    The same input model judged against many scrubs gives the same arrays: the last few results are kept,
    keyed by the arrays' bytes and the rules (a seeded computation, so the cached value is the value)."""
    key = (retain.tobytes(), held.tobytes(), np.asarray(w, float).tobytes(), rules.n_boot, rules.seed)
    if key not in _RETAIN_BOOT:
        if len(_RETAIN_BOOT) >= 8:
            _RETAIN_BOOT.pop(next(iter(_RETAIN_BOOT)))
        _RETAIN_BOOT[key] = _retain_boot(retain, held, w, rules)
    return _RETAIN_BOOT[key]


def _retain_boot(retain: np.ndarray, held: np.ndarray, w: np.ndarray, rules: VerdictRules) -> np.ndarray:
    rng = np.random.default_rng(rules.seed + 1)
    ranks = Ranks(retain, held)
    return np.concatenate([ranks.auc(counts(rng, len(retain), b), counts(rng, len(held), b) * w[None])
                           for b in np.diff(np.r_[np.arange(0, rules.n_boot, 100), rules.n_boot])])


def interval(values: np.ndarray, level: float, point: float | None = None, n: int | None = None
             ) -> tuple[float, float]:
    """Percentile interval of bootstrap ``values``; with ``point`` and ``n``, its two arms widened by the
    small-sample factor t_{n−1} / z · √(n / (n − 1)) (a percentile bootstrap under-covers at a few examples)."""
    a = (1.0 - level) / 2.0
    v = values[np.isfinite(values)]
    if v.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(v, [a, 1.0 - a])
    if point is not None and n is not None and n > 1 and np.isfinite(point):
        from scipy.stats import norm, t
        k = float(t.ppf(1 - a, n - 1) / norm.ppf(1 - a) * math.sqrt(n / (n - 1)))
        lo, hi = point - k * (point - lo), point + k * (hi - point)
    return float(lo), float(hi)


def samples_needed(n: int, ci: tuple[float, float], point: float, targets: list[float]) -> int | None:
    """Forget examples at which the interval (half-width ∝ 1/√n) would clear the farthest of ``targets`` from
    ``point``: n · (half-width / distance)² · 1.1 from the measured effect; None when ``point`` sits on a target
    or when that count is not above ``n`` (more examples of the same effect would not decide it: the effect,
    not the sample, is what leaves the verdict open)."""
    half = (ci[1] - ci[0]) / 2.0
    dist = [abs(point - t) for t in targets if abs(point - t) > 1e-9]
    if not dist or not np.isfinite(half):
        return None
    need = int(math.ceil(n * (half / max(dist)) ** 2 * 1.1))
    return need if need > n else None


def _agree(ci: dict, pt: dict, rules: VerdictRules, m: float) -> str | None:
    """Why the loss or the error on D_f (against held-out data) contradicts a ``forgot`` read off the ranks:
    the fraction of its own gap closed has an interval below 1 − m (None: they agree, or were not measured)."""
    for key, what in (("f_loss", "mean loss"), ("f_err", "error")):
        if key in ci and np.isfinite(pt.get(key, np.nan)) and ci[key][1] < 1 - m:
            lo, hi = ci[key]
            return f"the ranks say D_f looks unseen, but its {what} closed only {pt[key]:.2f} [{lo:.2f}, " \
                   f"{hi:.2f}] of its gap to held-out data"
    return None


def _fraction_rules(ci: dict, pt: dict, rules: VerdictRules, n: int, abs_margin: float = 0.0
                    ) -> tuple[str, str, int | None]:
    """forgot / overshoot / partly / did_not_forget / inconclusive from the fraction of the distance closed;
    the equivalence margin is ``rules.margin`` of the distance, or ``abs_margin`` in the gap's units if larger.
    ``forgot`` also needs f's interval to reach 1 (full forgetting not excluded) and the loss and error on D_f
    to agree (``f_loss`` / ``f_err`` in ``ci`` when measured)."""
    (lo, hi), f = ci["f"], pt["f"]
    m = max(rules.margin, abs_margin / pt["gap_b"]) if pt.get("gap_b", 0) > 0 else rules.margin
    # the upper side of the equivalence is the point margin alone: an interval reaching past 1 + m says only
    # that overshooting is not excluded, and at 10–30 samples it is what kept retrained models from `forgot`
    # (docs/decisions/verdict.md); overshooting established (lo > 1 + m) is said below
    if lo >= 1 - m and abs(1 - f) <= rules.point_margin and hi >= 1.0:
        disagree = _agree(ci, pt, rules, m)
        if disagree is None:
            return "forgot", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance: D_f now looks unseen", None
        return "partly", disagree, None
    if lo > 1 + m:
        why = "overshot: D_f now looks less like training data than held-out data (over-forgetting, or an " \
              "atypical D_f such as mislabelled samples)"
        return ("moved_wrong_way" if rules.overshoot_fails else "partly"), why, None
    if lo >= rules.floor:
        if f > 1 + rules.point_margin:
            return "partly", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance: past unseen-like (an " \
                             "overshoot, not established)", None
        if hi < 1 - m or f < 1 - rules.point_margin or hi < 1.0:
            return "partly", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance, not all of it", None
        need = samples_needed(n, (lo, hi), f, [1 - m])
        more = f"; ~{need} forget examples would establish all of it" if need else ""
        return "partly", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance: at least {lo:.2f}{more}", need
    if f < rules.floor and hi < max(1 - m, rules.dnf_ceiling):
        return "did_not_forget", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance, below the floor " \
                                 f"{rules.floor:g}", None
    need = samples_needed(n, (lo, hi), f, [rules.floor, max(1 - m, rules.dnf_ceiling)])
    more = f"too few examples to tell partly from not (~{need} would)" if need else \
        "between the floor and forgetting, and more examples of this effect would not settle it"
    return "inconclusive", f"closed {f:.2f} [{lo:.2f}, {hi:.2f}] of the distance: {more}", need


def decide_samples(ci: dict, pt: dict, rules: VerdictRules, n: int, calibrated: bool
                   ) -> tuple[str, str, int | None]:
    """(verdict, reason, forget examples that would decide it) for a set of samples; ``ci``/``pt`` hold
    ``gap_b``, ``gap_a``, ``change`` (gap_a − gap_b), ``f``, optionally ``f_loss``/``f_err`` (the loss's and
    the error's fraction of their gap closed) and, uncalibrated, ``r`` (D_r vs held-out AUC)."""
    if ci["change"][0] > 0 and pt["change"] >= rules.wrong_way_floor:
        return "moved_wrong_way", f"D_f looks significantly more like training data than before (gap " \
                                  f"{pt['gap_b']:.2f} -> {pt['gap_a']:.2f} z)", None
    (lo, hi), g = ci["gap_b"], pt["gap_b"]
    if lo <= 0:
        if not calibrated and ci["r"][0] <= 0.5:
            return "nothing_to_measure", "the input model does not tell D_r from held-out data", None
        gap = f"D_f's membership gap before the scrub, {g:.2f} z [{lo:.2f}, {hi:.2f}],"
        if hi < -rules.null_margin:
            return "nothing_to_measure", f"{gap} is below held-out data's: an atypical D_f (it needs held-out " \
                                         "data of its kind)", None
        need = samples_needed(n, (lo, hi), g, [0.0]) if g > 0 else None
        more = f"; ~{need} forget examples would establish a gap of this size" if need else ""
        return "nothing_to_measure", f"{gap} does not show that the model set D_f apart from unseen data: " \
                                     f"nothing to forget that can be measured{more}", need
    return _fraction_rules(ci, pt, rules, n, rules.abs_margin)


def probe_keeps_class(probe: dict, rules: VerdictRules) -> bool | None:
    """True when the probe fitted on the scrubbed model's features still recovers the class (recall at least
    the floor + ``probe_fraction`` × (recall on the input model's features − the floor); the floor: the
    probe's recall on a model that never saw the class, else chance); None when the probe recovers the class
    from the input model no better than from the floor (it cannot tell)."""
    base = probe["recall_never"] if probe.get("recall_never") is not None else probe["chance"]
    if probe["recall_before"] <= base:
        return None
    return probe["recall_after"] >= base + rules.probe_fraction * (probe["recall_before"] - base)


def decide_class(ci: dict, pt: dict, rules: VerdictRules, n: int, probe: dict | None
                 ) -> tuple[str, str, int | None]:
    """The verdict of a whole-class request from the class's held-out readouts: ``p_b``/``p_a`` (mean
    probability of the class on its held-out examples before/after), ``change`` and ``f`` (fraction closed
    toward 0, the behaviour of a model that never saw the class); ``probe``: the recall of a linear probe
    fitted on each model's features (:func:`scrubnet.readouts.verdict_class.class_probe`; None: no layer to
    probe). A pass (``forgot``, ``partly``) needs the probe: the features must have lost the class too."""
    if ci["p_b"][1] < 2 * rules.class_margin:
        return "nothing_to_measure", "the input model did not predict the class on its held-out examples", None
    if ci["change"][0] > 0 and pt["change"] >= rules.class_margin:
        return "moved_wrong_way", "the class's held-out examples get significantly more probability than " \
                                  "before", None
    if ci["p_a"][1] <= rules.class_margin:
        v, why, need = "forgot", "the class's held-out examples get the probability a model that never saw " \
                                 "the class gives them", None
    else:
        v, why, need = _fraction_rules(ci, pt, rules, n)
        if v == "forgot":  # the equivalence on the probability scale is the margin above
            v, why = "partly", why.replace("D_f now looks unseen", "the class's probability not yet near 0")
    if v not in ("forgot", "partly"):
        return v, why, need
    if probe is None:
        return "inconclusive", "the outputs no longer give the class, but no layer of the scrubbed model could " \
                               "be probed for it (name one: probe_layer=), so hiding is not ruled out", None
    keeps = probe_keeps_class(probe, rules)
    never = probe.get("recall_never") is not None
    base = "a model that never saw the class" if never else "chance"
    nums = f"recall {probe['recall_after']:.2f} (on the input model's {probe['recall_before']:.2f}, {base} " \
           f"{_base(probe):.2f})"
    if keeps and (never or probe["recall_after"] >= probe["recall_before"] - rules.probe_tolerance):
        return "hidden", f"the outputs no longer give the class, but a linear probe fitted on the scrubbed " \
                         f"features still recovers {nums}: suppression, not forgetting", None
    if keeps:
        return "inconclusive", f"the outputs no longer give the class, and a linear probe fitted on the " \
                               f"scrubbed features still recovers {nums}: a network that never saw the class " \
                               "may separate it as well; give a model that never saw it (never_saw=) to decide", None
    if keeps is None:
        return "inconclusive", f"a linear probe recovers the class from the input model's features no better " \
                               f"than from {base} ({probe['recall_before']:.2f} vs {_base(probe):.2f}): " \
                               "whether the features lost it cannot be measured", None
    return v, why + f"; a probe fitted on the features recovers {nums}", need


def _base(probe: dict) -> float:
    return probe["recall_never"] if probe.get("recall_never") is not None else probe["chance"]
