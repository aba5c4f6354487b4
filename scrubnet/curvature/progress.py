"""Progress of long passes (Fisher batches, Gram chunks, solver iterations) without a UI dependency here.

Curvature code calls ``report(description, done, total)`` from :func:`current_progress` after each unit of
work; whoever wants a progress bar (the CLI, with rich and an ETA) installs a reporter for the duration of
a call with :func:`progress_reporter`. With none installed the calls cost one context-variable lookup.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

ProgressFn = Callable[[str, int, int], None]

_REPORTER: contextvars.ContextVar[ProgressFn | None] = contextvars.ContextVar("scrubnet_progress", default=None)


def current_progress() -> ProgressFn | None:
    """The installed reporter, or None."""
    return _REPORTER.get()


@contextlib.contextmanager
def progress_reporter(fn: ProgressFn | None) -> Iterator[None]:
    """Install ``fn(description, done, total)`` as the reporter of every long pass inside the block."""
    token = _REPORTER.set(fn)
    try:
        yield
    finally:
        _REPORTER.reset(token)
