"""The statistics of ``scrubnet bench``: 95 % intervals over (forget set, seed) units, the paired comparison of
each method with the best, the groups of methods the bench cannot tell apart, and the tuning rule that widens a
grid whose best value lies on its edge (every tuned method gets the same number of trials).

Intervals are Student-t intervals of the mean: mean ± t_{0.975, n−1}·s/√n with s the sample standard deviation
(ddof 1); with one unit there is no interval (``lo`` = ``hi`` = None). The paired comparison takes, unit by
unit, the difference of a method's Avg. Gap and the best method's (same forget set, same seed, same retrain), and
its t-interval: a method whose interval contains 0 is *not distinguishable* from the best.

Tie groups (:func:`tie_groups`) take the multiplicity into account: all methods are compared with the leader
by paired t-tests and Holm's step-down procedure holds the family-wise error at 5 %; a group is contiguous in the
order of the means (no method ranks in a later group than a method with a larger mean). The tuning's choice
(:func:`best_index`) treats validation gaps closer than one forget sample's worth (:func:`choice_tolerance`) as
equal and takes the first value tried among them, so that a machine's last-digit noise cannot flip it.
"""
from __future__ import annotations

import math

import numpy as np

#: two-sided level of every interval
LEVEL = 0.95


def interval(values) -> dict:
    """The mean of ``values`` and its 95 % t-interval.

    Parameters
    ----------
    values : sequence of float
        One value per unit (n ≥ 1).

    Returns
    -------
    dict
        ``mean``, ``std`` (ddof 1; 0 when n = 1), ``n``, ``half`` (the half-width, None when n = 1), ``lo``,
        ``hi`` (None when n = 1).
    """
    v = np.asarray(list(values), dtype=float)
    n = int(v.size)
    if n == 0:
        raise ValueError("no value to summarise")
    mean = float(v.mean())
    if n == 1:
        return {"mean": mean, "std": 0.0, "n": 1, "half": None, "lo": None, "hi": None}
    sd = float(v.std(ddof=1))
    from scipy import stats  # imported where used: scipy.stats costs ≈ 0.9 CPU-s at every command's start-up

    half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1) * sd / math.sqrt(n))
    return {"mean": mean, "std": sd, "n": n, "half": half, "lo": mean - half, "hi": mean + half}


def paired(a: dict, b: dict) -> dict:
    """The paired difference a − b over the units both have.

    Parameters
    ----------
    a, b : dict of unit to float
        One value per unit (e.g. (forget set, seed) → Avg. Gap).

    Returns
    -------
    dict
        :func:`interval` of the differences on the shared units, plus ``distinguishable`` (the interval excludes
        0; False when there is no interval).
    """
    units = [u for u in a if u in b]
    if not units:
        raise ValueError("the two methods share no unit")
    out = interval([a[u] - b[u] for u in units])
    # an exact tie on every unit (e.g. the best against itself) has sd 0: not distinguishable
    out["distinguishable"] = out["lo"] is not None and (out["lo"] > 0 or out["hi"] < 0)
    return out


def paired_p(a: dict, b: dict) -> float:
    """Two-sided p-value of the paired t-test of a − b over the shared units (1 when every difference is 0;
    0 when they are all equal and not 0; 1 with a single unit: nothing can be told apart)."""
    d = np.asarray([a[u] - b[u] for u in a if u in b], dtype=float)
    if d.size < 2:
        return 1.0
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return 1.0 if float(np.abs(d).max()) == 0.0 else 0.0
    t = float(d.mean()) / (sd / math.sqrt(d.size))
    from scipy import stats

    return float(2 * stats.t.sf(abs(t), d.size - 1))


def holm(pvalues: dict[str, float], level: float = 1 - LEVEL) -> dict[str, bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise error ``level``.

    Parameters
    ----------
    pvalues : dict of str to float
        One p-value per hypothesis (m of them).
    level : float

    Returns
    -------
    dict of str to bool
        Sorted ascending p_(1) ≤ … ≤ p_(m), H_(i) is rejected while p_(j) ≤ level/(m − j + 1) for every
        j ≤ i;
        the first that fails and all after it are kept (ties in p: by name, a fixed rule).
    """
    names = sorted(pvalues, key=lambda k: (pvalues[k], k))
    out, m, going = {}, len(names), True
    for i, k in enumerate(names):
        going = going and pvalues[k] <= level / (m - i)
        out[k] = going
    return out


def tie_groups(order: list[str], gaps: dict[str, dict]) -> list[list[str]]:
    """Groups of methods the bench cannot tell apart.

    Parameters
    ----------
    order : list of str
        The methods, best first (by mean Avg. Gap).
    gaps : dict of str to dict
        Each method's Avg. Gap per unit.

    Returns
    -------
    list of list of str
        Group 1: the best (its leader) and the methods that follow it in ``order`` up to the first one Holm's
        procedure (:func:`holm` over the paired t-tests (:func:`paired_p`) of every remaining method against the
        leader, family-wise 5 %) tells apart from it; group 2 the same with the next method as leader, and so on.
        The groups are contiguous in ``order`` (no inversion of the ranking) and every method is in exactly one.
    """
    left = list(order)
    groups = []
    while left:
        lead, rest = left[0], left[1:]
        rejected = holm({m: paired_p(gaps[m], gaps[lead]) for m in rest}) if rest else {}
        members = [lead]
        for m in rest:
            if rejected[m]:
                break
            members.append(m)
        groups.append(members)
        left = left[len(members):]
    return groups


def choice_tolerance(n_forget: int) -> float:
    """The validation Avg. Gaps the tuning treats as equal: one forget sample's worth, 1/(4·N_f) (one sample
    of D_f moves UA or MIA-efficacy by 1/N_f, and the Avg. Gap is a mean of four metrics)."""
    return 1.0 / (4 * max(int(n_forget), 1))


def _to(v: float, space: str) -> float:
    return math.log(v) if space == "log" else math.log(v / (1 - v))


def _from(t: float, space: str) -> float:
    return math.exp(t) if space == "log" else 1 / (1 + math.exp(-t))


def _round(v: float) -> float:
    return float(f"{v:.3g}")


def next_trial(values: list[float], gaps: list[float], ok: list[bool], space: str = "log") -> float | None:
    """The next value of a knob's grid search.

    Parameters
    ----------
    values, gaps, ok : lists
        The values tried so far, their validation Avg. Gaps and whether each run succeeded.
    space : {"log", "logit"}
        Where the grid is even: log(v) for a positive knob, log(v/(1−v)) for one in (0, 1).

    Returns
    -------
    float or None
        When the best value (:func:`best_index`) is the smallest or largest tried, one grid step beyond it (the
        grid widens); otherwise the midpoint, in ``space``, between the best value and its better neighbour
        (the grid refines). None when that value has been tried already.
    """
    best = values[best_index(gaps, ok)]
    ts = sorted({_to(v, space) for v in values})
    tb = _to(best, space)
    i = min(range(len(ts)), key=lambda j: abs(ts[j] - tb))
    if len(ts) == 1:
        new = tb + math.log(3.0)
    elif i == 0:
        new = ts[0] - (ts[1] - ts[0])
    elif i == len(ts) - 1:
        new = ts[-1] + (ts[-1] - ts[-2])
    else:
        by_t = {_to(v, space): g for v, g in zip(values, gaps)}
        nb = ts[i - 1] if by_t[ts[i - 1]] <= by_t[ts[i + 1]] else ts[i + 1]
        new = (tb + nb) / 2
    v = _round(_from(new, space))
    return None if any(math.isclose(v, u, rel_tol=1e-9) for u in values) else v


def best_index(gaps: list[float], ok: list[bool], tol: float = 0.0) -> int:
    """The index of the chosen run: among the runs that succeeded (all runs when none did), those whose gap is
    within ``tol`` of the smallest, the first tried (a rule, not the last digits: ``tol`` is
    :func:`choice_tolerance` in the bench's final choice, 0 while it explores)."""
    pool = [i for i in range(len(gaps)) if ok[i]] or list(range(len(gaps)))
    low = min(gaps[i] for i in pool)
    return min(i for i in pool if gaps[i] <= low + tol * (1 + 1e-9))


def on_edge(values: list[float], chosen: float) -> bool:
    """Whether ``chosen`` is the smallest or the largest value tried (with more than one value)."""
    return len(set(values)) > 1 and chosen in (min(values), max(values))
