"""Exact ML-Forgetting in the primal: the p×p user-weight system factored once, each request a downdate in p-space.

Same quadratic as :mod:`scrubnet.mlforget.dual` (mean MSE to s·onehot + (µ/2)‖w‖²). For a retained set R
of n_R samples, with J_i ∈ R^{c×p} the Jacobian of sample i and r_i = f_{w_c}(x_i) − s·onehot(y_i):

    (A_R + λ_R I) w*(R) = −B_R,    A_R = Σ_{i∈R} J_iᵀ J_i,   B_R = Σ_{i∈R} J_iᵀ r_i,   λ_R = n_R µ.

The dual solves an N·c × N·c system; this one is p × p — the better one when p ≪ N·c (a head or a last
block linearised on many samples).

**Per checkpoint (once).** A_U and B_U over all user data U, and the eigendecomposition A_U = V Λ Vᵀ (the
ridge λ_R = n_R µ changes with every request, the eigenbasis serves every ridge; a Cholesky would be tied
to one ridge, as in the dual).

**Per request.** R = U \\ F with F every sample removed so far: A_R = A_U − Φ_Fᵀ Φ_F (Φ_F the m rows of the
removed samples), B_R = B_U − Φ_Fᵀ r_F, and with G = (A_U + λ_R I)⁻¹ = V diag(1/(Λ + λ_R)) Vᵀ the Woodbury
identity gives

    (A_R + λ_R I)⁻¹ = G + G Φ_Fᵀ (I_m − Φ_F G Φ_Fᵀ)⁻¹ Φ_F G,

so with Z = Vᵀ Φ_Fᵀ (p × m), D = diag(1/(Λ + λ_R)), y = D Vᵀ B_R: w* = −V (y + D Z S⁻¹ Zᵀ y), S = I − Zᵀ D Z
(m × m, SPD because A_R + λ_R I is). Cost: p²m + pm² + m³ per request, no pass over the retained data
(the removed samples' rows only). S's eigenvalues are ≥ λ_R/(λ_R + ‖Φ_F‖²): well conditioned by the ridge.
m grows with every sequential request; once m ≥ p the direct form — A_R = V Λ Vᵀ − Φ_FᵀΦ_F, a p×p Cholesky
of A_R + λ_R I, p²m + p³ — is cheaper, and the request takes it (``PrimalFactor.fit(downdate=...)``).

**Per output block.** When the linearised part is a single ``nn.Linear`` applied last (the head), J_i =
I_c ⊗ φ_iᵀ with φ_i = [h_i; 1] (features of the frozen prefix, :mod:`scrubnet.mlforget.prefix`), so A =
I_c ⊗ ΦᵀΦ: one (d+1)×(d+1) block shared by the c outputs, B a (d+1)×c matrix (c right-hand sides), and
m = |F| rows — the 513×513 ridge regression of a ResNet-18 head.

Everything in float64; the returned weights are cast to the model's dtype. The reported residual is of
the primal system, ‖(A_R + λ_R I) w + B_R‖/‖B_R‖.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from scrubnet.mlforget.certify import solve_rounding_bound
from scrubnet.training.cost import CostEstimate, gemm_seconds
from scrubnet.mlforget.rows import per_sample_jacobian
from scrubnet.models.linearized import LinearizedModel
from scrubnet.models.call import call_functional, floating_to, input_parts


def sample_rows(model: LinearizedModel, x: Tensor, y: Tensor, num_classes: int, target_scale: float,
                block: bool, chunk: int = 256):
    """Yields (Φ, r) per chunk of samples, float64: block → Φ (B, d+1) = [h, 1] and r (B, c); generic →
    Φ (B·c, p) = the stacked per-sample Jacobians (sample-major) and r (B·c, 1)."""
    net = model.base
    params = {n: p.detach().double() for n, p in net.named_parameters()}
    buffers = {n: b.double() if b.is_floating_point() else b for n, b in net.named_buffers()}
    if block:
        for i in range(0, len(x), chunk):
            xb = floating_to(x[i:i + chunk], torch.float64)
            with torch.no_grad():
                f0 = call_functional(net, (params, buffers), xb)
            r = f0 - target_scale * F.one_hot(y[i:i + chunk], num_classes).double()
            phi = xb.reshape(len(xb), -1)
            if len(model.linearized_names) == 2:
                phi = torch.cat([phi, torch.ones(len(xb), 1, dtype=phi.dtype, device=phi.device)], 1)
            yield phi, r
        return
    lin = list(model.linearized_names)
    for i in range(0, len(x), chunk):
        xb = floating_to(x[i:i + chunk], torch.float64)
        j = per_sample_jacobian(net, params, buffers, lin, xb, num_classes).reshape(len(xb) * num_classes, -1)
        with torch.no_grad():
            f0 = call_functional(net, (params, buffers), xb)
        r = (f0 - target_scale * F.one_hot(y[i:i + chunk], num_classes).double()).reshape(-1, 1)
        yield j, r


def weights_from_block(model: LinearizedModel, w: Tensor, block: bool) -> Tensor:
    """The flat user-weight vector (``linearized_names`` order) of the primal solution: block → W (d+1, c)
    to [weight (c, d), bias (c)]; generic → w (p, 1) flattened."""
    if not block:
        return w.reshape(-1)
    parts = [w[:-1].T.reshape(-1)] if len(model.linearized_names) == 2 else [w.T.reshape(-1)]
    if len(model.linearized_names) == 2:
        parts.append(w[-1].reshape(-1))
    return torch.cat(parts)


def primal_size(model: LinearizedModel, block: bool) -> int:
    """q: the side of the factored system (d+1 for the head block, p otherwise)."""
    if block:
        return int(model.delta[0].shape[1]) + (1 if len(model.linearized_names) == 2 else 0)
    return int(model.num_linearized)


@dataclass
class PrimalFactor:
    """A_U = V diag(Λ) Vᵀ and B_U of the user data (module docstring).

    ids (N,), eigvecs V (q, q) float64, eigvals Λ (q,) float64 clamped at 0, rhs B_U (q, k) float64 (k = c for
    the head block, 1 otherwise), block: the per-output block structure, seconds: build times.
    """

    ids: Tensor
    eigvecs: Tensor
    eigvals: Tensor
    rhs: Tensor
    mu: float
    num_classes: int
    target_scale: float
    block: bool
    seconds: dict = field(default_factory=dict)
    source: str = "built"
    # in memory only: A_U = V Λ Vᵀ, and (set, Φ_FᵀΦ_F, Φ_Fᵀr_F) of a removed set (sequential requests add to it;
    # the rows are constant — Jacobians at the base point, base residuals — for one data object, _rows_data)
    _rows_data: object = field(default=None, repr=False, compare=False)
    _a_u: Tensor | None = field(default=None, repr=False, compare=False)
    _removed_gram: tuple | None = field(default=None, repr=False, compare=False)

    TENSOR_NAMES = ("ids", "eigvecs", "eigvals", "rhs")

    def to_tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name).detach().cpu().contiguous() for name in self.TENSOR_NAMES}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], mu: float, num_classes: int, target_scale: float,
                     block: bool) -> "PrimalFactor":
        """The factor held by :meth:`to_tensors`' tensors; ``ValueError`` when they are inconsistent."""
        if set(tensors) != set(cls.TENSOR_NAMES):
            raise ValueError(f"primal factor tensors {sorted(tensors)} are not {sorted(cls.TENSOR_NAMES)}")
        ids, v, lam, b = (tensors[k] for k in cls.TENSOR_NAMES)
        q = int(lam.numel())
        k = int(num_classes) if block else 1
        if (ids.dtype != torch.long or ids.dim() != 1 or v.dtype != torch.float64 or v.shape != (q, q)
                or lam.dtype != torch.float64 or lam.dim() != 1 or b.dtype != torch.float64 or b.shape != (q, k)):
            raise ValueError("primal factor tensors have inconsistent dtypes or shapes")
        return cls(ids, v, lam, b, float(mu), int(num_classes), float(target_scale), bool(block),
                   {"gram_s": 0.0, "eig_s": 0.0}, "file")

    @classmethod
    def build(cls, model: LinearizedModel, x: Tensor, y: Tensor, ids: Tensor, num_classes: int, mu: float,
              target_scale: float, block: bool, chunk: int = 256) -> "PrimalFactor":
        """A_U, B_U over ``x[ids]`` (``x, y`` = all samples, in the solve space) and the eigendecomposition."""
        t0 = time.perf_counter()
        q = primal_size(model, block)
        dev = x.device
        a = torch.zeros(q, q, dtype=torch.float64, device=dev)
        b = torch.zeros(q, num_classes if block else 1, dtype=torch.float64, device=dev)
        for phi, r in sample_rows(model, x[ids], y[ids], num_classes, target_scale, block, chunk):
            a.addmm_(phi.T, phi)
            b.addmm_(phi.T, r)
        a = 0.5 * (a + a.T)
        t1 = time.perf_counter()
        lam, v = torch.linalg.eigh(a)
        t2 = time.perf_counter()
        return cls(ids.clone(), v, lam.clamp_min(0.0), b, float(mu), int(num_classes), float(target_scale),
                   bool(block), {"gram_s": t1 - t0, "eig_s": t2 - t1})

    @property
    def rows(self) -> int:
        return int(self.eigvecs.shape[0])

    def _same_data(self, x) -> None:
        """Forget the kept sums unless ``x`` is the object they were computed on, not edited since."""
        versions = tuple(getattr(t, "_version", 0) for t in input_parts(x))
        if self._rows_data is None or self._rows_data[0] is not x or self._rows_data[1] != versions:
            self._rows_data, self._removed_gram = (x, versions), None

    def removed_sums(self, model: LinearizedModel, x, y: Tensor, removed: Tensor, chunk: int = 256
                     ) -> tuple[Tensor, Tensor]:
        """(Φ_FᵀΦ_F (q, q), Φ_Fᵀr_F (q, k)) of the samples ``removed``. Sequential requests only add samples to
        the removed set, so the sums of the previous call are kept (in memory) and only the rows of the samples
        removed since are computed; any other set starts from zero."""
        self._same_data(x)
        ids = removed.tolist()
        have, gram, rsum = self._removed_gram or (frozenset(), None, None)
        if gram is None or not have <= set(ids):
            have = frozenset()
            gram = torch.zeros(self.rows, self.rows, dtype=torch.float64, device=self.eigvecs.device)
            rsum = torch.zeros_like(self.rhs)
        new = [i for i in ids if i not in have]
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=removed.device)
            gram, rsum = gram.clone(), rsum.clone()
            for phi, r in sample_rows(model, x[idx], y[idx], self.num_classes, self.target_scale, self.block, chunk):
                gram.addmm_(phi.T, phi)
                rsum.addmm_(phi.T, r)
        self._removed_gram = (frozenset(ids), gram, rsum)
        return gram, rsum

    def removed_rows(self, model: LinearizedModel, x: Tensor, y: Tensor, removed: Tensor, chunk: int = 256
                     ) -> tuple[Tensor, Tensor]:
        """(Φ_F, r_F) of the samples ``removed`` (sample-major, as :func:`sample_rows`)."""
        rows = list(sample_rows(model, x[removed], y[removed], self.num_classes, self.target_scale, self.block,
                                chunk))
        return torch.cat([p for p, _ in rows]), torch.cat([r for _, r in rows])

    def fit(self, model: LinearizedModel, x: Tensor, y: Tensor, keep: Tensor, chunk: int = 256,
            dtype: torch.dtype | None = None, downdate: str = "auto") -> tuple[Tensor, dict]:
        """w*(ids[keep]) by a downdate of the factor: (w in ``dtype``, default the model's, info
        with ``relative_residual``, ``removed_rows``, ``primal_rows``, ``primal_downdate``, ``solve_s``,
        ``weight_error_bound`` = ‖residual‖/λ_R ≥ ‖w₆₄ − w*‖ because λ_min(A_R + λ_R I) ≥ λ_R,
        ``float64_error_bound`` = the float64 rounding of that residual,
        :func:`~scrubnet.mlforget.certify.solve_rounding_bound` with k = n_U + 3q + m + 4: accumulation,
        eigendecomposition and residual). ``x, y`` = all samples (solve space).

        ``downdate``: 'woodbury' (module docstring; an m×m Cholesky, m = removed rows: O(q²m + m³)), 'direct'
        (A_R = V Λ Vᵀ − Φ_FᵀΦ_F, then a q×q Cholesky: O(q²m + q³)) or 'auto' — Woodbury while m < q. Sequential
        requests remove rows cumulatively, so after a few requests m passes q and the direct form is the cheap
        one (the same w* up to rounding; the residual below checks either)."""
        t0 = time.perf_counter()
        n_r = int(keep.sum())
        if n_r == 0:
            raise ValueError("no sample left to fit")
        lam_r = n_r * self.mu
        v, ev = self.eigvecs, self.eigvals
        d = (1.0 / (ev + lam_r)).unsqueeze(1)
        removed = self.ids[~keep]
        if downdate not in ("auto", "woodbury", "direct"):
            raise ValueError(f"downdate must be 'auto', 'woodbury' or 'direct', got {downdate!r}")
        m = int(removed.numel()) * (1 if self.block else self.num_classes)
        direct = m > 0 and (downdate == "direct" or (downdate == "auto" and m >= self.rows))
        if direct:   # A_R + λ_R I = A_U − Φ_FᵀΦ_F + λ_R I, formed and factored (q × q)
            if self._a_u is None:
                self._a_u = v @ (ev.unsqueeze(1) * v.T)
            gram, rsum = self.removed_sums(model, x, y, removed, chunk)
            b_r = self.rhs - rsum
            a_r = self._a_u - gram
            a_r = 0.5 * (a_r + a_r.T)
            a_r.diagonal().add_(lam_r)
            w = -torch.cholesky_solve(b_r, torch.linalg.cholesky(a_r))
            res = a_r @ w + b_r                                 # residual of the primal system on R
        else:
            b_r = self.rhs.clone()
            if m:
                phi_f, r_f = self.removed_rows(model, x, y, removed, chunk)
                b_r -= phi_f.T @ r_f
            y_e = d * (v.T @ b_r)                               # D Vᵀ B_R, (q, k)
            if m:
                z = v.T @ phi_f.T                               # (q, m)
                s = torch.eye(z.shape[1], dtype=z.dtype, device=z.device) - z.T @ (d * z)
                s = 0.5 * (s + s.T)
                t = torch.cholesky_solve(z.T @ y_e, torch.linalg.cholesky(s))
                y_e = y_e + d * (z @ t)
            w = -(v @ y_e)
            # residual of the primal system on R: (A_U − Φ_FᵀΦ_F + λ_R I) w + B_R
            res = v @ (ev.unsqueeze(1) * (v.T @ w)) + lam_r * w + b_r
            if m:
                res -= phi_f.T @ (phi_f @ w)
        res_norm = float(torch.linalg.vector_norm(res))
        rel = res_norm / float(torch.linalg.vector_norm(b_r).clamp_min(1e-300))
        # the objective is the primal system / n_R: ‖w − w*‖ ≤ ‖res‖/λ_min(A_R + λ_R I) ≤ ‖res‖/λ_R
        info = {"relative_residual": rel, "removed_rows": int(removed.numel()) * (1 if self.block else
                                                                                   self.num_classes),
                "primal_rows": self.rows, "primal_block": self.block, "solve_s": time.perf_counter() - t0,
                "primal_downdate": "direct" if direct else "woodbury",
                "weight_error_bound": res_norm / lam_r,
                "float64_error_bound": solve_rounding_bound(
                    len(self.ids) * (1 if self.block else self.num_classes) + 3 * self.rows + int(removed.numel())
                    + 4, float(ev.max()) + lam_r, lam_r, float(torch.linalg.vector_norm(w)),
                    float(torch.linalg.vector_norm(b_r)))}
        return weights_from_block(model, w, self.block).to(dtype or model.delta[0].dtype), info


def primal_fit(model: LinearizedModel, x: Tensor, y: Tensor, num_classes: int, mu: float, target_scale: float,
               block: bool, chunk: int = 256) -> tuple[Tensor, dict]:
    """w*(x, y) from scratch in the primal: A, B of (x, y), Cholesky of A + nµI, solve (the retraining yardstick
    of the primal family; never uses a factor)."""
    t0 = time.perf_counter()
    q = primal_size(model, block)
    a = torch.zeros(q, q, dtype=torch.float64, device=x.device)
    b = torch.zeros(q, num_classes if block else 1, dtype=torch.float64, device=x.device)
    for phi, r in sample_rows(model, x, y, num_classes, target_scale, block, chunk):
        a.addmm_(phi.T, phi)
        b.addmm_(phi.T, r)
    t1 = time.perf_counter()
    m = 0.5 * (a + a.T) + len(y) * mu * torch.eye(q, dtype=a.dtype, device=a.device)
    w = -torch.cholesky_solve(b, torch.linalg.cholesky(m))
    res = float(torch.linalg.vector_norm(m @ w + b) / torch.linalg.vector_norm(b).clamp_min(1e-300))
    info = {"solver": "primal", "primal_rows": q, "gram_s": t1 - t0, "factor_s": time.perf_counter() - t1,
            "relative_residual": res, "iterations": 0}
    return weights_from_block(model, w, block).to(model.delta[0].dtype), info


#: float64 GEMMs (the primal's Gram, eigendecomposition and solves) run at about half the float32 rate the cost
#: model's GEMM probe measures
FLOAT64_SLOWDOWN = 2.0


def primal_cost(model: LinearizedModel, x_probe, y_probe: Tensor, num_classes: int, target_scale: float,
                block: bool, n: int, n_request: int, chunk: int = 256) -> CostEstimate:
    """Training a forgettable model in the primal and one sequential request of ``n_request`` samples, in CPU
    seconds, the Jacobian rows priced by measuring them.

    How long one sample's rows take depends on how deep the backward passes must go (the earliest user
    weight), on the hook or per-sample path the network allows and on its framework's overheads, so the rows
    are timed on ``x_probe`` (up to one chunk, ideally a full one) and on an eighth of it, after a warm-up on
    the full probe: a
    chunk of m samples costs a + b·m, and N samples cost ⌈N/chunk⌉·a + N·b. The matrix
    work is priced at the GEMM rate: the Gram ΦᵀΦ and Φᵀr (2·N·c'·q·(q + 1), c' = c rows per sample, 1 for
    the head block), its eigendecomposition (≈ 9q³), and per request the removed rows' Gram (2·k·c'·q²), A_R
    and a Cholesky solve (q³/3 + 6q²), in float64 at :data:`FLOAT64_SLOWDOWN`.

    Parameters
    ----------
    model : LinearizedModel
        The model the rows are computed on: the solve space (``MLState.space``: the linearised suffix after a
        frozen prefix, whose features are computed once and cached, else the whole linearised network).
    x_probe, y_probe : inputs of that space (features after a prefix) and labels of a few samples
    num_classes, target_scale, block : as the primal factor
    n, n_request : int
        Samples N trained on; k removed by one request.
    chunk : int
        The rows' chunk size (:func:`sample_rows`).

    Returns
    -------
    CostEstimate
        ``seconds`` = build + request; ``details``: ``build_seconds``, ``request_seconds``,
        ``rows_seconds_per_sample`` and ``rows_seconds_per_chunk`` (measured), ``request_flops``.
    """
    q = primal_size(model, block)
    rows_per = 1 if block else int(num_classes)
    big = min(len(y_probe), chunk)
    small = max(1, big // 8)

    def timed(m: int) -> float:
        t0 = time.process_time()
        list(sample_rows(model, x_probe[:m], y_probe[:m], num_classes, target_scale, block, chunk))
        return time.process_time() - t0

    timed(big)                                                      # warm-up (first-call allocations)
    t_small, t_big = timed(small), timed(big)
    # one chunk of m samples costs a + b·m: a per chunk (the passes' fixed costs), b per sample
    per_sample = max(t_big - t_small, 0.0) / max(big - small, 1) if big > small else t_big / big
    per_chunk = max(t_big - per_sample * big, 0.0)

    def rows_seconds(m: int) -> float:
        return -(-m // chunk) * per_chunk + m * per_sample

    gram, eig = 2.0 * n * rows_per * q * (q + 1.0), 9.0 * float(q) ** 3
    downdate = 2.0 * n_request * rows_per * float(q) ** 2 + float(q) ** 3 / 3.0 + 6.0 * float(q) ** 2
    build = rows_seconds(n) + FLOAT64_SLOWDOWN * gemm_seconds(gram + eig)
    request = rows_seconds(n_request) + FLOAT64_SLOWDOWN * gemm_seconds(downdate)
    peak = 8 * (3 * q * q + 256 * rows_per * q)
    return CostEstimate("forgettable-primal", gram + eig + downdate, build + request, int(peak), 0.0,
                        {"build_seconds": build, "request_seconds": request, "rows_seconds_per_sample": per_sample,
                         "rows_seconds_per_chunk": per_chunk, "request_flops": downdate})
