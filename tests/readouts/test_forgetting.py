"""The forgetting verdict without a retrained model.

Calibration on tiny models where memorisation is real (an MLP fitted to zero loss on 200 samples with 30 %
noisy labels): the retrained model given as the scrub reads ``forgot``, the identity ``did_not_forget``, extra
training on D_f ``moved_wrong_way``, 3 forget samples ``inconclusive``, a model that does not tell D_r from
held-out data ``nothing_to_measure``. Then the statistics core on synthetic scores, against slow twins."""
import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from scrubnet.readouts.forgetting import (PerExample, VerdictRules, forgetting_verdict, judge_forgetting,
                                          per_example_statistics, verdict_lines, weighted_auc)
from scrubnet.readouts.references import train_references
from scrubnet.readouts.verdict_rules import Ranks as _Ranks, counts as _counts, paired_gaps

D, C = 20, 3


def _data(seed: int, n: int, noise: float = 0.3):
    """Three Gaussian classes in 20 dimensions (fixed means), a fraction ``noise`` of labels redrawn."""
    mu = torch.randn(C, D, generator=torch.Generator().manual_seed(1000)) * 0.6
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    x = mu[y] + torch.randn(n, D, generator=g)
    flip = torch.rand(n, generator=g) < noise
    return x, torch.where(flip, torch.randint(0, C, (n,), generator=g), y)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, C))


def _train(model: nn.Module, x, y, steps: int = 300, lr: float = 1e-2) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def world():
    """D_f (25), D_r (175), held-out (500); the model fitted on D_f ∪ D_r and the one retrained on D_r."""
    torch.set_num_threads(1)
    x, y = _data(0, 200)
    forget, retain, held = (x[:25], y[:25]), (x[25:], y[25:]), _data(100, 500)
    original = _train(_mlp(0), x, y)
    retrained = _train(_mlp(50), *retain)
    return dict(forget=forget, retain=retain, held=held, original=original, retrained=retrained, x=x, y=y)


def _verdict(w, before, after, forget=None, **kw):
    return forgetting_verdict(before, after, forget or w["forget"], w["retain"], w["held"], **kw)


@pytest.fixture(scope="module")
def refs(world):
    """Four reference models of the world's original (two pairs of complementary halves of its 200 samples)."""
    def fit(idx, seed):
        return _train(_mlp(seed), world["x"][idx], world["y"][idx])
    return train_references(fit, 200, pairs=2, seed=1)


def test_retrained_model_as_the_scrub_reads_forgot(world, refs):
    v = _verdict(world, world["original"], world["retrained"])
    assert v.verdict == "forgot" and not v.failed and v.request == "samples", v.summary
    assert v.auc_before_ci[0] > 0.7  # the original memorised D_f: it looks like training data
    assert v.auc_after_ci[0] < 0.5 < v.auc_after_ci[1]  # the retrained model cannot tell D_f from unseen data
    assert v.fraction_closed > 0.7 and v.gap_before_ci[0] > 0  # a significant move, (nearly) all the way
    assert v.auc_forget_retain_before == pytest.approx(0.5, abs=0.15)  # D_f was a member like D_r
    assert v.auc_forget_retain_after < v.auc_forget_retain_before - 0.1  # now D_r looks more like training data
    assert (v.n_forget, v.n_heldout, v.n_retain) == (25, 500, 175)
    r = _verdict(world, world["original"], world["retrained"], references=refs, forget_ids=np.arange(25))
    assert r.verdict == "forgot" and r.statistic == "calibrated" and r.references["models"] == 4, r.summary


def test_identity_reads_did_not_forget(world):
    v = _verdict(world, world["original"], world["original"])
    assert v.verdict == "did_not_forget" and v.failed, v.summary
    assert v.auc_after == v.auc_before and v.auc_after_ci == v.auc_before_ci  # paired: the same resamples
    assert v.fraction_closed == 0.0 and v.fraction_closed_ci == (0.0, 0.0)


def test_extra_training_on_the_forget_set_reads_moved_wrong_way(world):
    moderate = _train(_mlp(0), world["x"], world["y"], steps=40, lr=3e-3)  # D_f only partly memorised
    more = _train(copy.deepcopy(moderate), *world["forget"], steps=50, lr=3e-3)
    v = _verdict(world, moderate, more)
    assert v.verdict == "moved_wrong_way" and v.failed, v.summary
    assert v.auc_after_ci[0] > v.auc_before_ci[1] and v.gap_after_ci[0] > v.gap_before_ci[1]


def test_a_significant_wrong_way_move_is_reported_at_five_samples(world):
    """Five samples: far too few for an equivalence test, enough for a significant move toward membership."""
    moderate = _train(_mlp(0), world["x"], world["y"], steps=40, lr=3e-3)
    f5 = tuple(t[:5] for t in world["forget"])
    more = _train(copy.deepcopy(moderate), *f5, steps=60, lr=3e-3)
    v = _verdict(world, moderate, more, forget=f5)
    assert v.verdict == "moved_wrong_way" and v.n_forget == 5, v.summary


def test_reference_models_decide_ten_samples(world, refs):
    """Ten samples: the calibrated per-example tests establish that D_f was memorised and is still; the raw
    scores' interval is wider (the references remove each example's difficulty)."""
    f10, ids = tuple(t[:10] for t in world["forget"]), np.arange(10)
    raw = _verdict(world, world["original"], world["original"], forget=f10)
    cal = _verdict(world, world["original"], world["original"], forget=f10, references=refs, forget_ids=ids)
    assert cal.verdict == "did_not_forget" and cal.gap_before_ci[0] > raw.gap_before_ci[0] > 0, cal.summary
    with pytest.raises(ValueError, match="forget_ids"):
        _verdict(world, world["original"], world["original"], forget=f10, references=refs)


def test_model_that_cannot_tell_retain_from_heldout_reads_nothing_to_measure():
    """A linear model fitted on 4000 clean samples generalises: its D_r and held-out data look alike."""
    torch.set_num_threads(1)
    x, y = _data(200, 4000, noise=0.0)
    torch.manual_seed(0)
    linear = _train(nn.Linear(D, C), x, y, steps=200)
    v = forgetting_verdict(linear, linear, (x[:25], y[:25]), (x[25:], y[25:]), _data(300, 500, noise=0.0))
    assert v.verdict == "nothing_to_measure" and not v.failed, v.summary
    assert v.auc_retain_heldout_ci[0] < 0.5 < v.auc_retain_heldout_ci[1]


# --- whole classes ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def klass(world):
    """Class 2 forgotten whole: the original (all 200), the gold (D_r without class 2, another init), a model
    that only hides the class (its head row zeroed, its bias pushed down)."""
    x, y = world["x"], world["y"]
    out = y == 2
    gold = _train(_mlp(60), x[~out], y[~out])
    never = _train(_mlp(61), x[~out], y[~out])  # another model that never saw the class: the probe's floor
    hide = copy.deepcopy(world["original"])
    with torch.no_grad():
        hide[-1].weight[2] = 0.0
        hide[-1].bias[2] = -20.0
    return dict(forget=(x[out], y[out]), retain=(x[~out], y[~out]), gold=gold, hide=hide, never=never)


def test_a_class_reads_forgot_hidden_or_did_not_forget_as_a_class(world, klass):
    args = (klass["forget"], klass["retain"], world["held"])
    gold = forgetting_verdict(world["original"], klass["gold"], *args, never_saw=klass["never"])
    assert gold.request == "class" and gold.verdict == "forgot", gold.summary
    c = gold.class_readout
    assert c["label"] == 2 and c["prob_before"] > 0.3 and c["prob_after_ci"][1] < 0.05 and c["recall_after"] == 0
    # these Gaussian classes: a network that never saw class 2 still separates it linearly (the other classes'
    # features do), so without a never-saw model the probe cannot tell the gold from a hider: undecided
    alone = forgetting_verdict(world["original"], klass["gold"], *args)
    assert alone.verdict in ("forgot", "inconclusive") and "probe" in alone.reason, alone.summary
    hidden = forgetting_verdict(world["original"], klass["hide"], *args)
    assert hidden.verdict == "hidden" and hidden.failed, hidden.summary
    c = hidden.class_readout  # the same features: the fitted probe reads the same recall
    assert c["recall_probe"] == c["recall_probe_before"] > 0.5
    assert forgetting_verdict(world["original"], klass["hide"], *args, never_saw=klass["never"]).verdict == "hidden"
    same = forgetting_verdict(world["original"], world["original"], *args)
    assert same.verdict == "did_not_forget", same.summary


def test_a_class_without_held_out_examples_reads_nothing_to_measure_with_the_reason(world, klass):
    hx, hy = world["held"]
    v = forgetting_verdict(world["original"], klass["gold"], klass["forget"], klass["retain"],
                           (hx[hy != 2], hy[hy != 2]))
    assert v.verdict == "nothing_to_measure" and v.request == "class", v.summary
    assert "no held-out example of the forgotten class 2" in v.reason and v.class_readout["n_heldout_class"] == 0
    d = v.to_dict()
    json.dumps(d, allow_nan=False)  # the receipt's form: plain JSON, no NaN
    assert d["outcome"] == "nothing_to_measure" and d["fraction_closed"] is None
    lines = verdict_lines(d)  # what the CLI prints: a few short lines, the verdict first
    assert lines[0] == "forgetting verdict: nothing_to_measure" and 3 <= len(lines) <= 8
    assert all(len(line) <= 100 for line in lines) and "no held-out example" in " ".join(lines)
    lines = verdict_lines(forgetting_verdict(world["original"], klass["hide"], klass["forget"], klass["retain"],
                                             world["held"]).to_dict())
    assert lines[0] == "forgetting verdict: hidden" and all(len(line) <= 100 for line in lines), lines
    assert any(line.startswith("  probe") for line in lines) and len(lines) <= 10


# --- per-example statistics -----------------------------------------------------------------------------------

def test_per_example_statistics_are_the_cross_entropy_and_the_margin_of_each_sample(world):
    model = world["original"].train()
    x, y = world["held"]
    s = per_example_statistics(model, (x, y))
    with torch.no_grad():
        logits = model.eval()(x).double()
    model.train()
    assert np.allclose(s.loss, F.cross_entropy(logits, y, reduction="none").detach().numpy())
    for i in (0, 7, 123):
        other = max(float(logits[i, k]) for k in range(C) if k != int(y[i]))
        assert s.margin[i] == pytest.approx(float(logits[i, y[i]]) - other)
    assert model.training  # the mode is restored
    loaded = per_example_statistics(model, DataLoader(TensorDataset(x, y), batch_size=64))
    assert np.allclose(loaded.loss, s.loss) and (loaded.labels == y.numpy()).all()
    sub = per_example_statistics(model, TensorDataset(x, y), max_examples=50, seed=3)
    idx = torch.randperm(500, generator=torch.Generator().manual_seed(3))[:50].sort().values
    assert np.allclose(sub.loss, s.loss[idx.numpy()]) and len(sub) == 50


# --- the statistics core --------------------------------------------------------------------------------------

def _brute_auc(pos, neg, w):
    num = sum(wj * ((p > q) + 0.5 * (p == q)) for p in pos for q, wj in zip(neg, w))
    return num / (len(pos) * sum(w))


def test_weighted_auc_against_the_double_loop_with_ties_and_weights():
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 6, 17).astype(float), rng.integers(0, 6, 23).astype(float)  # many ties
    w = rng.uniform(0, 2, 23)
    assert weighted_auc(pos, neg, w) == pytest.approx(_brute_auc(pos, neg, w), abs=1e-12)
    assert weighted_auc(pos, neg) == pytest.approx(_brute_auc(pos, neg, np.ones(23)), abs=1e-12)


def test_bootstrap_by_counts_equals_the_auc_of_the_resampled_arrays():
    rng = np.random.default_rng(1)
    pos, neg, w = rng.normal(1, 1, 9), rng.normal(0, 1, 13), rng.uniform(0.5, 2, 13)
    cp, cn = _counts(rng, 9, 4), _counts(rng, 13, 4)
    fast = _Ranks(pos, neg).auc(cp, cn * w[None])
    for b in range(4):
        ip, jn = np.repeat(np.arange(9), cp[b].astype(int)), np.repeat(np.arange(13), cn[b].astype(int))
        assert fast[b] == pytest.approx(_brute_auc(pos[ip], neg[jn], w[jn]), abs=1e-12)


def test_the_membership_gap_is_the_mean_probit_of_each_examples_rank_among_held_out_data():
    """Slow twin of the per-example tests: for each forget example, the weighted mid-rank fraction of held-out
    scores below it, through Φ⁻¹ (clipped at the held-out resolution), averaged; the AUC is the mean fraction."""
    from scipy.stats import norm
    rng = np.random.default_rng(2)
    pos, neg, w = rng.normal(1, 1, 15), np.round(rng.normal(0, 1, 40), 1), rng.uniform(0.5, 2, 40)
    pos[:3] = neg[:3]  # ties count one half
    u = np.array([(w * ((p > neg) + 0.5 * (p == neg))).sum() / w.sum() for p in pos])
    n_eff = w.sum() ** 2 / (w ** 2).sum()
    eps = 1 / (2 * (n_eff + 1))
    reps = paired_gaps((pos, pos - 1), (neg, neg), w, VerdictRules(n_boot=0))
    assert reps["auc_b"][0] == pytest.approx(u.mean(), abs=1e-12)
    assert reps["gap_b"][0] == pytest.approx(norm.ppf(np.clip(u, eps, 1 - eps)).mean(), abs=1e-9)
    pw = rng.uniform(0, 3, 15)  # weighted forget examples: the weighted mean of the same z (the AUC unweighted)
    rw = paired_gaps((pos, pos - 1), (neg, neg), w, VerdictRules(n_boot=0), pos_weight=pw)
    z = norm.ppf(np.clip(u, eps, 1 - eps))
    assert rw["gap_b"][0] == pytest.approx((pw * z).sum() / pw.sum(), abs=1e-9) and rw["auc_b"][0] == reps["auc_b"][0]


def _pe(scores, labels=None):
    s = np.asarray(scores, float)
    return PerExample(loss=-s, margin=s, labels=np.zeros(len(s), int) if labels is None else np.asarray(labels))


def _judge(f_b, f_a, h, r, **kw):
    return judge_forgetting(_pe(f_b), _pe(f_a), _pe(h), _pe(h), _pe(r), **kw)


def test_unseen_examples_have_a_gap_of_zero_and_the_interval_covers_it():
    """D_f drawn like the held-out data: the gap's 90 % interval covers 0 in about 90 % of draws at n = 10."""
    rng = np.random.default_rng(9)
    h, r = rng.normal(size=400), rng.normal(2.0, 1.0, 300)
    covered = []
    for _ in range(60):
        f = rng.normal(size=10)
        v = _judge(f, f, h, r, rules=VerdictRules(n_boot=300))
        covered.append(v.gap_before_ci[0] <= 0 <= v.gap_before_ci[1])
    assert 0.8 <= np.mean(covered) <= 1.0


@pytest.mark.parametrize("closed, verdict", [
    (0.0, "did_not_forget"), (0.04, "did_not_forget"), (0.25, "partly"), (0.5, "partly"), (0.6, "partly"),
    (0.9, "partly"), (0.97, "forgot"), (1.0, "forgot"), (-0.5, "moved_wrong_way")])
def test_partial_scrubs_of_known_size(closed, verdict):
    """D_f's scores shifted back toward the held-out data's by a known fraction of the distance: the verdict
    and the fraction closed (with its interval) follow it; a near no-op (4 %) is did_not_forget, not partly;
    0.9 closed with an interval excluding full forgetting ([0.83, 0.96] at 300 samples) is partly."""
    rng = np.random.default_rng(3)
    f, h, r = rng.normal(1.5, 1.0, 300), rng.normal(size=2000), rng.normal(1.5, 1.0, 300)
    v = _judge(f, f - 1.5 * closed, h, r)
    assert v.verdict == verdict, v.summary
    if verdict != "moved_wrong_way":
        lo, hi = v.fraction_closed_ci
        assert lo <= closed + 0.03 and hi >= closed - 0.03 and hi - lo < 0.2, v.summary
        assert v.fraction_closed == pytest.approx(closed, abs=0.06)


@pytest.mark.parametrize("overshoot_fails, verdict", [(False, "partly"), (True, "moved_wrong_way")])
def test_overshoot_is_said(overshoot_fails, verdict):
    rng = np.random.default_rng(3)
    f, h, r = rng.normal(1.5, 1.0, 300), rng.normal(size=2000), rng.normal(1.5, 1.0, 300)
    v = _judge(f, f - 3.5, h, r, rules=VerdictRules(overshoot_fails=overshoot_fails))
    assert v.verdict == verdict and "overshot" in v.summary, v.summary


def test_nothing_to_measure_when_retain_or_forget_does_not_look_like_training_data():
    rng = np.random.default_rng(4)
    h, f = rng.normal(size=400), rng.normal(0.1, 1.0, 60)
    v = _judge(f, f - 2, h, rng.normal(size=300))  # D_r (and D_f) like held-out: the model tells nothing apart
    assert v.verdict == "nothing_to_measure" and "D_r" in v.reason, v.summary
    # D_r like held-out, but D_f itself established above it: the evidence on D_f decides
    assert _judge(f + 2, f, h, rng.normal(size=300)).verdict == "forgot"
    g = rng.normal(size=200)  # D_f never looked like training data (D_r did): no before-to-after to read
    v = _judge(g, g, h, rng.normal(2.0, 1.0, 300))
    assert v.verdict == "nothing_to_measure" and abs(v.gap_before) < 0.25, v.summary
    v = _judge(g - 3, g - 3, h, rng.normal(2.0, 1.0, 300))  # e.g. mislabelled D_f against ordinary held-out data
    assert v.verdict == "nothing_to_measure" and "atypical" in v.summary, v.summary
    # D_f's gap not established: nothing_to_measure with the measured gap, and how many examples of an effect
    # that size would establish it (more than were given)
    w = _judge(g[:8] + 0.3, g[:8] + 0.3, h, rng.normal(2.0, 1.0, 300))
    assert w.verdict == "nothing_to_measure" and w.gap_before_ci[0] < 0 < w.gap_before, w.summary
    assert f"{w.gap_before:.2f} z" in w.reason and w.samples_needed > 8, w.summary
    # ... but pushing such a D_f toward training-like is a move the wrong way
    assert _judge(g, g + 3, h, rng.normal(2.0, 1.0, 300)).verdict == "moved_wrong_way"


def test_memorised_examples_are_decided_at_three_samples_and_a_wrong_way_move_at_five():
    """No width gate: three examples above every held-out score establish membership (and an unchanged model
    did not forget); five examples pushed far up are a significant move the wrong way."""
    rng = np.random.default_rng(5)
    h, r = rng.normal(size=400), rng.normal(3.0, 1.0, 300)
    f = np.full(3, 50.0)
    v = _judge(f, f, h, r)
    assert v.verdict == "did_not_forget" and v.gap_before_ci[0] > 2.5, v.summary
    g = rng.normal(0.3, 1.0, 5)
    assert _judge(g, g + 6, h, r).verdict == "moved_wrong_way"


def test_held_out_is_matched_to_the_forget_sets_labels():
    """D_f all of class 1, scored like held-out class 1; held-out class 0 scores far lower. Unmatched, the AUC
    would be ≈ 0.75; matched it is ≈ 0.5 and the verdict is forgot."""
    rng = np.random.default_rng(6)
    h = np.r_[rng.normal(-3, 1, 300), rng.normal(0, 1, 300)]
    h_lab = np.r_[np.zeros(300, int), np.ones(300, int)]
    r, r_lab = np.r_[rng.normal(-1, 1, 200), rng.normal(2, 1, 200)], np.r_[np.zeros(200, int), np.ones(200, int)]
    f_b, f_a, f_lab = rng.normal(2, 1, 80), rng.normal(0, 1, 80), np.ones(80, int)
    v = judge_forgetting(_pe(f_b, f_lab), _pe(f_a, f_lab), _pe(h, h_lab), _pe(h, h_lab), _pe(r, r_lab))
    assert weighted_auc(f_a, h) > 0.7 and v.auc_after == pytest.approx(weighted_auc(f_a, h[300:]))
    assert v.verdict == "forgot", v.summary
    # a forget label absent from the held-out data: those examples are left out and counted
    f_lab2 = np.r_[np.ones(70, int), np.full(10, 2)]
    v2 = judge_forgetting(_pe(f_b, f_lab2), _pe(f_a, f_lab2), _pe(h, h_lab), _pe(h, h_lab), _pe(r, r_lab))
    assert v2.n_forget == 70


def test_the_statistic_is_chosen_on_retain_never_on_forget():
    rng = np.random.default_rng(7)
    h, r = rng.normal(size=(2, 400)), rng.normal(size=(2, 300))
    r[1] += 2.0  # the margin separates D_r from held-out data, the loss does not
    f = rng.normal(size=(2, 50))
    f[0] -= 5.0  # the loss would separate D_f far better: the choice must not look at it
    mk = lambda a: PerExample(loss=-a[0], margin=a[1], labels=np.zeros(a.shape[1], int))  # noqa: E731
    v = judge_forgetting(mk(f), mk(f), mk(h), mk(h), mk(r))
    assert v.statistic == "margin" and abs(v.statistic_aucs["margin"] - 0.5) > 0.3
    assert judge_forgetting(mk(f), mk(f), mk(h), mk(h), mk(r), statistic="loss").statistic == "loss"


def test_bootstrap_is_seeded_and_paired():
    rng = np.random.default_rng(8)
    f, h, r = rng.normal(2, 1, 40), rng.normal(size=300), rng.normal(2, 1, 200)
    a, b = _judge(f, f - 1, h, r), _judge(f, f - 1, h, r)
    assert a.to_dict() == b.to_dict()
    c = _judge(f, f - 1, h, r, rules=VerdictRules(seed=1))
    assert c.auc_after == a.auc_after and c.auc_after_ci != a.auc_after_ci
    assert a.summary.startswith(a.verdict) and "n_forget=40" in a.summary


def test_bad_inputs_are_refused():
    z = _pe(np.zeros(5))
    with pytest.raises(ValueError, match="at least one"):
        judge_forgetting(_pe([]), _pe([]), z, z, z)
    with pytest.raises(ValueError, match="same examples"):
        judge_forgetting(z, _pe(np.zeros(4)), z, z, z)
    with pytest.raises(ValueError, match="one length"):
        PerExample(np.zeros(3), np.zeros(2), np.zeros(3, int))
    with pytest.raises(ValueError, match="not finite"):
        judge_forgetting(_pe([1.0, np.nan, 2.0, 3.0, 4.0]), z, z, z, z, statistic="margin")
    with pytest.raises(ValueError, match="statistic"):
        judge_forgetting(z, z, z, z, z, statistic="entropy")


# --- reference models -------------------------------------------------------------------------------------------

def test_reference_offsets_average_the_models_that_never_trained_on_each_example():
    """Slow twin: the offset of training example i is the mean logit confidence (log p_y − log(1 − p_y)) under
    the models whose half did not hold i; a held-out example's is one model per pair; ``inside`` the others."""
    from scrubnet.readouts.references import ReferenceModels, reference_halves
    members = reference_halves(30, pairs=2, seed=4)
    assert members.shape == (4, 30) and (members[0] ^ members[1]).all() and (members[2] ^ members[3]).all()
    assert members[0].sum() == 15
    torch.manual_seed(0)
    models = [nn.Linear(D, C) for _ in range(4)]
    refs = ReferenceModels(models, members, seconds=1.5)
    x, y = torch.randn(6, D), torch.randint(0, C, (6,))
    ids = np.array([0, 3, 7, 11, 20, 29])
    with torch.no_grad():
        p = torch.stack([F.softmax(m(x).double(), 1)[torch.arange(6), y] for m in models]).numpy()
    phi = np.log(p) - np.log1p(-p)
    out = np.array([[phi[k, j] for k in range(4) if not members[k, i]] for j, i in enumerate(ids)]).mean(1)
    inside = np.array([[phi[k, j] for k in range(4) if members[k, i]] for j, i in enumerate(ids)]).mean(1)
    assert np.allclose(refs.offsets((x, y), ids), out) and np.allclose(refs.offsets((x, y), ids, inside=True), inside)
    held = refs.offsets((x, y), None, seed=5)
    pick = np.random.default_rng(5).integers(0, 2, size=(2, 6))
    assert np.allclose(held, (phi[pick[0], np.arange(6)] + phi[2 + pick[1], np.arange(6)]) / 2)
    assert refs.info() == {"models": 4, "seconds": 1.5}
    with pytest.raises(ValueError, match="complementary"):
        ReferenceModels(models, np.ones((4, 30), bool))
    with pytest.raises(ValueError, match="ids"):
        refs.offsets((x, y), None, inside=True)


# --- hiders: the class probe is fitted on the features, so no re-parametrisation defeats it -------------------

class _LogitWrapper(nn.Module):
    """The model with one logit lowered after its head: no linear layer's output is the logits."""

    def __init__(self, model, label):
        super().__init__()
        self.model, self.label = model, label

    def forward(self, x):
        out = self.model(x).clone()
        out[:, self.label] -= 30.0
        return out


class _NoLinear(nn.Module):
    """Logits from a bare matrix product: no layer the probe can find by hooks."""

    def __init__(self, model):
        super().__init__()
        self.body, self.w, self.b = model[:-1], nn.Parameter(model[-1].weight.T.clone()), model[-1].bias

    def forward(self, x):
        return self.body(x) @ self.w + self.b


def _hide(model, label=2):
    m = copy.deepcopy(model)
    with torch.no_grad():
        m[-1].weight[label] = 0.0
        m[-1].bias[label] = m[-1].bias.min() - 20.0
    return m


def test_hiders_in_any_parametrisation_never_read_forgot(world, klass):
    """The project's hider after a function-preserving permutation of the penultimate units, a wrapper lowering
    the class's logit, and the head re-fitted on D_r's features: the outputs drop the class, the features keep
    it, and the probe fitted on them reads what it reads on the input model — ``hidden``, never ``forgot``."""
    orig, args = world["original"], (klass["forget"], klass["retain"], world["held"])
    perm = copy.deepcopy(orig)
    p = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        perm[2].weight.copy_(perm[2].weight[p])
        perm[2].bias.copy_(perm[2].bias[p])
        perm[4].weight.copy_(perm[4].weight[:, p])
        assert (perm(world["held"][0]) - orig(world["held"][0])).abs().max() < 1e-4  # the same function
    refit = copy.deepcopy(orig)
    torch.manual_seed(3)
    refit[-1].reset_parameters()
    opt = torch.optim.Adam(refit[-1].parameters(), lr=1e-2)
    for _ in range(200):  # only the head learns, on D_r (class 2 never a target)
        opt.zero_grad()
        F.cross_entropy(refit(klass["retain"][0]), klass["retain"][1]).backward()
        opt.step()
    plain = forgetting_verdict(orig, _hide(orig), *args).class_readout
    for name, m in (("permuted", _hide(perm)), ("wrapper", _LogitWrapper(orig, 2)), ("refit", refit)):
        v = forgetting_verdict(orig, m, *args)
        assert v.class_readout["prob_after"] < 0.1, (name, v.summary)  # the outputs no longer give the class
        assert v.verdict == "hidden" and v.failed, (name, v.summary)
        assert v.class_readout["recall_probe"] == pytest.approx(plain["recall_probe"], abs=0.02), name
        v = forgetting_verdict(orig, m, *args, never_saw=klass["never"])
        assert v.verdict == "hidden", (name, v.summary)


def test_a_class_without_a_layer_to_probe_is_undecided_never_forgot(world, klass):
    """Logits from a bare matrix product (no linear layer to hook): the gold's outputs drop the class, but
    whether its features did cannot be checked — inconclusive with the reason; naming a layer probes it."""
    args = (klass["forget"], klass["retain"], world["held"])
    gold = _NoLinear(klass["gold"])
    v = forgetting_verdict(world["original"], gold, *args)
    assert v.verdict == "inconclusive" and "no layer" in v.reason and "probe_layer" in v.reason, v.summary
    assert v.class_readout["recall_probe"] is None
    named = forgetting_verdict(world["original"], gold, *args, probe_layer="body.3")
    assert named.verdict != "inconclusive" or "no layer" not in named.reason, named.summary
    assert named.class_readout["recall_probe"] is not None
    with pytest.raises(ValueError, match="no module named"):
        forgetting_verdict(world["original"], gold, *args, probe_layer="nowhere")


# --- every verdict consistent with every measured signal ------------------------------------------------------

def test_a_no_op_on_a_memorised_forget_set_reads_did_not_forget_at_100_samples():
    """D_f set apart from held-out data by a gap of ≈ 0.45 z (established at 100 samples, below the 0.6 z
    equivalence floor that used to make a no-op unfailable): the identity fails; a gold passes."""
    rng = np.random.default_rng(11)
    h, r = rng.normal(size=2000), rng.normal(1.0, 1.0, 500)
    f = rng.normal(0.45, 1.0, 100)
    v = _judge(f, f, h, r)
    assert 0 < v.gap_before_ci[0] and v.gap_before < 0.6, v.summary
    assert v.verdict == "did_not_forget" and v.failed and v.fraction_closed_ci == (0.0, 0.0), v.summary
    gold = _judge(f, rng.normal(size=100), h, r)
    assert not gold.failed, gold.summary


def test_an_unmemorised_forget_set_says_nothing_to_measure_with_its_gap_and_counts_never_below_given():
    rng = np.random.default_rng(12)
    h, r = rng.normal(size=2000), rng.normal(1.0, 1.0, 500)
    for n in (10, 100, 3000):
        f = rng.normal(0.05, 1.0, n)
        v = _judge(f, f, h, r)
        assert v.verdict in ("nothing_to_measure", "did_not_forget"), v.summary
        if v.verdict == "nothing_to_measure":
            assert "too few" not in v.reason and f"{v.gap_before:.2f} z" in v.reason, v.summary
        assert v.samples_needed is None or v.samples_needed > n, v.summary


def test_a_negligible_move_toward_membership_is_not_moved_wrong_way():
    """3000 forget examples moved up by 0.03 z: significant, negligible — not a failure by itself."""
    rng = np.random.default_rng(13)
    h, r = rng.normal(size=2000), rng.normal(2.0, 1.0, 500)
    f = rng.normal(1.5, 1.0, 3000)
    small = _judge(f, f + 0.03, h, r)
    assert small.gap_after_ci[0] > small.gap_before - 0.2 and small.verdict != "moved_wrong_way", small.summary
    assert _judge(f, f + 0.6, h, r).verdict == "moved_wrong_way"


def test_forgot_needs_the_loss_and_the_error_to_agree_with_the_ranks():
    """The margin's ranks of D_f moved to held-out data's, but its loss and error stayed at training level: the
    rank test alone would say forgot; the verdict says partly and why."""
    rng = np.random.default_rng(14)
    h_m, r_m, f_m = rng.normal(0, 1, 1000), rng.normal(2, 1, 500), rng.normal(2, 1, 200)
    h_l, r_l = rng.exponential(1.0, 1000), rng.exponential(0.1, 500)
    f_l = rng.exponential(0.1, 200)
    z = lambda n: np.zeros(n, int)  # noqa: E731
    pe = lambda loss, margin: PerExample(loss=loss, margin=margin, labels=z(len(loss)))  # noqa: E731
    args = (pe(h_l, h_m), pe(h_l, h_m), pe(r_l, r_m))
    ranks_only = judge_forgetting(pe(f_l, f_m), pe(f_l, rng.normal(0, 1, 200)), *args, statistic="margin")
    assert ranks_only.verdict == "partly" and "mean loss closed only" in ranks_only.reason, ranks_only.summary
    both = judge_forgetting(pe(f_l, f_m), pe(rng.exponential(1.0, 200), rng.normal(0, 1, 200)), *args,
                            statistic="margin")
    assert both.verdict == "forgot", both.summary


def test_retain_bootstrap_cache_returns_what_the_computation_gives():
    from scrubnet.readouts import verdict_rules as vr
    rng = np.random.default_rng(15)
    r, h, w = rng.normal(1, 1, 300), rng.normal(size=200), rng.uniform(0.5, 1.5, 200)
    rules = VerdictRules(n_boot=200)
    first = vr.retain_boot(r, h, w, rules)
    assert np.array_equal(first, vr._retain_boot(r, h, w, rules))
    assert vr.retain_boot(r, h, w, rules) is first  # the same input model: kept
    assert not np.array_equal(vr.retain_boot(r + 0.5, h, w, rules), first)  # another model: computed anew


def test_per_example_spreads_shrink_toward_the_pooled_variance():
    """out_scale against the formula written out per example: ((k−1)s² + ν σ²) / ((k−1) + ν)."""
    from scrubnet.readouts.references import out_scale
    rng = np.random.default_rng(16)
    phi = rng.normal(size=(8, 30)) * rng.uniform(0.5, 2.0, 30)
    out = rng.random((8, 30)) < 0.6
    out[:3] = True  # at least three OUT values per example
    mu, sd, pooled = out_scale(phi, out, prior=4.0)
    s2 = []
    for i in range(30):
        v = phi[out[:, i], i]
        assert mu[i] == pytest.approx(v.mean())
        s2.append(v.var(ddof=1))
    assert pooled == pytest.approx(np.mean(s2))
    for i in range(30):
        k = out[:, i].sum()
        assert sd[i] ** 2 == pytest.approx(((k - 1) * s2[i] + 4.0 * pooled) / (k - 1 + 4.0))
