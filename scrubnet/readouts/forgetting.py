"""A forgetting verdict that needs no retrained model: does D_f now look like data the model never saw?

Each example gets a membership score from one forward pass: the negated cross-entropy (``"loss"``) or the logit
margin (``"margin"``: logit of the true class minus the largest other logit); training members score higher.
The readout is the AUC of D_f against held-out data (the probability that a forget example scores above a
held-out one, ties counting one half), with held-out examples weighted so that their label mix matches D_f's
(a forgotten class is compared with held-out examples of that class). A model that never trained on D_f gives
0.5 in expectation; a model that memorised D_f gives ≈ 1.

The decision uses the input model's AUC of D_r against held-out data (which statistic separates training from
unseen data, and whether there is anything to measure at all) and a paired bootstrap of D_f against held-out
before and after (the same resampled forget and held-out examples score both models). Rules, thresholds and
their measurement: docs/decisions/verdict.md.

* :func:`per_example_statistics` — loss and margin of every example, one forward pass, chunk by chunk.
* :func:`judge_forgetting` — the pure statistics core: per-example statistics in, :class:`ForgettingVerdict` out.
* :func:`forgetting_verdict` — the model-level readout: two models and three data sets in.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import NormalDist

import numpy as np
import torch
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import model_device
from scrubnet.models.call import call_model

VERDICTS = ("forgot", "partly", "did_not_forget", "moved_wrong_way", "inconclusive", "nothing_to_measure")
#: verdicts that fail a method whose purpose is forgetting
FAILING = ("did_not_forget", "moved_wrong_way")
STATISTICS = ("loss", "margin")


@dataclass(frozen=True)
class PerExample:
    """Per-example statistics of one data set under one model.

    Parameters
    ----------
    loss : ndarray, shape (n,)
        Cross-entropy of each example, nats.
    margin : ndarray, shape (n,)
        Logit of the true class minus the largest other logit (logit units).
    labels : ndarray of int, shape (n,)
        The examples' labels (used to match label mixes between sets).
    """

    loss: np.ndarray
    margin: np.ndarray
    labels: np.ndarray

    def __post_init__(self):
        n = {len(self.loss), len(self.margin), len(self.labels)}
        if len(n) != 1:
            raise ValueError(f"loss, margin and labels must have one length, got {sorted(n)}")

    def __len__(self) -> int:
        return len(self.labels)

    def score(self, statistic: str) -> np.ndarray:
        """Membership score, shape (n,): higher means more like a training example."""
        if statistic == "loss":
            return -np.asarray(self.loss, dtype=np.float64)
        if statistic == "margin":
            return np.asarray(self.margin, dtype=np.float64)
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")


@dataclass(frozen=True)
class VerdictRules:
    """Thresholds of the verdict (docs/decisions/verdict.md says how they were measured).

    Parameters
    ----------
    level : float
        Coverage of every bootstrap interval (two-sided percentile intervals).
    margin : float
        AUC distance from 0.5 still read as "looks unseen": ``forgot`` when the after interval comes within
        ``margin`` of 0.5; D_f must start more than ``margin`` above 0.5 for there to be something to forget.
    max_width : float
        ``inconclusive`` when the after interval, or the interval a chance-level AUC has at these sample counts,
        is wider than this.
    overshoot_fails : bool
        Whether an after interval entirely below 0.5 − ``margin`` (D_f now looks *less* like training data than
        held-out data) reads ``moved_wrong_way`` (True) or ``partly`` (False, the default): without a reference
        model an over-forgetting scrub cannot be told from an atypical D_f (mislabelled or out-of-distribution
        samples, which a retrained model also scores below held-out data).
    n_boot : int
        Bootstrap replicates.
    seed : int
        Seed of the bootstrap's resampling.
    """

    level: float = 0.95
    margin: float = 0.05
    max_width: float = 0.3
    overshoot_fails: bool = False
    n_boot: int = 1000
    seed: int = 0


@dataclass
class ForgettingVerdict:
    """The verdict and the numbers behind it. AUCs are of "member score of D_f above that of held-out data".

    Attributes
    ----------
    verdict : str
        One of :data:`VERDICTS`.
    statistic : str
        ``"loss"`` or ``"margin"``, the score the AUCs use.
    auc_before, auc_after : float
        AUC of D_f against held-out data under the input and the scrubbed model.
    auc_before_ci, auc_after_ci : (float, float)
        Their bootstrap intervals (paired: the same resamples score both models).
    auc_change_ci : (float, float)
        Interval of auc_after − auc_before (positive: D_f looks more like training data than before).
    distance_change_ci : (float, float)
        Interval of |auc_after − 0.5| − |auc_before − 0.5| (negative: moved toward unseen-like).
    auc_retain_heldout, auc_retain_heldout_ci : float, (float, float)
        AUC of D_r against held-out data under the input model (how much the model tells members apart).
    auc_retain_heldout_after : float or None
        The same under the scrubbed model (None when D_r was not scored after).
    auc_forget_retain_before, auc_forget_retain_after : float or None
        AUC of D_f against D_r (≈ 0.5 while D_f is still a member like D_r; falls as D_f is forgotten).
    statistic_aucs : dict
        AUC of D_r against held-out data under the input model for each statistic (how the statistic was chosen).
    n_forget, n_heldout, n_retain : int
        Examples compared (forget examples whose label has no held-out example are left out).
    n_heldout_effective : float
        Kish's effective size of the label-matched held-out set (e.g. the held-out examples of D_f's class).
    level, rules : float, VerdictRules
    summary : str
        One line with the verdict and the numbers.
    """

    verdict: str
    statistic: str
    auc_before: float
    auc_before_ci: tuple[float, float]
    auc_after: float
    auc_after_ci: tuple[float, float]
    auc_change_ci: tuple[float, float]
    distance_change_ci: tuple[float, float]
    auc_retain_heldout: float
    auc_retain_heldout_ci: tuple[float, float]
    auc_retain_heldout_after: float | None
    auc_forget_retain_before: float | None
    auc_forget_retain_after: float | None
    statistic_aucs: dict
    n_forget: int
    n_heldout: int
    n_retain: int
    n_heldout_effective: float
    summary: str = ""
    rules: VerdictRules = field(default_factory=VerdictRules)

    @property
    def failed(self) -> bool:
        """True for the verdicts that fail a forgetting method (:data:`FAILING`)."""
        return self.verdict in FAILING

    def to_dict(self) -> dict:
        """JSON-ready dict (tuples as lists)."""
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# --- the statistics core -------------------------------------------------------------------------------------

def _label_weights(target_labels: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Weights of ``labels`` making their label mix that of ``target_labels`` (0 for labels absent there)."""
    classes, counts = np.unique(labels, return_counts=True)
    t_classes, t_counts = np.unique(target_labels, return_counts=True)
    share = dict(zip(t_classes.tolist(), (t_counts / t_counts.sum()).tolist()))
    per = {c: share.get(c, 0.0) / (n / len(labels)) for c, n in zip(classes.tolist(), counts.tolist())}
    return np.array([per[c] for c in labels.tolist()], dtype=np.float64)


class _Ranks:
    """Positive scores ranked once against sorted negative scores, so that each bootstrap replicate (counts of
    positives and negatives) costs one cumulative sum: AUC = Σ_i c_i F(s_i) / Σ_i c_i with F the weighted
    fraction of negatives below s_i plus half the tied ones."""

    def __init__(self, pos: np.ndarray, neg: np.ndarray):
        self.order = np.argsort(neg, kind="stable")
        s = neg[self.order]
        self.lt = np.searchsorted(s, pos, side="left")
        self.le = np.searchsorted(s, pos, side="right")

    def auc(self, c_pos: np.ndarray, w_neg: np.ndarray) -> np.ndarray:
        """AUCs, shape (B,), for positive counts (B, n_pos) and negative weights (B, n_neg)."""
        cum = np.concatenate([np.zeros((len(w_neg), 1)), np.cumsum(w_neg[:, self.order], axis=1)], axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample without negatives: NaN, dropped later
            f = (cum[:, self.lt] + cum[:, self.le]) / (2.0 * cum[:, -1:])
        return (c_pos * f).sum(1) / c_pos.sum(1)


def weighted_auc(pos: np.ndarray, neg: np.ndarray, neg_weight: np.ndarray | None = None) -> float:
    """P(pos score > neg score) + ½ P(tie), negatives weighted; shape-(n,) inputs, a float in [0, 1]."""
    w = np.ones(len(neg)) if neg_weight is None else np.asarray(neg_weight, dtype=np.float64)
    return float(_Ranks(np.asarray(pos, float), np.asarray(neg, float)).auc(np.ones((1, len(pos))), w[None])[0])


def _counts(rng: np.random.Generator, n: int, b: int) -> np.ndarray:
    """Bootstrap multiplicities, shape (b, n): each row resamples n of n with replacement."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=b).astype(np.float64)


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    if np.isnan(values).all():
        return float("nan"), float("nan")
    lo, hi = np.nanquantile(values, [a, 1.0 - a])
    return float(lo), float(hi)


def chance_width(n_pos: int, n_neg: int, level: float = 0.95) -> float:
    """Width of the normal interval of an AUC at chance (Mann–Whitney null variance (n+m+1)/(12nm)); the
    narrowest interval these sample counts allow around 0.5, even when a bootstrap collapses at 0 or 1."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    return float(2.0 * z * np.sqrt((n_pos + n_neg + 1) / (12.0 * n_pos * n_neg)))


def _choose_statistic(retain: PerExample, heldout: PerExample, w: np.ndarray) -> tuple[str, dict]:
    """The statistic that best separates D_r from held-out data (never looks at D_f)."""
    aucs = {s: weighted_auc(retain.score(s), heldout.score(s), w) for s in STATISTICS}
    return max(STATISTICS, key=lambda s: abs(aucs[s] - 0.5)), aucs


def _effective_n(w: np.ndarray) -> float:
    """Kish's effective sample size of weights: (Σw)² / Σw²."""
    return float(w.sum() ** 2 / (w ** 2).sum()) if w.sum() > 0 else 0.0


def _paired_boot(pos: tuple[np.ndarray, np.ndarray], neg: tuple[np.ndarray, np.ndarray], w: np.ndarray,
                 rules: VerdictRules, block: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap AUCs (before, after), each shape (n_boot,): the same forget and held-out resamples score the
    two models, so their difference carries only the scrub's change."""
    rng = np.random.default_rng(rules.seed)
    ranks = [_Ranks(p, n) for p, n in zip(pos, neg)]
    out = [[], []]
    for start in range(0, rules.n_boot, block):
        b = min(block, rules.n_boot - start)
        c_pos, c_neg = _counts(rng, len(pos[0]), b), _counts(rng, len(neg[0]), b) * w[None]
        for k in (0, 1):
            out[k].append(ranks[k].auc(c_pos, c_neg))
    return np.concatenate(out[0]), np.concatenate(out[1])


def _retain_boot(retain: np.ndarray, held: np.ndarray, w: np.ndarray, rules: VerdictRules) -> np.ndarray:
    """Bootstrap AUCs of D_r against held-out data, shape (n_boot,) (resampled independently of D_f's)."""
    rng = np.random.default_rng(rules.seed + 1)
    ranks = _Ranks(retain, held)
    return np.concatenate([ranks.auc(_counts(rng, len(retain), b), _counts(rng, len(held), b) * w[None])
                           for b in np.diff(np.r_[np.arange(0, rules.n_boot, 100), rules.n_boot])])


def _decide(ci: dict, width: float, rules: VerdictRules) -> tuple[str, str]:
    """(verdict, reason) from the intervals (``b``/``a``: AUC before/after, ``c``: after − before, ``d``: change
    of the distance to 0.5, ``r``: D_r vs held-out); the rules in the order docs/decisions/verdict.md gives them."""
    m, before_ci, after_ci = rules.margin, ci["b"], ci["a"]
    if ci["r"][0] <= 0.5:
        return "nothing_to_measure", "the input model does not tell D_r from held-out data"
    if not width <= rules.max_width:  # NaN too
        return "inconclusive", f"interval width {width:.2f} > {rules.max_width:.2f}: too few examples"
    if ci["c"][0] > 0 and after_ci[0] > 0.5:
        return "moved_wrong_way", "D_f looks significantly more like training data than before"
    if before_ci[0] <= 0.5 + m:
        if before_ci[1] < 0.5 - m:
            return "nothing_to_measure", "D_f looked less like training data than held-out data already before " \
                                         "the scrub (an atypical D_f: it needs held-out data of its kind)"
        if before_ci[1] <= 0.5 + 2 * m:
            return "nothing_to_measure", "D_f looked like held-out data already before the scrub"
        return "inconclusive", "whether D_f looked like training data before the scrub is not established"
    if max(after_ci[0] - 0.5, 0.5 - after_ci[1], 0.0) <= m:
        return "forgot", "D_f now looks like held-out data"
    if after_ci[1] < 0.5 - m:
        why = "overshot: D_f now looks less like training data than held-out data (over-forgetting, or an " \
              "atypical D_f such as mislabelled samples)"
        return ("moved_wrong_way" if rules.overshoot_fails else "partly"), why
    if ci["d"][1] < 0:
        return "partly", "moved significantly toward held-out-like; D_f still looks more like training data"
    return "did_not_forget", "no significant move toward held-out-like"


def _auc_or_none(pos: PerExample, neg: PerExample, statistic: str) -> float | None:
    w = _label_weights(pos.labels, neg.labels)
    return weighted_auc(pos.score(statistic), neg.score(statistic), w) if len(pos) and w.sum() > 0 else None


def judge_forgetting(forget_before: PerExample, forget_after: PerExample, heldout_before: PerExample,
                     heldout_after: PerExample, retain_before: PerExample, retain_after: PerExample | None = None,
                     *, statistic: str = "auto", rules: VerdictRules | None = None) -> ForgettingVerdict:
    """The verdict from per-example statistics (no model needed).

    Parameters
    ----------
    forget_before, forget_after : PerExample
        Statistics of D_f (same examples, same order) under the input and the scrubbed model.
    heldout_before, heldout_after : PerExample
        Statistics of held-out data under the two models.
    retain_before : PerExample
        Statistics of D_r (or a sample of it) under the input model: it picks the statistic and says whether
        the model tells training from unseen data at all.
    retain_after : PerExample, optional
        D_r under the scrubbed model (reported only).
    statistic : {"auto", "loss", "margin"}
        ``"auto"``: the one whose D_r-vs-held-out AUC is further from 0.5 under the input model.
    rules : VerdictRules, optional

    Returns
    -------
    ForgettingVerdict
    """
    rules = rules or VerdictRules()
    if min(len(forget_before), len(heldout_before), len(retain_before)) == 0:
        raise ValueError("the forget, held-out and retain sets must each hold at least one example")
    if len(forget_before) != len(forget_after) or len(heldout_before) != len(heldout_after):
        raise ValueError("the before and after statistics must cover the same examples")
    w_r = _label_weights(retain_before.labels, heldout_before.labels)
    chosen, stat_aucs = _choose_statistic(retain_before, heldout_before, w_r)
    statistic = chosen if statistic == "auto" else statistic
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose auto, loss or margin")
    sets = (forget_before, forget_after, heldout_before, heldout_after, retain_before)
    if not all(np.isfinite(p.score(statistic)).all() for p in sets):
        raise ValueError(f"a per-example {statistic} is not finite: the model's logits are not finite")
    # forget examples whose label no held-out example has cannot be compared: left out (and counted)
    keep = np.isin(forget_before.labels, heldout_before.labels)
    if not keep.any():
        raise ValueError("no held-out example shares a label with the forget set")
    f_b, f_a = (forget_before.score(statistic)[keep], forget_after.score(statistic)[keep])
    h_b, h_a = heldout_before.score(statistic), heldout_after.score(statistic)
    w_f = _label_weights(forget_before.labels[keep], heldout_before.labels)
    boot_b, boot_a = _paired_boot((f_b, f_a), (h_b, h_a), w_f, rules)
    boot_r = _retain_boot(retain_before.score(statistic), h_b, w_r, rules)
    boots = {"b": boot_b, "a": boot_a, "r": boot_r, "c": boot_a - boot_b,
             "d": np.abs(boot_a - 0.5) - np.abs(boot_b - 0.5)}
    ci = {k: _interval(v, rules.level) for k, v in boots.items()}
    n_f, n_h = int(keep.sum()), _effective_n(w_f)
    width = max(ci["a"][1] - ci["a"][0], chance_width(n_f, max(int(round(n_h)), 1), rules.level))
    verdict, reason = _decide(ci, width, rules)
    sub = lambda p: PerExample(p.loss[keep], p.margin[keep], p.labels[keep])  # noqa: E731
    auc_b, auc_a = weighted_auc(f_b, h_b, w_f), weighted_auc(f_a, h_a, w_f)
    out = ForgettingVerdict(
        verdict=verdict, statistic=statistic, auc_before=auc_b, auc_before_ci=ci["b"], auc_after=auc_a,
        auc_after_ci=ci["a"], auc_change_ci=ci["c"], distance_change_ci=ci["d"],
        auc_retain_heldout=stat_aucs[statistic],
        auc_retain_heldout_ci=ci["r"],
        auc_retain_heldout_after=None if retain_after is None else _auc_or_none(retain_after, heldout_after,
                                                                               statistic),
        auc_forget_retain_before=_auc_or_none(sub(forget_before), retain_before, statistic),
        auc_forget_retain_after=None if retain_after is None else _auc_or_none(sub(forget_after), retain_after,
                                                                              statistic),
        statistic_aucs=stat_aucs, n_forget=n_f, n_heldout=len(heldout_before), n_retain=len(retain_before),
        n_heldout_effective=n_h, rules=rules)
    out.summary = (f"{verdict} ({reason}): D_f vs held-out AUC ({statistic}) {auc_b:.2f} "
                   f"[{ci['b'][0]:.2f}, {ci['b'][1]:.2f}] -> {auc_a:.2f} [{ci['a'][0]:.2f}, {ci['a'][1]:.2f}]; "
                   f"D_r vs held-out {out.auc_retain_heldout:.2f}; n_forget={n_f}, n_heldout={len(heldout_before)} "
                   f"(effective {n_h:.0f} with D_f's labels)")
    return out


# --- the model-level readout ---------------------------------------------------------------------------------

@torch.no_grad()
def per_example_statistics(model: nn.Module, data, max_examples: int | None = None,
                           seed: int = 0) -> PerExample:
    """Loss and margin of every example of ``data`` under ``model`` (eval mode, one forward pass).

    Parameters
    ----------
    model : nn.Module
        Called through :func:`scrubnet.models.call.call_model`; its train/eval mode is restored.
    data : (x, y) tensors, Dataset, DataLoader or DataStream
        Read chunk by chunk through :func:`scrubnet.data.stream.as_stream`.
    max_examples : int, optional
        Score at most this many examples: a seeded random subset when the data are indexable, the first
        ones of a loader otherwise.
    seed : int
        Seed of that subset.

    Returns
    -------
    PerExample
        loss (n,) in nats, margin (n,) in logit units, labels (n,).
    """
    stream = as_stream(data)
    n = len(stream)
    if max_examples is not None and n > max_examples and stream.indexable:
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_examples].sort().values
        chunks = (stream.take(idx[i:i + stream.chunk_size]) for i in range(0, len(idx), stream.chunk_size))
    else:
        chunks = stream.chunks()
    device, was_training = model_device(model), model.training
    model.eval()
    losses, margins, labels, seen = [], [], [], 0
    try:
        for x, y in chunks:
            if max_examples is not None and seen >= max_examples:
                break
            logits = call_model(model, x.to(device)).double()
            y = y.to(logits.device)
            true = logits.gather(1, y[:, None])[:, 0]
            other = logits.scatter(1, y[:, None], float("-inf")).amax(1)
            losses.append(torch.logsumexp(logits, 1) - true)
            margins.append(true - other)
            labels.append(y)
            seen += len(y)
    finally:
        model.train(was_training)
    cat = lambda t: torch.cat(t).cpu().numpy() if t else np.zeros(0)  # noqa: E731
    k = max_examples if max_examples is not None else None
    return PerExample(cat(losses)[:k], cat(margins)[:k], cat(labels).astype(np.int64)[:k])


def forgetting_verdict(model_before: nn.Module, model_after: nn.Module, forget, retain, heldout, *,
                       statistic: str = "auto", rules: VerdictRules | None = None,
                       max_retain: int | None = 10000) -> ForgettingVerdict:
    """Did the scrub make D_f look like data the model never saw? No retrained model needed.

    Parameters
    ----------
    model_before, model_after : nn.Module
        The input model and the scrubbed one (same output classes).
    forget, retain, heldout : (x, y) tensors, Dataset, DataLoader or DataStream
        D_f, D_r and held-out data (e.g. the test set) — data neither model trained on.
    statistic : {"auto", "loss", "margin"}
        See :func:`judge_forgetting`.
    rules : VerdictRules, optional
        Thresholds, bootstrap size and seed.
    max_retain : int or None
        Score at most this many D_r examples (seeded subset); None scores all of D_r.

    Returns
    -------
    ForgettingVerdict
        One forward pass per set per model: D_f, held-out and (a sample of) D_r, before and after.
    """
    rules = rules or VerdictRules()
    stats = {}
    for name, model in (("before", model_before), ("after", model_after)):
        stats[name] = [per_example_statistics(model, forget), per_example_statistics(model, heldout),
                       per_example_statistics(model, retain, max_retain, rules.seed)]
    (f_b, h_b, r_b), (f_a, h_a, r_a) = stats["before"], stats["after"]
    return judge_forgetting(f_b, f_a, h_b, h_a, r_b, r_a, statistic=statistic, rules=rules)
