"""The per-sample loss of a model's logits, stated once: :class:`LossSpec`.

A training recipe's loss is one of

* ``"ce"``:  ℓ(f, y) = −Σ_k t_k log softmax(f)_k with t = (1 − ε)·onehot(y) + ε/c (label smoothing ε, 0 by
  default: plain cross-entropy; the definition of ``torch.nn.CrossEntropyLoss(label_smoothing=ε)``);
* ``"mse"``: ℓ(f, y) = ½‖f − s·onehot(y)‖² (target scale s, 1 by default; LQF's 15).

Both are functions of f through the residual r = ∂ℓ/∂f = softmax(f) − t (CE) or f − s·onehot(y) (MSE); the
output Hessian ∂²ℓ/∂f² = diag(p) − ppᵀ (CE, for any t summing to 1) or I (MSE) does not depend on ε or s, so
the Gauss–Newton matrix is the same and only losses, gradients and residuals change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: the loss kinds; recipes call them "cross_entropy" and "mse"
LOSS_KINDS = ("ce", "mse")


@dataclass(frozen=True)
class LossSpec:
    """A per-sample loss of logits (module docstring).

    Parameters
    ----------
    kind : str
        ``"ce"`` or ``"mse"``.
    target_scale : float
        s of the MSE target s·onehot(y) (> 0; 1 for CE).
    label_smoothing : float
        ε of the CE target (1 − ε)·onehot(y) + ε/c, in [0, 1) (0 for MSE).
    """

    kind: str = "ce"
    target_scale: float = 1.0
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r}; choose one of {', '.join(LOSS_KINDS)}")
        if not self.target_scale > 0 or (self.kind != "mse" and self.target_scale != 1.0):
            raise ValueError(f"target_scale must be > 0 and applies to the MSE loss only, got {self.target_scale:g}")
        if not 0.0 <= self.label_smoothing < 1.0 or (self.kind != "ce" and self.label_smoothing != 0.0):
            raise ValueError(f"label_smoothing must be in [0, 1) and applies to cross-entropy only, got "
                             f"{self.label_smoothing:g}")

    def targets(self, y: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """t (N, c): (1 − ε)·onehot(y) + ε/c for CE, s·onehot(y) for MSE."""
        onehot = F.one_hot(y, num_classes).to(dtype)
        if self.kind == "mse":
            return self.target_scale * onehot
        return (1.0 - self.label_smoothing) * onehot + self.label_smoothing / num_classes

    def per_sample(self, logits: Tensor, y: Tensor) -> Tensor:
        """ℓ(f_i, y_i) per sample, shape (N,), differentiable in ``logits`` (N, c)."""
        if self.kind == "ce":
            return F.cross_entropy(logits, y, reduction="none", label_smoothing=self.label_smoothing)
        return 0.5 * ((logits - self.targets(y, logits.shape[-1], logits.dtype)) ** 2).sum(-1)

    def mean(self, logits: Tensor, y: Tensor) -> Tensor:
        """The mean of :meth:`per_sample` (a scalar tensor; CE through its own mean reduction, the same bits as
        ``F.cross_entropy(logits, y)``)."""
        if self.kind == "ce":
            return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        return self.per_sample(logits, y).mean()

    def residual(self, logits: Tensor, y: Tensor) -> Tensor:
        """r = ∂ℓ/∂f per sample, (N, c): softmax(f) − t (CE) or f − s·onehot(y) (MSE)."""
        t = self.targets(y, logits.shape[-1], logits.dtype)
        return (torch.softmax(logits, dim=-1) - t) if self.kind == "ce" else logits - t

    def describe(self) -> str:
        """E.g. ``CE (label smoothing 0.1)`` or ``½‖f − 15·onehot(y)‖²``."""
        if self.kind == "ce":
            return "CE" + (f" (label smoothing {self.label_smoothing:g})" if self.label_smoothing else "")
        scale = "" if self.target_scale == 1.0 else f"{self.target_scale:g}·"
        return f"½‖f − {scale}onehot(y)‖²"


def as_loss(loss: str | LossSpec) -> LossSpec:
    """``loss`` as a :class:`LossSpec`: a kind name (``"ce"``, ``"mse"``) is the plain loss of that kind.

    Parameters
    ----------
    loss : str or LossSpec

    Returns
    -------
    LossSpec
    """
    if isinstance(loss, LossSpec):
        return loss
    if not isinstance(loss, str) or loss not in LOSS_KINDS:
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSS_KINDS)}")
    return LossSpec(loss)
