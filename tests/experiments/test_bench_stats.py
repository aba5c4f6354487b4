"""The bench's statistics against their definitions: t-intervals, paired differences, tie groups, the grid rule."""
import math

import numpy as np
import pytest
from scipy import stats

from scrubnet.experiments.bench_report import bench_table_rows, cell
from scrubnet.experiments.bench_stats import interval, next_trial, paired, tie_groups


def test_interval_is_the_student_t_interval_and_one_unit_has_none():
    v = [0.1, 0.4, 0.25, 0.3]
    got = interval(v)
    sd = math.sqrt(sum((x - np.mean(v)) ** 2 for x in v) / 3)
    half = 3.182446305284263 * sd / 2          # t_{0.975, 3}
    assert got["mean"] == pytest.approx(0.2625) and got["half"] == pytest.approx(half)
    assert (got["lo"], got["hi"]) == pytest.approx((0.2625 - half, 0.2625 + half))
    one = interval([0.3])
    assert one["half"] is None and one["n"] == 1
    assert cell(one) == "30.0 (n = 1)" and cell(got) == f"26.2 ± {100 * half:.1f}"


def test_paired_difference_uses_shared_units_and_ties_group_the_indistinguishable():
    rng = np.random.default_rng(0)
    units = [(f, s) for f in range(5) for s in range(3)]
    base = {u: float(rng.uniform(0.05, 0.3)) for u in units}
    a = dict(base)                                               # the best
    b = {u: v + 0.002 * ((-1) ** i) for i, (u, v) in enumerate(base.items())}   # the same up to noise
    c = {u: v + 0.1 + 0.01 * rng.standard_normal() for u, v in base.items()}       # clearly worse
    d = {u: v + 0.1 + 0.01 * rng.standard_normal() for u, v in base.items()}       # as bad as c
    p = paired(c, a)
    want = stats.ttest_rel(list(c.values()), list(a.values()))
    assert p["distinguishable"] and p["n"] == 15 and p["lo"] > 0
    assert want.pvalue < 0.05
    assert not paired(b, a)["distinguishable"] and not paired(a, a)["distinguishable"]
    gaps = {"a": a, "b": b, "c": c, "d": d}
    order = sorted(gaps, key=lambda m: np.mean(list(gaps[m].values())))
    assert tie_groups(order, gaps) == [["a", "b"], ["c", "d"]] or tie_groups(order, gaps) == [["b", "a"], ["c", "d"]]
    # a unit one method lacks is left out of the pairing
    del c[units[0]]
    assert paired(c, a)["n"] == 14


def test_next_trial_widens_an_edge_and_refines_an_interior_best():
    assert next_trial([0.01, 0.1, 1.0], [0.1, 0.2, 0.3], [True] * 3) == pytest.approx(0.001)
    assert next_trial([0.01, 0.1, 1.0], [0.3, 0.2, 0.1], [True] * 3) == pytest.approx(10.0)
    # interior best: the log-midpoint toward the better neighbour
    assert next_trial([0.01, 0.1, 1.0], [0.3, 0.1, 0.2], [True] * 3) == pytest.approx(0.316)
    # a failed run is not a best; β in (0, 1) widens in the logit
    assert next_trial([0.01, 0.1, 1.0], [0.0, 0.2, 0.3], [False, True, True]) == pytest.approx(0.0316)
    nxt = next_trial([0.9, 0.95, 0.99], [0.3, 0.2, 0.1], [True] * 3, "logit")
    assert 0.99 < nxt < 1 and nxt == pytest.approx(1 / (1 + math.exp(-(2 * math.log(99) - math.log(19)))), rel=1e-2)


def test_the_table_shows_intervals_ties_and_the_paired_difference():
    row = {"method": "x", "family": "field", "options": {"lr": 0.01}, "failed": 0, "tie_group": 2,
           "ua": interval([0.1, 0.2]), "ra": interval([0.9, 0.9]), "ta": interval([0.5, 0.6]),
           "mia_efficacy": interval([0.1, 0.3]), "avg_gap": interval([0.05, 0.07]), "time_s": interval([1, 2]),
           "vs_best": {**interval([0.01, 0.03]), "distinguishable": False}}
    line = bench_table_rows([row])[2]
    assert "| x (field) | 2 |" in line and "15.0 ± " in line and "+2.0 [" in line and "lr=0.01" in line


def _holm_by_hand(ps: dict, level=0.05) -> dict:
    """Holm written from its definition: reject H_(i) iff p_(j)·(m − j + 1) ≤ level for every j ≤ i."""
    names = sorted(ps, key=lambda k: (ps[k], k))
    m, out, adj = len(names), {}, 0.0
    for j, k in enumerate(names):
        adj = max(adj, min(1.0, ps[k] * (m - j)))      # the step-down adjusted p-value
        out[k] = adj <= level
    return out


def test_tie_groups_use_holm_against_the_leader_and_never_invert_the_ranking():
    from scrubnet.experiments.bench_stats import holm, paired_p
    rng = np.random.default_rng(3)
    units = [(f, s) for f in range(5) for s in range(3)]
    base = {u: float(rng.uniform(0.05, 0.3)) for u in units}
    noisy = lambda shift, sd: {u: v + shift + sd * rng.standard_normal() for u, v in base.items()}  # noqa: E731
    gaps = {"a": dict(base), "b": noisy(0.003, 0.02), "c": noisy(0.01, 0.002), "d": noisy(0.02, 0.08),
            "e": noisy(0.2, 0.01)}
    gaps["f"] = {u: v + 0.002 * (-1) ** i for i, (u, v) in enumerate(gaps["e"].items())}    # e up to noise
    order = sorted(gaps, key=lambda m: (np.mean(list(gaps[m].values())), m))
    # the paired t-test's p-value is scipy's
    for m in "bcde":
        want = stats.ttest_rel(list(gaps[m].values()), list(gaps["a"].values())).pvalue
        assert paired_p(gaps[m], gaps["a"]) == pytest.approx(want, rel=1e-9)
    ps = {m: paired_p(gaps[m], gaps["a"]) for m in order[1:]}
    assert holm(ps) == _holm_by_hand(ps)
    groups = tie_groups(order, gaps)
    assert [m for g in groups for m in g] == order            # contiguous: no method ranks after a worse one
    first = groups[0]
    rej = holm(ps)
    # group 1: the leader and the methods up to the first that Holm tells apart from it
    k = next((i for i, m in enumerate(order[1:]) if rej[m]), len(order) - 1)
    assert first == order[:k + 1]
    assert "c" not in first and {"e", "f"}.isdisjoint(first)   # c: tiny but steady shift; e, f: far worse
    assert any({"e", "f"} <= set(g) for g in groups)        # e and f cannot be told apart
    # c (a small steady shift) is told apart from a; b is not once the 5 comparisons are accounted for (alone, its
    # p < 0.05 would have called it different); b ranks below c, so it goes with c, not above it
    assert not rej["b"] and paired_p(gaps["b"], gaps["a"]) < 0.05 and rej["c"]
    assert groups[:2] == [["a"], ["c", "b", "d"]]
    # one p-value at 0.03 among three: unadjusted it is "distinguishable", Holm (0.05/3) keeps it
    assert holm({"x": 0.03, "y": 0.5, "z": 0.9}) == {"x": False, "y": False, "z": False}
    assert holm({"x": 0.01, "y": 0.02, "z": 0.9}) == {"x": True, "y": True, "z": False}


def test_the_tuning_choice_treats_gaps_within_one_forget_sample_as_a_tie():
    from scrubnet.experiments.bench import choose
    from scrubnet.experiments.bench_stats import best_index, choice_tolerance
    assert choice_tolerance(50) == 0.005 and choice_tolerance(5) == 0.05
    gaps, ok = [0.1010, 0.1006, 0.2], [True] * 3
    assert best_index(gaps, ok) == 1                       # strict: the last digits decide
    assert best_index(gaps, ok, 0.005) == 0                # within one sample: the first tried
    # noise below the tolerance on either value cannot flip the choice
    for e1, e2 in ((0.0015, -0.0015), (-0.0015, 0.0015)):
        assert best_index([gaps[0] + e1, gaps[1] + e2, 0.2], ok, 0.005) == 0
    assert best_index([0.1, 0.09, 0.05], [True, True, False], 0.005) == 1   # a failed run is never chosen
    res = [{"options": {"lr": v}, "metrics": {"avg_gap": g}, "ok": True} for v, g in ((0.1, 0.103), (0.3, 0.1))]
    assert choose(res, 0.005)["chosen"] == 0.1 and choose(res)["chosen"] == 0.3
