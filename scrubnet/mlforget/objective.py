"""The user-weight objective of the Mixed-Linear model and its exact, matrix-free derivatives.

Mixed-Linear model (thesis eq. 6.5): f^ML(x) = f_{w_c}(x) + J(x)·w_u, J(x) = ∂f_w(x)/∂w at the core weights
w_c (a :class:`~scrubnet.models.linearized.LinearizedModel` whose tangent Δw *is* w_u).

One normalisation everywhere (docs/decisions/mlforgetting.md, "ML-Forgetting"; the thesis mixes a mean in 6.8 with a sum in 6.10):

    L_D(w_u) = (1/|D|) Σ_{(x,y)∈D} ½‖f_{w_c}(x) + J(x) w_u − s·onehot(y)‖² + (µ/2)‖w_u‖²     (s = 5)
    g_D(w_u) = (1/|D|) Σ J(x)ᵀ (f^ML(x) − s·onehot(y)) + µ w_u
    H_D      = (1/|D|) Σ J(x)ᵀ J(x) + µ I                      (constant: the model is linear in w_u)

Products with H are one JVP (J v) and one VJP (Jᵀ u) per chunk; H is never formed. Minimiser:
w_u* = −H_D⁻¹ g_D(0), so fitting from scratch is a Newton step from 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from scrubnet.models.linearized import LinearizedModel


@dataclass
class UserObjective:
    """L_D, g_D and H_D·v of the module docstring for the data (x, y) and regulariser µ.

    ``chunk``: samples per JVP/VJP pass (memory only; results do not depend on it).
    """

    model: LinearizedModel
    x: Tensor
    y: Tensor
    num_classes: int
    mu: float
    target_scale: float = 5.0
    chunk: int = 4096

    def __post_init__(self):
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} samples but y has {len(self.y)}")
        if len(self.y) == 0:
            raise ValueError("the objective needs at least one sample")
        if not self.mu > 0:
            raise ValueError(f"µ must be positive (strong convexity), got {self.mu}")

    @property
    def n(self) -> int:
        return len(self.y)

    def targets(self, y: Tensor, dtype) -> Tensor:
        return self.target_scale * F.one_hot(y, self.num_classes).to(dtype)

    def _chunks(self):
        for i in range(0, self.n, self.chunk):
            yield self.x[i:i + self.chunk], self.y[i:i + self.chunk]

    @torch.no_grad()
    def loss(self, w: Tensor) -> float:
        """L_D(w) (mean over samples, with the µ term)."""
        total = 0.0
        for xb, yb in self._chunks():
            f0, jv = self.model.output_and_jvp(xb, w)
            total += 0.5 * float(((f0 + jv - self.targets(yb, f0.dtype)) ** 2).sum())
        return total / self.n + 0.5 * self.mu * float(w @ w)

    @torch.no_grad()
    def gradient(self, w: Tensor) -> tuple[Tensor, float]:
        """(g_D(w), L_D(w)): the exact residual gradient, one full pass (JVP + VJP per chunk)."""
        g = torch.zeros_like(w)
        total = 0.0
        for xb, yb in self._chunks():
            f0, jv = self.model.output_and_jvp(xb, w)
            r = f0 + jv - self.targets(yb, f0.dtype)
            total += 0.5 * float((r ** 2).sum())
            g += self.model.vjp(xb, r)
        return g / self.n + self.mu * w, total / self.n + 0.5 * self.mu * float(w @ w)

    @torch.no_grad()
    def hvp(self, v: Tensor) -> Tensor:
        """H_D v = (1/|D|) Σ Jᵀ(J v) + µ v."""
        out = torch.zeros_like(v)
        for xb, _ in self._chunks():
            out += self.model.vjp(xb, self.model.jvp(xb, v))
        return out / self.n + self.mu * v

    @torch.no_grad()
    def dense_hessian(self) -> Tensor:
        """H_D formed explicitly (p×p) — for tests on tiny models only."""
        p = self.model.num_linearized
        eye = torch.eye(p, dtype=self.model.delta[0].dtype)
        return torch.stack([self.hvp(eye[i]) for i in range(p)], dim=1)
