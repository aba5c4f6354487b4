"""A forgetting verdict that needs evidence: does D_f now look like data the model never saw?

Each forget example gets a per-example membership test against held-out data scored by the same model (its
rank among them, as a z-score: :mod:`scrubnet.readouts.verdict_rules`); the tests are combined over D_f into
the *membership gap* before and after the scrub, and the verdict rests on the fraction of that gap the scrub
closed, with its interval: ``forgot`` only when an equivalence test puts D_f at "unseen" *and* the move is
significant; ``partly`` with the fraction closed; ``did_not_forget`` below a floor; a significant move toward
membership is ``moved_wrong_way`` at any sample size.

* Scores: without reference models, the negated loss or the logit margin (chosen on D_r, never on D_f).
  With reference models (:mod:`scrubnet.readouts.references`, trained once per model on complementary halves
  of its training data, reused for every request), each example's logit confidence minus its mean under the
  reference models that never trained on it (offline LiRA's difficulty calibration): the per-example tests
  then decide a request of ten samples.
* A whole class (every training example of one label in D_f) is judged as a class: the probability the model
  gives the class on its held-out examples against the ≈ 0 of a model that never saw it, and the input model's
  a linear probe fitted anew on each model's last hidden features — a model that only hides the class (in any
  re-parametrisation of that layer) reads ``hidden``. No held-out example of the class: ``nothing_to_measure``
  with that reason.

Rules, thresholds and their measurement: docs/decisions/verdict.md.
"""
from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import model_device
from scrubnet.models.call import call_model
from scrubnet.readouts.verdict_class import class_probe
from scrubnet.readouts.verdict_rules import (VerdictRules, counts, decide_class, decide_samples,
                                             effective_n, interval, paired_gaps, retain_boot, weighted_auc)

VERDICTS = ("forgot", "partly", "did_not_forget", "moved_wrong_way", "hidden", "inconclusive",
            "nothing_to_measure")
#: verdicts that fail a method whose purpose is forgetting
FAILING = ("did_not_forget", "moved_wrong_way", "hidden")
#: verdicts that leave a scrub unjudged (said to the user, never a silent pass)
UNDECIDED = ("inconclusive", "nothing_to_measure")
STATISTICS = ("loss", "margin")
__all__ = ["VERDICTS", "FAILING", "PerExample", "VerdictRules", "ForgettingVerdict", "judge_forgetting",
           "per_example_statistics", "forgetting_verdict", "verdict_lines", "weighted_auc"]


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
    confidence : ndarray, shape (n,), optional
        log p_y − log(1 − p_y) (LiRA's logit confidence); derived from ``loss`` when not given.
    """

    loss: np.ndarray
    margin: np.ndarray
    labels: np.ndarray
    confidence: np.ndarray | None = None

    def __post_init__(self):
        n = {len(self.loss), len(self.margin), len(self.labels)}
        if self.confidence is not None:
            n.add(len(self.confidence))
        if len(n) != 1:
            raise ValueError(f"loss, margin, labels (and confidence) must have one length, got {sorted(n)}")

    def __len__(self) -> int:
        return len(self.labels)

    def score(self, statistic: str) -> np.ndarray:
        """Membership score, shape (n,): higher means more like a training example."""
        if statistic == "loss":
            return -np.asarray(self.loss, dtype=np.float64)
        if statistic == "margin":
            return np.asarray(self.margin, dtype=np.float64)
        if statistic == "confidence":
            if self.confidence is not None:
                return np.asarray(self.confidence, dtype=np.float64)
            loss = np.maximum(np.asarray(self.loss, dtype=np.float64), 1e-300)
            return -loss - np.log(-np.expm1(-loss))
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")

    def subset(self, keep: np.ndarray) -> "PerExample":
        """The examples where ``keep`` (a boolean mask) is True."""
        conf = None if self.confidence is None else self.confidence[keep]
        return PerExample(self.loss[keep], self.margin[keep], self.labels[keep], conf)


@dataclass
class ForgettingVerdict:
    """The verdict and the numbers behind it.

    Attributes
    ----------
    verdict : str
        One of :data:`VERDICTS`.
    reason : str
        Why, in one clause.
    request : str
        ``"samples"`` or ``"class"`` (D_f is every training example of one label).
    statistic : str
        ``"loss"``, ``"margin"`` or ``"calibrated"`` (logit confidence minus the reference models' mean).
    auc_before, auc_after : float
        AUC of D_f against held-out data (of D_f's labels) under the input and the scrubbed model.
    auc_before_ci, auc_after_ci : (float, float)
        Their bootstrap intervals (paired: the same resamples score both models).
    gap_before, gap_after, gap_before_ci, gap_after_ci : float, (float, float)
        D_f's membership gap (mean per-example z; 0 = unseen-like) and intervals.
    fraction_closed, fraction_closed_ci : float, (float, float)
        1 − gap_after / gap_before (for a class: 1 − p_after / p_before) and its interval.
    auc_retain_heldout, auc_retain_heldout_ci : float, (float, float)
        AUC of D_r against held-out data under the input model (raw statistic).
    auc_retain_heldout_after : float or None
        The same under the scrubbed model.
    auc_forget_retain_before, auc_forget_retain_after : float or None
        AUC of D_f against D_r.
    statistic_aucs : dict
        D_r-vs-held-out AUC per raw statistic (how the raw statistic was chosen).
    n_forget, n_heldout, n_retain : int
        Examples compared (forget examples whose label has no held-out example are left out).
    n_heldout_effective : float
        Kish's effective size of the label-matched held-out set.
    samples_needed : int or None
        For ``inconclusive``: forget examples at which the same effect would be decided.
    class_readout : dict or None
        For a class: ``label``, ``n_heldout_class``, ``prob_before``/``prob_after`` (+ ``_ci``), ``recall_before``,
        ``recall_after``, ``recall_probe`` / ``recall_probe_before`` / ``recall_probe_never`` (a linear probe
        fitted on the scrubbed / input / never-saw-the-class model's features; None: no layer probed) and
        ``probe_layer``.
    references : dict or None
        The reference models used: ``models`` and their one-off ``seconds``.
    summary : str
        One line with the verdict and the numbers.
    rules : VerdictRules
    """

    verdict: str
    reason: str
    request: str
    statistic: str
    auc_before: float
    auc_before_ci: tuple[float, float]
    auc_after: float
    auc_after_ci: tuple[float, float]
    gap_before: float
    gap_before_ci: tuple[float, float]
    gap_after: float
    gap_after_ci: tuple[float, float]
    fraction_closed: float
    fraction_closed_ci: tuple[float, float]
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
    samples_needed: int | None = None
    class_readout: dict | None = None
    references: dict | None = None
    summary: str = ""
    rules: VerdictRules = field(default_factory=VerdictRules)

    @property
    def failed(self) -> bool:
        """True for the verdicts that fail a forgetting method (:data:`FAILING`)."""
        return self.verdict in FAILING

    def to_dict(self) -> dict:
        """A plain JSON-able dict: ``outcome`` (the verdict) first, tuples as lists, non-finite numbers None."""
        def clean(v):
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, (tuple, list)):
                return [clean(x) for x in v]
            if isinstance(v, (float, np.floating)):
                return float(v) if np.isfinite(v) else None
            return v.item() if isinstance(v, np.generic) else v
        return {"outcome": self.verdict, **clean(asdict(self))}


# --- the statistics core -------------------------------------------------------------------------------------

def _label_weights(target_labels: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Weights of ``labels`` making their label mix that of ``target_labels`` (0 for labels absent there)."""
    classes, cnt = np.unique(labels, return_counts=True)
    t_classes, t_counts = np.unique(target_labels, return_counts=True)
    share = dict(zip(t_classes.tolist(), (t_counts / t_counts.sum()).tolist()))
    per = {c: share.get(c, 0.0) / (n / len(labels)) for c, n in zip(classes.tolist(), cnt.tolist())}
    return np.array([per[c] for c in labels.tolist()], dtype=np.float64)


def _choose_statistic(retain: PerExample, heldout: PerExample, w: np.ndarray) -> tuple[str, dict]:
    """The raw statistic that best separates D_r from held-out data (never looks at D_f)."""
    aucs = {s: weighted_auc(retain.score(s), heldout.score(s), w) for s in STATISTICS}
    return max(STATISTICS, key=lambda s: abs(aucs[s] - 0.5)), aucs


def _auc_or_none(pos: PerExample, neg: PerExample, statistic: str) -> float | None:
    w = _label_weights(pos.labels, neg.labels)
    return weighted_auc(pos.score(statistic), neg.score(statistic), w) if len(pos) and w.sum() > 0 else None


def _gap_part(scores: tuple, w: np.ndarray, rules: VerdictRules, n: int, pos_weight=None) -> tuple[dict, dict]:
    """Points and intervals of the gaps, AUCs, change and fraction closed from the paired bootstrap (``n``:
    the forget examples, or the Kish size of ``pos_weight``)."""
    reps = paired_gaps(scores[:2], scores[2:], w, rules, pos_weight=pos_weight)
    n = n if pos_weight is None else max(int(round(effective_n(np.asarray(pos_weight, float)))), 2)
    return _closed(reps, "gap", rules, n)


def _closed(reps: dict, key: str, rules: VerdictRules, n: int) -> tuple[dict, dict]:
    """Add the change (after − before) and the fraction closed 1 − after/before of ``reps[key_b]`` /
    ``reps[key_a]`` (index 0: the point, then the replicates); return the points and the intervals."""
    before, after = reps[f"{key}_b"], reps[f"{key}_a"]
    reps["change"] = after - before
    with np.errstate(invalid="ignore", divide="ignore"):
        reps["f"] = np.where(before > 0, 1.0 - after / before, np.nan)
    pt = {k: float(v[0]) for k, v in reps.items()}
    ci = {k: interval(v[1:], rules.level, pt[k], n) for k, v in reps.items()}
    return pt, ci


def _agreement(sets: tuple, w: np.ndarray, rules: VerdictRules, n: int) -> tuple[dict, dict]:
    """The loss's and the error's own fraction of their gap closed (``f_loss``, ``f_err``): gap = held-out
    (label-weighted) mean minus D_f's mean, before and after, paired bootstrap over D_f and held-out data.
    A statistic whose before gap's interval does not exclude 0 is left out (it has nothing to contradict)."""
    f_b, f_a, h_b, h_a = sets
    rng = np.random.default_rng(rules.seed + 3)
    cf = np.vstack([np.ones((1, len(f_b))), counts(rng, len(f_b), rules.n_boot)])
    ch = np.vstack([np.ones((1, len(h_b))), counts(rng, len(h_b), rules.n_boot)]) * w[None]
    pt, ci = {}, {}
    for key, stat in (("f_loss", lambda p: np.minimum(np.asarray(p.loss, float), 30.0)),
                      ("f_err", lambda p: (np.asarray(p.margin, float) <= 0).astype(float))):
        gb = ch @ stat(h_b) / ch.sum(1) - cf @ stat(f_b) / cf.sum(1)
        ga = ch @ stat(h_a) / ch.sum(1) - cf @ stat(f_a) / cf.sum(1)
        if interval(gb[1:], rules.level, gb[0], n)[0] <= 0:
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            f = np.where(gb > 0, 1.0 - ga / gb, np.nan)
        pt[key], ci[key] = float(f[0]), interval(f[1:], rules.level, float(f[0]), n)
    return pt, ci


def _class_part(h_b: PerExample, h_a: PerExample, label: int, rules: VerdictRules
                ) -> tuple[dict, dict, int]:
    """The class's held-out readouts: mean probability of the class (p_b, p_a), its change and the fraction
    closed toward 0, paired bootstrap over the class's held-out examples."""
    keep = h_b.labels == label
    p = [np.exp(-np.asarray(h.loss, float)[keep]) for h in (h_b, h_a)]
    n = int(keep.sum())
    c = np.vstack([np.ones((1, n)), counts(np.random.default_rng(rules.seed + 2), n, rules.n_boot)])
    pt, ci = _closed({"p_b": c @ p[0] / n, "p_a": c @ p[1] / n}, "p", rules, n)
    return pt, ci, n


def _scores(sets: tuple, raw: str, f_off, h_off, f_scale=None, h_scale=None) -> tuple:
    """Membership scores of (D_f before, D_f after, held-out before, held-out after): the raw statistic, or
    with reference offsets the logit confidence minus each example's offset (divided by its reference spread
    when given: online LiRA's per-example variance)."""
    if f_off is None:
        return tuple(p.score(raw) for p in sets)
    offs = (f_off, f_off, np.asarray(h_off, float), np.asarray(h_off, float))
    sc = (1.0, 1.0, 1.0, 1.0) if f_scale is None else (f_scale, f_scale, np.asarray(h_scale, float),
                                                        np.asarray(h_scale, float))
    out = tuple((p.score("confidence") - o) / c for p, o, c in zip(sets, offs, sc))
    if not all(np.isfinite(x).all() for x in out):
        raise ValueError("a calibrated score is not finite: check the reference offsets")
    return out


def _judge_class(h_b: PerExample, h_a: PerExample, label: int, rules: VerdictRules, probe: dict | None,
                 pt: dict, ci: dict) -> tuple:
    """(verdict, reason, samples needed, class readout) of a whole class; ``pt``/``ci`` get the class's
    fraction closed."""
    cpt, cci, n_hc = _class_part(h_b, h_a, label, rules)
    verdict, reason, need = decide_class(cci, cpt, rules, n_hc, probe)
    pt["f"], ci["f"] = cpt["f"], cci["f"]
    rec = [float(np.mean(h.margin[h.labels == label] > 0)) for h in (h_b, h_a)]
    cls = {"label": label, "n_heldout_class": n_hc, "prob_before": cpt["p_b"], "prob_before_ci": cci["p_b"],
           "prob_after": cpt["p_a"], "prob_after_ci": cci["p_a"], "recall_before": rec[0],
           "recall_after": rec[1], "recall_probe": None if probe is None else probe["recall_after"],
           "recall_probe_before": None if probe is None else probe["recall_before"],
           "recall_probe_never": None if probe is None else probe.get("recall_never"),
           "probe_layer": None if probe is None else probe.get("layer")}
    return verdict, reason, need, cls


def _raw_statistic(sets: tuple, statistic: str) -> tuple[str, dict, np.ndarray]:
    """Check the five per-example sets (D_f before/after, held-out before/after, D_r) and choose the raw
    statistic on D_r: (statistic, D_r-vs-held-out AUC per statistic, D_r's label weights of held-out data)."""
    f_b, f_a, h_b, h_a, r_b = sets
    if min(len(f_b), len(h_b), len(r_b)) == 0:
        raise ValueError("the forget, held-out and retain sets must each hold at least one example")
    if len(f_b) != len(f_a) or len(h_b) != len(h_a):
        raise ValueError("the before and after statistics must cover the same examples")
    w_r = _label_weights(r_b.labels, h_b.labels)
    chosen, stat_aucs = _choose_statistic(r_b, h_b, w_r)
    raw = chosen if statistic == "auto" else statistic
    if raw not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose auto, loss or margin")
    if not all(np.isfinite(p.score(raw)).all() for p in sets):
        raise ValueError(f"a per-example {raw} is not finite: the model's logits are not finite")
    return raw, stat_aucs, w_r


def _class_label(forget: PerExample, retain: PerExample) -> int | None:
    """The label of a whole-class request (D_f is one label that D_r does not hold), else None."""
    labels = np.unique(forget.labels)
    return int(labels[0]) if len(labels) == 1 and not np.isin(labels, retain.labels).any() else None


def judge_forgetting(forget_before: PerExample, forget_after: PerExample, heldout_before: PerExample,
                     heldout_after: PerExample, retain_before: PerExample, retain_after: PerExample | None = None,
                     *, statistic: str = "auto", rules: VerdictRules | None = None,
                     forget_offset: np.ndarray | None = None, heldout_offset: np.ndarray | None = None,
                     probe: dict | None = None, references: dict | None = None,
                     forget_weight: np.ndarray | None = None, forget_scale: np.ndarray | None = None,
                     heldout_scale: np.ndarray | None = None) -> ForgettingVerdict:
    """The verdict from per-example statistics (no model needed).

    Parameters
    ----------
    forget_before, forget_after : PerExample
        Statistics of D_f (same examples, same order) under the input and the scrubbed model.
    heldout_before, heldout_after : PerExample
        Statistics of held-out data under the two models.
    retain_before : PerExample
        Statistics of D_r (or a sample of it) under the input model: it picks the raw statistic, says whether
        the model tells training from unseen data at all, and whether D_f is a whole class.
    retain_after : PerExample, optional
        D_r under the scrubbed model (reported only).
    statistic : {"auto", "loss", "margin"}
        Raw statistic without offsets; ``"auto"``: the one whose D_r-vs-held-out AUC is further from 0.5.
    rules : VerdictRules, optional
    forget_offset, heldout_offset : ndarray, optional
        Per-example reference offsets (mean logit confidence under the reference models that never trained on
        the example); given, the score is the logit confidence minus the offset (``"calibrated"``).
    probe : dict, optional
        For a whole class: the fitted probe's ``recall_before``, ``recall_after``, ``recall_never`` and
        ``chance`` from :func:`~scrubnet.readouts.verdict_class.class_probe` (None: no layer could be probed,
        and a class that would pass reads ``inconclusive``).
    references : dict, optional
        What the reference models cost (recorded in the verdict).
    forget_weight : ndarray, optional
        Weights of D_f's examples in the gap (e.g. how far the reference models that trained on each example
        score it above those that did not: the examples where memorisation shows).
    forget_scale, heldout_scale : ndarray, optional
        Per-example spreads of the references' confidence (:meth:`ReferenceModels.scales`): the calibrated
        score is then divided by them (a z-score per example).

    Returns
    -------
    ForgettingVerdict
    """
    rules = rules or VerdictRules()
    if (forget_offset is None) != (heldout_offset is None) or (forget_scale is None) != (heldout_scale is None) \
            or (forget_scale is not None and forget_offset is None):
        raise ValueError("give the reference offsets (and scales) of both D_f and the held-out data, or neither")
    raw, stat_aucs, w_r = _raw_statistic((forget_before, forget_after, heldout_before, heldout_after,
                                          retain_before), statistic)
    label = _class_label(forget_before, retain_before)
    keep = np.isin(forget_before.labels, heldout_before.labels)
    if not keep.any():
        what = f"no held-out example of the forgotten class {label}" if label is not None else \
            "no held-out example shares a label with D_f"
        return _unmeasured(what, forget_before, heldout_before, retain_before, stat_aucs, raw, label, rules)
    calibrated = forget_offset is not None
    stat = "calibrated" if calibrated else raw
    scores = _scores((forget_before.subset(keep), forget_after.subset(keep), heldout_before, heldout_after),
                     raw, None if forget_offset is None else np.asarray(forget_offset, float)[keep], heldout_offset,
                     None if forget_scale is None else np.asarray(forget_scale, float)[keep], heldout_scale)
    w_f = _label_weights(forget_before.labels[keep], heldout_before.labels)
    n_f = int(keep.sum())
    pt, ci = _gap_part(scores, w_f, rules, n_f, None if forget_weight is None else
                       np.asarray(forget_weight, float)[keep])
    boot_r = retain_boot(retain_before.score(raw), heldout_before.score(raw), w_r, rules)
    ci["r"] = interval(boot_r, rules.level)
    cls = None
    if label is None:
        apt, aci = _agreement((forget_before.subset(keep), forget_after.subset(keep), heldout_before,
                               heldout_after), w_f, rules, n_f)
        verdict, reason, need = decide_samples({**ci, **aci}, {**pt, **apt}, rules, n_f, calibrated)
    else:
        verdict, reason, need, cls = _judge_class(heldout_before, heldout_after, label, rules, probe, pt, ci)
    out = ForgettingVerdict(
        verdict=verdict, reason=reason, request="samples" if label is None else "class", statistic=stat,
        auc_before=pt["auc_b"], auc_before_ci=ci["auc_b"], auc_after=pt["auc_a"], auc_after_ci=ci["auc_a"],
        gap_before=pt["gap_b"], gap_before_ci=ci["gap_b"], gap_after=pt["gap_a"], gap_after_ci=ci["gap_a"],
        fraction_closed=pt["f"], fraction_closed_ci=ci["f"], auc_retain_heldout=stat_aucs[raw],
        auc_retain_heldout_ci=ci["r"],
        auc_retain_heldout_after=None if retain_after is None else _auc_or_none(retain_after, heldout_after, raw),
        auc_forget_retain_before=_auc_or_none(forget_before.subset(keep), retain_before, raw),
        auc_forget_retain_after=None if retain_after is None else _auc_or_none(forget_after.subset(keep),
                                                                              retain_after, raw),
        statistic_aucs=stat_aucs, n_forget=n_f, n_heldout=len(heldout_before), n_retain=len(retain_before),
        n_heldout_effective=effective_n(w_f), samples_needed=need, class_readout=cls, references=references,
        rules=rules)
    out.summary = _summary(out)
    return out


# --- the model-level readout ---------------------------------------------------------------------------------

@torch.no_grad()
def per_example_statistics(model: nn.Module, data, max_examples: int | None = None,
                           seed: int = 0) -> PerExample:
    """Loss, margin and logit confidence of every example of ``data`` under ``model`` (eval mode, one forward pass).

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
        loss (n,) in nats, margin (n,) in logit units, labels (n,), confidence (n,) (true logit minus the
        log-sum-exp of the others: log p_y − log(1 − p_y)).
    """
    chunks = as_stream(data).sample_chunks(max_examples, seed)
    device, was_training = model_device(model), model.training
    model.eval()
    losses, margins, confs, labels, seen = [], [], [], [], 0
    try:
        for x, y in chunks:
            if max_examples is not None and seen >= max_examples:
                break
            logits = call_model(model, x.to(device)).double()
            y = y.to(logits.device)
            true = logits.gather(1, y[:, None])[:, 0]
            others = logits.scatter(1, y[:, None], float("-inf"))
            losses.append(torch.logsumexp(logits, 1) - true)
            margins.append(true - others.amax(1))
            confs.append(true - torch.logsumexp(others, 1))
            labels.append(y)
            seen += len(y)
    finally:
        model.train(was_training)
    cat = lambda t: torch.cat(t).cpu().numpy() if t else np.zeros(0)  # noqa: E731
    k = max_examples if max_examples is not None else None
    return PerExample(cat(losses)[:k], cat(margins)[:k], cat(labels).astype(np.int64)[:k], cat(confs)[:k])


def _unmeasured(what: str, f: PerExample, h: PerExample, r: PerExample, stat_aucs: dict, raw: str,
                label: int | None, rules: VerdictRules) -> ForgettingVerdict:
    """``nothing_to_measure`` when no held-out example can stand for D_f (the reason says what to give)."""
    nan, nan2 = float("nan"), (float("nan"), float("nan"))
    cls = None if label is None else {"label": label, "n_heldout_class": 0}
    out = ForgettingVerdict(
        verdict="nothing_to_measure", reason=f"{what}: give held-out data with D_f's labels", request=
        "samples" if label is None else "class", statistic=raw, auc_before=nan, auc_before_ci=nan2, auc_after=nan,
        auc_after_ci=nan2, gap_before=nan, gap_before_ci=nan2, gap_after=nan, gap_after_ci=nan2,
        fraction_closed=nan, fraction_closed_ci=nan2, auc_retain_heldout=stat_aucs[raw], auc_retain_heldout_ci=nan2,
        auc_retain_heldout_after=None, auc_forget_retain_before=None, auc_forget_retain_after=None,
        statistic_aucs=stat_aucs, n_forget=0, n_heldout=len(h), n_retain=len(r), n_heldout_effective=0.0,
        class_readout=cls, rules=rules)
    out.summary = _summary(out)
    return out


def _ci(c) -> str:
    return f"[{c[0]:.2f}, {c[1]:.2f}]" if c is not None and None not in c and np.all(np.isfinite(c)) else "[n/a]"


def verdict_lines(v: dict) -> list[str]:
    """A verdict (``ForgettingVerdict.to_dict()``, e.g. from a sidecar) as a few short lines for a terminal."""
    out = [f"forgetting verdict: {v['verdict']}"]
    out += [("  why: " if i == 0 else "       ") + part for i, part in enumerate(textwrap.wrap(v["reason"], 90))]
    cls = v.get("class_readout")
    if cls and cls.get("n_heldout_class"):
        out.append(f"  class {cls['label']}: probability on its held-out examples {cls['prob_before']:.2f} -> "
                   f"{cls['prob_after']:.2f} {_ci(cls['prob_after_ci'])}; recall {cls['recall_before']:.2f} -> "
                   f"{cls['recall_after']:.2f}")
        if cls.get("recall_probe") is not None:
            out.append(f"  probe fitted on the features: recall {cls['recall_probe_before']:.2f} -> "
                       f"{cls['recall_probe']:.2f}" + ("" if cls.get("recall_probe_never") is None else
                                                       f" (never saw it: {cls['recall_probe_never']:.2f})"))
    if v.get("auc_before") is not None and v.get("n_forget"):
        out.append(f"  D_f vs held-out AUC ({v['statistic']}): {v['auc_before']:.2f} -> {v['auc_after']:.2f} "
                   f"{_ci(v['auc_after_ci'])}")
        out.append(f"  membership gap (z): {v['gap_before']:.2f} {_ci(v['gap_before_ci'])} -> "
                   f"{v['gap_after']:.2f} {_ci(v['gap_after_ci'])}")
    if v.get("fraction_closed") is not None:
        out.append(f"  distance closed: {v['fraction_closed']:.2f} {_ci(v['fraction_closed_ci'])}")
    out.append(f"  n_forget {v['n_forget']}, n_heldout {v['n_heldout']} (effective {v['n_heldout_effective']:.0f})")
    if v.get("samples_needed"):
        out.append(f"  about {v['samples_needed']} forget examples would decide it"
                   + ("" if v.get("references") else " (or reference models: `scrubnet references`)"))
    if v.get("references"):
        out.append(f"  reference models: {v['references']['models']}, trained once in "
                   f"{v['references']['seconds']:.1f} s")
    return out


def _summary(v: ForgettingVerdict) -> str:
    """One line: the verdict, its reason and the deciding numbers."""
    s = f"{v.verdict} ({v.reason})"
    if np.isfinite(v.fraction_closed):
        s += f"; closed {v.fraction_closed:.2f} {_ci(v.fraction_closed_ci)}"
    if np.isfinite(v.auc_before):
        s += f"; D_f vs held-out AUC ({v.statistic}) {v.auc_before:.2f} -> {v.auc_after:.2f}"
    s += f"; n_forget={v.n_forget}, n_heldout={v.n_heldout}"
    return s + (f"; ~{v.samples_needed} forget examples would decide it" if v.samples_needed else "")


def forgetting_verdict(model_before: nn.Module, model_after: nn.Module, forget, retain, heldout, *,
                       statistic: str = "auto", rules: VerdictRules | None = None, max_retain: int | None = 10000,
                       references=None, forget_ids=None, probe_layer: str | None = None,
                       never_saw: nn.Module | None = None) -> ForgettingVerdict:
    """Did the scrub make D_f look like data the model never saw? No retrained model needed.

    Parameters
    ----------
    model_before, model_after : nn.Module
        The input model and the scrubbed one (same output classes).
    forget, retain, heldout : (x, y) tensors, Dataset, DataLoader or DataStream
        D_f, D_r and held-out data (e.g. the test set) — data neither model trained on.
    statistic : {"auto", "loss", "margin"}
        The raw statistic without reference models (see :func:`judge_forgetting`).
    rules : VerdictRules, optional
        Thresholds, bootstrap size and seed.
    max_retain : int or None
        Score at most this many D_r examples (seeded subset); None scores all of D_r.
    references : ReferenceModels, optional
        Reference models of the input model (:func:`scrubnet.readouts.references.train_references`): each
        example's score is calibrated by its mean under the references that never trained on it.
    forget_ids : sequence of int, optional
        D_f's positions in the training data the references were split from (required with ``references``).
    probe_layer : str, optional
        For a whole class: the dotted name of the module whose output the class probe reads (default: the
        input of the head, found by hooks).
    never_saw : nn.Module, optional
        For a whole class: a model that never saw the class (e.g. trained on D_r); the probe's recall on it is
        the floor of "forgotten" (default: chance).

    Returns
    -------
    ForgettingVerdict
        One forward pass per set per model (and per reference model on D_f and held-out data); a whole class
        also runs the class's held-out examples through both models' heads (the probe).
    """
    rules = rules or VerdictRules()
    stats = {}
    for name, model in (("before", model_before), ("after", model_after)):
        stats[name] = [per_example_statistics(model, forget), per_example_statistics(model, heldout),
                       per_example_statistics(model, retain, max_retain, rules.seed)]
    (f_b, h_b, r_b), (f_a, h_a, r_a) = stats["before"], stats["after"]
    f_off = h_off = info = None
    if references is not None:
        if forget_ids is None:
            raise ValueError("reference models need forget_ids: D_f's positions in the training data they split")
        f_off, h_off = references.offsets(forget, forget_ids), references.offsets(heldout, None, rules.seed)
        info = references.info()
    label, probe = _class_label(f_b, r_b), None
    if label is not None and (h_b.labels == label).any():
        probe = class_probe(model_before, model_after, heldout, label, retain, never_saw=never_saw,
                            layer=probe_layer, seed=rules.seed)
    return judge_forgetting(f_b, f_a, h_b, h_a, r_b, r_a, statistic=statistic, rules=rules, forget_offset=f_off,
                            heldout_offset=h_off, probe=probe, references=info)
