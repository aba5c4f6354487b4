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
