"""``estimator="reference"`` reproduces the field's reference code on every case of the stored fixtures
(tests/fixtures/audit-references, README there), within the tolerances the fixtures state."""
import json
from pathlib import Path

import numpy as np
import pytest

from scrubnet.audit.reference import lira_reference, ulira_game_reference
from scrubnet.audit.stats import KLOM_MODES, bucket_points, epsilon_score, example_epsilons, klom

FIX = Path(__file__).parents[1] / "fixtures" / "audit-references"


def _load(name):
    z = np.load(FIX / name, allow_pickle=False)
    return z, [str(c) for c in z["cases"]]


LIRA, LIRA_CASES = _load("lira_online.npz")
EPS, EPS_CASES = _load("neurips_eps.npz")
GAME, GAME_CASES = _load("ulira_game.npz")
VARIANTS = [("online", True, False), ("online_fixed", True, True), ("offline", False, False),
            ("offline_fixed", False, True)]


def test_fixture_meta_is_json():
    for z in (LIRA, EPS, GAME):
        assert "numpy" in json.loads(str(z["meta"]))
    assert len(LIRA_CASES) == 8 and len(EPS_CASES) == 27 and len(GAME_CASES) == 3


@pytest.mark.parametrize("case", LIRA_CASES)
@pytest.mark.parametrize("variant,online,fixed", VARIANTS)
def test_lira_reference_reproduces_tensorflow_privacy(case, variant, online, fixed):
    g = lambda k: LIRA[f"{case}/{k}"]  # noqa: E731
    e = lambda k: LIRA[f"{case}/{variant}.{k}"]  # noqa: E731
    r = lira_reference(g("shadow_phi"), g("shadow_in"), g("target_phi"), g("target_in"), g("shadow_valid"),
                       g("target_valid"), online=online, fixed_variance=fixed)
    np.testing.assert_array_equal(r.pair_model, g("pair_model"))
    np.testing.assert_array_equal(r.pair_example, g("pair_example"))
    np.testing.assert_array_equal(r.answers, g("answers"))
    assert (r.fit.in_size, r.fit.out_size) == (int(e("in_size")), int(e("out_size")))
    np.testing.assert_allclose(r.prediction, e("prediction"), rtol=1e-12, atol=0)
    for k in ("mean_in", "mean_out", "std_in", "std_out"):
        np.testing.assert_allclose(getattr(r.fit, k), e(k), rtol=1e-14, atol=1e-14, equal_nan=True, err_msg=k)
    np.testing.assert_array_equal(r.roc_fpr, e("roc_fpr"))
    np.testing.assert_array_equal(r.roc_tpr, e("roc_tpr"))
    assert abs(r.auc - float(e("auc"))) <= 1e-12
    for k in ("acc", "tpr_at_1pct_fpr", "tpr_at_01pct_fpr"):
        np.testing.assert_equal(getattr(r, k), float(e(k)), err_msg=k)


RUNNABLE = [c for c in EPS_CASES if f"{c}/error" not in EPS.files]


@pytest.mark.parametrize("case", RUNNABLE)
def test_epsilon_reference_reproduces_the_challenge_metric(case):
    g = lambda k: EPS[f"{case}/{k}"]  # noqa: E731
    u, r = g("u"), g("r")
    eps = example_epsilons(u, r, estimator="reference")
    np.testing.assert_array_equal(eps, g("eps"))  # float32-emulating with the exact grids: equal
    res = epsilon_score(u, r, retain_accuracy=tuple(g("retain_accuracy")), test_accuracy=tuple(g("test_accuracy")),
                        estimator="reference")
    assert res.forget_score == float(g("forget_score"))
    assert res.score == pytest.approx(float(g("final_score")), rel=1e-15, abs=0)
    b = bucket_points(u.shape[0])
    np.testing.assert_array_equal([lo for lo, _ in b], g("bucket_lower"))
    np.testing.assert_array_equal([p for _, p in b], g("bucket_points"))
    # the default estimator is the same construction wherever the reference runs
    np.testing.assert_array_equal(example_epsilons(u, r), g("eps"))


def test_epsilon_reference_raises_where_the_challenge_raises():
    case = "point_masses_identical"
    assert f"{case}/error" in EPS.files
    with pytest.raises(ValueError, match="no threshold"):
        example_epsilons(EPS[f"{case}/u"], EPS[f"{case}/r"], estimator="reference")
    # the default says "cannot be told apart"
    np.testing.assert_array_equal(example_epsilons(EPS[f"{case}/u"], EPS[f"{case}/r"]), 0.0)


def test_left_rounding_sensitive_examples_need_the_exact_construction():
    """The fixtures mark examples where (tr − width) + linspace(−2, 2) changes ε: ours matches the reference
    there too, so the construction is exact and not merely close."""
    marked = 0
    for case in RUNNABLE:
        sens = EPS[f"{case}/left_rounding_sensitive"]
        if sens.any():
            marked += int(sens.sum())
            eps = example_epsilons(EPS[f"{case}/u"][:, sens], EPS[f"{case}/r"][:, sens], estimator="reference")
            np.testing.assert_array_equal(eps, EPS[f"{case}/eps"][sens])
    assert marked == 7


@pytest.mark.parametrize("case", GAME_CASES)
def test_game_reference_reproduces_deepunlearn(case):
    g = lambda k: GAME[f"{case}/{k}"]  # noqa: E731
    r = ulira_game_reference(g("phi"), g("train"), g("forget"))
    np.testing.assert_array_equal(r.in_mask, g("in_mask"))
    np.testing.assert_array_equal(r.out_mask, g("out_mask"))
    np.testing.assert_array_equal(r.n_forgotten, g("n_forgotten"))
    np.testing.assert_array_equal(r.n_never, g("n_never"))
    for k in ("forget_mean", "forget_std", "never_mean", "never_std"):
        np.testing.assert_allclose(getattr(r, k), g(k), rtol=0, atol=1e-12, equal_nan=True, err_msg=k)
    for k in ("p_forgotten", "p_never"):
        want, got = g(k), getattr(r, k)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=k)  # NaN pattern exact
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, equal_nan=True, err_msg=k)
    for k in ("acc_forgotten", "acc_never", "acc_balanced"):
        np.testing.assert_array_equal(getattr(r, k), g(k), err_msg=k)
    # the reference's own output: per example, the finite and NaN p of the forgotten list in C order
    j = int(np.argmax(r.n_forgotten))
    np.testing.assert_allclose(r.p_forgotten[:, :, j][r.in_mask[:, :, j]], g("p_forgotten")[:, :, j][g("in_mask")[:, :, j]],
                               atol=1e-12, equal_nan=True)


# ----------------------------------------------------------------------------------------------- KLoM
KLOM = np.load(FIX / "klom.npz", allow_pickle=False)
KLOM_CASES = [str(c) for c in KLOM["cases"]]


def _klom_bench_twin(unl: np.ndarray, orc: np.ndarray, bins=20, eps=1e-5, clip=100.0) -> np.ndarray:
    """Slow twin of the benchmark's per-example loop, written from its description (fixture README):
    np.linspace edges, np.digitize indices 1..bins only, counts over counted totals, the floor where p > 0,
    then scipy.stats.entropy (which renormalises)."""
    from scipy.stats import entropy
    out = []
    for j in range(unl.shape[1]):
        a, b = np.clip(unl[:, j], -clip, clip), np.clip(orc[:, j], -clip, clip)
        lo, hi = min(a.min(), b.min()), max(a.max(), b.max())
        hi = lo + 1 if lo >= hi else hi
        e = np.linspace(lo, hi, bins + 1)
        ca = np.array([np.sum(np.digitize(a, e) == i) for i in range(1, bins + 1)])
        cb = np.array([np.sum(np.digitize(b, e) == i) for i in range(1, bins + 1)])
        p = ca / ca.sum() if ca.sum() > 0 else np.zeros(bins)
        q = cb / cb.sum() if cb.sum() > 0 else np.zeros(bins)
        with np.errstate(invalid="ignore"):
            out.append(entropy(p, np.where(p > 0, np.maximum(q, eps), q)))
    return np.array(out)


def test_klom_fixture_cases_are_all_there():
    assert json.loads(str(KLOM["meta"]))["bin_count"] == 20
    assert KLOM_CASES == ["same_law", "shifted", "few_models", "top_edge", "point_mass_above", "zero_span", "clipped",
                          "small_shift", "ties"]


@pytest.mark.parametrize("case", KLOM_CASES)
def test_klom_reference_mode_reproduces_the_benchmark(case):
    u, r, want = KLOM[f"{case}/unlearned"], KLOM[f"{case}/oracle"], KLOM[f"{case}/klom"]
    got = klom(u, r, mode="reference")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))   # the NaN case exactly
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, equal_nan=True)
    if np.isnan(want).any():  # the default keeps the top edge in the last bin: a number there
        assert np.all(np.isfinite(klom(u, r)))


def test_klom_reference_mode_equals_the_benchmark_twin_on_a_constructed_pool():
    """Same law, shifts, point masses on the top edge (NaN), an oracle wholly on the top edge, clipped margins,
    values on bin edges, weights 0 and 2 (= dropping and repeating a model)."""
    rng = np.random.default_rng(11)
    M, n = 12, 60
    r = rng.normal(0, 2, (M, n))
    u = r + rng.normal(0, 1, (M, n)) + rng.normal(0, 1.5, n)
    u[:, 0] = r[:, 0].max()                      # unlearned point mass on the top edge: NaN
    u[:, 1] = r[:, 1].max() + 3                  # point mass above the oracle: NaN
    r[:, 2] = u[:, 2].max() + 1                  # oracle point mass above the unlearned: q has no counted value
    u[:, 3], r[:, 3] = 500.0, rng.normal(99, 2, M)  # clipped to 100, the top edge: NaN as well
    u[:, 4], r[:, 4] = 7.0, 7.0                  # zero span
    u[:, 5:15] = np.round(u[:, 5:15] * 2) / 2    # ties and edge hits
    r[:, 5:15] = np.round(r[:, 5:15] * 2) / 2
    got = klom(u, r, mode="reference")
    want = _klom_bench_twin(u, r)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.flatnonzero(np.isnan(want)).tolist() == [0, 1, 3]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, equal_nan=True)
    w = rng.integers(0, 3, M)
    w[0] = 1
    keep = np.repeat(np.arange(M), w)
    np.testing.assert_allclose(klom(u, r, mode="reference", weights_unlearned=w, weights_oracle=w[::-1]),
                               _klom_bench_twin(u[keep], r[np.repeat(np.arange(M), w[::-1])]),
                               rtol=0, atol=1e-12, equal_nan=True)


def test_klom_modes_differ_by_the_documented_choices_only():
    rng = np.random.default_rng(12)
    u, r = rng.normal(0, 1, (16, 40)), rng.normal(0.5, 1, (16, 40))
    np.testing.assert_array_equal(klom(u, r, mode="reference", choices=KLOM_MODES["default"]), klom(u, r))
    np.testing.assert_array_equal(klom(u, r, choices=KLOM_MODES["reference"]), klom(u, r, mode="reference"))
    # each example's maximum lies on the top edge: dropping it changes every example; renormalising moves
    # a value by at most the floor's added mass (|Δ| ≤ 2·20·1e-5 here)
    top = klom(u, r, choices={"top": "drop"})
    assert np.all(top != klom(u, r))
    ren = klom(u, r, choices={"normalise": "scipy"})
    assert 0 < np.max(np.abs(ren - klom(u, r))) < 4e-4
    with pytest.raises(ValueError, match="unknown mode"):
        klom(u, r, mode="scipy")
