"""The data of a tuning run: validation forget sets drawn like D_f, and the user's data cut and joined in the
form the user gave it (so the user's own training function receives what it expects).

A data set is ``(x, y)`` tensors, a map-style ``Dataset`` or a ``DataLoader`` over one; a cut keeps the form:
tensors are indexed, a ``Dataset`` becomes a ``Subset``, a ``DataLoader`` a new loader over the cut of its data
set with its batch size, ``collate_fn`` and shuffling (a seeded generator when it shuffled).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset, RandomSampler, Subset

from scrubnet.data.stream import BatchKeys, DataStream, as_stream
from scrubnet.models.call import cat_inputs


def labels_of(data, keys: BatchKeys | None = None) -> Tensor:
    """Every label of ``data`` (tensors, ``Dataset`` or ``DataLoader``), in the data set's own order (a loader:
    its data set read by index, so the order does not depend on its sampler).

    Parameters
    ----------
    data : tensors, Dataset or DataLoader
    keys : BatchKeys, optional

    Returns
    -------
    Tensor
        (n,) integer labels.
    """
    s = as_stream(data, keys)
    view = s.indexed()
    if view is None:
        raise ValueError("tuning draws validation forget sets by index: give the data as tensors, a map-style "
                         "Dataset or a DataLoader over one")
    return torch.cat([y.cpu() for _, y in view.chunks()])


def draw_like(y_retain: Tensor, y_forget: Tensor, seed: int, whole_class: int | None = None
              ) -> tuple[Tensor, int | None]:
    """Positions in D_r of a validation forget set like D_f, and its class when D_f is a whole class.

    Parameters
    ----------
    y_retain, y_forget : Tensor
        The labels of D_r and D_f.
    seed : int
        Fixes the draw.
    whole_class : int, optional
        D_f's class when D_f is a whole class: the validation set is then a whole other class of D_r (the one
        whose size is closest to D_f's, ties by a seeded draw).

    Returns
    -------
    idx, cls : Tensor, int or None
        Sorted positions in D_r (disjoint from D_f by construction); the validation class or None. For a
        random D_f: as many samples of each class as D_f holds (fewer when D_r has fewer).
    """
    g = torch.Generator().manual_seed(10_007 * int(seed) + 4_242)
    if whole_class is not None:
        counts = Counter(int(c) for c in y_retain.tolist())
        classes = sorted(counts)
        order = torch.randperm(len(classes), generator=g).tolist()
        cls = min((classes[i] for i in order), key=lambda c: abs(counts[c] - len(y_forget)))
        return torch.nonzero(y_retain == cls).flatten(), cls
    picked = []
    for c, k in sorted(Counter(int(c) for c in y_forget.tolist()).items()):
        pool = torch.nonzero(y_retain == c).flatten()
        picked.append(pool[torch.randperm(len(pool), generator=g)[:k]])
    idx = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
    return idx.sort().values, None


def _dataset_of(data) -> Dataset | None:
    if isinstance(data, DataLoader):
        return data.dataset
    return data if isinstance(data, Dataset) else None


def _like(data, ds: Dataset, seed: int):
    """``ds`` in the form of ``data``: a loader with ``data``'s batching when ``data`` is a loader."""
    if not isinstance(data, DataLoader):
        return ds
    shuffle = isinstance(data.sampler, RandomSampler)
    return DataLoader(ds, batch_size=data.batch_size, shuffle=shuffle, collate_fn=data.collate_fn,
                      drop_last=data.drop_last, generator=torch.Generator().manual_seed(seed) if shuffle else None)


def cut(data, idx: Tensor, seed: int = 0):
    """The samples ``idx`` of ``data`` (positions in its data set), in ``data``'s form (module docstring).

    Parameters
    ----------
    data : tensors, Dataset or DataLoader
    idx : Tensor
        Positions.
    seed : int
        Fixes a shuffling loader's order.

    Returns
    -------
    tensors, Dataset or DataLoader
        Of the same kind as ``data``.
    """
    ds = _dataset_of(data)
    if ds is None:
        x, y = as_stream(data).tensors()
        return x[idx], y[idx]
    return _like(data, Subset(ds, idx.tolist()), seed)


def join(a, b, seed: int = 0):
    """D_a ⊔ D_b in ``a``'s form (tensors concatenated; data sets chained; a loader with ``a``'s batching).

    Parameters
    ----------
    a, b : tensors, Dataset or DataLoader
        Of the same kind (tensors with tensors, data sets or loaders with data sets or loaders).
    seed : int
        Fixes a shuffling loader's order.

    Returns
    -------
    tensors, Dataset or DataLoader
    """
    da, db = _dataset_of(a), _dataset_of(b)
    if da is None or db is None:
        if (da is None) != (db is None):
            raise ValueError("tuning joins D_r and D_f: give both as tensors, or both as data sets / loaders")
        (xa, ya), (xb, yb) = as_stream(a).tensors(), as_stream(b).tensors()
        return cat_inputs([xa, xb.to(ya.device)]), torch.cat([ya, yb.to(ya.device)])
    return _like(a, ConcatDataset([da, db]), seed)


def fresh(data, seed: int = 0):
    """``data`` ready for one more run that must not depend on the runs before it: a shuffling ``DataLoader``
    made anew with its order seeded by ``seed`` (a loader's generator advances with every pass), anything
    else as it is.

    Parameters
    ----------
    data : tensors, Dataset or DataLoader
    seed : int

    Returns
    -------
    tensors, Dataset or DataLoader
    """
    if not isinstance(data, DataLoader):
        return data
    return _like(data, data.dataset, seed)


def complement(n: int, idx: Tensor) -> Tensor:
    """The positions 0 … n − 1 not in ``idx``, sorted."""
    keep = torch.ones(n, dtype=torch.bool)
    keep[idx] = False
    return torch.nonzero(keep).flatten()


def stream(data, keys: BatchKeys | None = None) -> DataStream:
    """``data`` as a stream read by index where it can be (deterministic readouts, whatever the loader's
    sampler)."""
    s = as_stream(data, keys)
    return s.indexed() or s
