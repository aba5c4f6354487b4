"""Certificates of ML-Forgetting requests in the arithmetic the weights are stored in.

A request's certificate bounds KL(N(w_s, σ²I) ‖ N(w*, σ²I)) = ‖w_s − w*‖²/(2σ²), with w_s the user weights
*as stored* (before the noise; float32 for a float32 network) and w* the exact minimiser of the retain
objective — the quadratic whose Jacobian rows and base residuals the library evaluates in float64 from the
stored network (for a frozen prefix: from its features, computed in the network's dtype as at inference).
The solvers work in float64 and the answer w₆₄ is then cast to the network's dtype, so

    ‖w_s − w*‖ ≤ ‖w_s − w₆₄‖ + ‖w₆₄ − w*‖ ≤ ρ + ε_solve + ε_fp,

* ρ = ‖fl(w₆₄) − w₆₄‖, the storage rounding, computed exactly (:func:`rounding_error`; 0 for float64);
* ε_solve: the solver's residual bound of w₆₄ — ‖res‖/λ_min of its system (primal, dual, certified CG);
* ε_fp = γ_k (L‖w₆₄‖ + ‖b‖)/λ_min (:func:`solve_rounding_bound`): the float64 rounding in forming that
  residual, normwise (γ_k = ku/(1 − ku), u = 2⁻⁵³, k the longest inner product, L ≥ λ_max of the system).
  It is 10⁻¹⁶-relative: it never decides a certificate, the float32 term ρ (~10⁻⁸-relative) does.

The cast to the nearest float32 is the closest float32 vector to w₆₄ coordinate by coordinate, so ρ is (up
to ε_solve) the least distance any float32 weights can have from w*: a budget below ρ²/(2σ²) cannot be met
in float32 and such a request is refused (``ValueError``, nothing applied), whichever solver ran.

:func:`residual_bound` is an independent a-posteriori check that does not trust the solver at all: the
gradient of the retain objective at the stored weights, evaluated in float64 over the remaining data (one
JVP and two VJPs per chunk), and ‖w_s − w*‖ ≤ ‖g(w_s)‖/µ because H ⪰ µI. It is valid however w_s was
computed, but loose by up to κ(H) (rounding errors spread over every eigendirection of H).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from scrubnet.mlforget.objective import UserObjective

U64 = 2.0 ** -53


def gamma(k: int, u: float = U64) -> float:
    """γ_k = ku/(1 − ku), the standard bound on the relative rounding of a k-term sum or inner product."""
    ku = k * u
    if ku >= 1.0:
        return float("inf")
    return ku / (1.0 - ku)


def rounding_error(w_hi: Tensor, w_stored: Tensor) -> float:
    """‖w_stored − w_hi‖₂ rounded up: ``w_hi`` the float64 answer, ``w_stored`` (p,) its cast (any dtype).

    The float64 difference is exact (the cast is to the nearest value, within a factor 2: Sterbenz); the
    sum of squares and the root add at most γ_{p+2} relative, which is added."""
    d = w_stored.detach().double() - w_hi.detach().double()
    if not bool(d.any()):
        return 0.0
    n = float(torch.linalg.vector_norm(d))
    return n * (1.0 + gamma(d.numel() + 2))


def rounding_bound_a_priori(norm_hi: float, dtype: torch.dtype, p: int) -> float:
    """A bound on ‖fl(w) − w‖₂ before w is known, from a bound ``norm_hi`` ≥ ‖w‖: u‖w‖ + √p·η/2 (u the
    unit roundoff of ``dtype``, η its smallest subnormal, for coordinates that underflow); 0 for float64."""
    if dtype == torch.float64:
        return 0.0
    fi = torch.finfo(dtype)
    eta = fi.smallest_normal * fi.eps  # the smallest subnormal
    return (fi.eps / 2.0) * norm_hi * (1.0 + 1e-6) + math.sqrt(p) * eta / 2.0


def solve_rounding_bound(k: int, lam_max: float, lam_min: float, w_norm: float, b_norm: float) -> float:
    """ε_fp = γ_k (L‖w‖ + ‖b‖)/λ_min: the float64 rounding of a residual b + A w with λ_max(A) ≤ ``lam_max``,
    converted to weights by λ_min(A) ≥ ``lam_min`` (module docstring)."""
    return gamma(int(k)) * (lam_max * w_norm + b_norm) / lam_min


def certificate(*, solve_bound: float | None, fp_bound: float, rounding: float, sigma: float,
                budget: float | None, solver: str, residual: float, stored_dtype: torch.dtype,
                posterior: float | None = None) -> dict:
    """The request's certificate (a JSON-able dict).

    Parameters
    ----------
    solve_bound : float or None
        ε_solve ≥ ‖w₆₄ − w*‖ (weight units); None when the solver proves nothing (SGD).
    fp_bound : float
        ε_fp, the float64 rounding of the residual behind ``solve_bound``.
    rounding : float
        ρ = ‖w_s − w₆₄‖, the storage rounding (:func:`rounding_error`).
    sigma, budget : float
        The noise std σ and the budget in nats (None: no budget).
    solver, residual, stored_dtype
        Recorded as they are (the solver's name, its relative residual, the dtype of w_s).
    posterior : float, optional
        :func:`residual_bound` of w_s when it was computed; the certificate takes the smaller bound.

    Returns
    -------
    dict
        ``weight_error_bound`` ε ≥ ‖w_s − w*‖ (= ε_solve + ε_fp + ρ, or the posterior bound when smaller),
        ``kl_bound_nats`` = ε²/(2σ²) (``inf`` at σ = 0 unless ε = 0, nan without a proof), ``within_budget``
        (None without a budget), the parts (``solve_error_bound``, ``float64_error_bound``,
        ``rounding_error``, ``posterior_weight_error_bound``), ``sigma``, ``budget_nats``, ``solver``,
        ``residual``, ``stored_dtype``.
    """
    eps = float("nan") if solve_bound is None else float(solve_bound) + float(fp_bound) + float(rounding)
    if posterior is not None and posterior == posterior and not eps <= posterior:
        eps = float(posterior)
    if eps != eps:
        kl = float("nan")
    elif sigma > 0:
        kl = eps * eps / (2.0 * sigma * sigma)
    else:
        kl = 0.0 if eps == 0 else float("inf")
    return {"kl_bound_nats": kl, "sigma": float(sigma), "weight_error_bound": eps,
            "solve_error_bound": float("nan") if solve_bound is None else float(solve_bound),
            "float64_error_bound": float(fp_bound), "rounding_error": float(rounding),
            "posterior_weight_error_bound": None if posterior is None else float(posterior),
            "stored_dtype": str(stored_dtype).replace("torch.", ""), "residual": float(residual),
            "budget_nats": budget, "solver": solver,
            "within_budget": None if budget is None else bool(kl <= budget)}


def stored_certificate(info, w64: Tensor | None, w_stored: Tensor, sigma: float, budget: float | None,
                       posterior: float | None = None) -> dict:
    """:func:`certificate` of a request's stored weights from its step.

    Parameters
    ----------
    info : StepInfo
        The step (``solver``, ``relative_residual``, ``extra['weight_error_bound']`` = ε_solve and
        ``extra['float64_error_bound']`` = ε_fp).
    w64 : Tensor or None
        (p,) the solver's float64 answer; None for the SGD step, which proves nothing.
    w_stored : Tensor
        (p,) the weights as stored (its cast to the network's dtype).
    sigma, budget, posterior
        As in :func:`certificate`.
    """
    ex = info.extra
    rho = rounding_error(w64, w_stored) if w64 is not None else 0.0
    return certificate(solve_bound=ex.get("weight_error_bound") if w64 is not None else None,
                       fp_bound=ex.get("float64_error_bound", 0.0), rounding=rho, sigma=sigma, budget=budget,
                       solver=info.solver, residual=info.relative_residual, stored_dtype=w_stored.dtype,
                       posterior=posterior)


def refusal(cert: dict) -> str:
    """The ``ValueError`` message of a request whose certificate misses its budget (nothing is applied)."""
    sigma, rho = cert["sigma"], cert["rounding_error"]
    floor = rho * rho / (2.0 * sigma * sigma) if sigma > 0 else float("inf")
    return (f"the request cannot meet its budget of {cert['budget_nats']} nats: its proven bound is "
            f"{cert['kl_bound_nats']:.3g} nats at σ = {sigma:g} (‖w − w*‖ ≤ {cert['weight_error_bound']:.3g}, of "
            f"which {rho:.3g} is the rounding of the stored {cert['stored_dtype']} weights: {floor:.3g} nats "
            "that no weights in that dtype can avoid); raise σ or the budget, or use a float64 network. "
            "Nothing was applied")


@torch.no_grad()
def residual_bound(obj: UserObjective, w_stored: Tensor) -> tuple[float, dict]:
    """A-posteriori bound on ‖w_s − w*(obj)‖ from the stored weights alone (module docstring).

    Parameters
    ----------
    obj : UserObjective
        The retain objective on a float64 ML module (:meth:`MLState.objective64` on the remaining data).
    w_stored : Tensor
        (p,) the weights as stored, any dtype (cast exactly to float64).

    Returns
    -------
    (bound, info)
        bound = (‖g‖ + ε_fp)/µ with g = g(w_s) in float64 and ε_fp = γ_k(‖a‖ + ‖b‖ + µ‖w_s‖), a = Jᵀ(f₀ − t)/n,
        b = JᵀJw_s/n the two parts whose sum cancels (k = chunk·c + p, the longest sum); info has
        ``gradient_norm``, ``float64_error`` and ``products`` (JVP/VJP passes over the data: 3).
    """
    w = w_stored.detach().double()
    a = torch.zeros_like(w)
    b = torch.zeros_like(w)
    for i in range(0, obj.n, obj.chunk):
        xb, yb = obj.x[i:i + obj.chunk], obj.y[i:i + obj.chunk]
        f0, jv = obj.model.output_and_jvp(xb, w)
        a += obj.model.vjp(xb, f0 - obj.targets(yb, f0.dtype))
        b += obj.model.vjp(xb, jv)
    a, b = a / obj.n, b / obj.n
    g = a + b + obj.mu * w
    k = min(obj.chunk, obj.n) * obj.num_classes + w.numel() + -(-obj.n // obj.chunk) + 3
    fp = gamma(k) * (float(torch.linalg.vector_norm(a)) + float(torch.linalg.vector_norm(b))
                     + obj.mu * float(torch.linalg.vector_norm(w)))
    gn = float(torch.linalg.vector_norm(g))
    return (gn + fp) / obj.mu, {"gradient_norm": gn, "float64_error": fp, "products": 3}
