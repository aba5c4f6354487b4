"""Exact deletion with ordinary (non-linear) fine-tuning: isolated adapters, SISA-style shards and slices.

    sm = sharded_finetune(model, x, y, user_weights=LoRA(["query", "value"], rank=4,
                                                         modules_to_save=["classifier"]),
                          shards=4, slices=4, epochs=20, lr=1e-2, seed=0)
    sm(x_test)                                  # log of the shards' mean probabilities (logits-like)
    info = sm.forget([3, 17], x, y)             # retrains only the touched shards, from their slice checkpoints

The second exact engine beside the linearised one (:mod:`scrubnet.mlforget.finetune`). The user data D (ids:
positions in D, or the ``ids`` given) are split into S shards and each shard into R slices. Each shard owns a
copy of the user weights (a :class:`~scrubnet.models.lora.LoRA` adapter, parameter-name prefixes or
``"head"``: the same conventions as the linearised engine) which starts from the same pretrained point
(LoRA: B = 0, A fixed by the LoRA seed; named layers: their pretrained values) and is fine-tuned the ordinary
way (Adam on the task's loss, non-linear, network in eval mode: no dropout, BatchNorm running statistics):

* stage r = 1..R trains on the shard's slices 1..r (SISA's incremental training) for
  E_r = ceil(2E/(R+1)) epochs, from the weights after stage r−1, with a fresh Adam; the weights after every
  stage are kept (the slice checkpoints; stage 0 = the pretrained point);
* a sample's shard and slice are a function of its id alone (:func:`assignment`: a keyed sha256 of
  (seed, id)), and each epoch's batch order a seeded function of the ids a stage holds (a permutation of the
  sorted ids drawn from a generator seeded by (seed, shard, stage, epoch)); neither depends on the other
  samples' positions or on which samples were deleted elsewhere;
* with a fixed validation set (``validation=``, not deletable user data), every stage keeps its epoch with
  the least validation error (early stopping, the rule of the validation-tuned yardstick) instead of its
  last; a retrained stage selects the same epoch, so deletion stays exact;
* the model answers with the mean of the non-empty shards' probabilities (``aggregate="mean"``; ``"vote"``:
  the share of shards voting each class). Its ``forward`` returns the log of that mean, so arg-max, accuracy
  and cross-entropy read it as logits.

**Deletion** (:meth:`ShardedModel.forget`): for each shard holding a deleted id, with r₀ the earliest slice
holding one, stages r₀..R are trained again from the checkpoint after stage r₀−1 on the remaining ids. Stages
before r₀ saw exactly the same samples in the same order as a run on D ∖ D_f would, so their checkpoints are
that run's; stages from r₀ on are recomputed by the same code on the same samples. Hence, after any sequence
of requests, the weights EQUAL those of :func:`sharded_finetune` on D ∖ D_f with the same seeds — bit for bit
on a CPU with the same thread count (every kernel used is deterministic there; tests/mlforget/test_sharded.py
checks it with ``torch.equal``). On a GPU, non-deterministic kernels make it equal to float tolerance only.

**Tasks.** Labels ``y`` of shape (N,): classification, cross-entropy on the model's logits (N, c). Labels of
shape (N, T): a causal language model (``AutoModelForCausalLM`` or any model giving logits (N, T, V)) with
the loss on the answer tokens only — HuggingFace's convention: ``labels`` = the input ids where the answer is,
−100 elsewhere, logits at position t predict the token at t+1, through the pretrained LM head
(:func:`causal_lm_loss`). ``loss_fn(net, x, y) -> scalar`` replaces either (a pluggable training step).

**Cost.** A request retrains Σ_{r ≥ r₀} E_r·|slices 1..r of the touched shards| sample-passes; the full
training costs Σ_r E_r·|slices 1..r| over all shards (``info["sample_passes"]`` and ``train_info`` count
both). docs/decisions/forgettable.md measures accuracy and request cost against S and R.

The engine's core needs only torch: transformers is never imported here (a HuggingFace model is just a
module whose output has ``logits``). :func:`sharded_state` wraps a :class:`ShardedModel` as the request
store's state (:mod:`scrubnet.mlforget.store`), so ``scrubnet mlforget forget``, ``show``, ``serve`` and the
signed receipts work on it as on the linearised engine.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.mlforget.finetune import split_batch, user_weight_names
from scrubnet.mlforget.model import MLConfig, MLState, distinct_request_ids
from scrubnet.models.call import Inputs, ModelInputs, call_model

#: the engine's name in checkpoints and receipts
ENGINE = "sharded"
#: the aggregation rules of the shards' outputs
AGGREGATES = ("mean", "vote")
#: the label value ignored by the causal-LM loss (HuggingFace's)
IGNORE_INDEX = -100


@dataclasses.dataclass
class ShardedConfig:
    """Settings of the sharded engine (module docstring).

    Parameters
    ----------
    shards : int
        S, the number of isolated adapters.
    slices : int
        R, the slices per shard (checkpoints after each).
    epochs : int
        E: the budget of the whole shard; stage r trains E_r = ceil(2E/(R+1)) epochs on slices 1..r
        (SISA's rule: each sample is seen about E times over the stages).
    lr, batch_size, weight_decay : Adam on the loss, fresh at each stage.
    aggregate : str
        'mean' (of probabilities) or 'vote'.
    seed : int
        Seed of the assignment and the batch orders.
    validated : bool
        Every stage keeps the epoch (0..E_r) with the least error on a fixed validation set (the yardstick's
        early-stopping rule) instead of its last; set by ``sharded_finetune(validation=...)``.
    """

    shards: int = 4
    slices: int = 4
    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 0.0
    aggregate: str = "mean"
    seed: int = 0
    validated: bool = False

    def __post_init__(self):
        if int(self.shards) < 1 or int(self.slices) < 1:
            raise ValueError(f"shards and slices must be ≥ 1, got {self.shards} and {self.slices}")
        if int(self.epochs) < 1 or int(self.batch_size) < 1:
            raise ValueError(f"epochs and batch_size must be ≥ 1, got {self.epochs} and {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0) or not self.weight_decay >= 0:
            raise ValueError(f"lr must be > 0 and weight_decay ≥ 0, got {self.lr} and {self.weight_decay}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}")
        self.shards, self.slices, self.epochs, self.batch_size = (int(self.shards), int(self.slices),
                                                                  int(self.epochs), int(self.batch_size))

    def stage_epochs(self) -> int:
        """E_r = ceil(2E/(R+1)), the epochs of every stage."""
        return max(1, math.ceil(2 * self.epochs / (self.slices + 1)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def assignment(ids, shards: int, slices: int, seed: int) -> tuple[Tensor, Tensor]:
    """(shard, slice) of every id: a function of (seed, id) alone, so deleting samples moves no other.

    shard = u mod S, slice = 1 + (u div S) mod R, with u the first 8 bytes of
    sha256("scrubnet-shard/1|seed|id") (uniform: shards and slices balanced in expectation).

    Parameters
    ----------
    ids : sequence of int (n,)
    shards, slices, seed : int

    Returns
    -------
    (Tensor (n,) int64 in [0, S), Tensor (n,) int64 in [1, R])
    """
    u = [int.from_bytes(hashlib.sha256(f"scrubnet-shard/1|{int(seed)}|{int(i)}".encode()).digest()[:8], "big")
         for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist()]
    shard = torch.tensor([v % shards for v in u], dtype=torch.long)
    sl = torch.tensor([1 + (v // shards) % slices for v in u], dtype=torch.long)
    return shard, sl


def _order_seed(seed: int, shard: int, stage: int, epoch: int) -> int:
    h = hashlib.sha256(f"scrubnet-order/1|{int(seed)}|{shard}|{stage}|{epoch}".encode()).digest()
    return int.from_bytes(h[:7], "big")


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of the answer tokens: logits (n, T, V) at t predict labels (n, T) at t+1; positions
    labelled −100 are ignored (HuggingFace's causal-LM loss)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX)


def default_loss(net: nn.Module, x: Inputs, y: Tensor) -> Tensor:
    """The training loss of a batch: cross-entropy on the logits (n, c) for labels (n,), the causal-LM loss
    (:func:`causal_lm_loss`) for labels (n, T)."""
    logits = call_model(net, x)
    return causal_lm_loss(logits, y) if y.dim() == 2 else F.cross_entropy(logits, y)


class ShardedModel(nn.Module):
    """S isolated copies of the user weights on one frozen network, with their slice checkpoints.

    Built by :func:`sharded_finetune` (or empty, by the store, then filled by ``load_state_dict``).

    Parameters
    ----------
    net : nn.Module
        The network with its user weights at the pretrained point (adapters applied); copied, frozen.
    names : list of str
        The user-weight parameter names.
    config : ShardedConfig
    ids : sequence of int
        The ids of the user data (positions in D unless given).
    loss_fn : callable, optional
        ``loss_fn(net, x, y) -> scalar`` (default :func:`default_loss`).

    ``state_dict()`` holds only user weights: ``init/<name>`` (the pretrained point), ``s<k>/r<j>/<name>``
    (shard k after stage j = 1..R; j = R is what the model answers with) and ``held/s<k>`` (how many
    samples shard k holds now; an empty shard is left out of the aggregate). The base network is not in it:
    the checkpoint rebuilds it from its recorded source and hashes.
    """

    engine = ENGINE

    def __init__(self, net: nn.Module, names: list[str], config: ShardedConfig, ids, loss_fn: Callable | None = None):
        super().__init__()
        net = copy.deepcopy(net).eval()
        for p in net.parameters():
            p.requires_grad_(False)
        object.__setattr__(self, "net", net)  # not a submodule: the state_dict holds the user weights only
        self.names = list(names)
        self.config = config
        self.ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        if len(torch.unique(self.ids)) != len(self.ids):
            raise ValueError("the sample ids must be distinct")
        self.shard_of, self.slice_of = assignment(self.ids, config.shards, config.slices, config.seed)
        self.forgotten = torch.zeros(0, dtype=torch.long)
        self.loss_fn = loss_fn or default_loss
        params = dict(net.named_parameters())
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"user weights {missing[:5]} are not parameters of the network")
        self.init = {n: params[n].detach().clone() for n in self.names}
        self.ckpt = [[{n: t.clone() for n, t in self.init.items()} for _ in range(config.slices)]
                     for _ in range(config.shards)]
        self.held = torch.zeros(config.shards, dtype=torch.long)
        self.train_info: dict = {}
        self.validation = None  # (x, y): the fixed validation set of a ``validated`` schedule

    # -- bookkeeping ---------------------------------------------------------------------------------------
    @property
    def num_linearized(self) -> int:
        """Number of user weights of one shard (the name the linearised engine's module uses)."""
        return int(sum(t.numel() for t in self.init.values()))

    def remaining_ids(self) -> Tensor:
        """User ids not yet forgotten (sorted)."""
        keep = ~torch.isin(self.ids, self.forgotten)
        return torch.sort(self.ids[keep]).values

    def _held(self, shard: int, stage: int, remaining: Tensor) -> Tensor:
        """Sorted ids shard ``shard`` trains on at ``stage`` (its remaining ids of slices 1..stage)."""
        m = (self.shard_of == shard) & (self.slice_of <= stage) & torch.isin(self.ids, remaining)
        return torch.sort(self.ids[m]).values

    # -- weights -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, weights: dict) -> None:
        params = dict(self.net.named_parameters())
        for n in self.names:
            params[n].copy_(weights[n])

    def _snapshot(self) -> dict:
        params = dict(self.net.named_parameters())
        return {n: params[n].detach().clone() for n in self.names}

    def state_dict(self, *args, **kwargs) -> dict:  # noqa: D102 — the layout is in the class docstring
        out = {f"init/{n}": t.detach().clone().contiguous() for n, t in self.init.items()}
        for k, stages in enumerate(self.ckpt):
            for j, w in enumerate(stages, start=1):
                out.update({f"s{k}/r{j}/{n}": t.detach().clone().contiguous() for n, t in w.items()})
        out.update({f"held/s{k}": self.held[k:k + 1].clone() for k in range(self.config.shards)})
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: D102
        want = set(self.state_dict())
        got = set(state_dict)
        if want != got:
            raise RuntimeError(f"sharded weights: missing {sorted(want - got)[:5]}, unexpected "
                               f"{sorted(got - want)[:5]}")
        self.init = {n: state_dict[f"init/{n}"].clone() for n in self.names}
        self.ckpt = [[{n: state_dict[f"s{k}/r{j}/{n}"].clone() for n in self.names}
                      for j in range(1, self.config.slices + 1)] for k in range(self.config.shards)]
        self.held = torch.cat([state_dict[f"held/s{k}"].reshape(1).long() for k in range(self.config.shards)])
        return None

    def named_parameters(self, *args, **kwargs):  # the store's finiteness check and the tests read these
        for k, v in self.state_dict().items():
            if v.is_floating_point():
                yield k, v

    # -- training ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _val_error(self) -> float:
        """Error of the network as it stands on the fixed validation set (a causal-LM sample is right when
        every answer token is the arg-max)."""
        if self.validation is None:
            raise ValueError("this sharded model selects every stage's epoch on a validation set: give the same "
                             "validation data (ShardedModel.validation = (x, y)) before training or deleting")
        xv, yv = self.validation
        wrong = 0
        for b in range(0, len(yv), 256):
            out, lab = call_model(self.net, xv[b:b + 256]), yv[b:b + 256]
            if lab.dim() == 2:
                t = lab[:, 1:]
                wrong += int((~((out[:, :-1].argmax(-1) == t) | (t == IGNORE_INDEX)).all(1)).sum())
            else:
                wrong += int((out.argmax(1) != lab).sum())
        return wrong / len(yv)

    def _train_shard(self, shard: int, first_stage: int, x_all: Inputs, y_all: Tensor, pos: dict,
                     remaining: Tensor) -> int:
        """Stages ``first_stage``..R of ``shard`` from the checkpoint before ``first_stage``; returns the
        sample-passes."""
        cfg = self.config
        start = self.init if first_stage == 1 else self.ckpt[shard][first_stage - 2]
        self._load(start)
        params = dict(self.net.named_parameters())
        chosen = [params[n] for n in self.names]
        passes = 0
        for stage in range(first_stage, cfg.slices + 1):
            held = self._held(shard, stage, remaining)
            if len(held):
                rows = torch.tensor([pos[int(i)] for i in held.tolist()], dtype=torch.long)
                for p in chosen:
                    p.requires_grad_(True)
                opt = torch.optim.Adam(chosen, lr=cfg.lr, weight_decay=cfg.weight_decay)
                best = (self._val_error(), self._snapshot()) if cfg.validated else None
                for epoch in range(cfg.stage_epochs()):
                    g = torch.Generator().manual_seed(_order_seed(cfg.seed, shard, stage, epoch))
                    order = rows[torch.randperm(len(rows), generator=g)]
                    for b in range(0, len(order), cfg.batch_size):
                        idx = order[b:b + cfg.batch_size]
                        loss = self.loss_fn(self.net, x_all[idx], y_all[idx])
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                    passes += len(rows)
                    if best is not None:
                        err = self._val_error()
                        if err < best[0]:  # strictly better: ties keep the earlier epoch, as the yardstick
                            best = (err, self._snapshot())
                if best is not None:
                    self._load(best[1])
                for p in chosen:
                    p.requires_grad_(False)
                    p.grad = None
            self.ckpt[shard][stage - 1] = self._snapshot()
        self.held[shard] = len(self._held(shard, cfg.slices, remaining))
        return passes

    def _positions(self, x_all: Inputs, y_all: Tensor, row_ids, needed: Tensor | None = None) -> dict:
        if len(x_all) != len(y_all):
            raise ValueError(f"inputs and labels hold {len(x_all)} and {len(y_all)} samples")
        row_ids = torch.arange(len(y_all)) if row_ids is None else \
            torch.as_tensor(np.asarray(row_ids, dtype=np.int64).reshape(-1))
        if len(row_ids) != len(y_all):
            raise ValueError(f"{len(row_ids)} row ids for {len(y_all)} samples")
        pos = {int(i): k for k, i in enumerate(row_ids.tolist())}
        needed = self.remaining_ids() if needed is None else needed
        absent = [int(i) for i in needed.tolist() if int(i) not in pos]
        if absent:
            raise ValueError(f"the data lack the remaining user samples {absent[:10]}")
        return pos

    def fit(self, x_all: Inputs, y_all: Tensor, row_ids=None) -> dict:
        """Train every shard from the pretrained point on the remaining ids (rows of ``x_all`` named by
        ``row_ids``, default positions); returns the training info."""
        pos = self._positions(x_all, y_all, row_ids)
        t0, remaining = time.perf_counter(), self.remaining_ids()
        passes = sum(self._train_shard(k, 1, x_all, y_all, pos, remaining) for k in range(self.config.shards))
        self._load(self.ckpt[0][-1])
        self.train_info = {"engine": ENGINE, "sample_passes": int(passes), "train_seconds": time.perf_counter() - t0,
                           "samples_per_shard": self.held.tolist(), **self.config.to_dict()}
        return self.train_info

    def check_ids(self, ids) -> Tensor:
        """The sorted distinct ids of a request; ``ValueError`` naming unknown, repeated or forgotten ids."""
        uniq = distinct_request_ids(ids)
        done = uniq[torch.isin(uniq, self.forgotten)]
        if done.numel():
            raise ValueError(f"id(s) {done.tolist()[:10]} were already forgotten by an earlier request")
        unknown = uniq[~torch.isin(uniq, self.ids)]
        if unknown.numel():
            raise ValueError(f"id(s) {unknown.tolist()[:10]} are not user data ids")
        return uniq

    def forget(self, ids, x_all: Inputs, y_all: Tensor, row_ids=None) -> dict:
        """Delete ``ids`` exactly (module docstring): retrain the touched shards from their last slice
        checkpoint before the earliest deleted sample.

        Parameters
        ----------
        ids : sequence of int
            User ids not yet forgotten.
        x_all, y_all : the user data (rows named by ``row_ids``, default positions); it must hold every
            remaining id (the deleted rows may be present or absent).
        row_ids : sequence of int, optional

        Returns
        -------
        dict
            ``engine``, ``solver`` ('retrain'), ``shards_retrained``, ``from_slice`` ({shard: r₀}),
            ``sample_passes`` (this request), ``full_sample_passes`` (the training's), ``seconds``.
        """
        ids_t = self.check_ids(ids)
        if self.config.validated and self.validation is None:
            self._val_error()  # refuses before any state changes: an unvalidated retrain would not be exact
        rem = self.remaining_ids()
        pos = self._positions(x_all, y_all, row_ids, rem[~torch.isin(rem, ids_t)])
        where = torch.isin(self.ids, ids_t)
        first: dict[int, int] = {}
        for s, r in zip(self.shard_of[where].tolist(), self.slice_of[where].tolist()):
            first[s] = min(first.get(s, r), r)
        self.forgotten = torch.sort(torch.cat([self.forgotten, ids_t])).values
        t0, remaining = time.perf_counter(), self.remaining_ids()
        passes = sum(self._train_shard(s, r, x_all, y_all, pos, remaining) for s, r in sorted(first.items()))
        self._load(self.ckpt[0][-1])
        return {"engine": ENGINE, "solver": "retrain", "shards_retrained": sorted(first),
                "from_slice": {str(s): r for s, r in sorted(first.items())}, "sample_passes": int(passes),
                "full_sample_passes": int(self.train_info.get("sample_passes", 0) or 0),
                "shards": self.config.shards, "slices": self.config.slices,
                "seconds": time.perf_counter() - t0}

    def reset(self) -> None:
        """Forget everything: every shard back at the pretrained point, holding nothing (the aggregate is
        then the pretrained network's output)."""
        self.ckpt = [[{n: t.clone() for n, t in self.init.items()} for _ in range(self.config.slices)]
                     for _ in range(self.config.shards)]
        self.held = torch.zeros(self.config.shards, dtype=torch.long)
        self.forgotten = self.ids.clone()

    # -- prediction ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def shard_probabilities(self, x: Inputs) -> Tensor:
        """Softmax outputs of every shard, (S, n, c) or (S, n, T, V); empty shards answer with the
        pretrained point."""
        out = []
        for k in range(self.config.shards):
            self._load(self.ckpt[k][-1])
            out.append(torch.softmax(call_model(self.net, x).double(), dim=-1))
        return torch.stack(out)

    @torch.no_grad()
    def forward(self, *args, **kwargs) -> Tensor:
        """Log of the aggregate of the non-empty shards (all shards when every one is empty)."""
        x = args[0] if len(args) == 1 and not kwargs else ModelInputs(args[0], kwargs)
        probs = self.shard_probabilities(x)
        live = self.held > 0
        if bool(live.any()):
            probs = probs[live]
        if self.config.aggregate == "vote":
            probs = F.one_hot(probs.argmax(-1), probs.shape[-1]).double()
        agg = probs.mean(0)
        dtype = self.init[self.names[0]].dtype
        return torch.log(agg.clamp_min(1e-300)).to(dtype)


def user_network(model: nn.Module, user_weights):
    """(network with adapters, user-weight names, spec dict) — the linearised engine's conventions
    (:func:`scrubnet.mlforget.finetune.user_weight_names`)."""
    return user_weight_names(model, user_weights)


def sharded_finetune(model: nn.Module, x, y: Tensor | None = None, *, user_weights="head", shards: int = 4,
                     slices: int = 4, epochs: int = 20, lr: float = 1e-3, batch_size: int = 32,
                     weight_decay: float = 0.0, aggregate: str = "mean", ids=None, seed: int = 0,
                     loss_fn: Callable | None = None, validation=None) -> ShardedModel:
    """Fine-tune ``model`` with the sharded engine (module docstring).

    Parameters
    ----------
    model : nn.Module
        The pretrained network (a HuggingFace classifier or causal LM included); copied, never modified.
    x : Tensor (N, ...), ModelInputs, dict batch, or (x, y)
    y : Tensor (N,) class labels, or (N, T) token labels (−100 where no loss), optional
    user_weights : LoRA, list of str, or "head"
    shards, slices, epochs, lr, batch_size, weight_decay, aggregate, seed : :class:`ShardedConfig`
    ids : sequence of int, optional
        The samples' ids (default 0..N−1). A run on D ∖ D_f passes the remaining ids to equal a deletion.
    loss_fn : callable, optional
    validation : (x_val, y_val), optional
        A fixed validation set that is NOT deletable user data: every stage keeps its epoch with the least
        error there (early stopping, the yardstick's rule). Deletion stays exact — a retrained stage sees the
        same samples, order and validation set, so it selects the same epoch — provided the same set is given
        again (``ShardedModel.validation``) before every request; a request without it is refused.

    Returns
    -------
    ShardedModel
        Trained; ``train_info`` holds the cost; ``spec`` the user-weights spec dict.
    """
    data_x, data_y = split_batch(x)
    y = data_y if y is None else y
    if y is None or len(y) != len(data_x) or len(y) == 0:
        raise ValueError("give labels for every sample (y, or a dict batch with 'labels')")
    cfg = ShardedConfig(shards, slices, epochs, lr, batch_size, weight_decay, aggregate, seed,
                        validated=validation is not None)
    net, names, spec = user_network(model, user_weights)
    sm = ShardedModel(net, names, cfg, torch.arange(len(y)) if ids is None else ids, loss_fn)
    if validation is not None:
        vx, vy = validation
        sm.validation = (split_batch(vx)[0], vy)
    sm.spec = spec
    sm.fit(data_x, y, None if ids is None else ids)
    return sm


def sharded_state(sm: ShardedModel, num_classes: int, base_sha256: str | None = None):
    """The request store's state (:class:`~scrubnet.mlforget.model.MLState`) of a sharded model: user ids =
    its ids, no core, σ = 0 (no noise: deletion is by retraining)."""
    cfg = MLConfig(sigma=0.0, leaky_slope=None, core_fraction=0.0, linearize=list(sm.names))
    state = MLState(sm, torch.zeros(0, dtype=torch.long), sm.ids.clone(), sm.forgotten.clone(), cfg,
                    int(num_classes), int(sm.config.seed))
    state.train_info = dict(sm.train_info)
    state.base_sha256, state.user_weights = base_sha256, getattr(sm, "spec", None)
    return state


__all__ = ["AGGREGATES", "ENGINE", "IGNORE_INDEX", "ShardedConfig", "ShardedModel", "assignment",
           "causal_lm_loss", "default_loss", "sharded_finetune", "sharded_state"]
