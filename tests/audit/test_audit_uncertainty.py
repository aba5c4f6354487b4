"""Weighted pair statistics against slow, obviously-correct twins; the two-way bootstrap; KLoM by hand; the
logits file read back into the same statistics."""
import numpy as np
import pytest

from scrubnet.audit.logits_file import audit_logits_files, read_logits_file, write_logits_file
from scrubnet.audit.stats import auc_score, klom, lira_pairs, roc_curve, tpr_at_fpr, ulira
from scrubnet.audit.uncertainty import (ScoredPairs, bootstrap_pairs, bootstrap_weights, ci95, difference_ci,
                                        enough_negatives, pair_statistics, pair_weights, summarize)


def _pairs(seed=0, P=120, shift=1.0, ties=False):
    rng = np.random.default_rng(seed)
    lab = rng.random(P) < 0.4
    s = rng.normal(0, 1, P) + shift * lab - 0.3
    if ties:
        s = np.round(s * 2) / 2
    return ScoredPairs(s, lab, rng.integers(0, 5, P), rng.integers(0, 30, P))


def _slow(p, w):
    """Each pair repeated w times (integer bootstrap counts), then the unweighted textbook statistics."""
    rep = np.repeat(np.arange(p.score.size), w.astype(int))
    s, lab = p.score[rep], p.label[rep]
    pos, neg = s[lab], s[~lab]
    fpr, tpr = roc_curve(pos, neg)
    return {"balanced_accuracy": 0.5 * (np.mean(pos > 0) + np.mean(neg <= 0)), "auc": auc_score(pos, neg),
            "tpr_at_1pct_fpr": tpr_at_fpr(fpr, tpr, 0.01), "tpr_at_01pct_fpr": tpr_at_fpr(fpr, tpr, 0.001)}


@pytest.mark.parametrize("ties", [False, True])
def test_weighted_statistics_equal_repeating_the_pairs(ties):
    p = _pairs(ties=ties)
    wc, we = bootstrap_weights(5, 30, 6, seed=1)
    w = pair_weights(p, wc, we)
    got = pair_statistics(p, w)
    for b in range(6):
        want = _slow(p, w[b])
        for k, v in want.items():
            assert got[k][b] == pytest.approx(v, abs=1e-12), (k, b)


def test_unit_weights_give_ulira():
    rng = np.random.default_rng(3)
    M, n = 30, 20
    pin, pout = rng.normal(1, 1, (M, n)), rng.normal(0, 1, (M, n))
    pin[rng.random((M, n)) < 0.5] = np.nan
    pout[rng.random((M, n)) < 0.5] = np.nan
    sh, cl = np.arange(M) < 20, np.arange(M) % 5
    u = ulira(pin, pout, sh, sh)
    p, usable = lira_pairs(pin, pout, sh, sh, cl, cl)
    st = pair_statistics(p)
    assert st["balanced_accuracy"][0] == pytest.approx(u.balanced_accuracy, abs=1e-12)
    assert st["auc"][0] == pytest.approx(u.auc, abs=1e-12)
    assert (p.n_positive, p.n_negative) == (u.n_positive, u.n_negative)
    # the reference estimator scores the same pairs, differently
    pr, _ = lira_pairs(pin, pout, sh, sh, cl, cl, estimator="reference")
    assert pr.score.size == p.score.size and not np.allclose(pr.score, p.score)


def test_bootstrap_interval_covers_and_narrows():
    small, big = _pairs(P=80, shift=1.0), _pairs(P=4000, shift=1.0)
    cs = ci95(bootstrap_pairs(small, 5, 30, 400, 0)["balanced_accuracy"])
    cb = ci95(bootstrap_pairs(big, 5, 30, 400, 0)["balanced_accuracy"])
    point = pair_statistics(big)["balanced_accuracy"][0]
    assert cb[0] <= point <= cb[1]
    assert (cb[1] - cb[0]) < (cs[1] - cs[0])
    # same seed, same replicates; a method against itself cannot be told apart
    r1, r2 = bootstrap_pairs(big, 5, 30, 50, 7), bootstrap_pairs(big, 5, 30, 50, 7)
    assert np.array_equal(r1["auc"], r2["auc"]) and difference_ci(r1["auc"], r2["auc"]) == [0.0, 0.0]


def test_low_fpr_rates_need_enough_negatives():
    assert enough_negatives(500, 0.01) and not enough_negatives(499, 0.01)
    assert not enough_negatives(4999, 0.001) and enough_negatives(5000, 0.001)
    s = summarize(_pairs(P=200), None)
    assert s["tpr_at_01pct_fpr"] is None and s["tpr_at_1pct_fpr"] is None
    with pytest.raises(ValueError, match="both kinds"):
        pair_statistics(ScoredPairs([1.0, 2.0], [True, True], [0, 0], [0, 1]))


def test_klom_by_hand():
    # one example: unlearned {0, 0, 10}, oracle {0, 10, 10}: span [0, 10], 20 bins → mass in bins 0 and 19
    u, r = np.array([[0.0], [0.0], [10.0]]), np.array([[0.0], [10.0], [10.0]])
    want = (2 / 3) * np.log((2 / 3) / (1 / 3)) + (1 / 3) * np.log((1 / 3) / (2 / 3))
    assert klom(u, r)[0] == pytest.approx(want, abs=1e-12)
    # identical ensembles: 0; unlearned mass where the oracle has none: the eps floor
    assert klom(r, r)[0] == 0.0
    assert klom(np.array([[0.0], [0.0]]), np.array([[10.0], [10.0]]))[0] == pytest.approx(np.log(1 / 1e-5))
    # margins beyond ±100 are clipped; a point mass on both sides is one bin: 0
    assert klom(np.array([[500.0]]), np.array([[100.0]]))[0] == 0.0
    # bootstrap weights = repeating the models
    w = np.array([2, 0, 1])
    assert klom(u, r, weights_unlearned=w)[0] == pytest.approx(klom(u[[0, 0, 2]], r)[0], abs=1e-12)


def test_logits_file_round_trip(tmp_path):
    """A pool written in the documented format gives the same game as the statistics on the arrays."""
    rng = np.random.default_rng(5)
    S, F, n, c = 8, 2, 40, 3
    labels = rng.integers(0, c, n)
    trained = np.zeros((S * F, n), bool)
    unlearned = np.zeros((S * F, n), bool)
    logits = rng.normal(0, 1, (S * F, n, c))
    split = np.repeat(np.arange(S), F)
    for s in range(S):
        half = rng.permutation(n)[: n // 2]
        for f in range(F):
            k = s * F + f
            trained[k, half] = True
            unlearned[k, rng.choice(half, 5, replace=False)] = True
    logits[np.arange(S * F)[:, None], np.arange(n)[None, :], labels[None, :]] += 2.0 * unlearned  # a trace
    write_logits_file(tmp_path / "m.npz", logits=logits, labels=labels, trained=trained, unlearned=unlearned,
                      split=split, oracle_margins=rng.normal(0, 1, (4, n)), ensemble_margins=rng.normal(0, 1, (4, n)),
                      ensemble_forget=np.arange(n) < 5)
    pool = read_logits_file(tmp_path / "m.npz")
    assert pool.method == "m" and pool.shadow.sum() == 6 * F
    d = audit_logits_files([tmp_path / "m.npz"], replicates=100)["methods"]["m"]
    phi = pool.phi
    u = ulira(np.where(unlearned, phi, np.nan), np.where(~trained, phi, np.nan), pool.shadow, pool.shadow)
    assert d["ulira_game_balanced_accuracy"] == pytest.approx(u.balanced_accuracy, abs=1e-12)
    assert d["ulira_game_balanced_accuracy"] > 0.6  # the planted trace is found
    assert d["epsilon_u"] == d["epsilon_r"] == 4 and d["klom_forget"] is not None
    # bad files: one clear error each
    np.savez(tmp_path / "bad.npz", margins=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="format"):
        read_logits_file(tmp_path / "bad.npz")
    write_logits_file(tmp_path / "bad2.npz", margins=phi, trained=trained, unlearned=unlearned & ~trained | unlearned,
                      split=split)
    bad = np.load(tmp_path / "bad2.npz")
    arrays = dict(bad)
    arrays["unlearned"] = ~arrays["trained"]
    np.savez(tmp_path / "bad3.npz", **arrays)
    with pytest.raises(ValueError, match="outside the model's 'trained'"):
        read_logits_file(tmp_path / "bad3.npz")


def test_centered_interval_removes_the_resampling_shift():
    from scrubnet.audit.uncertainty import centered_ci95
    reps = np.array([3.0, 3.2, 3.4, 3.6])
    lo, hi = centered_ci95(reps, 1.6)
    assert lo < 1.6 < hi and hi - lo == pytest.approx(np.percentile(reps, 97.5) - np.percentile(reps, 2.5))
    assert centered_ci95(np.array([np.nan]), 1.0) is None
