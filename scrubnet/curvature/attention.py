"""Attention under forward-mode AD.

``F.scaled_dot_product_attention`` dispatches on the CPU to a fused kernel that has no forward-mode (JVP) rule,
so every Jacobian–vector product through an attention layer fails inside torch. The math backend computes the
same softmax(QKᵀ/√d)V from differentiable primitives; :func:`jvp_safe_attention` selects it for the code inside
the ``with`` block (docs/decisions/own-model.md, "SDPA under forward-mode AD"). Models without attention are unaffected.
"""
from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel


def jvp_safe_attention():
    """A context manager restricting ``F.scaled_dot_product_attention`` to its math backend."""
    return sdpa_kernel(SDPBackend.MATH)
