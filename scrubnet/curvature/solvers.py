"""Linear solvers shared by every curvature-based method.

:func:`cg_iterate` is the one conjugate-gradient loop; ``conjugate_gradient`` (relative-residual stop) and
``certified_cg`` (stop at a proven error bound) decide only when it stops. ``conjugate_gradient`` solves ``A x = b`` for a symmetric positive-definite ``A`` given only as a
function ``matvec(v) = A v`` (a Gauss–Newton-, Fisher- or NTK-vector product); it never forms ``A``.
``cholesky_solve_jitter`` solves a dense SPD system, adding jitter to the diagonal when the
factorisation fails, and reports the jitter it used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from scrubnet.curvature.progress import current_progress


@dataclass
class SolveInfo:
    """What a solve did: iterations, final relative residual ‖b − A x‖/‖b‖, whether it met ``tol``,
    and the diagonal jitter added (Cholesky only)."""

    iterations: int
    relative_residual: float
    converged: bool
    jitter: float = 0.0

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}iterations": float(self.iterations),
                f"{prefix}relative_residual": float(self.relative_residual),
                f"{prefix}converged": float(self.converged),
                f"{prefix}jitter": float(self.jitter)}


@dataclass
class CGState:
    """The iterate of :func:`cg_iterate` after ``it`` steps: x, residual r = b − A x (recursive), z = P r,
    search direction p, rz = rᵀz, the last step's α and β, the products used, and why it ended."""

    x: Tensor
    r: Tensor
    z: Tensor
    p: Tensor
    rz: Tensor
    it: int = 0
    alpha: Tensor | None = None
    beta: Tensor | None = None
    matvecs: int = 0
    stopped: bool = False      # ``stop`` said so
    breakdown: bool = False    # pᵀAp ≤ 0: A not positive definite along p


def cg_iterate(matvec: Callable[[Tensor], Tensor], b: Tensor, stop: Callable[[CGState], bool], *,
               max_iter: int, x0: Tensor | None = None,
               precond: Callable[[Tensor], Tensor] | None = None) -> CGState:
    """The one preconditioned conjugate-gradient loop of scrubnet, for ``A x = b`` (A SPD, given as
    ``matvec``). ``stop(state)`` is asked before the first step and after every step (it sees α, β and the
    new residual, and may spend products of its own, counted in ``state.matvecs`` by the caller); the loop
    also ends after ``max_iter`` steps or on a breakdown (pᵀAp ≤ 0, the current iterate kept). Scalars are
    0-dim tensors in the dtype of ``b``."""
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    st = CGState(x=x, r=b.clone(), z=b, p=b, rz=torch.zeros((), dtype=b.dtype, device=b.device))
    if x0 is not None:
        st.r = b - matvec(x)
        st.matvecs += 1
    st.z = precond(st.r) if precond is not None else st.r
    st.p = st.z.clone()
    st.rz = torch.sum(st.r * st.z)
    if stop(st):
        st.stopped = True
        return st
    report = current_progress()
    while st.it < max_iter:
        if report is not None:  # the cap is the bar's total: the time remaining is an upper bound
            report(f"CG iterations (cap {max_iter})", st.it, max_iter)
        ap = matvec(st.p)
        st.matvecs += 1
        pap = torch.sum(st.p * ap)
        if pap <= 0:
            st.breakdown = True
            break
        st.alpha = st.rz / pap
        st.x = st.x + st.alpha * st.p
        st.r = st.r - st.alpha * ap
        st.it += 1
        st.z = precond(st.r) if precond is not None else st.r
        rz_new = torch.sum(st.r * st.z)
        st.beta = rz_new / st.rz
        if stop(st):
            st.stopped = True
            break
        st.p = st.z + st.beta * st.p
        st.rz = rz_new
    return st


def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Tensor | None = None,
                       tol: float = 1e-6, max_iter: int = 500,
                       precond: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, SolveInfo]:
    """Preconditioned conjugate gradient for ``A x = b`` (A symmetric positive definite).

    Stops when ``‖r‖ ≤ tol·‖b‖`` or after ``max_iter`` iterations. ``b`` may have any shape; ``matvec``
    must accept and return tensors of that shape. Accumulates in the dtype of ``b``.
    """
    b_norm = float(torch.linalg.vector_norm(b))
    if b_norm == 0.0:
        return torch.zeros_like(b), SolveInfo(0, 0.0, True)
    st = cg_iterate(matvec, b, lambda s: float(torch.linalg.vector_norm(s.r)) / b_norm <= tol,
                    max_iter=max_iter, x0=x0, precond=precond)
    res = float(torch.linalg.vector_norm(st.r)) / b_norm
    return st.x, SolveInfo(st.it, res, res <= tol)


def certified_cg(matvec, b: Tensor, *, lam_min: float, target: float, max_iter: int, precond=None,
                 precond_lam_min: float = 1.0) -> tuple[Tensor, dict]:
    """Preconditioned CG on A x = b (A ⪰ ``lam_min``·I) from 0 that stops as soon as a proven bound on the
    error ‖x_k − A⁻¹b‖₂ of the current iterate is ≤ ``target``.

    The bound: ‖e_k‖₂² ≤ ‖e_k‖²_A/λ_min(A), and ‖e_k‖²_A ≤ γ_k^{(ν)} r_kᵀz_k, the Gauss–Radau upper bound of
    CG (Golub & Meurant; the recursion of Meurant & Tichý):

        γ_0^{(ν)} = 1/ν,   γ_{k+1}^{(ν)} = (γ_k^{(ν)} − α_k) / (ν(γ_k^{(ν)} − α_k) + β_{k+1}),

    α_k, β_{k+1} the CG coefficients, valid for any 0 < ν ≤ λ_min(P⁻¹A) (P the preconditioner;
    ``precond_lam_min`` = a lower bound of λ_min(P⁻¹), 1 without one: ν = lam_min·precond_lam_min). It is the
    quadrature bound of rᵀA⁻¹r with a node prescribed at ν, always ≤ ‖r‖²/ν — so never looser than the plain
    ‖r_k‖/λ_min, and typically several times tighter (it uses the Ritz values CG has already found instead of
    assuming the whole residual sits at the smallest eigenvalue). The recursive residual drifts from the true
    one in finite precision: when a bound is accepted the true residual b − A x_k is formed (one product) and
    ‖r_true − r_k‖/λ_min is added (A⁻¹ of the gap). Returns (x, info with ``iterations``,
    ``weight_error_bound``, ``residual_bound`` (the plain ‖b − A x‖/λ_min of the returned x), ``converged``,
    ``matvecs``). The iteration is :func:`cg_iterate`'s; this function only decides when to stop."""
    nu = lam_min * precond_lam_min
    acc = {"gam_nu": 1.0 / nu, "bound": 0.0, "plain": 0.0, "extra": 0}

    def stop(st: CGState) -> bool:
        if st.it == 0:
            acc["plain"] = acc["bound"] = float(torch.linalg.vector_norm(st.r)) / lam_min
            return acc["plain"] <= target or float(st.rz) == 0.0
        alpha, beta = float(st.alpha), float(st.beta)
        acc["gam_nu"] = (acc["gam_nu"] - alpha) / (nu * (acc["gam_nu"] - alpha) + beta)
        energy = max(acc["gam_nu"], 0.0) * float(torch.sum(st.r * st.z))   # γ·r_kᵀz_k ≥ ‖e_k‖²_A
        bound = min((energy / lam_min) ** 0.5, float(torch.linalg.vector_norm(st.r)) / lam_min)
        acc["bound"] = bound
        if bound <= target:
            r_true = b - matvec(st.x)
            acc["extra"] += 1
            acc["plain"] = float(torch.linalg.vector_norm(r_true)) / lam_min
            acc["bound"] = min(bound + float(torch.linalg.vector_norm(r_true - st.r)) / lam_min, acc["plain"])
            return acc["bound"] <= target
        return False

    st = cg_iterate(matvec, b, stop, max_iter=max_iter, precond=precond)
    if st.it == 0 and st.stopped:
        return st.x, {"iterations": 0, "weight_error_bound": acc["plain"], "residual_bound": acc["plain"],
                      "converged": True, "matvecs": 0}
    if not st.stopped and not st.breakdown:
        acc["plain"] = float(torch.linalg.vector_norm(b - matvec(st.x))) / lam_min
        acc["extra"] += 1
    return st.x, {"iterations": st.it, "weight_error_bound": acc["bound"], "residual_bound": acc["plain"],
                  "converged": acc["bound"] <= target, "matvecs": st.matvecs + acc["extra"]}


def cholesky_solve_jitter(a: Tensor, b: Tensor, *, jitter: float = 0.0, max_tries: int = 8,
                          factor: float = 10.0) -> tuple[Tensor, SolveInfo]:
    """Solve ``a x = b`` for a dense symmetric PSD ``a`` (n×n) by Cholesky.

    If the factorisation fails, add ``j·mean(diag(a))·I`` with ``j`` = 1e-10, 1e-9, … (``factor``
    apart, at most ``max_tries`` times) and report the absolute jitter used in ``SolveInfo.jitter``.
    ``b`` is (n,) or (n, k).
    """
    n = a.shape[0]
    scale = float(torch.diagonal(a).abs().mean()) or 1.0
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    j = jitter
    for _ in range(max_tries + 1):
        chol, info = torch.linalg.cholesky_ex(a + j * eye if j > 0 else a)
        if int(info) == 0:
            bb = b.unsqueeze(-1) if b.ndim == 1 else b
            x = torch.cholesky_solve(bb, chol)
            x = x.squeeze(-1) if b.ndim == 1 else x
            res = float(torch.linalg.vector_norm(a @ x - b) / max(float(torch.linalg.vector_norm(b)), 1e-300))
            return x, SolveInfo(1, res, True, j)
        j = 1e-10 * scale if j == 0 else j * factor
    raise torch.linalg.LinAlgError(f"Cholesky failed even with jitter {j:.3g} on a {n}×{n} matrix")
