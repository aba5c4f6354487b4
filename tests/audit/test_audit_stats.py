"""U-LiRA and the ε-score on synthetic Gaussians whose answers are known in closed form."""
import math

import numpy as np
import pytest
from scipy.stats import norm

from scrubnet.audit.stats import (EPSILON_CAP, bucket_points, epsilon_score, example_epsilon, forget_score,
                                  logit_confidence, ulira)


def test_logit_confidence_matches_probabilities():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 7, 4)) * 5
    y = rng.integers(0, 4, size=7)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    py = np.take_along_axis(p, np.broadcast_to(y[:, None], (3, 7, 1)), -1)[..., 0]
    np.testing.assert_allclose(logit_confidence(z, y), np.log(py) - np.log(1 - py), rtol=1e-9, atol=1e-9)
    # stable where p_y rounds to 1
    assert np.isfinite(logit_confidence(np.array([[800.0, 0.0]]), np.array([0]))).all()


def _pool(rng, n_examples, m_in, m_out, shift, sd_in=1.0):
    """Per-example means; IN = mean + shift, OUT = mean, one observation per (model, example)."""
    base = rng.normal(0, 3, size=n_examples)
    phi_in = base + shift + sd_in * rng.normal(size=(m_in, n_examples))
    phi_out = base + rng.normal(size=(m_out, n_examples))
    return phi_in, phi_out


@pytest.mark.parametrize("fixed", [False, True])
def test_ulira_identical_in_out_is_chance(fixed):
    rng = np.random.default_rng(1)
    phi_in, phi_out = _pool(rng, 400, 60, 60, 0.0)
    sh = np.arange(60) < 50
    r = ulira(phi_in, phi_out, sh, sh, fixed_variance=fixed)
    assert abs(r.balanced_accuracy - 0.5) < 0.04
    assert abs(r.auc - 0.5) < 0.04
    assert r.n_positive == 4000 and r.n_negative == 4000


def test_ulira_shift_matches_gaussian_closed_form():
    # equal variances, shift Δ: the likelihood-ratio test cuts at Δ/2, balanced accuracy Φ(Δ/2)
    rng = np.random.default_rng(2)
    for delta in (1.0, 2.0):
        phi_in, phi_out = _pool(rng, 300, 220, 220, delta)
        sh = np.arange(220) < 200
        r = ulira(phi_in, phi_out, sh, sh, fixed_variance=True)
        assert abs(r.balanced_accuracy - norm.cdf(delta / 2)) < 0.02, (delta, r.balanced_accuracy)
        s = r.spread()
        assert abs(s["mean"] - norm.cdf(delta / 2)) < 0.03


def test_ulira_well_separated_is_perfect_and_missing_entries_are_ignored():
    rng = np.random.default_rng(3)
    phi_in, phi_out = _pool(rng, 100, 20, 20, 12.0, sd_in=0.5)
    phi_in[rng.random(phi_in.shape) < 0.5] = np.nan   # each model unlearned half of the examples
    phi_out[rng.random(phi_out.shape) < 0.5] = np.nan
    sh = np.arange(20) < 14
    r = ulira(phi_in, phi_out, sh, sh, fixed_variance=True)
    assert r.balanced_accuracy == 1.0 and r.tpr_at_1pct_fpr == 1.0 and r.auc == 1.0
    assert np.nanmin(r.per_example_accuracy) == 1.0
    # per-example variances from a handful of shadows are noisy, a few target points fall on the wrong side
    assert ulira(phi_in, phi_out, sh, sh).balanced_accuracy > 0.98


def test_ulira_rejects_bad_shapes():
    with pytest.raises(ValueError):
        ulira(np.zeros((3, 4)), np.zeros((3, 5)), np.ones(3, bool), np.ones(3, bool))


def test_epsilon_identical_samples_is_zero_and_score_one():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 10))
    res = epsilon_score(x, x.copy(), retain_accuracy=(0.9, 0.9), test_accuracy=(0.7, 0.7))
    assert np.all(res.epsilons == 0.0)
    assert res.forget_score == 1.0 and res.score == 1.0


def test_epsilon_same_law_is_small_and_separated_is_the_cap():
    rng = np.random.default_rng(5)
    same = epsilon_score(rng.normal(size=(512, 20)), rng.normal(size=(512, 20)))
    # a shared law: the sweep's extreme thresholds still see tail counts such as 4 vs 1 of 512 (ε = ln 4),
    # the estimator's known finite-sample floor; far below a real shift (next test) and the cap
    assert np.median(same.epsilons) < math.log(5) and same.forget_score >= 0.2
    far = epsilon_score(rng.normal(size=(64, 5)), 20 + rng.normal(size=(64, 5)))
    assert np.all(far.epsilons == EPSILON_CAP) and far.forget_score == 0.0
    # a point mass against a spread sample: range ratio < 1 % → the cap
    assert example_epsilon(np.full(32, 1.0), rng.normal(size=32)) == EPSILON_CAP


def test_epsilon_grows_with_the_shift():
    rng = np.random.default_rng(6)
    e = [np.median(example_epsilon(rng.normal(size=256), d + rng.normal(size=256))) for d in (0.0, 1.0, 3.0)]
    assert e[0] < e[1] < e[2]


def test_single_threshold_epsilon_by_hand():
    # 4 vs 4 values: the best single threshold leaves FPR = 1/4 and FNR = 1/4 → ε = log(3/4 − δ) − log(1/4)
    u = np.array([0.0, 1.0, 2.0, 5.0])
    r = np.array([3.0, 4.0, 6.0, 7.0])
    e = example_epsilon(u, r)
    assert e >= math.log(0.75 - 1e-5) - math.log(0.25) - 1e-9


def test_buckets_follow_the_challenge():
    b = bucket_points(512)                       # ceil(ln 511) = 7 → 14 buckets
    assert len(b) == 14 and b[0] == (0.0, 1.0) and b[-1] == (6.5, 0.5 ** 13)
    assert forget_score([0.0, 0.49, 0.5, 1.2, 7.0], 512) == pytest.approx((1 + 1 + 0.5 + 0.25 + 0) / 5)
    with pytest.raises(ValueError):
        bucket_points(2)


def test_interval_counts_fast_path_equals_searching_every_grid_point():
    """The two-sided family's counts from cut indices equal a direct search of each of the 400 left ends per
    right end, including sample values placed exactly on grid points."""
    from scrubnet.audit.stats import _count_in, _interval_counts, _left_ends
    rng = np.random.default_rng(0)
    for _ in range(100):
        v = np.sort(rng.normal(0, 1, rng.integers(1, 40)))
        rights = np.linspace(v[0] - 1, v[-1] + 2, 50) + rng.normal(0, 1e-3)
        w = float(rng.uniform(0, 2))
        grid = _left_ends(rights, w, 400)
        v = np.sort(np.r_[v, grid[rng.integers(0, 50, 5), rng.integers(0, 400, 5)]])
        np.testing.assert_array_equal(_interval_counts(v, rights, w, 400),
                                      _count_in(v, grid.ravel(), np.repeat(rights, 400)))


# ------------------------------------------------------------------------------------ retain leakage
def _tiny_audit(methods, pool, tmp_path):
    from scrubnet.audit.run import Audit, default_plan
    from scrubnet.experiments.config import ExperimentConfig
    cfg = ExperimentConfig.from_dict({
        "data": {"n_train_per_class": 16, "n_test_per_class": 8, "core_per_class": 20, "forget_count": 4,
                 "num_samples": 1000},
        "train": {"pretrain_epochs": 2, "max_epochs": 25, "batch_size": 32}, "model_options": {"hidden": 32}})
    return Audit(cfg, methods, default_plan(methods, pool=pool), tmp_path)


def test_retain_leakage_of_retrain_is_centred_on_zero_when_nothing_leaks(tmp_path):
    """Nothing leaks: every model's φ has one law (trained examples +2, a split-level draw shared by the split's
    models as its seed and start are, and a small per-model part), so the retrain's two forget sets give near
    duplicates. The audit's construction (one row per split on both sides) is centred on 0 at 8 splits and its
    interval covers 0; stacking the two near-duplicate rows against one row per split is not."""
    from scrubnet.audit.stats import retain_accuracy
    a = _tiny_audit(["original", "retrain"], 8, tmp_path)
    n, S = a.data.n, a.plan.splits
    trained = [a._mask(a.data.halves[s]) for s in range(S)]
    rng = np.random.default_rng(0)

    def draw():
        mu, sd = rng.normal(0, 2, n), rng.uniform(0.5, 1.5, n)
        phis = {}
        for s in range(S):
            split = mu + 2.0 * trained[s] + sd * rng.normal(size=n)
            phis[f"original/{s}"] = split + 0.05 * sd * rng.normal(size=n)
            for f in range(a.plan.forget_sets):
                phis[f"retrain/{s}/{f}"] = split + 0.05 * sd * rng.normal(size=n)
        a.phi_d = lambda mid, method=None, field="logits": phis[mid]

    new, covered, stacked = [], 0, []
    for _ in range(200):
        draw()
        r = a.retain_leakage("retrain", 200, int(rng.integers(1 << 30)))
        new.append(r["leakage"])
        covered += r["ci95"][0] <= 0.0 <= r["ci95"][1]
        both = tuple(np.concatenate(x) for x in zip(a.retain_rows("retrain", 0), a.retain_rows("retrain", 1)))
        before = retain_accuracy(a.retain_rows("retrain", before=True), 2, n, 1, 0)[0]
        stacked.append(retain_accuracy(both, 2, n, 1, 0)[0] - before)
    assert abs(np.mean(new)) < 0.01 and covered >= 180, (np.mean(new), covered)
    assert np.mean(stacked) < -0.02  # the old construction: near duplicates on one side only


def test_retain_leakage_before_is_the_methods_own_family_original(tmp_path):
    """ML-Forgetting's "before" rows are its own mixed-linear original (stored with its scrub of (s, 0)); every
    other method's are the pool's originals; each side has one row per split."""
    a = _tiny_audit(["original", "retrain", "finetune", "mlforget"], 4, tmp_path)
    seen = []
    a.phi_d = lambda mid, method=None, field="logits": seen.append((mid, field)) or np.zeros(a.data.n)
    a.retain_rows("mlforget", before=True)
    assert seen == [(f"scrub/mlforget/{s}/0", "original_logits") for s in range(4)]
    for m in ("finetune", "retrain", "original"):
        seen.clear()
        a.retain_rows(m, before=True)
        assert seen == [(f"original/{s}", "logits") for s in range(4)]
    seen.clear()
    a.retain_rows("finetune", 1)
    assert seen == [(f"scrub/finetune/{s}/1", "logits") for s in range(4)]
    assert a._required({"id": "scrub/mlforget/0/0", "method": "mlforget"}) == ("original_logits",)
    assert a._required({"id": "eps/mlforget/0", "method": "mlforget"}) == ()
    assert a._required({"id": "scrub/finetune/0/0", "method": "finetune"}) == ()


def test_cache_entry_without_a_required_tensor_counts_as_absent(tmp_path):
    import torch

    from scrubnet.audit.pool import Cache
    c = Cache(tmp_path, {"v": 1})
    c.save("scrub/mlforget/0/0", {"logits": torch.zeros(3, 2)})
    assert c.has("scrub/mlforget/0/0") and not c.has("scrub/mlforget/0/0", require=("original_logits",))
    c.save("scrub/mlforget/0/0", {"logits": torch.zeros(3, 2), "original_logits": torch.ones(3, 2)})
    assert c.has("scrub/mlforget/0/0", require=("original_logits",))
