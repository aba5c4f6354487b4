"""Exact ML-Forgetting in the dual: the user-data Gram built once per checkpoint, a Schur complement per request.

The user weights enter the Mixed-Linear model linearly and the loss is the mean squared error, so the
retain objective (:mod:`scrubnet.mlforget.objective`) is an exact quadratic in w_u. For a set R of n_R
samples, with J_R ∈ R^{n_R c × p} the stacked Jacobian rows of the core network at w_c (sample-major:
row i·c + k is ∂f_k(x_i)/∂w_u) and r_R = f_{w_c}(x_R) − s·onehot(y_R) ∈ R^{n_R c}:

    L_R(w) = (1/n_R) ½‖r_R + J_R w‖² + (µ/2)‖w‖²
    ⇒ (J_Rᵀ J_R + λ_R I) w* = −J_Rᵀ r_R,   λ_R = n_R µ              (normal equations × n_R)
    ⇒ w*(R) = −J_Rᵀ a_R,   (K_RR + λ_R I) a_R = r_R,   K = J Jᵀ       (push-through identity)

so the exact minimiser — the retrained user weights — is one VJP of dual coefficients a_R through the core
network. An exact Newton step from any w lands on w*(R) (the objective is quadratic), so a forgetting
request *is* w' = w*(D_r).

**Per checkpoint (once).** K_UU over all user data U (Nc × Nc, float64, by
:func:`scrubnet.curvature.ntk.ntk_gram` on a float64 copy of the core network whose only trainable
parameters are the linearised ones) and its eigendecomposition K_UU = Q Λ Qᵀ. Training w_u is the request
"remove nothing".

**Per request.** Removing the samples F (all forgotten so far) leaves R = U \\ F. With
G = (K_UU + λ_R I)⁻¹ = Q diag(1/(Λ + λ_R)) Qᵀ — the eigendecomposition serves every ridge — the inverse of
the retained block is the Schur complement of the removed one,

    (K_RR + λ_R I)⁻¹ = G_RR − G_RF G_FF⁻¹ G_FR,

so with r̃ = r on R and 0 on F: u = G r̃, s = G_FF⁻¹ u_F, a = u − G[:, F] s (then a_F = 0 exactly and
a_R = (K_RR + λ_R I)⁻¹ r_R). Cost: three products with Q (Nc² each), one |F|c × |F|c Cholesky, and one VJP
over D_r. Sequential requests compose: F accumulates and the factor is never modified (the same answer as
successive Cholesky downdates, without their error accumulation).

Why an eigendecomposition and not a Cholesky factor of K_UU + λ_U I with row downdates: the objective is a
*mean*, so the ridge λ_R = n_R µ changes with every request. A Cholesky factor is tied to one ridge; after
a downdate it factors K_RR + λ_U I, and the difference (n_U − n_R)µ·I is full rank, which costs several
correction iterations per request (each a pass over an Nc² matrix). The eigendecomposition costs more
once (about 10× a Cholesky) and 3 passes per request; the measured trade-off is in docs/decisions/mlforgetting.md,
"ML-Forgetting solvers".

**Retraining from scratch (the yardstick).** :func:`dual_fit` — the Gram of D_r, a Cholesky of
K_RR + λ_R I, one VJP: the best exact solver when Nc is moderate (it never needs the factor above).

Precision: Gram, eigendecomposition, solves and the VJP in float64 whatever the model's dtype; the answer is
cast back to the model's dtype. Reported residuals are of the dual system ‖(K_RR + λ_R I) a_R − r_R‖/‖r_R‖.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.curvature.ntk import DEFAULT_BUDGET, jacobian_vjp, ntk_gram
from scrubnet.models.linearized import LinearizedModel
from scrubnet.models.call import call_model, floating_to


def jacobian_network(model: LinearizedModel) -> nn.Module:
    """A float64 copy of the frozen core network of ``model`` whose trainable parameters are exactly the
    linearised ones (the user weights), in eval mode: its Jacobian is the J of the ML model."""
    net = copy.deepcopy(model.base).double().eval()
    lin = set(model.linearized_names)
    for name, p in net.named_parameters():
        p.requires_grad_(name in lin)
    return net


def base_residuals(net: nn.Module, x: Tensor, y: Tensor, num_classes: int, target_scale: float,
                   batch_size: int = 1024) -> Tensor:
    """r = f_{w_c}(x) − s·onehot(y), (N, c) float64 (no dependence on the user weights)."""
    outs = []
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            outs.append(call_model(net, floating_to(x[i:i + batch_size], torch.float64)))
    f0 = torch.cat(outs)
    return f0 - target_scale * F.one_hot(y, num_classes).double()


def weights_from_coefficients(net: nn.Module, x: Tensor, a: Tensor, batch_size: int = 256) -> Tensor:
    """w = −Jᵀa: one VJP through the core network; x (N, ...), a (N, c) → (p,) float64."""
    return -jacobian_vjp(net, floating_to(x, torch.float64), a, batch_size=batch_size)


def dual_fit(model: LinearizedModel, x: Tensor, y: Tensor, num_classes: int, mu: float,
             target_scale: float = 5.0, memory_budget_bytes: int = DEFAULT_BUDGET) -> tuple[Tensor, dict]:
    """w*(x, y) from scratch in the dual: Gram K of (x, y), Cholesky of K + nµI, one VJP.

    Returns (w in the model's dtype, info with ``gram_s``, ``factor_s``, ``vjp_s``, ``dual_rows`` and
    ``relative_residual`` of the dual system)."""
    n = len(y)
    net = jacobian_network(model)
    t0 = time.perf_counter()
    k = ntk_gram(net, floating_to(x, torch.float64), memory_budget_bytes=memory_budget_bytes)
    t1 = time.perf_counter()
    r = base_residuals(net, x, y, num_classes, target_scale).reshape(-1, 1)
    lam = n * mu
    m = k + lam * torch.eye(k.shape[0], dtype=k.dtype)
    chol = torch.linalg.cholesky(m)
    a = torch.cholesky_solve(r, chol)
    res = float(torch.linalg.vector_norm(m @ a - r) / torch.linalg.vector_norm(r).clamp_min(1e-300))
    t2 = time.perf_counter()
    w = weights_from_coefficients(net, x, a.reshape(n, num_classes))
    t3 = time.perf_counter()
    info = {"solver": "dual", "dual_rows": int(k.shape[0]), "gram_s": t1 - t0, "factor_s": t2 - t1,
            "vjp_s": t3 - t2, "relative_residual": res, "iterations": 0}
    return w.to(model.delta[0].dtype), info


@dataclass
class DualFactor:
    """The user-data Gram of one checkpoint, eigendecomposed: K_UU = Q diag(Λ) Qᵀ (module docstring).

    ids: (N,) positions in D of its rows' samples (rows i·c … i·c + c − 1 belong to ids[i]);
    eigvecs Q: (N·c, N·c) float64; eigvals Λ: (N·c,) float64, clamped at 0; residuals r: (N, c) float64;
    seconds: build times (``gram_s``, ``eig_s``).
    """

    ids: Tensor
    eigvecs: Tensor
    eigvals: Tensor
    residuals: Tensor
    mu: float
    num_classes: int
    seconds: dict = field(default_factory=dict)
    net: nn.Module | None = None  # the float64 Jacobian network (:func:`jacobian_network`), kept for the VJPs
    source: str = "built"  # "built" in this process, or "file" (:meth:`from_tensors`)

    #: names of the tensors :meth:`to_tensors` returns (the whole factor; ``mu`` and ``num_classes`` travel
    #: as the file's metadata)
    TENSOR_NAMES = ("ids", "eigvecs", "eigvals", "residuals")

    def to_tensors(self) -> dict[str, Tensor]:
        """The factor as contiguous CPU tensors (ids int64, the rest float64), for a safetensors file."""
        return {name: getattr(self, name).detach().cpu().contiguous() for name in self.TENSOR_NAMES}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], mu: float, num_classes: int) -> "DualFactor":
        """The factor held by :meth:`to_tensors`' tensors; ``ValueError`` when they are not a consistent factor
        (names, dtypes, shapes: ids (N,), eigvecs (N·c, N·c), eigvals (N·c,), residuals (N, c))."""
        if set(tensors) != set(cls.TENSOR_NAMES):
            raise ValueError(f"factor tensors {sorted(tensors)} are not {sorted(cls.TENSOR_NAMES)}")
        ids, q, lam, r = (tensors[k] for k in cls.TENSOR_NAMES)
        n, c = int(ids.numel()), int(num_classes)
        if (ids.dtype != torch.long or ids.dim() != 1 or q.dtype != torch.float64 or q.shape != (n * c, n * c)
                or lam.dtype != torch.float64 or lam.shape != (n * c,) or r.dtype != torch.float64
                or r.shape != (n, c)):
            raise ValueError("factor tensors have inconsistent dtypes or shapes")
        return cls(ids, q, lam, r, float(mu), c, {"gram_s": 0.0, "eig_s": 0.0}, None, "file")

    @classmethod
    def build(cls, model: LinearizedModel, x: Tensor, y: Tensor, ids: Tensor, num_classes: int, mu: float,
              target_scale: float = 5.0, memory_budget_bytes: int = DEFAULT_BUDGET) -> "DualFactor":
        """Gram of the samples ``x[ids]`` (sample-major rows) and its eigendecomposition. ``x, y`` = all of D."""
        net = jacobian_network(model)
        xs = floating_to(x[ids], torch.float64)
        t0 = time.perf_counter()
        k = ntk_gram(net, xs, memory_budget_bytes=memory_budget_bytes)
        t1 = time.perf_counter()
        lam, q = torch.linalg.eigh(k)
        del k
        t2 = time.perf_counter()
        r = base_residuals(net, xs, y[ids], num_classes, target_scale)
        return cls(ids.clone(), q, lam.clamp_min(0.0), r, float(mu), int(num_classes),
                   {"gram_s": t1 - t0, "eig_s": t2 - t1}, net)

    @property
    def rows(self) -> int:
        return int(self.eigvecs.shape[0])

    def nbytes(self) -> int:
        return self.eigvecs.numel() * self.eigvecs.element_size()

    def coefficients(self, keep: Tensor) -> tuple[Tensor, dict]:
        """Dual coefficients of R = ids[keep]: a (N, c) float64 with a = (K_RR + λ_R I)⁻¹ r_R on R, 0 elsewhere.

        ``keep``: (N,) bool. Returns (a, info) with ``relative_residual`` of the dual system on R and
        ``removed_rows`` = |F|·c."""
        c = self.num_classes
        keep_rows = keep.repeat_interleave(c)
        n_r = int(keep.sum())
        if n_r == 0:
            raise ValueError("no sample left to fit")
        lam_r = n_r * self.mu
        q, ev = self.eigvecs, self.eigvals
        d = 1.0 / (ev + lam_r)
        r_t = torch.where(keep_rows, self.residuals.reshape(-1), torch.zeros((), dtype=q.dtype))
        z = d * (q.T @ r_t)                       # Qᵀ u, u = G r̃
        removed = torch.nonzero(~keep_rows).flatten()
        if removed.numel():
            q_f = q[removed]                      # (m, Nc)
            g_ff = (q_f * d) @ q_f.T              # G_FF (m × m), SPD
            g_ff = 0.5 * (g_ff + g_ff.T)
            u_f = q_f @ z                         # u_F
            s = torch.cholesky_solve(u_f.unsqueeze(1), torch.linalg.cholesky(g_ff)).squeeze(1)
            z = z - d * (q_f.T @ s)               # Qᵀ a, a = u − G[:, F] s
        a = q @ z
        ka = q @ (ev * z)
        a = torch.where(keep_rows, a, torch.zeros((), dtype=a.dtype))
        res_vec = torch.where(keep_rows, ka + lam_r * a - r_t, torch.zeros((), dtype=a.dtype))
        rel = float(torch.linalg.vector_norm(res_vec) / torch.linalg.vector_norm(r_t).clamp_min(1e-300))
        return a.reshape(-1, c), {"relative_residual": rel, "removed_rows": int(removed.numel()),
                                  "dual_rows": self.rows, "coefficient_norm": float(torch.linalg.vector_norm(a))}

    def fit(self, model: LinearizedModel, x: Tensor, keep: Tensor, dtype: torch.dtype | None = None
            ) -> tuple[Tensor, dict]:
        """w*(ids[keep]) = −J_Rᵀ a_R: (w in ``dtype``, default the model's, info). ``x`` = all of D."""
        t0 = time.perf_counter()
        a, info = self.coefficients(keep)
        t1 = time.perf_counter()
        sel = self.ids[keep]
        net = self.net if self.net is not None else jacobian_network(model)
        w = weights_from_coefficients(net, x[sel], a[keep])
        info.update({"solve_s": t1 - t0, "vjp_s": time.perf_counter() - t1})
        return w.to(dtype or model.delta[0].dtype), info
