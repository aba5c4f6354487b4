"""Per-sample Jacobian rows of a network in a subset of its weights, for any model input.

J_i = ∂f(x_i)/∂w ∈ R^{c×p} for every sample of a batch, by the first of three paths that applies:

1. **Layer hooks** (when every differentiated parameter is the weight or bias of a layer the kernel registry of
   :mod:`scrubnet.curvature.kernels` covers — Linear, Conv, eval-mode BatchNorm; LoRA's B factor and a
   classifier head are Linear): one batched forward pass with a zero tangent added to each such layer's output,
   c backward passes to those tangents, and the kernel's closed form Σ_t g_t a_tᵀ per sample. No ``vmap`` over
   samples, so it runs on forwards with data-dependent control flow. Checked once per network against path 3
   on two samples (a hook that never fires, a weight used outside its layer); on a mismatch the network keeps
   to paths 2–3.
2. One ``jacrev`` per sample, vmapped over the samples (``torch.func.vmap``).
3. One sample at a time (the same numbers, a Python loop), where the forward cannot be vmapped over its inputs —
   a HuggingFace transformer inspects its attention mask (``mask.all()``) to pick a kernel. The model is called through
:func:`~scrubnet.models.call.call_functional`, so a :class:`~scrubnet.models.call.ModelInputs` brings its
extra inputs (attention masks) along.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.func import jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from scrubnet.curvature.kernels import kernel_for
from scrubnet.models.call import Inputs, call_functional

# per network: {tuple of names: whether the hook path reproduced the per-sample rows}
_HOOKS_AGREE: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], bool]]" = weakref.WeakKeyDictionary()
_AGREE_RTOL = 1e-6


def per_sample_jacobian(net: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], names: list[str],
                        x: Inputs, num_classes: int) -> Tensor:
    """The Jacobians of ``net``'s logits in the parameters ``names`` at ``params``, one per sample.

    Parameters
    ----------
    net : nn.Module
        Called as ``functional_call(net, (params, buffers), x)``; must be in eval mode (per-sample outputs).
    params, buffers : dict of str to Tensor
        Every parameter and buffer of ``net``.
    names : list of str
        The parameters differentiated (their order is the columns' order, each flattened).
    x : Tensor or ModelInputs, B samples
    num_classes : int
        c, the number of logits.

    Returns
    -------
    Tensor, shape (B, c, p)
        p = the total size of the parameters ``names``.
    """
    frozen = {n: p for n, p in params.items() if n not in set(names)}
    w = {n: params[n] for n in names}

    def f(wd, xi):
        return call_functional(net, ({**frozen, **wd}, buffers), xi.unsqueeze(0)).squeeze(0)

    b = len(x)
    with sdpa_kernel([SDPBackend.MATH]):  # the fused CPU attention kernels have no batching rule
        layers = _covering_layers(net, names)
        if layers is not None:
            agree = _HOOKS_AGREE.setdefault(net, {})
            key = tuple(names)
            if key not in agree:   # the slow twin on two samples decides once per network
                probe = x[:2]
                fast = _hook_rows(net, params, buffers, layers, names, probe, num_classes)
                slow = _loop_rows(f, w, probe, len(probe), names, num_classes)
                scale = float(slow.abs().max()) or 1.0
                agree[key] = fast.shape == slow.shape and float((fast - slow).abs().max()) <= _AGREE_RTOL * scale
            if agree[key]:
                return _hook_rows(net, params, buffers, layers, names, x, num_classes)
        return _rows(f, w, x, b, names, num_classes)


def _covering_layers(net: nn.Module, names: list[str]) -> dict[str, tuple[nn.Module, dict[str, str]]] | None:
    """{module name: (module, {"weight"/"bias": full parameter name})} when every name in ``names`` is the
    weight or bias of a module the kernel registry covers, else None."""
    wanted, layers, found = set(names), {}, set()
    for mname, m in net.named_modules():
        own = {pn: (f"{mname}.{pn}" if mname else pn) for pn, _ in m.named_parameters(recurse=False)}
        mine = {pn: full for pn, full in own.items() if full in wanted}
        if not mine:
            continue
        if kernel_for(m) is None or set(mine) - {"weight", "bias"}:
            return None
        layers[mname] = (m, mine)
        found.update(mine.values())
    return layers if found == wanted else None


def _hook_rows(net: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
               layers: dict[str, tuple[nn.Module, dict[str, str]]], names: list[str], x: Inputs,
               num_classes: int) -> Tensor:
    """Path 1 of the module docstring: (B, c, p) from layer inputs a and output gradients g = ∂f_k/∂out."""
    inputs: dict[str, list[Tensor]] = {}
    tangents: list[tuple[str, Tensor]] = []

    def make_hook(name):
        def hook(mod, inp, out):
            z = torch.zeros_like(out, requires_grad=True)   # ∂f/∂z = ∂f/∂out, whatever requires grad upstream
            inputs.setdefault(name, []).append(inp[0].detach())
            tangents.append((name, z))
            return out + z
        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, (m, _) in layers.items()]
    try:
        with torch.enable_grad():
            logits = call_functional(net, ({k: v.detach() for k, v in params.items()}, buffers), x)
    finally:
        for h in handles:
            h.remove()
    b, zs = len(x), [z for _, z in tangents]
    grads = [torch.autograd.grad(logits[:, k].sum(), zs, retain_graph=k < num_classes - 1, allow_unused=True)
             for k in range(num_classes)]
    per_param: dict[str, Tensor] = {}
    calls: dict[str, int] = {}
    for j, (name, z) in enumerate(tangents):
        mod, mine = layers[name]
        g = torch.stack([torch.zeros_like(z) if grads[k][j] is None else grads[k][j] for k in range(num_classes)])
        a = inputs[name][calls.get(name, 0)]
        calls[name] = calls.get(name, 0) + 1
        grads_of = kernel_for(mod).per_sample_grads(mod, a, g)               # {"weight"/"bias": (B, c, numel)}
        for pname, full in mine.items():
            r = grads_of[pname]
            per_param[full] = per_param[full] + r if full in per_param else r   # summed over calls (sharing)
    missing = [n for n in names if n not in per_param]
    if missing:   # a layer whose hook never fired: the probe against the per-sample rows will refuse it
        for n in missing:
            per_param[n] = torch.zeros(b, num_classes, params[n].numel(), dtype=logits.dtype, device=logits.device)
    return torch.cat([per_param[n].reshape(b, num_classes, -1) for n in names], 2).detach()


def _rows(f, w: dict[str, Tensor], x: Inputs, b: int, names: list[str], num_classes: int) -> Tensor:
    """Paths 2–3 of the module docstring."""
    try:
        jac = vmap(jacrev(f), in_dims=(None, 0))(w, x)
    except RuntimeError as e:
        if "vmap" not in str(e):
            raise
        # data-dependent control flow in the forward (module docstring): one sample at a time
        return _loop_rows(f, w, x, b, names, num_classes)
    return torch.cat([jac[n].reshape(b, num_classes, -1) for n in names], 2)


def _loop_rows(f, w: dict[str, Tensor], x: Inputs, b: int, names: list[str], num_classes: int) -> Tensor:
    """Path 3: one ``jacrev`` per sample (the slow twin of the other paths)."""
    per = [jacrev(f)(w, x[i]) for i in range(b)]
    return torch.cat([torch.stack([r[n] for r in per]).reshape(b, num_classes, -1) for n in names], 2)
