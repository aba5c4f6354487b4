"""What the field's unlearning methods share: optimisers, batch streams over D_r (and D_r ⊔ extras), training
mode, and the cross-entropy / distillation losses, all on the model's device and through
:func:`~scrubnet.models.call.call_model`.

Each method lives in its own module (``neggrad_plus``, ``l1_sparse``, ``salun``, ``scrub``, ``ssd``,
``bad_teacher``, ``unsir``, ``boundary_shrink``); their defaults and the decisions behind them are recorded in
docs/decisions/field-methods.md. Data follow the fine-tuning baselines' rules: D_r is a
:class:`~scrubnet.data.stream.DataStream` read one batch at a time (an indexable source by a seeded
permutation, a ``DataLoader`` by its own batches), D_f is small by nature and read into memory.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.data.stream import DataStream
from scrubnet.device import model_device, seeded_generator
from scrubnet.methods.base import ForgetContext, ForgettingMethod
from scrubnet.models import freeze_batchnorm
from scrubnet.models.call import ModelInputs, call_model, cat_inputs

from scrubnet.methods.base import Option  # noqa: F401  (re-exported for the field's modules)
from scrubnet.training.cost import fisher_diagonal_cost, train_cost  # noqa: F401  (likewise)
from scrubnet.training.guard import guard_after_step, guard_scope


#: optimisers the field's methods are written with
OPTIMISERS = ("sgd", "adam")
#: the batch size of the OPTML-Group releases (``--batch_size`` 256: GA, ℓ1-sparse, SalUn, Boundary Shrink) and of
#: Bad-Teacher's ``blindspot``
RELEASED_BATCH = 256


def make_optimiser(model: nn.Module, kind: str, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (with ``momentum``) or ``torch.optim.Adam`` over the trainable parameters.

    Parameters
    ----------
    model : nn.Module
    kind : {"sgd", "adam"}
    lr, momentum, weight_decay : float
        Step size, SGD momentum (ignored by Adam), L2 weight decay toward 0 (the optimisers' own).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimiser must be one of {', '.join(OPTIMISERS)}, got {kind!r}")


def check_positive(**values) -> None:
    """``ValueError`` naming the first of ``values`` (name=number) that is not > 0."""
    for k, v in values.items():
        if v is not None and not v > 0:
            raise ValueError(f"{k} must be > 0, got {v!r}")


def sgd_options(lr: float, batch: int | None = RELEASED_BATCH) -> dict[str, Option]:
    """The SGD options of the field methods that fine-tune with SGD (``lr``: its default step size; ``batch``:
    its released batch size, None for the recipe's)."""
    return {"epochs": Option(int, ">= 1", default=10), "lr": Option(float, "> 0", default=lr),
            "momentum": Option(float, "[0, 1)", default=0.9), "weight_decay": Option(float, ">= 0", default=5e-4),
            "batch_size": Option(int | None, ">= 1", default=batch)}


class SGDFieldMethod(ForgettingMethod):
    """The traits shared by the field's methods that fine-tune with SGD (:func:`sgd_options`): they stream
    D_r, make one pass per epoch and run only when named. Not registered: a base, not a method."""

    streams = True
    passes = "epochs"
    in_default_run = False


def set_sgd(method, epochs: int, lr: float, momentum: float, weight_decay: float, batch_size: int | None) -> None:
    """Check and store the :func:`sgd_options` on ``method`` (``ValueError`` naming a bad one)."""
    check_positive(epochs=epochs, lr=lr, batch_size=batch_size)
    method.epochs, method.lr = int(epochs), float(lr)
    method.momentum, method.weight_decay, method.batch_size = float(momentum), float(weight_decay), batch_size


def sgd_start(method, model: nn.Module, ctx: ForgetContext, offset: int, *, decay: bool = True
              ) -> tuple[nn.Module, torch.device, int, torch.Generator, torch.optim.Optimizer]:
    """What the ``scrub`` of a method with :func:`sgd_options` starts from: a copy of ``model`` to train, its
    device, the batch size (the method's, else the recipe's), the seeded generator (``offset``, see
    :func:`generator_for`) and the SGD optimiser (without the decay when ``decay`` is False: the method applies
    it itself)."""
    model = copy.deepcopy(model)
    dev = model_device(model)
    bs = int(method.batch_size or ctx.recipe.batch_size)
    g = generator_for(model, ctx, offset)
    opt = make_optimiser(model, "sgd", method.lr, method.momentum, method.weight_decay if decay else 0.0)
    return model, dev, bs, g, opt


def train_mode(model: nn.Module, ctx: ForgetContext) -> None:
    """Training mode, with BatchNorm frozen when the recipe trained with it frozen (as the baselines do)."""
    model.train()
    if ctx.recipe is not None and ctx.recipe.freeze_bn:
        freeze_batchnorm(model)


def generator_for(model: nn.Module, ctx: ForgetContext, offset: int) -> torch.Generator:
    """The method's seeded generator on the model's device (``offset`` keeps methods' streams apart)."""
    return seeded_generator(10_007 * ctx.seed + offset, model_device(model))


def stream_batches(data: DataStream, batch_size: int, g: torch.Generator, dev: torch.device
                   ) -> Iterator[tuple[Tensor, Tensor]]:
    """One pass over ``data`` in batches on ``dev``: a seeded permutation of an indexable source (tensors, a
    ``Dataset``, or a ``DataLoader`` over a map-style one, read by index and collated by the loader's
    ``collate_fn``: the same batches as its data set given directly), an iterable loader's own batches otherwise."""
    view = data.indexed()
    if view is not None:
        order = torch.randperm(len(view), generator=g, device=g.device).cpu()
        for i in range(0, len(order), batch_size):
            x, y = view.take(order[i:i + batch_size])
            yield x.to(dev), y.to(dev)
    else:
        for x, y in data.chunks():
            yield x.to(dev), y.to(dev)


def tensor_batches(x: Tensor, y: Tensor, batch_size: int, g: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """One pass over in-memory (x, y) in batches of a seeded permutation."""
    order = torch.randperm(len(y), generator=g, device=g.device).to(y.device)
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        yield x[idx], y[idx]


def mixed_batches(retain: DataStream, x_e, y_e: Tensor, batch_size: int, g: torch.Generator | None,
                  dev: torch.device, what: str, order: Tensor | None = None) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """One pass over D_r ⊔ E (E = (x_e, y_e) in memory) in batches of a seeded permutation of the N_r + N_e
    positions (or of the given ``order`` of them, e.g. ``arange``: D_r then E, unshuffled): ``(x, y, from_e)``
    with ``from_e`` (bool, (B,)) marking E's samples. D_r must be indexable."""
    retain = by_index(retain, what)
    n_r, n_e = len(retain), len(y_e)
    if order is None:
        order = torch.randperm(n_r + n_e, generator=g, device=g.device)
    order = order.cpu()
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        from_e = idx >= n_r
        parts_x, parts_y = [], []
        if (~from_e).any():
            xr, yr = retain.take(idx[~from_e])
            parts_x.append(xr.to(dev))
            parts_y.append(yr.to(dev))
        if from_e.any():
            e = (idx[from_e] - n_r).to(y_e.device)
            parts_x.append(x_e[e].to(dev))
            parts_y.append(y_e[e].to(dev))
        # retain samples first, then E's: the permutation fixes which samples share a batch, not their order
        flag = torch.cat([torch.zeros(int((~from_e).sum()), dtype=torch.bool),
                          torch.ones(int(from_e.sum()), dtype=torch.bool)]).to(dev)
        yield cat_inputs(parts_x), torch.cat(parts_y), flag


def by_index(retain: DataStream, what: str) -> DataStream:
    """``retain`` when indexable; a ``DataLoader`` over a map-style data set as that data set read by index (its
    items collated by the loader's ``collate_fn``, so dict batches and their extra inputs come as the loader
    makes them); ``ValueError`` otherwise (an iterable-style loader has no samples to draw)."""
    if retain.indexable:
        return retain
    view = retain.indexed()
    if view is None:
        raise ValueError(f"{what} draws batches from D_r and other samples together: give D_r as tensors, an "
                         "indexable Dataset, or a DataLoader over a map-style Dataset")
    return view


class SubsetStream(DataStream):
    """The samples ``idx`` (1-D int64) of an indexable stream, read on demand, in that order."""

    def __init__(self, base: DataStream, idx: Tensor, what: str = "this method"):
        if not base.indexable:
            raise ValueError(f"{what} draws a part of D_r: give D_r as tensors or an indexable Dataset, "
                             "not a DataLoader")
        self.base, self.idx, self.kind, self.chunk_size, self._len = base, idx, "dataset", base.chunk_size, len(idx)

    def take(self, idx):
        return self.base.take(self.idx[torch.as_tensor(idx, dtype=torch.long)])


def stream_labels(data: DataStream) -> Tensor:
    """The labels of every sample of an indexable stream, in its order (int64, (N,), on the CPU)."""
    if data.kind == "tensors":
        return data.y.cpu()
    return torch.cat([data.take(torch.arange(i, min(i + data.chunk_size, len(data))))[1].cpu()
                      for i in range(0, len(data), data.chunk_size)])


def kl_to_targets(student_logits: Tensor, target_probs: Tensor, T: float = 1.0) -> Tensor:
    """Mean over samples of KL(q ‖ softmax(s/T)) with q the given target distributions (rows), scalar."""
    log_s = F.log_softmax(student_logits / T, dim=-1)
    return F.kl_div(log_s, target_probs, reduction="batchmean")


def distill_kl(student_logits: Tensor, teacher_logits: Tensor, T: float) -> Tensor:
    """Hinton's distillation loss T²·KL(softmax(t/T) ‖ softmax(s/T)), mean over samples, scalar."""
    return kl_to_targets(student_logits, F.softmax(teacher_logits.detach() / T, dim=-1), T) * T * T


class Diverged(RuntimeError):
    """A training step met a non-finite loss or left non-finite weights."""


def step(opt: torch.optim.Optimizer, loss: Tensor, edit_grads: Callable[[], None] | None = None) -> None:
    """One optimiser step on ``loss`` (``edit_grads()`` runs between the backward pass and the update);
    :class:`Diverged` when the loss or the updated weights are not finite."""
    if not bool(torch.isfinite(loss.detach())):
        raise Diverged("the loss became non-finite")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if edit_grads is not None:
        edit_grads()
    opt.step()
    for group in opt.param_groups:
        for p in group["params"]:
            if not bool(torch.isfinite(p).all()):
                raise Diverged("the weights became non-finite")
    guard_after_step(opt)


def guarded_epochs(model: nn.Module, epochs: int, body: Callable[[int], None], what: str) -> str | None:
    """Run ``body(e)`` for e = 0 … epochs − 1; when a step diverges (:class:`Diverged`), put back the weights and
    buffers ``model`` had at the start of that epoch and stop. Returns None, or the reason (one sentence) when
    the method stopped early — the caller marks its result failed with it. The active retain guard
    (:mod:`scrubnet.training.guard`) watches the epochs: a retain error risen past its tolerance puts back the
    last good weights, halves the step sizes and, repeated, ends the epochs (not a failure: the guard's events
    become the result's warnings)."""
    with guard_scope(model):
        for e in range(epochs):
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
            try:
                body(e)
            except Diverged as err:
                model.load_state_dict(snapshot)
                return (f"{what} diverged in epoch {e + 1} of {epochs} ({err}); the model returned is the one at "
                        "the start of that epoch")
    return None


def forget_in_memory(forget: DataStream, dev: torch.device) -> tuple[Tensor, Tensor]:
    """D_f as (x, y) on ``dev`` (D_f is small by nature)."""
    x, y = forget.tensors()
    return x.to(dev), y.to(dev)


@torch.no_grad()
def mean_ce(model: nn.Module, x, y: Tensor, batch_size: int = 512) -> float:
    """Mean cross-entropy of ``model`` (in its current mode) on in-memory (x, y)."""
    total = 0.0
    for i in range(0, len(y), batch_size):
        total += float(F.cross_entropy(call_model(model, x[i:i + batch_size]), y[i:i + batch_size],
                                       reduction="sum"))
    return total / max(len(y), 1)


def float_inputs(x, what: str) -> Tensor:
    """``x`` when it is a floating tensor (inputs a gradient can move); ``ValueError`` (one line naming the
    cause: integer inputs such as token ids, or extra inputs such as an attention mask) otherwise."""
    if isinstance(x, ModelInputs):
        main = x.main
        cause = (f"its main input has dtype {main.dtype} (e.g. token ids)" if not main.is_floating_point()
                 else f"the extra inputs {', '.join(sorted(x.extras))} have no perturbation")
        raise ValueError(f"{what} needs floating-point input tensors alone (it moves the inputs by their gradient), "
                         f"got ModelInputs: {cause}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{what} needs floating-point input tensors (it moves the inputs by their gradient), "
                         f"got {type(x).__name__}" + (f" of dtype {x.dtype} (e.g. token ids)"
                                                      if isinstance(x, Tensor) else ""))
    return x
