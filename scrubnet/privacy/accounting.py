"""Privacy accounting of full-batch noisy gradient descent with Gaussian differential privacy.

Each step of NoisyGD / AdaMix releases a sum whose L2 sensitivity to adding or removing one private
sample is at most the clip threshold τ_t (after projection onto orthonormal directions, which cannot
lengthen a vector), with Gaussian noise of standard deviation σ·τ_t. One step is therefore a Gaussian
mechanism with μ_t = τ_t / (σ·τ_t) = 1/σ, and the adaptive composition of T such steps is

    μ = sqrt(Σ_t μ_t²) = √T / σ        (μ-Gaussian differential privacy).

There is no subsampling, so no amplification and no RDP/moments accountant is involved: the whole run is
one Gaussian mechanism with parameter μ. A μ-GDP mechanism is (ε, δ(ε))-DP for every ε ≥ 0 with the
analytical Gaussian-mechanism curve

    δ(ε; μ) = Φ(μ/2 − ε/μ) − e^ε · Φ(−μ/2 − ε/μ),

which increases with μ and decreases with ε. ``epsilon_of_mu`` inverts it in ε, ``mu_of_epsilon`` in μ, and
``max_steps`` gives the largest T with δ(ε; √T/σ) ≤ δ (for σ = 20, δ = 1e-5 and ε = 0.5, 1, 2, 3, 4, 8 this
is T = 8, 28, 100, 206, 342, 1110).

Hyper-parameter searches (e.g. choosing the learning rate on held-out data) are *not* accounted for here,
as in the method's original evaluation; the MixDP protocol of scrubnet selects them without touching the
private data.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from scrubnet._config import strict_from_dict


def delta_of_epsilon(eps, mu):
    """δ(ε; μ) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ) for μ > 0 (arrays broadcast); δ = 0 where μ = 0.

    The second term is evaluated as exp(ε + log Φ(·)) so that large ε does not overflow.
    """
    from scipy.special import log_ndtr, ndtr  # imported where used (start-up time of every command)

    eps = np.asarray(eps, dtype=np.float64)
    mu = np.asarray(mu, dtype=np.float64)
    safe = np.where(mu > 0, mu, 1.0)
    a = ndtr(safe / 2 - eps / safe)
    b = np.exp(eps + log_ndtr(-safe / 2 - eps / safe))
    out = np.clip(a - b, 0.0, 1.0)
    return np.where(mu > 0, out, 0.0)


def epsilon_of_mu(mu, delta: float, iters: int = 200):
    """The smallest ε ≥ 0 with δ(ε; μ) ≤ ``delta``, for a scalar or an array of μ ≥ 0 (bisection in ε).

    Returns a float for a scalar μ, else an array of the same shape. ε = 0 where μ = 0.
    """
    from scipy.special import ndtri

    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    mu_arr = np.asarray(mu, dtype=np.float64)
    if np.any(mu_arr < 0) or not np.all(np.isfinite(mu_arr)):
        raise ValueError("mu must be finite and non-negative")
    lo = np.zeros_like(mu_arr)
    # δ(ε; μ) ≤ Φ(μ/2 − ε/μ) ≤ δ once ε ≥ μ²/2 + μ·z with z = −Φ⁻¹(δ): a safe upper end
    hi = mu_arr ** 2 / 2 + mu_arr * max(0.0, float(-ndtri(delta))) + 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_small = delta_of_epsilon(mid, mu_arr) > delta
        lo = np.where(too_small, mid, lo)
        hi = np.where(too_small, hi, mid)
    out = np.where(mu_arr > 0, hi, 0.0)
    return float(out) if np.ndim(mu) == 0 else out


def mu_of_epsilon(eps: float, delta: float, iters: int = 200) -> float:
    """The largest μ with δ(ε; μ) ≤ ``delta`` (bisection in μ; δ increases with μ)."""
    _check_target(eps, delta)
    lo, hi = 0.0, 1.0
    while delta_of_epsilon(eps, hi) <= delta:
        hi *= 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        if delta_of_epsilon(eps, mid) <= delta:
            lo = mid
        else:
            hi = mid
    return lo


def max_steps(eps: float, delta: float, sigma: float) -> int:
    """T_max: the largest number of full-batch steps T with δ(ε; √T/σ) ≤ δ (integer bisection).

    Starts from ⌊σ² μ*(ε, δ)²⌋ and checks the integer neighbours on the exact curve, so rounding of μ* can
    never give a T that overshoots the budget.
    """
    _check_target(eps, delta)
    if not sigma > 0:
        raise ValueError(f"sigma must be positive, got {sigma}")

    def ok(t: int) -> bool:
        return t == 0 or float(delta_of_epsilon(eps, math.sqrt(t) / sigma)) <= delta

    lo, hi = 0, max(1, int(math.floor(sigma ** 2 * mu_of_epsilon(eps, delta) ** 2)) + 2)
    while ok(hi):
        hi *= 2
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _check_target(eps: float, delta: float) -> None:
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"epsilon must be a positive number, got {eps}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")


@dataclass
class Accounting:
    """The privacy ledger of one trained model.

    ``mu = √steps / sigma`` (Gaussian DP), ``epsilon`` the (ε, δ) conversion of that μ at ``delta`` (at most
    the target), ``target_epsilon`` what was asked, ``clip_thresholds`` the τ_t of every step (units of the
    per-sample gradient's Frobenius norm). ``public_only`` marks a model that never saw private data
    (μ = ε = 0), ``non_private`` one trained on private data without noise (μ = ε = ∞, stored as None).
    """

    sigma: float | None
    steps: int
    delta: float | None
    target_epsilon: float | None
    mu: float | None
    epsilon: float | None
    clip_thresholds: list[float] = field(default_factory=list)
    mechanism: str = "gaussian-dp"

    @classmethod
    def gaussian(cls, sigma: float, steps: int, delta: float, target_epsilon: float | None,
                 clip_thresholds) -> "Accounting":
        mu = math.sqrt(steps) / sigma
        return cls(sigma=float(sigma), steps=int(steps), delta=float(delta),
                   target_epsilon=None if target_epsilon is None else float(target_epsilon), mu=mu,
                   epsilon=epsilon_of_mu(mu, delta) if steps else 0.0,
                   clip_thresholds=[float(t) for t in clip_thresholds])

    @classmethod
    def public_only(cls, steps: int) -> "Accounting":
        return cls(sigma=None, steps=int(steps), delta=0.0, target_epsilon=None, mu=0.0, epsilon=0.0,
                   mechanism="public-only")

    @classmethod
    def non_private(cls, steps: int) -> "Accounting":
        return cls(sigma=None, steps=int(steps), delta=None, target_epsilon=None, mu=None, epsilon=None,
                   mechanism="non-private")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Accounting":
        return strict_from_dict(cls, d, "accounting")
