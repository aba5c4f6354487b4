"""Per-tenant limits of ``scrubnet serve``: a token bucket of POSTs per identity (429 with ``Retry-After`` when
empty), a quota of queued submissions per identity, and the time a client may take to send its body."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Limits:
    """Rate limits and quotas, one bucket per token name.

    Parameters
    ----------
    rate : float
        POSTs per second a tenant may sustain (the bucket's refill rate).
    burst : int
        POSTs a tenant may send at once (the bucket's size).
    max_queued : int
        Submissions of one tenant that may wait in the queue; more get 429.
    body_timeout_s : float
        Seconds a client may take to send its request body (408 after).
    """
    rate: float = 2.0
    burst: int = 20
    max_queued: int = 16
    body_timeout_s: float = 10.0
    _buckets: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit(self, name: str, now: float | None = None) -> float | None:
        """Take one POST from ``name``'s bucket: None when admitted, else the seconds to wait (Retry-After).

        Parameters
        ----------
        name : str
            The token's identity.
        now : float or None
            The monotonic time (for tests); now when None.

        Returns
        -------
        float or None
            None, or the wait until the bucket holds one POST again.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            level, last = self._buckets.get(name, (float(self.burst), now))
            level = min(float(self.burst), level + (now - last) * self.rate)
            if level >= 1.0:
                self._buckets[name] = (level - 1.0, now)
                return None
            self._buckets[name] = (level, now)
            return (1.0 - level) / self.rate

    @staticmethod
    def retry_after(seconds: float) -> dict:
        """The ``Retry-After`` header (whole seconds, at least 1)."""
        return {"Retry-After": str(max(1, math.ceil(seconds)))}
