"""The frozen prefix of a Mixed-Linear model, computed once: features in, linearised part only.

When only the layers after some point are linearised (the head, or the last block and the head), every
Jacobian product J(x)·v and Jᵀu of the ML model runs the frozen layers before that point again — the same
numbers at every CG iteration, every Gram block and every request. Split the network

    f(x) = s(h(x)),    h = the frozen prefix (no linearised parameter),  s = the rest (all linearised ones),

then J_f(x) = J_s(h(x)) exactly (the prefix does not depend on w_u), so the ML model's products are those
of ``LinearizedModel(s)`` on the features h(x): computed once, streamed in chunks in the model's own dtype
(float32 for a float32 network: no float64 copy of the inputs is ever held), kept for the process.

The split is found by tracing the network (``torch.fx``): the cut is the input of the first operation that
touches a linearised parameter, and it is valid only when every later operation reads nothing computed
before the cut but that one tensor (a skip connection from earlier layers into the linearised part makes
it invalid: then there is no prefix and the products run through the whole network as before). A network
that cannot be traced, or a split whose s(h(x)) differs from f(x) on the first samples, is not split.

The head block: when the linearised part is exactly one ``nn.Linear`` applied last (the default "linearise
the head"), J(x) = I_c ⊗ [h(x); 1]ᵀ, so JᵀJ is block diagonal with c equal blocks ΦᵀΦ (Φ = [H, 1]);
:attr:`PrefixSplit.head_linear` says so (the primal path factors the (d+1)×(d+1) block once).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.fx as fx
from torch import Tensor, nn

from scrubnet.models.linearized import LinearizedModel
from scrubnet.models.call import call_model, input_parts


def _module_touches(target: str, names: set[str]) -> bool:
    return any(n.startswith(target + ".") for n in names)


def split_network(model: nn.Module, linearized_names: list[str]) -> tuple[nn.Module, nn.Module] | None:
    """(prefix h, suffix s) with f = s ∘ h, s holding every parameter named in ``linearized_names`` and h none
    of them, or None when no such split exists or is found (module docstring). Both are ``GraphModule`` s
    sharing ``model``'s submodules' qualified names (s's parameters keep their names)."""
    names = set(linearized_names)
    try:
        gm = fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - any tracing failure means: no prefix, the full network is used
        return None
    nodes = list(gm.graph.nodes)
    cut = None
    for i, node in enumerate(nodes):
        if (node.op == "call_module" and _module_touches(str(node.target), names)) or \
                (node.op == "get_attr" and str(node.target) in names):
            cut = i
            break
    if cut is None:
        return None
    first = nodes[cut]
    if first.op != "call_module" or not first.args or not isinstance(first.args[0], fx.Node):
        return None
    h = first.args[0]
    if h.op == "placeholder":
        return None  # nothing before the linearised part: no prefix to cache
    before = set(nodes[:cut])
    for node in nodes[cut:]:
        for a in node.all_input_nodes:
            if a in before and a is not h and a.op != "get_attr":
                return None  # the linearised part reads something computed before the cut besides h
    # the prefix: every node up to h, output h
    pg = fx.Graph()
    env: dict = {}
    for node in nodes:
        env[node] = pg.node_copy(node, lambda n: env[n])
        if node is h:
            break
    pg.output(env[h])
    # the suffix: a placeholder for h, then the nodes from the cut on (get_attr nodes copied when used)
    sg = fx.Graph()
    senv: dict = {h: sg.placeholder("features")}

    def arg(n):
        if n not in senv:
            if n.op != "get_attr":
                raise KeyError(n)
            senv[n] = sg.node_copy(n, arg)
        return senv[n]

    for node in nodes[cut:]:
        senv[node] = sg.node_copy(node, arg)
    prefix = fx.GraphModule(model, pg).eval()
    suffix = fx.GraphModule(model, sg).eval()
    if not set(linearized_names) <= {n for n, _ in suffix.named_parameters()}:
        return None
    prefix_params = [n for n, _ in prefix.named_parameters()]
    if not prefix_params or any(n in names for n in prefix_params):
        return None  # a prefix without weights (a reshape) saves nothing
    return prefix, suffix


class PrefixSplit:
    """The frozen prefix of an ML module and its linearised suffix, with the features cache.

    ``model``: the ML module (:class:`~scrubnet.models.linearized.LinearizedModel` of the whole network);
    ``suffix_model``: a :class:`LinearizedModel` of the suffix with the same linearised names in the same
    order (flat user-weight vectors are interchangeable), Δw kept at 0 (products never read it);
    :meth:`features` maps inputs x (N, …) to h(x) (N, …) in the network's dtype, computed once per input tensor.
    """

    def __init__(self, model: LinearizedModel, prefix: nn.Module, suffix: nn.Module, chunk: int = 1024):
        self.prefix = prefix.eval()
        for p in self.prefix.parameters():
            p.requires_grad_(False)
        lin = LinearizedModel(suffix, prefixes=list(model.linearized_names))
        params = dict(lin.base.named_parameters())
        lin.linearized_names = list(model.linearized_names)  # the ML module's order, not the graph's
        lin.delta = nn.ParameterList([nn.Parameter(torch.zeros_like(params[n])) for n in lin.linearized_names])
        self.suffix_model = lin
        self.chunk = int(chunk)
        self._key = None
        self._x = None
        self._h = None
        self.seconds = 0.0
        self.head_linear = self._is_head_linear()

    @classmethod
    def of(cls, model: LinearizedModel, chunk: int = 1024, check: Tensor | None = None) -> "PrefixSplit | None":
        """The split of ``model``'s network, or None (module docstring). With ``check`` (a few inputs), the
        split is kept only if s(h(x)) equals f(x) on them (to the dtype's rounding)."""
        parts = split_network(model.base, list(model.linearized_names))
        if parts is None:
            return None
        split = cls(model, *parts, chunk=chunk)
        if check is not None and len(check):
            with torch.no_grad():
                full = call_model(model.base, check)
                via = call_model(split.suffix_model.base, call_model(split.prefix, check))
            tol = 1e3 * torch.finfo(full.dtype).eps * float(full.abs().max().clamp_min(1.0))
            if full.shape != via.shape or float((full - via).abs().max()) > tol:
                return None
        return split

    def _is_head_linear(self) -> bool:
        """True when the suffix is exactly one nn.Linear whose weight (and bias) are the linearised parameters."""
        g = self.suffix_model.base.graph
        ops = [n for n in g.nodes if n.op not in ("placeholder", "output")]
        if len(ops) != 1 or ops[0].op != "call_module":
            return False
        mod = self.suffix_model.base.get_submodule(str(ops[0].target))
        if not isinstance(mod, nn.Linear):
            return False
        want = [f"{ops[0].target}.weight"] + ([f"{ops[0].target}.bias"] if mod.bias is not None else [])
        return self.suffix_model.linearized_names == want

    def __deepcopy__(self, memo):
        """Copies share the frozen modules and the features cache (nothing in them is ever modified): a copied
        ML state must not recompute the prefix pass."""
        other = copy.copy(self)
        memo[id(self)] = other
        return other

    @torch.no_grad()
    def features(self, x: Tensor) -> Tensor:
        """h(x), streamed in chunks of ``chunk`` samples, cached for the last input tensor seen."""
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype, t.device, getattr(t, "_version", 0)) for t in input_parts(x))
        if self._key == key and self._x is x:
            return self._h
        t0 = time.perf_counter()
        outs = [call_model(self.prefix, x[i:i + self.chunk]) for i in range(0, len(x), self.chunk)]
        h = torch.cat(outs) if outs else call_model(self.prefix, x[:0])
        self.seconds += time.perf_counter() - t0
        self._key, self._x, self._h = key, x, h
        return h
