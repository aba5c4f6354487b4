"""The NTK Gram's schedule: how the compact Jacobian factors of the samples are held, contracted and, when
they do not fit in the memory budget, split into layer groups or sample chunks ("NTK cost" and "NTK memory"
in docs/decisions/index.md).

* :class:`_GramPlan` — per layer the cheaper of two exact contractions:
    explicit: Θ_l = G_l G_lᵀ with per-row gradients G_l (rows × numel);
    ghost:    Θ_l[(n,k),(m,k')] = Σ_{s,t} (g_{nks}·g_{mk't}) (ã_{ns}·ã_{mt}),   ã = [a, 1] (bias folded in),
  and per layer the storage (rows, raw capture, ghost factors); :meth:`_GramPlan.hold` captures samples into
  :class:`_Held` factors, :meth:`_GramPlan.contract` adds their Gram block.
* :func:`_symmetric_schedule` — layer groups or chunks, whichever spends fewer FLOPs outside the
  contraction (:func:`_schedule_flops`); :func:`ntk_gram_schedule` reports it without running it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from scrubnet.curvature.jacobian_rows import DEFAULT_BUDGET, JacobianRows, _Layer
from scrubnet.curvature.progress import current_progress
from scrubnet.models.call import Inputs

def _ghost_block(a_i: Tensor, g_i: Tensor, a_j: Tensor, g_j: Tensor, c: int, budget: int) -> Tensor:
    """Σ_{s,t} (g_{ns}·g_{mt})(ã_{ns}·ã_{mt}) for rows (n,k) × (m,k'): returns (R_i × R_j).

    a_i (N_i, T, d), g_i (N_i·c, T, e); the (R_i·T × R_j·T) temporary is chunked over rows of i."""
    n_i, t, _ = a_i.shape
    n_j = a_j.shape[0]
    r_j = g_j.shape[0]
    out = torch.empty(g_i.shape[0], r_j, dtype=g_i.dtype, device=g_i.device)
    gj = g_j.reshape(r_j * t, -1)
    aj = a_j.reshape(n_j * t, -1)
    per_sample = c * t * r_j * t * g_i.element_size() * 2
    step = max(1, int(budget // max(per_sample, 1)))
    for s in range(0, n_i, step):
        e = min(n_i, s + step)
        ka = (a_i[s:e].reshape(-1, a_i.shape[-1]) @ aj.T).reshape(e - s, 1, t, n_j, 1, t)
        kg = (g_i[s * c:e * c].reshape(-1, g_i.shape[-1]) @ gj.T).reshape(e - s, c, t, n_j, c, t)
        out[s * c:e * c] = kg.mul_(ka).sum(dim=(2, 5)).reshape((e - s) * c, r_j)   # in place: no second temporary
    return out


@dataclass
class _Held:
    """Compact Jacobian factors of ``n`` consecutive samples (rows sample-major, c rows per sample).

    rows:  (n·c, width) per-row gradients of every parameter kept as rows (explicit layers, BN, fallback),
           side by side in one matrix (columns: ``_GramPlan.row_cols``), so that their Gram is one GEMM;
    raw:   {layer: (a (n, ...), g (c, n, ...))} the capture itself, for explicit layers whose rows are
           larger than their capture; per-row gradients are rebuilt per contraction block;
    ghost: {layer: (a (n, ...), g rows (n·c, T, d_out))} for layers contracted by the ghost rule: the input
           as captured, unfolded into patches ã (n, T, d_in[+1]) for one layer at a time when contracted."""

    n: int
    rows: Tensor | None = None
    raw: dict = field(default_factory=dict)
    ghost: dict = field(default_factory=dict)


class _GramPlan:
    """Per-layer contraction ("explicit" | "ghost") and storage ("rows" | "raw" | "ghost") for one Gram."""

    def __init__(self, engine: JacobianRows, n: int, m: int, method: str, itemsize: int, held_budget: int,
                 layers: list[_Layer] | None = None, generic: bool = True):
        c = engine.num_classes
        self.engine, self.c = engine, c
        self.layers = list(engine.layers if layers is None else layers)
        self.generic_names = list(engine.generic_names) if generic else []
        self.contraction: dict[str, str] = {}
        self.storage: dict[str, str] = {}
        for lay in self.layers:
            ghost = lay.factored and (method == "ghost" or (method == "auto" and
                                                             engine.ghost_is_cheaper(lay, n * c, m * c)))
            self.contraction[lay.name] = "ghost" if ghost else "explicit"
            self.storage[lay.name] = "ghost" if ghost else "rows"
        generic = c * sum(engine.params[k].numel() for k in self.generic_names)
        # explicit layers: keep the smaller of (rows, capture) until everything fits; switching a layer
        # to its capture costs a rebuild of its per-row gradients per block, ∝ T: cheapest T first
        candidates = sorted((lay for lay in self.layers
                             if self.storage[lay.name] == "rows" and lay.factored
                             and lay.input_numel + c * lay.output_numel < c * lay.numel),
                            key=lambda lay: lay.positions)
        for lay in candidates:
            if self.per_sample(generic) * itemsize * n <= held_budget:
                break
            self.storage[lay.name] = "raw"
        self.per_sample_bytes = self.per_sample(generic) * itemsize
        self.row_cols: dict[tuple[int, int], tuple[int, int]] = {}
        spans = [sl for lay in self.layers if self.storage[lay.name] == "rows"
                 for sl in (lay.weight, lay.bias) if sl is not None]
        spans += [engine.offsets[k] for k in self.generic_names]
        col = 0
        for lo, hi in spans:
            self.row_cols[(lo, hi)] = (col, col + hi - lo)
            col += hi - lo
        self.row_width = col

    def per_sample(self, generic: int) -> int:
        c, total = self.c, generic
        for lay in self.layers:
            kind = self.storage[lay.name]
            if kind == "rows":
                total += c * lay.numel
            elif kind == "raw":
                total += lay.input_numel + c * lay.output_numel
            else:
                total += lay.input_numel + c * lay.output_numel
        return total

    def capture_bytes_per_sample(self, itemsize: int) -> int:
        """Working memory of one sample in :meth:`hold`'s capture of this plan's layers: autograd's saved
        tensors, the hooked outputs' clones and the c output gradients of the hooked layers, the unfolded
        input and per-row gradients of the largest layer whose rows are built, the fallback rows."""
        eng, c = self.engine, self.c
        built = [lay for lay in self.layers if self.storage[lay.name] in ("rows", "raw")]
        hooked = sum(lay.calls * (lay.input_numel + lay.output_numel) for lay in self.layers)
        unf = max([lay.positions * lay.d_in for lay in built] or [0])
        rows = max([lay.numel for lay in self.layers if self.storage[lay.name] == "rows"] or [0])
        generic = c * sum(eng.params[k].numel() for k in self.generic_names)
        return itemsize * (2 * eng.all_outputs_per_sample + hooked + c * hooked + 2 * unf + 2 * c * rows + generic)

    def hold(self, x: Inputs, micro: int) -> _Held:
        """Capture every sample of ``x`` once (micro-batches) into preallocated compact factors."""
        eng, c, n = self.engine, self.c, len(x)
        held = _Held(n)
        if self.row_width:
            dtype = next(iter(eng.params.values())).dtype
            held.rows = torch.empty(n * c, self.row_width, dtype=dtype, device=x.device)
        report = current_progress()
        for s in range(0, n, micro):
            xb = x[s:s + micro]
            lo, hi = s, s + len(xb)
            if report is not None:
                report("NTK: Jacobian rows (samples)", s, n)
            cap = eng.capture(xb, layers=self.layers)
            for lay in self.layers:
                kind = self.storage[lay.name]
                if kind == "rows":
                    parts = eng.rows(cap, lay)
                elif kind == "raw":
                    a, g = cap.inputs[lay.name][0], cap.grads[lay.name][0]
                    if lay.name not in held.raw:
                        held.raw[lay.name] = (a.new_empty((n,) + tuple(a.shape[1:])),
                                              g.new_empty((c, n) + tuple(g.shape[2:])))
                    held.raw[lay.name][0][lo:hi] = a
                    held.raw[lay.name][1][:, lo:hi] = g
                    continue
                else:  # the input as captured (unfolded per contraction: 9× smaller for a 3×3 conv)
                    a = cap.inputs[lay.name][0]
                    g = eng.ghost_rows(lay, cap.grads[lay.name][0])
                    if lay.name not in held.ghost:
                        held.ghost[lay.name] = (a.new_empty((n,) + tuple(a.shape[1:])),
                                                g.new_empty((n * c,) + tuple(g.shape[1:])))
                    held.ghost[lay.name][0][lo:hi] = a
                    held.ghost[lay.name][1][lo * c:hi * c] = g
                    continue
                for sl, r in parts:
                    c0, c1 = self.row_cols[sl]
                    held.rows[lo * c:hi * c, c0:c1] = r
            del cap
            for sl, r in (eng.generic_rows(xb) if self.generic_names else []):
                c0, c1 = self.row_cols[sl]
                held.rows[lo * c:hi * c, c0:c1] = r
        if report is not None:
            report("NTK: Jacobian rows (samples)", n, n)
        return held

    def contract(self, hi: _Held, hj: _Held, out: Tensor, same: bool, budget: int) -> None:
        """out (hi.n·c × hj.n·c) += J_i J_jᵀ from compact factors. ``same``: hi is hj and ``out`` is square;
        only blocks on or above the diagonal are computed, each off-diagonal block is also added
        transposed below it."""
        eng, c = self.engine, self.c
        lay_by_name = {lay.name: lay for lay in eng.layers}

        def pairs(n_i: int, n_j: int, step: int):
            if same:  # at least 8 blocks per side: the blocks above the diagonal are ≈ 56 % of the square
                step = min(step, max(1, -(-n_i // 8)))
            for s in range(0, n_i, step):
                for t in range(s if same else 0, n_j, step):
                    yield s, min(n_i, s + step), t, min(n_j, t + step)

        def add(s, e, t, f, blk):
            out[s * c:e * c, t * c:f * c] += blk.to(out.dtype)
            if same and t != s:
                out[t * c:f * c, s * c:e * c] += blk.T.to(out.dtype)

        report = current_progress()
        steps = (hi.rows is not None) + len(hi.raw) + len(hi.ghost)
        done = 0

        def tick():
            nonlocal done
            done += 1
            if report is not None:
                report("NTK: Gram contraction (layers)", done, steps)

        # per-row gradients held side by side: one GEMM per block, symmetric blocks once
        if hi.rows is not None:
            for s, e, t, f in pairs(hi.n, hj.n, max(hi.n, hj.n)):
                add(s, e, t, f, hi.rows[s * c:e * c] @ hj.rows[t * c:f * c].T)
            tick()
        # captures: rebuild per-row gradients per block of samples sized to the budget
        for name, (a_i, g_i) in hi.raw.items():
            lay = lay_by_name[name]
            a_j, g_j = hj.raw[name]
            step = _raw_step(lay, c, a_i.element_size(), budget)
            cache: tuple[int, list] | None = None
            for s, e, t, f in pairs(hi.n, hj.n, step):
                if cache is None or cache[0] != s:
                    cache = (s, eng.rows_from(lay, a_i[s:e], g_i[:, s:e]))   # rows of block s, reused along t
                rows_j = cache[1] if same and t == s else eng.rows_from(lay, a_j[t:f], g_j[:, t:f])
                blk = None
                for (_, r_i), (_, r_j) in zip(cache[1], rows_j):   # weight, then bias
                    blk = r_i @ r_j.T if blk is None else blk.addmm_(r_i, r_j.T)
                add(s, e, t, f, blk)
            tick()
        # ghost rule: input patches unfolded for one layer at a time (transient), output rows as held
        for name, (x_i, g_i) in hi.ghost.items():
            x_j, g_j = hj.ghost[name]
            a_i = eng.ghost_factors(lay_by_name[name], x_i)
            a_j = a_i if hj is hi else eng.ghost_factors(lay_by_name[name], x_j)
            for s, e, t, f in pairs(hi.n, hj.n, max(hi.n, hj.n)):
                add(s, e, t, f, _ghost_block(a_i[s:e], g_i[s * c:e * c], a_j[t:f], g_j[t * c:f * c], c, budget))
            del a_i, a_j
            tick()


def _chunked_passes(k: int) -> float:
    """Capture passes over all samples of the snake schedule with ``k`` chunks: 1 + k(k−1)/2 chunk
    captures (:func:`_symmetric_gram`), in units of k chunks."""
    return (1.0 + k * (k - 1) / 2.0) / k


def _min_bytes_per_sample(engine: JacobianRows, lay: _Layer, n: int, method: str) -> int:
    """Elements one sample of ``lay`` needs when held as compactly as possible (rows or capture)."""
    c = engine.num_classes
    capture = lay.input_numel + c * lay.output_numel
    ghost = lay.factored and (method == "ghost" or (method == "auto" and engine.ghost_is_cheaper(lay, n * c, n * c)))
    if ghost:
        return capture
    return min(c * lay.numel, capture) if lay.factored else c * lay.numel


def _pass_flops(engine: JacobianRows, x1: Inputs, layers: list[_Layer], generic: bool) -> float:
    """FLOPs of capturing one sample for ``layers`` only (forward + c backward passes reaching them)."""
    with FlopCounterMode(display=False) as counter:
        engine.capture(x1, layers=layers)
        if generic:
            engine.generic_rows(x1)
    return float(counter.get_total_flops())


def _raw_step(lay: _Layer, c: int, itemsize: int, budget: int) -> int:
    """Samples per block when a held capture's per-row gradients are rebuilt (:meth:`_GramPlan.contract`)."""
    return max(1, int(budget // max(2 * c * lay.numel * itemsize, 1)))


def _schedule_flops(plan: _GramPlan, n: int, chunk: int, pass_flops: float, budget: int, itemsize: int) -> float:
    """FLOPs a schedule spends beyond the Gram contraction itself (the same in every schedule): captures
    (``pass_flops`` per sample captured), per-row gradients of "rows" layers built at each capture, and the
    rebuilds of "raw" layers' per-row gradients, counted by walking the block loops of
    :func:`_symmetric_gram` and :meth:`_GramPlan.contract`."""
    c = plan.c
    sizes = [min(n, s + chunk) - s for s in range(0, n, chunk)]
    k = len(sizes)
    # snake: the held chunk h meets every chunk not done yet; the last one streamed is held next
    captured, done, h = sizes[0], {0}, 0
    pair_list: list[tuple[int, int]] = []
    while len(done) < k:
        todo = [j for j in range(k) if j not in done]
        for j in todo:
            pair_list.append((h, j))
            captured += sizes[j]
        h = todo[-1]
        done.add(h)
    total = pass_flops * captured
    for lay in plan.layers:
        per_sample = 2.0 * c * lay.positions * lay.numel      # per-row gradients of one sample
        kind = plan.storage[lay.name]
        if kind == "rows":
            total += per_sample * captured
        elif kind == "raw":
            step = _raw_step(lay, c, itemsize, budget)
            rebuilt = 0
            for m in sizes:                                     # diagonal blocks: i once, j per block above
                blocks = [min(m, s + step) - s for s in range(0, m, step)]
                rebuilt += m + sum(sum(blocks[b + 1:]) for b in range(len(blocks)))
            for i, j in pair_list:                              # off-diagonal: i once, j once per i-block
                rebuilt += sizes[i] + -(-sizes[i] // step) * sizes[j]
            total += per_sample * rebuilt
    return total


def _symmetric_schedule(engine: JacobianRows, x: Inputs, n: int, method: str, itemsize: int,
                        held_budget: int, contraction_budget: int | None = None) -> list[tuple[_GramPlan, int]]:
    """How to contract a symmetric Gram whose factors do not fit: [(plan of a layer group, chunk size)].

    Two ways; the one with fewer FLOPs beyond the contraction itself wins (:func:`_schedule_flops`:
    captures, per-row gradients built and rebuilt; "NTK memory" in docs/decisions/index.md):
    * all layers at once, the samples in chunks: a chunk pair needs both chunks held, so chunks are half
      of what fits, and the snake order of :func:`_symmetric_gram` captures 1 + k(k−1)/2 chunks;
    * layer groups, packed from the output side so that each group's factors of **all** samples fit (a
      group too large alone is chunked as above): one capture pass per group, and the c backward passes
      of a group stop at its earliest layer, so groups near the output cost little more than a forward.
    Θ is the sum of the groups' Grams (each parameter belongs to exactly one group)."""
    c = engine.num_classes
    x1 = x[:1]
    budget = held_budget // 3 if contraction_budget is None else contraction_budget
    generic_elems = c * sum(engine.params[k].numel() for k in engine.generic_names)

    def option(layers, generic):
        plan = _GramPlan(engine, n, n, method, itemsize, held_budget, layers=layers, generic=generic)
        fit = int(held_budget // max(plan.per_sample_bytes, 1))
        chunk = n if fit >= n else max(1, fit // 2)
        cost = _schedule_flops(plan, n, chunk, _pass_flops(engine, x1, layers, generic), budget, itemsize)
        return plan, chunk, cost

    plan, chunk, whole_cost = option(engine.layers, True)
    whole = [(plan, chunk)]
    # groups from the output side (modules register roughly in forward order)
    capacity = held_budget // (itemsize * n)
    groups: list[list[_Layer]] = []
    current: list[_Layer] = []
    used = generic_elems  # the fallback parameters' rows travel with the first group built (the last layers)
    for lay in reversed(engine.layers):
        need = _min_bytes_per_sample(engine, lay, n, method)
        if current and used + need > capacity:
            groups.append(current)
            current, used = [], 0
        current.append(lay)
        used += need
    if current:
        groups.append(current)
    if len(groups) <= 1:
        return whole
    grouped, grouped_cost = [], 0.0
    for g, layers in enumerate(groups):
        plan, chunk, cost = option([lay for lay in engine.layers if lay in layers], g == 0)   # forward order
        grouped.append((plan, chunk))
        grouped_cost += cost
    return grouped if grouped_cost < whole_cost else whole


def ntk_gram_schedule(model: nn.Module, x1: Inputs, n: int, *, memory_budget_bytes: int = DEFAULT_BUDGET,
                      method: str = "auto") -> dict:
    """How :func:`ntk_gram` will contract the symmetric Gram of ``n`` samples like ``x1`` within the budget,
    without running it: {"schedule": "held" (every factor at once) | "layer groups" | "chunks",
    "groups": number of layer groups, "chunks": [chunks per group], "extra_flops": FLOPs of captures and
    per-row-gradient (re)builds beyond the single pass that :func:`ntk_gram_flops` counts (≥ 0)}."""
    engine = JacobianRows(model, x1[:1])
    c = engine.num_classes
    dtype = next(iter(engine.params.values())).dtype
    isz = torch.tensor([], dtype=dtype).element_size()
    held_budget, contraction_budget = 3 * memory_budget_bytes // 5, memory_budget_bytes // 5
    plan = _GramPlan(engine, n, n, method, isz, held_budget)
    if int(held_budget // max(plan.per_sample_bytes, 1)) >= n:
        return {"schedule": "held", "groups": 1, "chunks": [1], "extra_flops": 0.0}
    sched = _symmetric_schedule(engine, x1[:1], n, method, isz, held_budget, contraction_budget)
    cost = sum(_schedule_flops(p, n, chunk, _pass_flops(engine, x1[:1], p.layers, bool(p.generic_names)),
                               contraction_budget, isz) for p, chunk in sched)
    once = n * _pass_flops(engine, x1[:1], engine.layers, True) + sum(
        2.0 * c * n * lay.positions * lay.numel for lay in engine.layers if plan.contraction[lay.name] == "explicit")
    return {"schedule": "layer groups" if len(sched) > 1 else "chunks", "groups": len(sched),
            "chunks": [-(-n // chunk) for _, chunk in sched], "extra_flops": max(0.0, cost - once)}

