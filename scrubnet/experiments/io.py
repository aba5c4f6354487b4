"""Output helpers of the experiments: the atomic writers of :mod:`scrubnet.atomic_io`, atomic figure saving,
and figures built without pyplot (no global backend state is touched)."""
from __future__ import annotations

import io
from pathlib import Path


from scrubnet.atomic_io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text", "atomic_savefig", "subplots"]


def subplots(*args, figsize=None, **kwargs):
    """``(figure, axes)`` like ``pyplot.subplots`` but on a standalone :class:`~matplotlib.figure.Figure`
    (rendered by Agg on save, freed by the garbage collector; nothing to close)."""
    from matplotlib.figure import Figure  # imported where used: matplotlib slows every command's start-up

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def atomic_savefig(fig, path: str | Path, **kwargs) -> None:
    """Save a matplotlib figure atomically (format from the path's suffix)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    atomic_write_bytes(path, buf.getvalue())
