"""A Mixed-Linear model from the user's own trained network and data: no ``Split``, no core training.

    state = ml_from_network(net, x, y)                       # linearise the head (found by name), fit w_u
    out = forget_request(state, x, y, ids)                   # exact, or certified with budget_nats=…

The network's weights are the core weights w_c as given (frozen, eval mode: BatchNorm uses its running
statistics). The layers named by ``linearize`` (parameter-name prefixes; default: the head, found as
``head``, ``fc``, ``classifier``, ``get_classifier()`` or the last ``nn.Linear``) become the linear part:
their trained values are **discarded** and replaced by a data-independent centre (``center='zero'``: zeros,
the default for a head that is one affine layer; ``'init'``: the layers' own ``reset_parameters()`` under
``seed``, the default when more than one layer is linearised — a head that is a two-layer ``Sequential``
included — since at a zero centre every layer but the last has a zero Jacobian, and the last one's inputs
vanish too: a zero centre there is refused with that reason), and the
user weights w_u are trained from 0 on (x, y) with the mean MSE to s·onehot + (µ/2)‖w_u‖² — the exact
minimiser, by the solver chosen by size (primal, dual or CG).

What the user gives up (docs/decisions/mlforgetting.md, "ML-Forgetting at realistic sizes"): the linearised layers are
retrained from zero as a linear model on the user data, so their accuracy is that of the linearised
model, not of the trained network; and forgetting is exact (or certified) for the linearised weights only —
the frozen layers, and the BatchNorm running statistics of the linearised layers, keep whatever they
learned from the data they were trained on, forgotten samples included. The guarantee is the thesis's only
when the frozen part never saw deletable data (trained on a core set).
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from scrubnet.mlforget.model import MLConfig, MLState, train_exact_factored
from scrubnet.models import eval_mode
from scrubnet.models.call import Inputs, call_model, input_parts
from scrubnet.models.linearized import LinearizedModel, select_parameter_names


def find_head(model: nn.Module) -> str:
    """The qualified name of the classifier head: ``head``, ``fc``, ``classifier``, the module returned by
    ``get_classifier()``, else the last ``nn.Linear``; ``ValueError`` when there is none."""
    named = dict(model.named_modules())
    for name in ("head", "fc", "classifier"):
        mod = named.get(name)
        if mod is not None and any(True for _ in mod.parameters()):
            return name
    if callable(getattr(model, "get_classifier", None)):
        target = model.get_classifier()
        for name, mod in named.items():
            if mod is target and name:
                return name
    linears = [n for n, m in named.items() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1]
    raise ValueError("no classifier head found (no head/fc/classifier, no get_classifier(), no nn.Linear); "
                     "name the layers to linearise")


def _owning_layers(model: nn.Module, names: list[str]) -> list[str]:
    """The modules owning the linearised parameters ``names`` (those holding a weight), in order."""
    owners = []
    for n in names:
        owner = n.rsplit(".", 1)[0] if "." in n else ""
        if n.endswith("weight") and owner not in owners:
            owners.append(owner)
    return owners


@torch.no_grad()
def _reset(model: nn.Module, names: list[str], center: str, seed: int) -> None:
    params = dict(model.named_parameters())
    if center == "zero":
        for n in names:
            params[n].zero_()
        return
    owners = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in names})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for owner in owners:
            mod = model.get_submodule(owner) if owner else model
            if not callable(getattr(mod, "reset_parameters", None)):
                raise ValueError(f"layer {owner!r} has no reset_parameters(); use center='zero'")
            fresh = copy.deepcopy(mod)
            fresh.reset_parameters()
            fp = dict(fresh.named_parameters(recurse=False))
            for pn, p in mod.named_parameters(recurse=False):
                full = f"{owner}.{pn}" if owner else pn
                if full in names:
                    p.copy_(fp[pn])  # parameters only: buffers (running statistics) stay as trained


def ml_from_network(model: nn.Module, x: Inputs, y: Tensor, num_classes: int | None = None, *,
                    linearize: list[str] | str | None = None, config: MLConfig | None = None,
                    center: str | None = None, seed: int = 0) -> MLState:
    """The ML model of ``model`` on the user data (x, y) (module docstring): all N samples are user data,
    deletable; no core ids. ``config`` defaults to ``MLConfig(leaky_slope=None)`` (the user's activations
    are kept); its ``linearize`` is replaced by the names linearised here. ``x`` may be a
    :class:`~scrubnet.models.call.ModelInputs` (e.g. token ids with an attention mask); ``num_classes``
    defaults to the width of the network's output on the first samples. Returns the trained state."""
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"x and y must hold the same positive number of samples, got {len(x)} and {len(y)}")
    if not all(bool(torch.isfinite(t).all()) for t in input_parts(x) if t.is_floating_point()):
        raise ValueError("the data x contain non-finite values (NaN or inf)")
    if num_classes is None:  # the width of the network's output on one batch
        with torch.no_grad(), eval_mode(model):
            num_classes = int(call_model(model, x[:2]).shape[-1])
    c = int(num_classes)
    if int(y.min()) < 0 or int(y.max()) >= c:
        raise ValueError(f"labels must lie in [0, {c}), got [{int(y.min())}, {int(y.max())}]")
    prefixes = [find_head(model)] if linearize is None else ([linearize] if isinstance(linearize, str)
                                                             else list(linearize))
    core = copy.deepcopy(model).eval()
    names = select_parameter_names(core, prefixes)
    layers = _owning_layers(core, names)
    if center is None:
        center = "zero" if linearize is None and len(layers) == 1 else "init"
    if center not in ("zero", "init"):
        raise ValueError(f"center must be 'zero' or 'init', got {center!r}")
    if center == "zero" and len(layers) > 1:
        raise ValueError(f"center='zero' linearises {len(layers)} layers ({', '.join(layers[:3])}) at zero, where "
                         "the Jacobian of every layer but the last vanishes (and the last one's inputs with it): "
                         "the linear model could fit nothing but biases; use center='init'")
    _reset(core, names, center, seed)
    cfg = copy.deepcopy(config) if config is not None else MLConfig(leaky_slope=None)
    cfg.linearize = list(prefixes)
    lin = LinearizedModel(core, prefixes=prefixes, leaky_slope=cfg.leaky_slope)
    ids = torch.arange(len(y))
    state = MLState(lin, torch.zeros(0, dtype=torch.long), ids, torch.zeros(0, dtype=torch.long), cfg, c, int(seed))
    state.space(x)
    train_exact_factored(state, x, y, torch.Generator().manual_seed(7919 * int(seed) + 11))
    return state
