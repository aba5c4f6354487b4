"""Data as users hold it, read in chunks: :class:`DataStream`.

A data set reaches scrubnet as one of

* ``(x, y)`` tensors (or a ``TensorDataset``): kept as they are;
* a map-style ``Dataset`` whose items are ``(x, y)`` tuples or dicts: read ``chunk_size`` items at a time
  (collated with ``torch.utils.data.default_collate``), never all at once;
* a ``DataLoader`` whose batches are ``(x, y)`` tuples or dicts: its own batches, in its own order, with its
  own augmentation, one pass per :meth:`DataStream.chunks` call.

Dict items and batches are read by key: the input under the first of ``BatchKeys.x`` present (default
``x``, ``input``, ``inputs``, ``image``, ``images``, ``img``, ``pixel_values``, ``features``), the label under
the first of ``BatchKeys.y`` (default ``y``, ``label``, ``labels``, ``target``, ``targets``). Fields beyond the
input and the label have no meaning for scrubbing: they are refused (a third tuple field, another dict key)
unless ``BatchKeys(ignore_extra=True)`` says to ignore them.

The streaming rule (docs/decisions/index.md, "Streaming user data"): full-batch quantities (mean losses, gradients,
Fisher diagonals, readouts) are sums over chunks divided by the number of samples, so no method or readout
needs D_r in memory at once. Every chunk is checked finite as it is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

DEFAULT_CHUNK = 512


@dataclass(frozen=True)
class BatchKeys:
    """Which dict keys hold the input and the label (first present wins), and whether other fields are ignored.

    Parameters
    ----------
    x : tuple of str
        Candidate keys of the input (default ``x``, ``input``, ``inputs``, ``image``, ``images``, ``img``,
        ``pixel_values``, ``features``).
    y : tuple of str
        Candidate keys of the label (default ``y``, ``label``, ``labels``, ``target``, ``targets``).
    ignore_extra : bool
        Ignore other fields of a dict batch (and fields after the second of a tuple batch) instead of refusing
        the batch (default False).

    Returns
    -------
    BatchKeys
        A frozen rule; :meth:`split` maps one batch to ``(input (n, ...), label (n,))``.
    """

    x: tuple[str, ...] = ("x", "input", "inputs", "image", "images", "img", "pixel_values", "features")
    y: tuple[str, ...] = ("y", "label", "labels", "target", "targets")
    ignore_extra: bool = False

    def split(self, batch) -> tuple[Tensor, Tensor]:
        """(input, label) of one item or batch; ``ValueError`` naming what is wrong."""
        if isinstance(batch, dict):
            xk = next((k for k in self.x if k in batch), None)
            yk = next((k for k in self.y if k in batch), None)
            if xk is None or yk is None:
                missing = "input" if xk is None else "label"
                tried = self.x if xk is None else self.y
                raise ValueError(f"a dict batch has no {missing} key (tried {', '.join(tried)}; got keys "
                                 f"{', '.join(map(str, batch))}); name it with BatchKeys({missing[0]}=(...,))")
            extra = sorted(set(map(str, batch)) - {xk, yk})
            if extra and not self.ignore_extra:
                raise ValueError(f"a dict batch has fields besides the input {xk!r} and label {yk!r}: "
                                 f"{', '.join(extra)}; scrubnet gives them no meaning — pass "
                                 "BatchKeys(ignore_extra=True) to ignore them")
            return batch[xk], batch[yk]
        if isinstance(batch, (tuple, list)):
            if len(batch) < 2:
                raise ValueError(f"a batch must hold (input, label), got {len(batch)} field(s)")
            if len(batch) > 2 and not self.ignore_extra:
                raise ValueError(f"a batch has {len(batch)} fields; scrubnet reads (input, label) and gives the "
                                 "others no meaning — pass BatchKeys(ignore_extra=True) to ignore them")
            return batch[0], batch[1]
        raise TypeError(f"a batch must be an (input, label) tuple or a dict, got {type(batch).__name__}")


def _check_chunk(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise TypeError(f"batches must hold tensors, got {type(x).__name__} and {type(y).__name__}")
    if len(x) != len(y):
        raise ValueError(f"a batch holds {len(x)} inputs and {len(y)} labels")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("the inputs contain non-finite values (NaN or inf)")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(f"labels must be integer class indices, got dtype {y.dtype}")
    return x, y


class DataStream:
    """One data set read in chunks (module docstring). ``kind`` is ``"tensors"``, ``"dataset"`` or ``"loader"``.

    ``len(stream)`` is the number of samples; :meth:`chunks` yields (x, y) chunks in order (a loader: its
    batches); :meth:`take` returns the samples at given indices (tensors and datasets); :meth:`tensors`
    materialises everything (for the few places that need D in memory, e.g. the protocol's own tensors).
    """

    def __init__(self, source, keys: BatchKeys | None = None, chunk_size: int = DEFAULT_CHUNK):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
        self.keys, self.chunk_size = keys or BatchKeys(), int(chunk_size)
        self.x: Tensor | None = None
        self.y: Tensor | None = None
        if isinstance(source, (tuple, list)) and len(source) == 2 and isinstance(source[0], Tensor):
            self.kind = "tensors"
            self.x, self.y = _check_chunk(source[0], source[1])
        elif isinstance(source, TensorDataset) and len(source.tensors) >= 2:
            if len(source.tensors) > 2 and not self.keys.ignore_extra:
                raise ValueError(f"the TensorDataset holds {len(source.tensors)} tensors; scrubnet reads (input, "
                                 "label) — pass BatchKeys(ignore_extra=True) to ignore the others")
            self.kind = "tensors"
            self.x, self.y = _check_chunk(source.tensors[0], source.tensors[1])
        elif isinstance(source, DataLoader):
            self.kind, self.loader = "loader", source
        elif isinstance(source, Dataset):
            if not hasattr(source, "__len__"):
                raise TypeError("an iterable-style Dataset has no length: wrap it in a DataLoader")
            self.kind, self.dataset = "dataset", source
        else:
            raise TypeError(f"expected (x, y) tensors, a Dataset or a DataLoader, got {type(source).__name__}")
        self._len: int | None = len(self.y) if self.kind == "tensors" else None

    def __len__(self) -> int:
        if self._len is None:
            if self.kind == "dataset":
                self._len = len(self.dataset)
            else:
                try:
                    self._len = len(self.loader.dataset)
                    if getattr(self.loader, "drop_last", False):
                        raise TypeError  # the loader sees fewer samples than its data set holds: count them
                except TypeError:
                    self._len = sum(len(y) for _, y in self.chunks())
        return self._len

    @property
    def indexable(self) -> bool:
        """True when samples can be fetched by index (tensors, map-style datasets)."""
        return self.kind != "loader"

    def take(self, idx) -> tuple[Tensor, Tensor]:
        """The samples at ``idx`` (a 1-D index tensor or list), in that order."""
        if self.kind == "tensors":
            return self.x[idx], self.y[idx]
        if self.kind == "loader":
            raise TypeError("a DataLoader's samples cannot be fetched by index; iterate its batches")
        items = [self.keys.split(self.dataset[int(i)]) for i in idx]
        x = default_collate([a for a, _ in items])
        y = default_collate([b for _, b in items])
        return _check_chunk(x, torch.as_tensor(y))

    def chunks(self, chunk_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """(x, y) chunks of at most ``chunk_size`` samples (a loader: its own batches), each checked finite."""
        size = int(chunk_size or self.chunk_size)
        if self.kind == "loader":
            for batch in self.loader:
                x, y = self.keys.split(batch)
                yield _check_chunk(x, torch.as_tensor(y))
            return
        n = len(self)
        for i in range(0, n, size):
            yield self.take(torch.arange(i, min(i + size, n))) if self.kind == "dataset" else \
                (self.x[i:i + size], self.y[i:i + size])

    def tensors(self) -> tuple[Tensor, Tensor]:
        """All samples as (x, y) tensors (materialised; the tensors themselves for ``kind == "tensors"``)."""
        if self.kind == "tensors":
            return self.x, self.y
        xs, ys = zip(*self.chunks()) if len(self) else ((), ())
        if not xs:
            raise ValueError("the data set is empty")
        return torch.cat(xs), torch.cat(ys)


def as_stream(data, keys: BatchKeys | None = None, chunk_size: int = DEFAULT_CHUNK) -> DataStream:
    """``data`` as a :class:`DataStream` (a stream is returned unchanged)."""
    return data if isinstance(data, DataStream) else DataStream(data, keys, chunk_size)
