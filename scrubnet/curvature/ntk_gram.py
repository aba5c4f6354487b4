"""The empirical NTK Gram Θ = J Jᵀ of a network's logits, never holding J (eval mode, sample-major rows).

:func:`ntk_gram` (Θ or the cross-Gram J(x) J(x')ᵀ under a memory budget; every Jacobian row computed once
when the compact factors of x fit, else once per layer group or per held chunk: :mod:`.ntk_schedule`),
:func:`ntk_gram_flops` (its FLOP floor), :func:`ntk_diag_blocks` (the N per-sample c×c blocks
J_x diag(v) J_xᵀ) and :func:`iter_jacobian_rows` (every row once, one micro-batch and layer at a time).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.curvature.jacobian_rows import DEFAULT_BUDGET, JacobianRows, _micro_batch
from scrubnet.curvature.ntk_schedule import _GramPlan, _symmetric_schedule
from scrubnet.curvature.progress import current_progress
from scrubnet.models.call import Inputs

def _symmetric_gram(plan: _GramPlan, x: Inputs, theta: Tensor, chunk: int, micro: int, budget: int) -> None:
    """theta (N·c × N·c) += J Jᵀ over ``plan``'s layers, the samples in chunks of ``chunk``.

    Snake order: a held chunk is contracted with itself and with every chunk it has not met yet, each
    captured ("streamed") in turn; the last one streamed becomes the next held chunk, so it is not captured
    again. k chunks cost 1 + k(k−1)/2 chunk captures instead of k(k+1)/2, with two chunks in memory."""
    n, c = len(x), plan.c
    bounds = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    done = [False] * len(bounds)
    h = 0
    report, pairs_total, pairs_done = current_progress(), len(bounds) * (len(bounds) + 1) // 2, 0
    held = plan.hold(x[bounds[0][0]:bounds[0][1]], micro)
    while True:
        a0, a1 = bounds[h]
        plan.contract(held, held, theta[a0 * c:a1 * c, a0 * c:a1 * c], True, budget)
        done[h] = True
        pairs_done += 1
        if report is not None:
            report(f"NTK: chunk pairs ({len(plan.layers)} layers)", pairs_done, pairs_total)
        todo = [j for j in range(len(bounds)) if not done[j]]
        if not todo:
            return
        nxt = None
        for j in todo:
            b0, b1 = bounds[j]
            streamed = plan.hold(x[b0:b1], micro)
            plan.contract(held, streamed, theta[a0 * c:a1 * c, b0 * c:b1 * c], False, budget)
            theta[b0 * c:b1 * c, a0 * c:a1 * c] = theta[a0 * c:a1 * c, b0 * c:b1 * c].T
            pairs_done += 1
            if report is not None:
                report(f"NTK: chunk pairs ({len(plan.layers)} layers)", pairs_done, pairs_total)
            if j == todo[-1]:
                nxt = streamed
            del streamed  # before the next chunk is captured
        del held
        held, h = nxt, todo[-1]
        del nxt


def ntk_gram(model: nn.Module, x: Inputs, x2: Inputs | None = None, *,
             memory_budget_bytes: int = DEFAULT_BUDGET, method: str = "auto",
             out_dtype: torch.dtype = torch.float64) -> Tensor:
    """Empirical NTK Gram Θ = J(x) J(x2)ᵀ of the logits (eval mode), sample-major rows, never holding J.

    Shapes: x (N, ...), x2 (M, ...) (default x) → Θ (N·c, M·c) in ``out_dtype``, on x's device.
    ``method``: "auto" (per layer the cheaper of explicit/ghost, :meth:`JacobianRows.contraction_flops`),
    "explicit" or "ghost" (ghost where the kernel is factored).

    Algorithm ("NTK cost" in docs/decisions/index.md): the samples of x are captured (one forward + c backward
    passes to the layer outputs) **once** per held chunk into compact factors — per layer the smaller of
    its per-row gradients and its capture (input, output gradients), the ghost factors for ghost layers —
    sized so that, when it fits in 3/5 of the budget, the whole of x is one chunk and every Jacobian row is
    computed exactly once. The Gram is then contracted layer by layer in blocks from the held factors;
    symmetric blocks are computed once and mirrored. When the factors of x do not fit
    (:func:`_symmetric_schedule`, the cheaper of the two in FLOPs spent outside the contraction):
    either the layers are split into groups whose factors of all samples fit, each group captured in its
    own pass whose backward stops at the group's earliest layer, and Θ is the sum of the groups' Grams; or
    the samples are split into chunks held two at a time in a snake order (the last chunk streamed is the
    next held, 1 + k(k−1)/2 chunk captures for k chunks). For a cross-Gram (x2 given) the samples of x2
    are streamed in micro-batches against held chunks of x.
    """
    if method not in ("auto", "explicit", "ghost"):
        raise ValueError(f"method must be 'auto', 'explicit' or 'ghost', got {method!r}")
    if memory_budget_bytes <= 0:
        raise ValueError("memory_budget_bytes must be positive")
    if len(x) == 0:
        raise ValueError("ntk_gram needs at least one sample")
    symmetric = x2 is None
    x2 = x if symmetric else x2
    engine = JacobianRows(model, x)
    c = engine.num_classes
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    n, m = len(x), len(x2)
    micro = _micro_batch(engine, isz, memory_budget_bytes // 5)
    held_budget = 3 * memory_budget_bytes // 5
    plan = _GramPlan(engine, n, m, method, isz, held_budget)
    contraction_budget = memory_budget_bytes // 5
    theta = torch.zeros(n * c, m * c, dtype=out_dtype, device=x.device)
    chunk_i = max(1, min(n, int(held_budget // max(plan.per_sample_bytes, 1))))
    if symmetric and chunk_i < n:
        for group_plan, chunk in _symmetric_schedule(engine, x, n, method, isz, held_budget, contraction_budget):
            # micro-batches sized to what this plan's capture holds (≥ the all-layer rule's)
            group_micro = max(micro, int(memory_budget_bytes // 5 // max(group_plan.capture_bytes_per_sample(isz), 1)))
            _symmetric_gram(group_plan, x, theta, chunk, group_micro, contraction_budget)
        return theta
    for i0 in range(0, n, chunk_i):
        i1 = min(n, i0 + chunk_i)
        held = plan.hold(x[i0:i1], micro)
        ri0, ri1 = i0 * c, i1 * c
        j_start = 0
        if symmetric:
            plan.contract(held, held, theta[ri0:ri1, ri0:ri1], True, contraction_budget)
            j_start = i1
        for s in range(j_start, m, micro):
            xb = x2[s:min(m, s + micro)]
            rj0, rj1 = s * c, (s + len(xb)) * c
            streamed = plan.hold(xb, micro)
            plan.contract(held, streamed, theta[ri0:ri1, rj0:rj1], False, contraction_budget)
            del streamed  # before the next block is captured
        del held
    return theta


def ntk_gram_flops(model: nn.Module, x: Inputs, n: int | None = None) -> dict[str, float]:
    """FLOP floor (FLOP = 2 multiply-adds) of the exact Gram over ``n`` samples like ``x`` (default len(x)).

    ``jacobian_pass``: one forward and c backward passes to the layer outputs per sample (counted with
    ``torch.utils.flop_counter`` on one sample: matmuls and convolutions), i.e. every Jacobian row once;
    ``gram``: Σ over layers of the cheaper of the explicit and ghost contractions of the symmetric Gram
    (half of the off-diagonal blocks), per-row gradients included for explicit layers;
    ``total`` = their sum. Returns FLOPs (floats)."""
    n = len(x) if n is None else int(n)
    engine = JacobianRows(model, x[:1])
    c = engine.num_classes
    with FlopCounterMode(display=False) as counter:
        engine.capture(x[:1])
    per_sample = float(counter.get_total_flops())
    r = n * c
    gram = 0.0
    for lay in engine.layers:
        explicit, ghost = engine.contraction_flops(lay, r, r)
        # symmetric: R(R+1)/2 row pairs instead of R²; the per-row gradients are computed once
        explicit = 0.5 * float(r) * (r + 1) * lay.numel + r * lay.positions * lay.numel
        if ghost != math.inf:
            ghost = 0.5 * ghost
        gram += 2.0 * min(explicit, ghost)
    generic = sum(engine.params[k].numel() for k in engine.generic_names)
    gram += 2.0 * 0.5 * float(r) * (r + 1) * generic
    return {"jacobian_pass": per_sample * n, "gram": gram, "total": per_sample * n + gram}


def ntk_diag_blocks(model: nn.Module, x: Inputs, param_weights: Tensor | None = None, *,
                    memory_budget_bytes: int = DEFAULT_BUDGET, out_dtype: torch.dtype = torch.float64) -> Tensor:
    """Per-sample blocks Σ_x = J_x diag(v) J_xᵀ (c×c) for every sample: returns (N, c, c).

    ``param_weights`` v is a flat (p,) vector (e.g. the variance of Gaussian weight noise), default 1
    (then each block is the diagonal block of Θ). One pass over x; per-row gradients of one layer of one
    micro-batch at a time.
    """
    engine = JacobianRows(model, x)
    c = engine.num_classes
    if param_weights is not None and param_weights.numel() != engine.p:
        raise ValueError(f"param_weights has {param_weights.numel()} entries, model has {engine.p} parameters")
    out = torch.zeros(len(x), c, c, dtype=out_dtype, device=x.device)
    for sl, (lo, hi), r in _rows_stream(engine, x, memory_budget_bytes):
        b = sl.stop - sl.start
        r3 = r.reshape(b, c, -1)
        if param_weights is None:
            out[sl] += torch.bmm(r3, r3.transpose(1, 2)).to(out_dtype)
        else:
            w = param_weights[lo:hi].to(r.dtype)
            out[sl] += torch.bmm(r3 * w, r3.transpose(1, 2)).to(out_dtype)
    return out


def _rows_stream(engine: JacobianRows, x: Inputs, budget: int):
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    micro = _micro_batch(engine, isz, budget // 2)
    for s in range(0, len(x), micro):
        xb = x[s:s + micro]
        sl = slice(s, s + len(xb))
        cap = engine.capture(xb)
        for lay in engine.layers:
            for ps, r in engine.rows(cap, lay):
                yield sl, ps, r
        del cap
        for ps, r in engine.generic_rows(xb):
            yield sl, ps, r


def iter_jacobian_rows(model: nn.Module, x: Inputs, *, memory_budget_bytes: int = DEFAULT_BUDGET
                       ) -> Iterator[tuple[slice, tuple[int, int], Tensor]]:
    """Yield (sample slice, (start, stop) in the flat parameters, per-row gradients (B·c, stop − start)):
    every Jacobian row computed exactly once, one micro-batch and one layer at a time (the floor cost of
    any exact method that needs the Gram)."""
    engine = JacobianRows(model, x)
    yield from _rows_stream(engine, x, memory_budget_bytes)

