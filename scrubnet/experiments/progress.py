"""A rich progress bar that turns into a no-op when disabled (tests, non-interactive use)."""
from __future__ import annotations

import contextlib

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class _NullProgress:
    """Accepts the calls a rich ``Progress`` gets and does nothing with them."""

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        return None

    def advance(self, *a, **k):
        return None


@contextlib.contextmanager
def make_progress(enabled: bool = True, console=None):
    if not enabled:
        yield _NullProgress()
        return

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                  transient=False) as p:
        yield p
