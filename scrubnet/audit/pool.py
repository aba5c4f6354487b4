"""The model pool of one experiment, its tasks and its on-disk cache.

Pool data = the experiment's D (n samples); every model's outputs are its logits on D followed by D_test.

* **Shared pre-training**: one backbone pre-trained on the core (seed ``derive(audit_seed, "pretrain")``); the
  core is never forgotten, so every model of the pool starts from it and differs in what it fine-tunes on.
* **Split s** (s = 0 … S−1): T_s = a random half of D; seed_s = ``derive(audit_seed, "split/s")`` fixes the
  fresh head of its start w_0^s and the batch order of its original (as in ``scrubnet run``, the retrains of
  the split share the original's seed and w_0).
* **Forget set (s, f)** (f = 0 … F−1): drawn from T_s ∩ C without replacement, C = the experiment's forget
  class (or all of D when the experiment names ids), of size min(|D_f|, ⌊|T_s ∩ C| / 2⌋), so that each
  candidate is forgotten in about a quarter of the (s, f) pairs.
* Models: ``original/s`` (fine-tuned on T_s), ``retrain/s/f`` (T_s without F_{s,f}, the experiment's retrain
  mode), ``scrub/<method>/s/f`` (the method applied to ``original/s``, ``ctx.seed = seed_s``; a method that
  trains its own model family also stores that family's original as ``original_logits``).
* ε pool (one original, one forget set: ``original/0`` and F_{0,0}): ``eps-retrain/r`` (r < R) retrains from
  w_0^0 with seeds ``derive(audit_seed, "eps-retrain/r")``, and ``eps/<method>/u`` (u < U) the method on
  ``original/0`` with ``ctx.seed = derive(audit_seed, "eps/u")`` (one seed per u shared by the methods:
  common random numbers, and the methods that share work — ntk/ntk-fisher, mlforget/mlforget-retrain — share it).

Every seed is derived from a model's id, so the pool is the same however its tasks are scheduled. Each
finished model is cached as ``<cache>/<id>-<key>.safetensors`` (logits; weights for originals and the
backbone), ``key`` = sha256 of the experiment's data/model/training configuration, the audit seed, the
model's id and the method options; writes are atomic (temporary file + rename), so an interrupted audit
resumes and a second method reuses the originals and retrains. Each file carries a content hash checked
before use; a damaged entry is named on stderr and recomputed (:class:`Cache`).
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from scrubnet.data import load_split
from scrubnet.data.splits import Split
from scrubnet.device import resolve_device
from scrubnet.integrity import ArtifactError, load_verified, save_verified
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.methods.artifacts import ArtifactCache
from scrubnet.methods.base import protocol_context, protocol_method
from scrubnet.methods.user_methods import load_user_method
from scrubnet.models import build_model
from scrubnet.scrub import scrub_and_measure
from scrubnet.training import finetune_many, finetune_start, predict_logits, pretrain, retrain_many
from scrubnet.models.call import cat_inputs

#: version of the pool's rules; part of every cache key (2: the stopping rule as stated, see :func:`train_task`)
POOL_VERSION = 2


def derive(audit_seed: int, model_id: str) -> int:
    """A seed in [0, 2^31) from the audit seed and a model id (sha256; schedule-independent)."""
    h = hashlib.sha256(f"{int(audit_seed)}:{model_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


@dataclass
class PoolPlan:
    """The geometry of a pool. ``pairs[m]`` = forget sets per split the method m is run on (≤ ``forget_sets``);
    ``eps_models[m]`` = U for the ε-score of method m (R = max over methods)."""

    splits: int
    forget_sets: int
    shadow_splits: int
    pairs: dict[str, int]
    eps_models: dict[str, int]
    models_per_task: int = 32

    def to_dict(self) -> dict:
        return {"splits": self.splits, "forget_sets": self.forget_sets, "shadow_splits": self.shadow_splits,
                "pairs": dict(self.pairs), "eps_models": dict(self.eps_models),
                "models_per_task": self.models_per_task}


@dataclass
class PoolData:
    """Everything about the data and the index sets (positions in D) of the pool."""

    cfg: ExperimentConfig
    split: object
    audit_seed: int
    halves: list[np.ndarray] = field(default_factory=list)          # T_s, sorted positions in D
    forget: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # F_{s,f}, sorted positions in D

    @property
    def n(self) -> int:
        return len(self.split.y)


def build_pool_data(cfg: ExperimentConfig, split, audit_seed: int, splits: int, forget_sets: int) -> PoolData:
    """Draw T_s and F_{s,f} (module docstring) from the audit seed."""
    n = len(split.y)
    if n < 4:
        raise ValueError("the audit needs at least 4 training samples")
    y = split.y.numpy()
    fc = cfg.data.forget_class if cfg.data.forget_ids is None else None
    cand_mask = (y == fc) if fc is not None else np.ones(n, bool)
    n_forget = len(split.forget_idx)
    pd = PoolData(cfg, split, audit_seed)
    for s in range(splits):
        rng = np.random.default_rng(derive(audit_seed, f"half/{s}"))
        half = np.sort(rng.permutation(n)[: n // 2])
        pd.halves.append(half)
        cand = half[cand_mask[half]]
        size = min(n_forget, len(cand) // 2)
        if size < 1:
            raise ValueError(f"split {s}: too few forget candidates in the half ({len(cand)})")
        for f in range(forget_sets):
            rf = np.random.default_rng(derive(audit_seed, f"forget/{s}/{f}"))
            pd.forget[(s, f)] = np.sort(rf.choice(cand, size=size, replace=False))
    return pd


def local_positions(half: np.ndarray, forget: np.ndarray) -> np.ndarray:
    """Positions of ``forget`` (positions in D) inside the training set ``half``."""
    return np.searchsorted(half, forget)


# ----------------------------------------------------------------------------------------------- cache
class Cache:
    """Models' outputs on disk, one verified safetensors file per model (:mod:`scrubnet.integrity`: content
    hash in the metadata, atomic writes). An entry that is damaged (truncated, not safetensors, hash mismatch,
    non-finite) or was written without a hash is reported on stderr by file name, deleted and counts as
    absent, so the audit recomputes it; ``damaged`` lists the reports."""

    def __init__(self, root: Path, base_key: dict):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.base = json.dumps(base_key, sort_keys=True)
        self.damaged: list[str] = []

    def key(self, model_id: str, options: dict | None = None) -> str:
        blob = json.dumps({"base": self.base, "id": model_id, "options": options or {}}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def path(self, model_id: str, options: dict | None = None) -> Path:
        return self.root / f"{model_id.replace('/', '_')}-{self.key(model_id, options)}.safetensors"

    def has(self, model_id: str, options: dict | None = None, require: tuple[str, ...] = ()) -> bool:
        """Whether a sound entry holding the tensors named in ``require`` is stored (a damaged one is reported,
        deleted and reported absent; one written before a tensor was required counts as absent)."""
        p = self.path(model_id, options)
        if not p.is_file():
            return False
        try:
            tensors, _ = load_verified(p)
        except ArtifactError as e:
            self.damaged.append(str(e))
            sys.stderr.write(f"warning: audit cache entry {e}; recomputing it\n")
            p.unlink(missing_ok=True)
            return False
        return all(k in tensors for k in require)

    def load(self, model_id: str, options: dict | None = None) -> dict[str, torch.Tensor]:
        """The entry's tensors, verified (:class:`~scrubnet.integrity.ArtifactError` naming the file)."""
        return load_verified(self.path(model_id, options))[0]

    def save(self, model_id: str, tensors: dict[str, torch.Tensor], options: dict | None = None,
             meta: dict | None = None) -> None:
        save_verified(self.path(model_id, options), tensors,
                      {"id": model_id, **{k: str(v) for k, v in (meta or {}).items()}})


# ----------------------------------------------------------------------------------------------- tasks
_SPLIT_CACHE: dict[str, object] = {}


def _worker_split(shared: dict):
    """The experiment's configuration and split, rebuilt on the worker (cached per process) on the worker's
    device (``shared["device"]``: auto | cpu | cuda, resolved where the task runs); sets the torch threads."""
    torch.set_num_threads(shared["threads"])
    cfg = ExperimentConfig.from_dict(shared["config"])
    dev = resolve_device(shared.get("device", "cpu"))
    key = json.dumps(cfg.data.to_dict(), sort_keys=True) + str(dev)
    if key not in _SPLIT_CACHE:
        _SPLIT_CACHE[key] = load_split(cfg.data).to(dev)
    return cfg, _SPLIT_CACHE[key]


def _points(split) -> torch.Tensor:
    return cat_inputs([split.x, split.x_test])


def _logits(model, x) -> torch.Tensor:
    return predict_logits(model, x).float().cpu()


def _cpu_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _start(shared: dict, cfg: ExperimentConfig, split, seed: int):
    pre = build_model(cfg.model, split.input_shape, _n_pre(split), seed=shared["pretrain_seed"],
                      **cfg.model_options)
    pre.load_state_dict(shared["pretrained"])
    return finetune_start(pre, split.num_classes, seed).to(split.x.device)


def _n_pre(split) -> int:
    return split.num_core_classes if len(split.y_core) else split.num_classes


def pretrain_task(shared: dict, _payload=None) -> dict[str, torch.Tensor]:
    """The shared backbone's weights."""
    cfg, split = _worker_split(shared)
    model = build_model(cfg.model, split.input_shape, _n_pre(split), seed=shared["pretrain_seed"],
                        **cfg.model_options).to(split.x.device)
    if len(split.y_core):
        model = pretrain(model, split.x_core, split.y_core, cfg.train, shared["pretrain_seed"])
    return _cpu_state(model)


def train_task(shared: dict, payload: list[dict]) -> list[tuple[str, dict[str, torch.Tensor], float]]:
    """Fine-tune a batch of originals / retrains vmapped, to the protocol's stopping rule *as stated*: zero
    training error, then ``extra_epochs`` more epochs that all end at zero error (``sustained=True``: the count
    restarts when the error comes back; cap ``max_epochs``). Each model's outputs carry ``fit:final_error``
    (training error of the returned weights), ``fit:epochs`` and ``fit:met`` (1 if the rule stopped it, 0 if
    the cap did), so the audit can say how many pool models did not fit.

    Each item: ``{"id", "seed" (training seed), "start_seed" (head of w_0), "half" (positions in D),
    "forget" (positions in D or None), "keep_weights"}``. Returns (id, tensors, seconds per model)."""
    cfg, split = _worker_split(shared)
    t0 = time.perf_counter()
    starts = {s: _start(shared, cfg, split, s) for s in {it["start_seed"] for it in payload}}
    originals = [it for it in payload if it["forget"] is None]
    retrains = [it for it in payload if it["forget"] is not None]
    out: list = []
    x_all = _points(split)
    dev = split.x.device
    if originals:
        res = finetune_many([starts[it["start_seed"]] for it in originals],
                            [split.x[torch.as_tensor(it["half"], device=dev)] for it in originals],
                            [split.y[torch.as_tensor(it["half"], device=dev)] for it in originals], cfg.train,
                            [it["seed"] for it in originals], sustained=True)
        for it, (m, h) in zip(originals, res):
            t = {"logits": _logits(m, x_all), **_fit_tensors(h, cfg)}
            if it.get("keep_weights"):
                t.update({f"w:{k}": v for k, v in _cpu_state(m).items()})
            out.append((it["id"], t))
    if retrains:
        res = retrain_many([starts[it["start_seed"]] for it in retrains], split.x, split.y,
                           [torch.as_tensor(local_positions(np.asarray(it["half"]), np.asarray(it["forget"])),
                                            device=dev) for it in retrains], cfg.train,
                           [it["seed"] for it in retrains], mode=cfg.retrain_mode,
                           train_idxs=[torch.as_tensor(it["half"], device=dev) for it in retrains], sustained=True)
        for it, (m, h) in zip(retrains, res):
            out.append((it["id"], {"logits": _logits(m, x_all), **_fit_tensors(h, cfg)}))
    dt = (time.perf_counter() - t0) / max(len(payload), 1)
    return [(i, t, dt) for i, t in out]


def _fit_tensors(h, cfg: ExperimentConfig) -> dict[str, torch.Tensor]:
    """The stopping-rule outcome of one trained model, stored next to its logits."""
    met = h.zero_error_epoch is not None and h.epochs >= h.zero_error_epoch + cfg.train.extra_epochs
    return {"fit:final_error": torch.tensor(float(h.final_error), dtype=torch.float64),
            "fit:epochs": torch.tensor(int(h.epochs)), "fit:met": torch.tensor(int(met))}


def scrub_task(shared: dict, payload: dict) -> list[tuple[str, dict[str, torch.Tensor], float]]:
    """Run methods on one original and one forget set.

    ``payload``: ``{"original": state dict, "start_seed", "half", "forget" (positions in D),
    "runs": [{"id", "method", "options", "seed"}]}``; runs with the same seed share ``ctx.cache``."""
    cfg, split = _worker_split(shared)
    for spec in shared.get("user_methods", ()):  # a user's module:Class, registered on this worker too
        load_user_method(spec)
    start = _start(shared, cfg, split, payload["start_seed"])
    original = copy.deepcopy(start)
    original.load_state_dict(payload["original"])
    original.eval()
    dev = split.x.device
    half = torch.as_tensor(payload["half"], device=dev)
    fpos = torch.as_tensor(local_positions(np.asarray(payload["half"]), np.asarray(payload["forget"])), device=dev)
    sub = Split(split.x_core, split.y_core, split.x[half], split.y[half], split.x_test, split.y_test, fpos,
                split.num_classes, split.num_core_classes, None, split.name, dict(split.meta))
    caches: dict[int, ArtifactCache] = {}
    x_all = _points(split)
    out = []
    for run in payload["runs"]:
        t0 = time.perf_counter()
        ctx = protocol_context(start, cfg.train, num_classes=split.num_classes, seed=int(run["seed"]),
                               split=sub, retrain_mode=cfg.retrain_mode,
                               cache=caches.setdefault(int(run["seed"]), ArtifactCache()))
        # the one scrub path, its retain-error rule reported (the pool keeps every model, as `scrubnet run`)
        res = scrub_and_measure(protocol_method(run["method"], **run["options"]), original, sub.retain,
                                sub.forget, ctx, retain_rule="report")
        tensors = {"logits": _logits(res.model, x_all)}
        own = res.scrub.original if res.scrub is not None else None
        if own is not None and own is not original:  # a method's own family (ML-Forgetting): its "before" model
            tensors["original_logits"] = _logits(own, x_all)
        out.append((run["id"], tensors, time.perf_counter() - t0))
    return out
