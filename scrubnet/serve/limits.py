"""Per-tenant limits of ``scrubnet serve``: a token bucket of POSTs per identity (429 with ``Retry-After`` when
empty), a second bucket of reads per identity (per client address for the public routes), a quota of queued
submissions per identity, and the time a client may take to send its body."""
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
    read_rate : float
        GETs per second a tenant (or, on the public routes, a client address) may sustain.
    read_burst : int
        GETs it may send at once.
    """
    rate: float = 2.0
    burst: int = 20
    max_queued: int = 16
    body_timeout_s: float = 10.0
    read_rate: float = 20.0
    read_burst: int = 100
    _buckets: dict = field(default_factory=dict, repr=False)
    _reads: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit_read(self, name: str, now: float | None = None) -> float | None:
        """Take one GET from ``name``'s read bucket (a token's identity, or ``addr:`` and a client address):
        None when admitted, else the seconds to wait. A bucket of its own: reads never use up POSTs."""
        return self._take(self._reads, name, self.read_rate, self.read_burst, now)

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
        return self._take(self._buckets, name, self.rate, self.burst, now)

    def _take(self, buckets: dict, name: str, rate: float, burst: int, now: float | None) -> float | None:
        now = time.monotonic() if now is None else now
        with self._lock:
            level, last = buckets.get(name, (float(burst), now))
            level = min(float(burst), level + (now - last) * rate)
            if level >= 1.0:
                buckets[name] = (level - 1.0, now)
                return None
            buckets[name] = (level, now)
            if len(buckets) > 100_000:  # addresses come and go: forget the full buckets, never a debt
                for k in [k for k, (lv, t) in buckets.items() if lv + (now - t) * rate >= burst]:
                    del buckets[k]
            return (1.0 - level) / rate

    @staticmethod
    def retry_after(seconds: float) -> dict:
        """The ``Retry-After`` header (whole seconds, at least 1)."""
        return {"Retry-After": str(max(1, math.ceil(seconds)))}
