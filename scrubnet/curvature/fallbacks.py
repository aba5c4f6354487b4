"""Which autodiff path each curvature product takes on a given model, chosen once per model by probing.

torch lacks some rules that the fast paths need: forward-mode AD (``torch.func.jvp``) has no rule for the
fused CPU kernels (``aten::_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``, the fused
SDPA kernels, ``mkldnn_rnn_layer``); ``torch.func.vmap`` over samples fails on RNNs and on code with
data-dependent control flow (HuggingFace's attention-mask code); and a forward hook on a layer sees nothing
when its weight is used functionally (``nn.MultiheadAttention``'s ``out_proj``) or when the weight is tied
to another layer. For each, a mathematically equal path exists:

* ``kernels="non-fused"`` — the fused kernels switched off (``torch.backends.mha`` fast path, oneDNN,
  SDPA restricted to its math backend): the same function from differentiable primitives;
* ``jvp="double-vjp"`` — J v as the VJP of u ↦ Jᵀu (linear in u) with cotangent v: two reverse passes
  instead of one forward-mode pass;
* ``per_sample="loop"`` — per-sample gradients one sample at a time (batch 1, one backward per cotangent)
  instead of ``vmap``;
* ``layer_table`` — parameters whose layer kernel does not reproduce autograd's gradient on the probe batch
  (hook never fired, weight tied or also used functionally) are ``unhooked``: their Jacobian rows and Fisher
  terms come from the per-sample (autograd) path instead of the layer table.

:func:`probe_paths` decides on two samples (every check compares numbers, not only whether something
raises) and caches the frozen :class:`AutodiffPaths` per model; :func:`force_paths` overrides it (tests
compare fast paths and fallbacks). :func:`cost_multipliers` prices the choice for the cost model.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.func import jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

from scrubnet.curvature.kernels import func_per_sample_grads, kernel_for, loop_per_sample_grads
from scrubnet.models import eval_mode
from scrubnet.models.call import call_functional, call_model


@dataclass(frozen=True)
class AutodiffPaths:
    """The paths chosen for one model (module docstring).

    kernels:    "default" | "non-fused"; jvp: "forward" | "double-vjp"; per_sample: "vmap" | "loop";
    unhooked:   names of trainable parameters that the layer table does not cover (autograd path).
    """

    kernels: str = "default"
    jvp: str = "forward"
    per_sample: str = "vmap"
    unhooked: tuple[str, ...] = ()

    @property
    def layer_table(self) -> str:
        return "hooks" if not self.unhooked else "hooks+autograd"

    @property
    def any_fallback(self) -> bool:
        return self != AutodiffPaths(unhooked=self.unhooked) or bool(self.unhooked)

    def as_dict(self) -> dict:
        """What a method's report carries as ``report["fallbacks"]``."""
        return {"kernels": self.kernels, "jvp": self.jvp, "per_sample": self.per_sample,
                "layer_table": self.layer_table, "unhooked": list(self.unhooked)}

    def context(self) -> contextlib.AbstractContextManager:
        """The context every model call of this model runs in (non-fused kernels where chosen)."""
        return non_fused_kernels() if self.kernels == "non-fused" else contextlib.nullcontext()


@contextlib.contextmanager
def non_fused_kernels() -> Iterator[None]:
    """Switch off the fused CPU kernels (MHA/TransformerEncoder fast path, oneDNN RNNs and convolutions)
    and restrict SDPA to its math backend; the previous settings are restored."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.backends.mkldnn.flags(enabled=False), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


# ---- the products each path computes ---------------------------------------------------------------

def jvp_with_pullback(f: Callable[[dict], Tensor], params: dict[str, Tensor], tangent: dict[str, Tensor],
                      paths: AutodiffPaths) -> tuple[Tensor, Tensor, Callable]:
    """(f(w), J v, pullback u ↦ (Jᵀu,)) for a function f of a parameter dict: forward-mode J v, or the
    double-VJP J v = ∂/∂u ⟨Jᵀu, v⟩ (exact: Jᵀu is linear in u)."""
    out, pull = vjp(f, params)
    if paths.jvp == "forward":
        _, jv = jvp(f, (params,), (tangent,))
        return out, jv, pull
    _, pull_u = vjp(lambda u: pull(u)[0], torch.zeros_like(out))
    (jv,) = pull_u(tangent)
    return out, jv, pull


# ---- probing -----------------------------------------------------------------------------------------

_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_FORCED: dict[str, object] = {}


@contextlib.contextmanager
def force_paths(**fields) -> Iterator[None]:
    """Override fields of every probed :class:`AutodiffPaths` inside the block (tests: run a fallback where
    the fast path also runs, and compare)."""
    bad = set(fields) - {"kernels", "jvp", "per_sample", "unhooked"}
    if bad:
        raise ValueError(f"unknown path fields {sorted(bad)}")
    old = dict(_FORCED)
    _FORCED.update(fields)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(old)


def _signature(model: nn.Module, x) -> tuple:
    extras = tuple(sorted(getattr(x, "extras", {}) or {}))
    return (tuple((k, p.requires_grad, p.dtype, tuple(p.shape)) for k, p in model.named_parameters()),
            tuple(x.shape[1:]), x.dtype, extras)


def probe_paths(model: nn.Module, x) -> AutodiffPaths:
    """The :class:`AutodiffPaths` of ``model`` on inputs like ``x`` (probed on its first two samples, in
    eval mode; cached per model and input signature; :func:`force_paths` applies on top)."""
    sig = _signature(model, x)
    hit = _CACHE.get(model)
    if hit is None or hit[0] != sig:
        with eval_mode(model):
            paths = _probe(model, x[:2])
        _CACHE[model] = (sig, paths)
        hit = _CACHE[model]
    return replace(hit[1], **_FORCED) if _FORCED else hit[1]


def _close(a: Tensor, b: Tensor, scale: float = 0.0) -> bool:
    """‖a − b‖ ≤ tol·max(‖a‖, ‖b‖, scale): ``scale`` (the norm of the whole gradient) keeps a parameter whose
    gradient is zero up to rounding (a key bias under softmax) from failing on relative noise."""
    tol = 1e-8 if a.dtype == torch.float64 else 1e-3
    scale = max(float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b)), scale, 1e-30)
    return float(torch.linalg.vector_norm(a - b)) <= tol * scale


def _try(fn: Callable[[], bool]) -> bool:
    try:
        return bool(fn())
    except Exception:   # noqa: BLE001 — any failure of a fast path means: take its fallback
        return False


def _probe(model: nn.Module, x) -> AutodiffPaths:
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    if not params:
        return AutodiffPaths()
    g = torch.Generator().manual_seed(0)
    dtype = next(iter(params.values())).dtype
    tangent = {k: torch.randn(v.shape, generator=g, dtype=v.dtype).to(v.device) for k, v in params.items()}

    def f(p):
        return call_functional(model, (p, buffers), x)

    def jvp_ok() -> bool:
        _, jv_rev, _ = jvp_with_pullback(f, params, tangent, AutodiffPaths(jvp="double-vjp"))
        _, jv = jvp(f, (params,), (tangent,))
        return _close(jv, jv_rev)

    c = f(params).shape[-1]
    cot = torch.randn(len(x), 1, c, generator=g, dtype=dtype).to(next(iter(params.values())).device)
    names = list(params)

    def vmap_ok() -> bool:
        fast = func_per_sample_grads(model, params, names, buffers, x, cot, per_sample="vmap")
        slow = loop_per_sample_grads(model, params, names, buffers, x, cot)
        total = float(torch.linalg.vector_norm(torch.cat([slow[k].reshape(-1) for k in names])))
        return all(_close(fast[k], slow[k], total) for k in names)

    ok_default = (_try(jvp_ok), _try(vmap_ok))
    kernels = "default"
    ok = ok_default
    if not all(ok_default):
        with non_fused_kernels():
            ok_nf = (_try(jvp_ok), _try(vmap_ok))
        if sum(ok_nf) > sum(ok_default):
            kernels, ok = "non-fused", ok_nf
    paths = AutodiffPaths(kernels=kernels, jvp="forward" if ok[0] else "double-vjp",
                          per_sample="vmap" if ok[1] else "loop")
    with paths.context():
        unhooked = unhooked_params(model, x, params)
    return replace(paths, unhooked=tuple(unhooked))


def unhooked_params(model: nn.Module, x, params: dict[str, Tensor]) -> list[str]:
    """Trainable parameters of kernel-covered layers (:func:`~scrubnet.curvature.kernels.kernel_for`) whose
    kernel gradient, from the hooked (input, output gradient) pairs of the layer summed over its calls, does
    not equal autograd's gradient of a random projection of the logits on ``x``: the hook never fired (the
    weight is used functionally), or the weight is tied to or also used outside the layer."""
    mods = {}
    for mname, m in model.named_modules():
        own = {pn: (f"{mname}.{pn}" if mname else pn) for pn, p in m.named_parameters(recurse=False)
               if p.requires_grad}
        own = {pn: full for pn, full in own.items() if full in params}
        if kernel_for(m) is not None and own and set(own) <= {"weight", "bias"}:
            mods[mname] = (m, own)
    if not mods:
        return []
    seen: dict[str, list] = {k: [] for k in mods}

    def make_hook(name):
        def hook(mod, inp, out):
            out2 = out.clone()
            seen[name].append((inp[0].detach(), out2))
            return out2
        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, (m, _) in mods.items()]
    named = dict(model.named_parameters())
    leaves = [named[k] for k in params]
    try:
        with torch.enable_grad():
            logits = call_model(model, x)
            w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
            outs = [o for n in mods for _, o in seen[n]]
            grads = torch.autograd.grad((logits * w.to(logits.device)).sum(), leaves + outs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    true = {k: g for k, g in zip(params, grads[:len(leaves)])}
    out_grads = iter(grads[len(leaves):])
    total = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in true.values() if g is not None]
                                                     or [torch.zeros(1)])))
    bad = []
    for name, (m, own) in mods.items():
        calls = [(a, next(out_grads)) for a, _ in seen[name]]
        if not calls:
            bad.extend(v for v in own.values() if v in params)
            continue
        got: dict[str, Tensor] = {}
        for a, go in calls:
            if go is None:
                continue
            for pn, t in kernel_for(m).per_sample_grads(m, a, go.unsqueeze(0)).items():
                s = t.sum((0, 1))
                got[pn] = got[pn] + s if pn in got else s
        for pn, full in own.items():
            ref = true.get(full)
            ref = torch.zeros_like(named[full]) if ref is None else ref
            mine = got.get(pn, torch.zeros_like(ref.reshape(-1)))
            if not _close(mine.reshape(-1), ref.reshape(-1), total):
                bad.append(full)
    return sorted(set(bad) & set(params))


def cost_multipliers(paths: AutodiffPaths) -> dict[str, float]:
    """Factors the cost model applies for the chosen paths.

    Returns {"jvp": FLOPs of one J v relative to forward-mode AD (1; the double-VJP runs a reverse pass to
    build u ↦ Jᵀu and reverse-differentiates it: ≈ 2), "per_sample_batch1": 1.0 when per-sample gradients
    run one sample at a time (same FLOPs, n passes at batch 1 instead of n/B vectorised ones) else 0.0,
    "unhooked_params": number of parameters priced at the per-sample path instead of the layer table}."""
    return {"jvp": 2.0 if paths.jvp == "double-vjp" else 1.0,
            "per_sample_batch1": 1.0 if paths.per_sample == "loop" else 0.0,
            "unhooked_params": float(len(paths.unhooked))}


def fallbacks_report(model: nn.Module, data) -> dict:
    """``report["fallbacks"]`` of a method: the paths :func:`probe_paths` chooses for ``model`` on the first
    samples of ``data`` (inputs, an (x, y) pair, or a stream with ``chunks()``)."""
    x = data
    if hasattr(data, "chunks"):
        x = next(iter(data.chunks(2)))[0]
    elif isinstance(data, (tuple, list)):
        x = data[0]
    return probe_paths(model, x).as_dict()
