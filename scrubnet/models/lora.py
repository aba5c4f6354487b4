"""Low-rank adapters (LoRA) in peft's convention, with the factor that enters linearly as the user weight.

An adapted ``nn.Linear`` computes

    y = W x + b + s · B A x,        A ∈ R^{r×d_in} fixed (random),  B ∈ R^{d_out×r} trainable, initial 0,

with s = ``alpha / rank`` (peft's ``lora_alpha / r``). Parameter names follow peft's layout without its adapter
name: ``<target>.base_layer.weight`` (the pretrained W, frozen), ``<target>.lora_A.weight`` (A) and
``<target>.lora_B.weight`` (B). ``target_modules`` match as in peft: a module whose qualified name equals a
target or ends with ``"." + target``.

**Why B is the user weight and A is fixed.** At the initial point B = 0 the adapter's output is 0 and its
Jacobian with respect to A is ``s·Bᵀ(…) = 0``: a tangent model in A (or in A and B jointly, whose A-block
vanishes) is degenerate. The Jacobian with respect to B is ``s·g (A x)ᵀ`` (g the output's sensitivity to the
layer's output): non-zero as soon as A is. With A fixed each adapted layer is affine in its B (no product of
two trained factors), so the tangent model differs from the adapted network only through the curvature of the
layers after it: not at all when the adapted layer is the last (the head), at second order in B otherwise.
The update ΔW = s·B A lives in the r-dimensional row space of the random A (LoRA-FA's parameterisation).

GPT-2's ``Conv1D`` (transformers; weight stored (d_in, d_out), y = x W + b) is adapted like an
``nn.Linear`` (peft does the same with ``fan_in_fan_out``): the adapter's A and B are the same, merging adds
(s·B A)ᵀ to its weight.

A is drawn like peft's default (``kaiming_uniform_(a=√5)``, the ``nn.Linear`` default) from ``seed``, so
the same spec on the same model gives the same adapter everywhere.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class LoRA:
    """Which layers get an adapter and how (module docstring).

    Parameters
    ----------
    target_modules : list of str
        Module names (or name suffixes, peft's matching) of the ``nn.Linear`` layers to adapt.
    rank : int
        r, the adapter's inner dimension.
    alpha : float, optional
        peft's ``lora_alpha``; the scale is ``alpha / rank`` (default ``alpha = rank``: scale 1).
    modules_to_save : list of str, optional
        Modules whose own parameters are also user weights (peft's ``modules_to_save``, e.g. a new
        classifier head), linearised around their given values.
    seed : int
        Seed of the fixed factors A.
    """

    target_modules: list[str]
    rank: int = 4
    alpha: float | None = None
    modules_to_save: list[str] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        self.target_modules = list(self.target_modules)
        self.modules_to_save = list(self.modules_to_save or [])
        if not self.target_modules:
            raise ValueError("LoRA needs at least one target module")
        if int(self.rank) < 1:
            raise ValueError(f"LoRA rank must be ≥ 1, got {self.rank}")
        self.rank = int(self.rank)

    @property
    def scale(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha) / self.rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_peft(cls, config, seed: int = 0) -> "LoRA":
        """The spec of a ``peft.LoraConfig`` (``target_modules``, ``r``, ``lora_alpha``, ``modules_to_save``)."""
        targets = config.target_modules
        if targets is None or isinstance(targets, str) and not targets:
            raise ValueError("the peft LoraConfig names no target_modules")
        if isinstance(targets, str):
            raise ValueError("a regular-expression target_modules is not supported; list the module names")
        return cls(sorted(targets), int(config.r), float(config.lora_alpha), list(config.modules_to_save or []),
                   seed)


class LoRALinear(nn.Module):
    """``base_layer(x) + scale · lora_B(lora_A(x))`` (module docstring); A fixed, B zero at construction.

    Parameters
    ----------
    base_layer : nn.Linear
        The pretrained layer (kept as given; its parameters are frozen by the caller).
    rank : int
    scale : float
    generator : torch.Generator
        Draws A.
    """

    def __init__(self, base_layer: nn.Module, rank: int, scale: float, generator: torch.Generator):
        super().__init__()
        d_in, d_out = _features(base_layer)
        w = base_layer.weight
        self.base_layer = base_layer
        self.lora_A = nn.Linear(d_in, rank, bias=False, dtype=w.dtype, device=w.device)
        self.lora_B = nn.Linear(rank, d_out, bias=False, dtype=w.dtype, device=w.device)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=√5) on a (rank, d_in) weight
        with torch.no_grad():
            a = (torch.rand(rank, d_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            self.lora_A.weight.copy_(a.to(w.dtype))
            self.lora_B.weight.zero_()
        self.lora_A.weight.requires_grad_(False)
        self.scale = float(scale)

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x) + self.scale * self.lora_B(self.lora_A(x))


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2), recognised without importing transformers."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None \
        and m.weight.dim() == 2


def _features(m: nn.Module) -> tuple[int, int]:
    """(d_in, d_out) of an ``nn.Linear`` or a ``Conv1D``."""
    if _is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return m.in_features, m.out_features


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, spec: LoRA) -> tuple[nn.Module, list[str]]:
    """A copy of ``model`` with an adapter on every ``nn.Linear`` matched by ``spec.target_modules``.

    Parameters
    ----------
    model : nn.Module
        The pretrained network; never modified.
    spec : LoRA

    Returns
    -------
    adapted : nn.Module
        The copy, in ``model``'s train/eval mode, outputs equal to ``model``'s (B = 0).
    user_names : list of str
        The user-weight parameter names: every ``<target>.lora_B.weight`` (model order), then the
        parameters of ``spec.modules_to_save``.
    """
    adapted = copy.deepcopy(model)
    named = dict(adapted.named_modules())
    targets = [n for n, m in named.items() if n and any(_matches(n, t) for t in spec.target_modules)]
    for t in spec.target_modules:
        if not any(_matches(n, t) for n in targets):
            raise ValueError(f"LoRA target {t!r} matches no module of the model")
    bad = [n for n in targets if not (isinstance(named[n], nn.Linear) or _is_conv1d(named[n]))]
    if bad:
        raise ValueError(f"LoRA targets must be nn.Linear (or GPT-2 Conv1D) layers; {bad[:5]} are "
                         f"{sorted({type(named[n]).__name__ for n in bad})}")
    g = torch.Generator().manual_seed(int(spec.seed))
    for n in targets:
        parent_name, _, child = n.rpartition(".")
        parent = adapted.get_submodule(parent_name) if parent_name else adapted
        setattr(parent, child, LoRALinear(named[n], spec.rank, spec.scale, g))
    names = [f"{n}.lora_B.weight" for n in targets]
    params = [n for n, _ in adapted.named_parameters()]
    for m in spec.modules_to_save:
        hits = [p for p in params if any(p.startswith(s + ".") for s in
                                         [k for k in dict(adapted.named_modules()) if k and _matches(k, m)])]
        if not hits:
            raise ValueError(f"modules_to_save entry {m!r} matches no module with parameters")
        names += [p for p in hits if p not in names]
    order = {p: i for i, p in enumerate(params)}
    return adapted, sorted(names, key=order.__getitem__)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every :class:`LoRALinear` folded into a plain ``nn.Linear`` (W + s·B A; peft's
    ``merge_and_unload``): the same function, the adapter's parameters gone.

    Parameters
    ----------
    model : nn.Module

    Returns
    -------
    nn.Module
        The merged copy; ``model`` is not modified.
    """
    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, LoRALinear):
            lin = mod.base_layer
            delta = mod.scale * mod.lora_B.weight @ mod.lora_A.weight
            lin.weight.add_(delta.T if _is_conv1d(lin) else delta)
            parent_name, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent_name) if parent_name else out, child, lin)
    return out
