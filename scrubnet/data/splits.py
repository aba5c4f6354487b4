"""The one split rule of scrubnet: core / D / D_test, and the forget set D_f inside D.

Given a pool of labelled training samples and a pool of labelled test samples:

* ``core`` (pre-training data, never forgotten) = every training sample of the core classes
  (optionally capped per class);
* ``D`` = ``n_train_per_class`` training samples of each task class;
* ``D_test`` = ``n_test_per_class`` test samples of each task class;
* ``D_f`` ⊂ D, chosen by (class, count) with a seed, by explicit ids (positions in D), or as a whole class;
  ``D_r = D \\ D_f``.

Task labels are re-indexed to ``0..len(task_classes)-1`` (in the order given) and core labels to
``0..len(core_classes)-1``, so the fine-tuned head has exactly one output per task class.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


class SplitError(ValueError):
    """A split or forget-set request that cannot be honoured (bad ids, classes, counts)."""


@dataclass
class Split:
    """All tensors of one experiment. ``x_*`` are float32 inputs, ``y_*`` int64 labels.

    ``forget_idx`` holds positions in D (sorted, unique); ``retain_idx`` is its complement in D.
    """

    x_core: Tensor
    y_core: Tensor
    x: Tensor
    y: Tensor
    x_test: Tensor
    y_test: Tensor
    forget_idx: Tensor
    num_classes: int
    num_core_classes: int
    forget_class: int | None = None  # set when a whole class is forgotten
    name: str = "custom"
    meta: dict = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "Split":
        """This split with every tensor on ``device`` (self when already there)."""
        device = torch.device(device)
        tensors = (self.x_core, self.y_core, self.x, self.y, self.x_test, self.y_test, self.forget_idx)
        if all(t.device == device for t in tensors):
            return self
        return Split(*(t.to(device) for t in tensors), self.num_classes, self.num_core_classes, self.forget_class,
                     self.name, dict(self.meta))

    @property
    def retain_idx(self) -> Tensor:
        mask = torch.ones(len(self.y), dtype=torch.bool, device=self.y.device)
        mask[self.forget_idx] = False
        return torch.nonzero(mask).flatten()

    @property
    def retain(self) -> tuple[Tensor, Tensor]:
        idx = self.retain_idx
        return self.x[idx], self.y[idx]

    @property
    def forget(self) -> tuple[Tensor, Tensor]:
        return self.x[self.forget_idx], self.y[self.forget_idx]

    @property
    def full(self) -> tuple[Tensor, Tensor]:
        return self.x, self.y

    @property
    def test(self) -> tuple[Tensor, Tensor]:
        return self.x_test, self.y_test

    @property
    def core(self) -> tuple[Tensor, Tensor]:
        return self.x_core, self.y_core

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def fingerprint(self) -> str:
        """sha256 over the core data, D and D_test (inputs and labels, in order): identifies the data a model was
        trained and tested on. The forget set is not part of it (checkpoints record their forget ids
        separately), so the original, the retrain reference and every scrubbed model of one split share it.
        The one fingerprint definition of the package (checkpoints, ML checkpoints, results)."""
        h = hashlib.sha256()
        for t in (self.x_core, self.y_core, self.x, self.y, self.x_test, self.y_test):
            h.update(np.ascontiguousarray(t.detach().cpu().numpy()).tobytes())
        return h.hexdigest()

    def with_forget(self, forget_idx: Tensor, forget_class: int | None = None) -> "Split":
        """A copy of this split with another forget set (ids validated)."""
        idx = validate_forget_ids(forget_idx, len(self.y)).to(self.y.device)
        return Split(self.x_core, self.y_core, self.x, self.y, self.x_test, self.y_test, idx,
                     self.num_classes, self.num_core_classes, forget_class, self.name, dict(self.meta))


def validate_forget_ids(ids, n: int) -> Tensor:
    """Check forget ids (positions in D, 0 ≤ id < n): not empty, no duplicates, not all of D.

    Returns them as a sorted int64 tensor; raises :class:`SplitError` naming the offending ids.
    """
    arr = np.asarray(ids if not isinstance(ids, Tensor) else ids.cpu().numpy())
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        raise SplitError("the forget set is empty: give at least one sample id")
    if not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise SplitError(f"forget ids must be integers, got dtype {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= n)]
    if bad.size:
        raise SplitError(f"forget id(s) out of range [0, {n}): {', '.join(str(int(b)) for b in bad[:10])}")
    uniq, counts = np.unique(arr, return_counts=True)
    if np.any(counts > 1):
        dup = uniq[counts > 1]
        raise SplitError(f"duplicated forget id(s): {', '.join(str(int(d)) for d in dup[:10])}")
    if uniq.size >= n:
        raise SplitError(f"the forget set covers all {n} samples of D: nothing would be retained")
    return torch.as_tensor(uniq, dtype=torch.long)


def select_forget(y: Tensor, *, forget_class: int | None = None, forget_count: int | None = None,
                  forget_ids=None, seed: int = 0) -> tuple[Tensor, int | None]:
    """Choose D_f inside D (labels ``y`` of D, task-indexed).

    * ``forget_ids``: explicit positions in D;
    * ``forget_class`` and ``forget_count``: ``forget_count`` samples of that class drawn without
      replacement with ``numpy.random.default_rng(seed)``;
    * ``forget_class`` alone: the whole class (returned second so Hiding/Fisher can use it).
    """
    n = len(y)
    if forget_ids is not None:
        if forget_class is not None or forget_count is not None:
            raise SplitError("give either forget ids or (forget class, forget count), not both")
        return validate_forget_ids(forget_ids, n), None
    if forget_class is None:
        raise SplitError("no forget set: give forget ids, or a forget class (with an optional count)")
    classes = sorted(int(c) for c in torch.unique(y))
    if forget_class not in classes:
        raise SplitError(f"forget class {forget_class} is not a task class (task classes: {classes})")
    members = torch.nonzero(y == forget_class).flatten().numpy()
    if forget_count is None:
        return validate_forget_ids(members, n), forget_class
    if forget_count <= 0:
        raise SplitError(f"forget count must be positive, got {forget_count}")
    if forget_count > len(members):
        raise SplitError(f"forget count {forget_count} exceeds the {len(members)} samples of class {forget_class}")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(members, size=forget_count, replace=False)
    return validate_forget_ids(chosen, n), (forget_class if forget_count == len(members) else None)


def _take_per_class(y: np.ndarray, classes, count: int | None, rng: np.random.Generator, what: str):
    out = []
    for c in classes:
        idx = np.nonzero(y == c)[0]
        if count is None:
            out.append(idx)
            continue
        if len(idx) < count:
            raise SplitError(f"{what}: class {c} has {len(idx)} samples, {count} requested")
        out.append(np.sort(rng.choice(idx, size=count, replace=False)))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def make_split(x_train, y_train, x_test, y_test, *, core_classes, task_classes, n_train_per_class: int,
               n_test_per_class: int, core_per_class: int | None = None, forget_class: int | None = None,
               forget_count: int | None = None, forget_ids=None, seed: int = 0, name: str = "custom") -> Split:
    """Apply the split rule (module docstring) to pools of samples.

    ``forget_class`` is given in *task* indexing (0 = first of ``task_classes``). ``seed`` fixes every
    random choice (which samples enter D, D_test, the core and D_f).
    """
    core_classes, task_classes = list(core_classes), list(task_classes)
    if set(core_classes) & set(task_classes):
        raise SplitError(f"core and task classes overlap: {sorted(set(core_classes) & set(task_classes))}")
    if len(task_classes) < 2:
        raise SplitError("need at least two task classes")
    y_train_np = np.asarray(y_train.cpu().numpy() if isinstance(y_train, Tensor) else y_train)
    y_test_np = np.asarray(y_test.cpu().numpy() if isinstance(y_test, Tensor) else y_test)
    x_train = torch.as_tensor(x_train, dtype=torch.float32)
    x_test = torch.as_tensor(x_test, dtype=torch.float32)
    present = set(np.unique(y_train_np).tolist())
    missing = [c for c in core_classes + task_classes if c not in present]
    if missing:
        raise SplitError(f"class(es) {missing} have no training samples")
    rng = np.random.default_rng(seed)
    d_idx = _take_per_class(y_train_np, task_classes, n_train_per_class, rng, "D")
    t_idx = _take_per_class(y_test_np, task_classes, n_test_per_class, rng, "D_test")
    c_idx = _take_per_class(y_train_np, core_classes, core_per_class, rng, "core") if core_classes else \
        np.zeros(0, dtype=np.int64)
    task_map = {c: i for i, c in enumerate(task_classes)}
    core_map = {c: i for i, c in enumerate(core_classes)}
    y = torch.as_tensor([task_map[int(v)] for v in y_train_np[d_idx]], dtype=torch.long)
    yt = torch.as_tensor([task_map[int(v)] for v in y_test_np[t_idx]], dtype=torch.long)
    yc = torch.as_tensor([core_map[int(v)] for v in y_train_np[c_idx]], dtype=torch.long)
    forget_idx, fclass = select_forget(y, forget_class=forget_class, forget_count=forget_count,
                                       forget_ids=forget_ids, seed=seed + 1)
    return Split(x_train[c_idx], yc, x_train[d_idx], y, x_test[t_idx], yt, forget_idx,
                 num_classes=len(task_classes), num_core_classes=len(core_classes), forget_class=fclass,
                 name=name, meta={"core_classes": core_classes, "task_classes": task_classes, "seed": seed})
