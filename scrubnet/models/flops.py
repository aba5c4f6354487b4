"""Counting one sample's work for the cost model: GEMM FLOPs and the non-GEMM elements FLOP counters miss.

:class:`torch.utils.flop_counter.FlopCounterMode` counts matmuls and convolutions, and the attention kernels
it knows (the CUDA ones). On a transformer three things were missing from its count, and
:func:`count_work` adds them:

* the fused CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward): its
  QKᵀ and PV products (backward: the recomputed QKᵀ and the four gradient products);
* the non-GEMM work — softmax (the attention scores, in or out of a fused kernel), LayerNorm, GELU and SiLU,
  forward and backward — counted in *elements* written (see :data:`NONGEMM_OPS`): memory-bound work that a
  FLOP count does not price; the cost model prices each element at :data:`NONGEMM_FLOP_EQUIV` GEMM-FLOP
  equivalents;
* the encoder layers themselves in inference: ``nn.TransformerEncoderLayer``'s fast path runs one fused op
  that no counter sees, so counting runs with the fast path off (the same products, counted);
* recurrent layers: ``nn.LSTM`` on the CPU runs one fused oneDNN kernel per layer and direction
  (``mkldnn_rnn_layer``) that no counter sees — its products are counted here (forward 2·T·B·(|W_ih| + |W_hh|),
  backward twice that: the input and weight gradients) with its gate nonlinearities and cell updates as
  non-GEMM elements (:data:`RNN_GATE_ELEMENTS` per hidden unit per step); ``nn.GRU`` and ``nn.RNN`` decompose
  into matmuls the counter sees, and their ``sigmoid``/``tanh`` gates are non-GEMM elements like GELU's.

ReLU, BatchNorm, residual adds and the loss's log-softmax are not in :data:`NONGEMM_OPS`: the MLP and
convolutional constants of the cost model were fitted without them, so their estimates are unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.models.call import call_model

aten = torch.ops.aten

# GEMM-FLOP equivalents per non-GEMM element written (softmax, LayerNorm, GELU/SiLU; forward or backward):
# fitted on benchmarks/cost_check.py's transformer cases (retrain, finetune, Newton, NTK-CG, Fisher) so the
# estimate meets the measured CPU time; it also carries the transformer's other elementwise work (head
# reshapes, residual adds, ReLU, dropout-free copies), which grows with the same dimensions
NONGEMM_FLOP_EQUIV = 1500.0

#: ops whose output elements count as non-GEMM work (elements of their first output)
NONGEMM_OPS = {aten._softmax, aten._softmax_backward_data, aten.native_layer_norm, aten.native_layer_norm_backward,
               aten.gelu, aten.gelu_backward, aten.silu, aten.silu_backward, aten.sigmoid, aten.sigmoid_,
               aten.sigmoid_backward, aten.tanh, aten.tanh_, aten.tanh_backward}
_RNN_FWD, _RNN_BWD = aten.mkldnn_rnn_layer, aten.mkldnn_rnn_layer_backward
#: non-GEMM elements of a fused LSTM layer per hidden unit per time step and sample (backward: twice as many), at
#: :data:`NONGEMM_FLOP_EQUIV` each: the oneDNN kernel fuses its gates and cell update, so they cost far less
#: than the 8 elements it writes would cost unfused; fitted on benchmarks/cost_check.py's LSTM cases (retrain
#: and Newton within 1.5× of measured: docs/decisions/cost-vs-retrain.md, "Recurrent layers")
RNN_GATE_ELEMENTS = 0.5
_SDPA_FWD = {aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention}
_SDPA_BWD = {aten._scaled_dot_product_flash_attention_for_cpu_backward,
             aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_efficient_attention_backward,
             aten._scaled_dot_product_cudnn_attention_backward}
# the kernels FlopCounterMode does not count itself
_SDPA_UNCOUNTED = {aten._scaled_dot_product_flash_attention_for_cpu,
                   aten._scaled_dot_product_flash_attention_for_cpu_backward}


def _sdpa_shapes(func, args) -> tuple[int, int, int]:
    """(B·H·L·S score elements, E, Ev) of an attention kernel call; forward args are (q, k, v, ...), backward
    ones (grad_out, q, k, v, ...)."""
    q, k, v = (args[1], args[2], args[3]) if func in _SDPA_BWD else (args[0], args[1], args[2])
    scores = q.numel() // q.shape[-1] * k.shape[-2]
    return scores, q.shape[-1], v.shape[-1]


class _NonGemmCounter(TorchDispatchMode):
    """Counts non-GEMM elements and the attention FLOPs FlopCounterMode misses (module docstring)."""

    def __init__(self):
        super().__init__()
        self.elements = 0.0
        self.extra_flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in NONGEMM_OPS:
            first = next(t for t in tree_leaves(out) if isinstance(t, Tensor))
            self.elements += first.numel()
        elif packet in (_RNN_FWD, _RNN_BWD):
            x, w_ih, w_hh = args[0], args[1], args[2]
            tokens = x.numel() // x.shape[-1]                  # T·B, whichever of them comes first
            hidden = w_hh.shape[-1]
            factor = 2.0 if packet is _RNN_BWD else 1.0
            self.extra_flops += factor * 2.0 * tokens * (w_ih.numel() + w_hh.numel())
            self.elements += factor * RNN_GATE_ELEMENTS * tokens * hidden
        elif packet in _SDPA_FWD or packet in _SDPA_BWD:
            scores, e, ev = _sdpa_shapes(packet, args)
            backward = packet in _SDPA_BWD
            self.elements += scores * (2 if backward else 1)   # softmax; backward: P and dS
            if packet in _SDPA_UNCOUNTED:   # QKᵀ, PV; backward: QKᵀ again, dV, dP, dQ, dK
                self.extra_flops += 2.0 * scores * ((3 * e + 2 * ev) if backward else (e + ev))
        return out


@contextmanager
def _no_fastpath():
    """The transformer layers' fused inference path off (it hides its products from any counter)."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None:
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)


@contextmanager
def counting_work():
    """A context that counts every op run inside it: yields ``result`` (a callable returning
    ``(gemm_flops, nongemm_elements)`` so far)."""
    with _no_fastpath(), FlopCounterMode(display=False) as flops, _NonGemmCounter() as other:
        yield lambda: (float(flops.get_total_flops()) + other.extra_flops, float(other.elements))


def count_work(model: nn.Module, x1, backward: bool = False) -> tuple[float, float]:
    """One sample's work: (GEMM FLOPs, non-GEMM elements).

    Parameters
    ----------
    model : nn.Module
        Counted in its current mode (callers put it in eval mode).
    x1 : Tensor or ModelInputs
        One probe sample, shape (1, ...) (only the first is used).
    backward : bool
        Also count the backward of its cross-entropy (target class 0) to every trainable parameter (the input's
        gradient is not computed), as a training step runs it. The parameters' ``.grad`` are untouched.

    Returns
    -------
    tuple[float, float]
        GEMM FLOPs (FLOP = 2 per multiply-add; :class:`~torch.utils.flop_counter.FlopCounterMode`'s count plus
        the fused CPU attention products) and non-GEMM elements written (:data:`NONGEMM_OPS` and the attention
        scores' softmax).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with counting_work() as result:
        if backward:
            with torch.enable_grad():
                out = call_model(model, x1[:1])
                target = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
                torch.autograd.grad(nn.functional.cross_entropy(out, target), params, allow_unused=True)
        else:
            with torch.no_grad():
                call_model(model, x1[:1])
    return result()
