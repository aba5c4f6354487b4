"""Data as users hold it, read in chunks: :class:`DataStream`.

A data set reaches scrubnet as one of

* ``(x, y)`` tensors (or a ``TensorDataset``): kept as they are;
* a map-style ``Dataset`` whose items are ``(x, y)`` tuples or dicts: read ``chunk_size`` items at a time
  (collated with ``torch.utils.data.default_collate``), never all at once;
* a ``DataLoader`` whose batches are ``(x, y)`` tuples or dicts: its own batches, in its own order, with its
  own augmentation, one pass per :meth:`DataStream.chunks` call.

Dict items and batches are read by key: the main input under the first of ``BatchKeys.x`` present (default
``x``, ``input``, ``inputs``, ``input_ids``, ``image``, ``images``, ``img``, ``pixel_values``, ``features``),
the label under the first of ``BatchKeys.y`` (default ``y``, ``label``, ``labels``, ``target``, ``targets``),
and the model's further inputs under the keys of ``BatchKeys.extra`` (default the HuggingFace names
``attention_mask``, ``token_type_ids``, ``position_ids``, ``pixel_mask``, ``decoder_input_ids``,
``decoder_attention_mask``, ``head_mask``, ``bbox``, ``visual_embeds``…). A batch with extras yields
``x`` as a :class:`~scrubnet.models.call.ModelInputs` (main input + extras passed to the model as keyword
arguments, in every method and readout); without, a plain tensor. Any other field is refused (a third tuple
field, an unknown dict key) with the way to name it — never dropped silently — unless
``BatchKeys(ignore_extra=True)`` explicitly says to ignore it.

The streaming rule (docs/decisions/index.md, "Streaming user data"): full-batch quantities (mean losses, gradients,
Fisher diagonals, readouts) are sums over chunks divided by the number of samples, so no method or readout
needs D_r in memory at once. Every chunk is checked finite as it is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from scrubnet.models.call import Inputs, ModelInputs, cat_inputs

DEFAULT_CHUNK = 512


@dataclass(frozen=True)
class BatchKeys:
    """Which dict keys hold the main input and the label (first present wins), which hold further model
    inputs (every one present is passed to the model as a keyword argument of that name), and whether other
    fields are ignored (``ignore_extra=True``: an explicit opt-out; by default they are refused).

    Parameters
    ----------
    x : tuple of str
        Candidate keys of the main input (passed positionally).
    y : tuple of str
        Candidate keys of the integer labels.
    extra : tuple of str
        Keys of further inputs, passed as ``model(x, **{key: value})``.
    ignore_extra : bool
        Ignore fields named nowhere above instead of refusing them.

    Returns
    -------
    BatchKeys
        A frozen rule; :meth:`split` maps one batch to ``(input (n, ...), label (n,))``, the input a
        :class:`~scrubnet.models.call.ModelInputs` when extra inputs are present.
    """

    x: tuple[str, ...] = ("x", "input", "inputs", "input_ids", "image", "images", "img", "pixel_values",
                          "features")
    y: tuple[str, ...] = ("y", "label", "labels", "target", "targets")
    extra: tuple[str, ...] = ("attention_mask", "token_type_ids", "position_ids", "pixel_mask", "head_mask",
                              "inputs_embeds", "decoder_input_ids", "decoder_attention_mask", "bbox",
                              "visual_embeds", "visual_attention_mask", "visual_token_type_ids", "langs",
                              "global_attention_mask")
    ignore_extra: bool = False

    def split(self, batch) -> tuple[Inputs, Tensor]:
        """(input, label) of one item or batch; ``ValueError`` naming what is wrong.

        The input is a tensor, or a :class:`~scrubnet.models.call.ModelInputs` when extra inputs are present.
        """
        if isinstance(batch, Mapping):
            xk = next((k for k in self.x if k in batch), None)
            yk = next((k for k in self.y if k in batch), None)
            if xk is None or yk is None:
                missing, kw = ("input", "x") if xk is None else ("label", "y")
                tried = self.x if xk is None else self.y
                raise ValueError(f"a dict batch has no {missing} key (tried {', '.join(tried)}; got keys "
                                 f"{', '.join(map(str, batch))}); name it with BatchKeys({kw}=('your_key',))")
            extras = [k for k in self.extra if k in batch and k not in (xk, yk)]
            other = sorted(set(map(str, batch)) - {xk, yk, *extras})
            if other and not self.ignore_extra:
                raise ValueError(f"a dict batch has fields besides the input {xk!r}, the label {yk!r} and the "
                                 f"model inputs BatchKeys.extra names: {', '.join(other)}; to pass them to the "
                                 f"model as keyword arguments name them with BatchKeys(extra=BatchKeys().extra + "
                                 f"({', '.join(map(repr, other))},)), to drop them pass BatchKeys(ignore_extra=True)")
            x = batch[xk]
            if extras:
                x = ModelInputs(x, {k: batch[k] for k in extras})
            return x, batch[yk]
        if isinstance(batch, (tuple, list)):
            if len(batch) < 2:
                raise ValueError(f"a batch must hold (input, label), got {len(batch)} field(s)")
            if len(batch) > 2 and not self.ignore_extra:
                raise ValueError(f"a batch has {len(batch)} fields; scrubnet reads a tuple as (input, label) — "
                                 "give further model inputs in a dict batch (keys named by BatchKeys.extra), or "
                                 "pass BatchKeys(ignore_extra=True) to drop them")
            return batch[0], batch[1]
        raise TypeError(f"a batch must be an (input, label) tuple or a dict, got {type(batch).__name__}")


def input_tensors(x: Inputs) -> dict[str, Tensor]:
    """The tensors of an input by name (``"x"`` for a plain tensor; the main input and each extra)."""
    if isinstance(x, ModelInputs):
        return {"input": x.main, **x.extras}
    return {"x": x}


def inputs_finite(x: Inputs) -> bool:
    """True when every floating tensor of ``x`` is finite (integer inputs such as token ids always are)."""
    return all(bool(torch.isfinite(t).all()) for t in input_tensors(x).values() if t.is_floating_point())


def _check_chunk(x: Inputs, y: Tensor) -> tuple[Inputs, Tensor]:
    bad = {k: type(t).__name__ for k, t in {**input_tensors(x), "labels": y}.items() if not isinstance(t, Tensor)}
    if bad:
        raise TypeError("batches must hold tensors, got " + ", ".join(f"{k}: {v}" for k, v in bad.items()))
    if len(x) != len(y):
        raise ValueError(f"a batch holds {len(x)} inputs and {len(y)} labels")
    if not inputs_finite(x):
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
        self.source = source   # the data as the user gave it (what a user's own training function is handed)
        self.x: Inputs | None = None
        self.y: Tensor | None = None
        if isinstance(source, (tuple, list)) and len(source) == 2 and isinstance(source[0], (Tensor, ModelInputs)):
            self.kind = "tensors"
            self.x, self.y = _check_chunk(source[0], source[1])
        elif isinstance(source, TensorDataset) and len(source.tensors) >= 2:
            if len(source.tensors) > 2 and not self.keys.ignore_extra:
                raise ValueError(f"the TensorDataset holds {len(source.tensors)} tensors; scrubnet reads (input, "
                                 "label) — pass (ModelInputs(x, {name: tensor}), y) for further model inputs, or "
                                 "BatchKeys(ignore_extra=True) to drop them")
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
        self.collate = None   # a loader's collate_fn, for a stream made by :meth:`indexed`

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

    def take(self, idx) -> tuple[Inputs, Tensor]:
        """The samples at ``idx`` (a 1-D index tensor or list), in that order."""
        if self.kind == "tensors":
            return self.x[idx], self.y[idx]
        if self.kind == "loader":
            raise TypeError("a DataLoader's samples cannot be fetched by index; iterate its batches")
        if self.collate is not None:
            x, y = self.keys.split(self.collate([self.dataset[int(i)] for i in idx]))
            return _check_chunk(x, torch.as_tensor(y))
        items = [self.keys.split(self.dataset[int(i)]) for i in idx]
        x = _collate_inputs([a for a, _ in items])
        y = default_collate([b for _, b in items])
        return _check_chunk(x, torch.as_tensor(y))

    def indexed(self) -> "DataStream | None":
        """This stream read by index: itself when indexable; for a ``DataLoader`` over a map-style ``Dataset``, a
        stream over that data set whose items are collated by the loader's ``collate_fn`` (the loader's own
        batching of dict items, padding included; its sampler is not used); None for an iterable-style one."""
        if self.indexable:
            return self
        ds = self.loader.dataset
        if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__") \
                or not hasattr(ds, "__getitem__"):
            return None
        if isinstance(ds, Dataset):
            view = DataStream(ds, self.keys, self.chunk_size)
        else:   # a list of items, as HuggingFace examples often are
            view = DataStream(torch.utils.data.Subset(ds, range(len(ds))), self.keys, self.chunk_size)
        view.collate = self.loader.collate_fn
        return view

    def chunks(self, chunk_size: int | None = None) -> Iterator[tuple[Inputs, Tensor]]:
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

    def sample_chunks(self, max_examples: int | None = None, seed: int = 0) -> Iterator[tuple[Inputs, Tensor]]:
        """:meth:`chunks` of at most ``max_examples`` samples: a seeded subset (in index order) when the stream
        is longer and indexable, else every chunk."""
        n = len(self)
        if max_examples is None or n <= max_examples or not self.indexable:
            yield from self.chunks()
            return
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_examples].sort().values
        for i in range(0, len(idx), self.chunk_size):
            yield self.take(idx[i:i + self.chunk_size])

    def tensors(self) -> tuple[Inputs, Tensor]:
        """All samples as (x, y) tensors (materialised; the tensors themselves for ``kind == "tensors"``)."""
        if self.kind == "tensors":
            return self.x, self.y
        xs, ys = zip(*self.chunks()) if len(self) else ((), ())
        if not xs:
            raise ValueError("the data set is empty")
        return cat_inputs(xs), torch.cat(ys)


def _collate_inputs(xs: list) -> Inputs:
    if any(isinstance(a, ModelInputs) for a in xs):
        if not all(isinstance(a, ModelInputs) and list(a.extras) == list(xs[0].extras) for a in xs):
            raise ValueError("the data set's items do not all carry the same extra input fields")
        return ModelInputs(default_collate([a.main for a in xs]),
                           {k: default_collate([a.extras[k] for a in xs]) for k in xs[0].extras})
    return default_collate(xs)


def as_stream(data, keys: BatchKeys | None = None, chunk_size: int = DEFAULT_CHUNK) -> DataStream:
    """``data`` as a :class:`DataStream` (a stream is returned unchanged)."""
    return data if isinstance(data, DataStream) else DataStream(data, keys, chunk_size)
