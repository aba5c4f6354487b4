"""Fine-tune K models of one architecture at once: ``torch.func`` (``stack_module_state`` + ``vmap`` +
``functional_call``), with exactly the protocol of :func:`scrubnet.training.finetune`.

Each model k has its own start ``w_0^k`` (its fresh head), its own training set (x_k, y_k) and its own seed.
Per model and per step the update is the one of the single-model loop:

    L_k(w) = mean_batch CE(f_w(x), y) + (wd/2)·‖w − w_0^k‖²
    b ← g (first step) or momentum·b + g;   w ← w − lr·b          (torch.optim.SGD, dampening 0)

with the batch order of epoch e drawn by ``torch.randperm(n_k, generator=g_k)`` from the same generator the
loop uses (seeded ``10_007·seed + 2``), and the stopping rule per model: stop ``extra_epochs`` after the first
epoch (≥ ``min_epochs``) with zero training error, at the latest after ``max_epochs``. A model that has
stopped is removed from the stack, so its weights are exactly those at its own stopping epoch. The vmapped
matrix products sum in another order than the loop's, so the weights agree with the loop to float tolerance
(the tests compare them), not bit for bit.

BatchNorm is supported in the fine-tuning protocol's frozen form only (``freeze_bn=True``: running statistics
are constants, γ and β train); trainable BN statistics and Dropout are refused with a clear error, because a
vmapped functional call cannot update per-model buffers in place. Pre-training is not done here (it is shared
by the pool, see :mod:`scrubnet.audit`).

Inputs of different sizes are grouped by size and each group is trained as one stack. Tensors stay on the
device of the inputs (the models must be there too); on the CPU the batch orders are those of the loop.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, stack_module_state, vmap

from scrubnet.device import seeded_generator
from scrubnet.training.loops import TrainConfig, TrainHistory, replace_forgotten
from scrubnet.models.call import call_functional


def check_poolable(model: nn.Module, cfg: TrainConfig) -> None:
    """Raise ``ValueError`` when ``model`` cannot be trained vmapped under ``cfg`` (module docstring)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            raise ValueError(f"vmapped training does not support Dropout ({type(m).__name__}); "
                             "train these models one at a time with scrubnet.training.finetune")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not cfg.freeze_bn:
            raise ValueError("vmapped training needs frozen BatchNorm (training.freeze_bn = true); "
                             "with trainable BN statistics train the models one at a time")


def _stack(dicts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


def finetune_many(starts: Sequence[nn.Module], xs: Sequence[Tensor], ys: Sequence[Tensor], cfg: TrainConfig,
                  seeds: Sequence[int], sustained: bool = False) -> list[tuple[nn.Module, TrainHistory]]:
    """``[finetune(starts[k], xs[k], ys[k], cfg, seeds[k], sustained=sustained) for k]``, K models at a time.

    ``starts``: K models of one architecture (the pull targets w_0^k are their weights);
    ``xs[k]``: inputs ``[n_k, ...]``, ``ys[k]``: int64 labels ``[n_k]``. Returns one (model, history) per k,
    in order, the models being copies of ``starts[k]`` with the trained weights (eval mode).
    """
    if not (len(starts) == len(xs) == len(ys) == len(seeds)):
        raise ValueError("finetune_many: starts, xs, ys and seeds must have the same length")
    if not starts:
        return []
    for s in starts:
        check_poolable(s, cfg)
    shapes = [(n, tuple(p.shape)) for n, p in starts[0].named_parameters()]
    for s in starts[1:]:
        if [(n, tuple(p.shape)) for n, p in s.named_parameters()] != shapes:
            raise ValueError("finetune_many: all start models must share one architecture")
    out: list = [None] * len(starts)
    groups: dict[int, list[int]] = {}
    for k, y in enumerate(ys):
        groups.setdefault(len(y), []).append(k)
    for n, ks in groups.items():
        res = _finetune_group([starts[k] for k in ks], torch.stack([xs[k] for k in ks]),
                              torch.stack([ys[k] for k in ks]), cfg, [int(seeds[k]) for k in ks], sustained)
        for k, r in zip(ks, res):
            out[k] = r
    return out


def _finetune_group(starts: list[nn.Module], x: Tensor, y: Tensor, cfg: TrainConfig,
                    seeds: list[int], sustained: bool = False) -> list[tuple[nn.Module, TrainHistory]]:
    """One stack of K models with equal training-set size n: x ``[K, n, ...]``, y ``[K, n]``."""
    K, n = y.shape
    base = copy.deepcopy(starts[0]).eval()  # eval = the protocol's mode: BN frozen, no Dropout (checked)
    trainable = [name for name, p in base.named_parameters() if p.requires_grad]
    params_all, buffers = stack_module_state(starts)
    params = {k: params_all[k].detach().clone() for k in trainable}
    consts = {**{k: v.detach() for k, v in params_all.items() if k not in params}, **buffers}
    w0 = {k: v.clone() for k, v in params.items()}
    wd, lr, mom, bs = float(cfg.wd), float(cfg.lr), float(cfg.momentum), int(cfg.batch_size)

    def logits_fn(p, c, xb):
        return call_functional(base, (p, c), xb)

    def loss_fn(p, c, w0k, xb, yb):
        total = torch.zeros((), device=xb.device)
        for k in p:
            total = total + torch.sum((p[k] - w0k[k]) ** 2)
        return F.cross_entropy(logits_fn(p, c, xb), yb) + 0.5 * wd * total

    grads_fn = vmap(grad(loss_fn))
    predict = vmap(logits_fn)
    gens = [seeded_generator(10_007 * s + 2, x.device) for s in seeds]  # as scrubnet.training.finetune
    bufs: dict[str, Tensor] | None = None
    active = list(range(K))  # original index of each row of the stack
    results: list = [None] * K
    zero_at: list[int | None] = [None] * K
    epoch = 0
    while active and epoch < cfg.max_epochs:
        perms = torch.stack([torch.randperm(n, generator=g, device=g.device) for g in gens]).to(x.device)
        rows = torch.arange(len(active), device=x.device)[:, None]
        for i in range(0, n, bs):
            idx = perms[:, i:i + bs]
            g = grads_fn(params, consts, w0, x[rows, idx], y[rows, idx])
            with torch.no_grad():
                if bufs is None:
                    bufs = {k: v.clone() for k, v in g.items()}
                else:
                    for k in bufs:
                        bufs[k].mul_(mom).add_(g[k])
                for k in params:
                    params[k] = params[k] - lr * bufs[k]
        epoch += 1
        with torch.no_grad():
            err = (predict(params, consts, x).argmax(-1) != y).float().mean(1)
        keep = []
        for r, k in enumerate(active):
            if sustained and zero_at[k] is not None and float(err[r]) > 0.0:
                zero_at[k] = None  # the protocol as stated: the count restarts when the error comes back
            if zero_at[k] is None and epoch >= cfg.min_epochs and float(err[r]) == 0.0:
                zero_at[k] = epoch
            if (zero_at[k] is not None and epoch >= zero_at[k] + cfg.extra_epochs) or epoch >= cfg.max_epochs:
                results[k] = _finish(starts[k], {p: v[r] for p, v in params.items()},
                                     {c: v[r] for c, v in consts.items()}, logits_fn, x[r], y[r], epoch, zero_at[k])
            else:
                keep.append(r)
        if len(keep) < len(active):
            sel = torch.as_tensor(keep, dtype=torch.long, device=x.device)
            params = {k: v[sel] for k, v in params.items()}
            consts = {k: v[sel] for k, v in consts.items()}
            w0 = {k: v[sel] for k, v in w0.items()}
            bufs = {k: v[sel] for k, v in bufs.items()} if bufs is not None else None
            x, y = x[sel], y[sel]
            gens = [gens[r] for r in keep]
            active = [active[r] for r in keep]
    return results


def _finish(start: nn.Module, p: dict[str, Tensor], c: dict[str, Tensor], logits_fn, x: Tensor, y: Tensor,
            epoch: int, zero_at: int | None) -> tuple[nn.Module, TrainHistory]:
    model = copy.deepcopy(start)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in p:
                param.copy_(p[name])
        logits = logits_fn(p, c, x)
        final_loss = float(F.cross_entropy(logits, y))
        final_err = float((logits.argmax(1) != y).float().mean())
    return model.eval(), TrainHistory(epoch, zero_at, final_loss, final_err)


def retrain_many(starts: Sequence[nn.Module], x: Tensor, y: Tensor, forget_idxs: Sequence[Tensor],
                 cfg: TrainConfig, seeds: Sequence[int], mode: str = "remove",
                 train_idxs: Sequence[Tensor] | None = None,
                 sustained: bool = False) -> list[tuple[nn.Module, TrainHistory]]:
    """``[retrain(starts[k], x_k, y_k, forget_idxs[k], cfg, seeds[k], mode) for k]`` vmapped (``sustained``:
    the stopping rule of :func:`scrubnet.training.finetune`).

    (x_k, y_k) is (x, y) restricted to ``train_idxs[k]`` (default: all of it); ``forget_idxs[k]`` are
    positions *in (x_k, y_k)*. ``mode`` as in :func:`scrubnet.training.retrain`.
    """
    if mode not in ("remove", "replace"):
        raise ValueError(f"unknown retrain mode {mode!r}: use 'remove' or 'replace'")
    xs, ys = [], []
    for k, fidx in enumerate(forget_idxs):
        xk, yk = (x, y) if train_idxs is None else (x[train_idxs[k]], y[train_idxs[k]])
        if mode == "remove":
            mask = torch.ones(len(yk), dtype=torch.bool, device=yk.device)
            mask[fidx] = False
            xs.append(xk[mask])
            ys.append(yk[mask])
        else:
            xr, yr = replace_forgotten(xk, yk, fidx, int(seeds[k]))
            xs.append(xr)
            ys.append(yr)
    return finetune_many(starts, xs, ys, cfg, seeds, sustained)
