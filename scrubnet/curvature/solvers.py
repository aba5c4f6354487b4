"""Linear solvers shared by every curvature-based method.

``conjugate_gradient`` solves ``A x = b`` for a symmetric positive-definite ``A`` given only as a
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


def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, *, x0: Tensor | None = None,
                       tol: float = 1e-6, max_iter: int = 500,
                       precond: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, SolveInfo]:
    """Preconditioned conjugate gradient for ``A x = b`` (A symmetric positive definite).

    Stops when ``‖r‖ ≤ tol·‖b‖`` or after ``max_iter`` iterations. ``b`` may have any shape; ``matvec``
    must accept and return tensors of that shape. Accumulates in the dtype of ``b``.
    """
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - matvec(x) if x0 is not None else b.clone()
    b_norm = float(torch.linalg.vector_norm(b))
    if b_norm == 0.0:
        return torch.zeros_like(b), SolveInfo(0, 0.0, True)
    z = precond(r) if precond is not None else r
    p = z.clone()
    rz = torch.sum(r * z)
    res = float(torch.linalg.vector_norm(r)) / b_norm
    it = 0
    report = current_progress()
    while res > tol and it < max_iter:
        if report is not None:  # the cap is the bar's total: the time remaining is an upper bound
            report(f"CG iterations (cap {max_iter})", it, max_iter)
        ap = matvec(p)
        pap = torch.sum(p * ap)
        if pap <= 0:
            # not positive definite along p (or breakdown): stop with the current iterate
            break
        step = rz / pap
        x = x + step * p
        r = r - step * ap
        it += 1
        res = float(torch.linalg.vector_norm(r)) / b_norm
        if res <= tol:
            break
        z = precond(r) if precond is not None else r
        rz_new = torch.sum(r * z)
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x, SolveInfo(it, res, res <= tol)


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
