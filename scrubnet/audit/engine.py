"""Execution engines for the pool's tasks, behind one small interface.

An engine maps a task function over payloads: ``engine.map(fn, shared, payloads)`` yields ``(i, result)`` for
each payload as it finishes (any order). ``shared`` is sent once (Ray: one object in the object store) and
passed as ``fn(shared, payload)``. Results do not depend on the engine: every random choice inside a task comes
from the ids of the models it trains.

* :class:`LocalEngine` — in-process, one task after the other (the default; no extra dependency).
* :class:`RayEngine` — one Ray task per payload (a batch of models), ``max_retries`` re-runs a task whose
  worker died. ``address=None`` starts a local Ray (``num_cpus`` CPUs); ``"HOST:PORT"`` joins a running
  cluster. Needs ``pip install "scrubnet[ray]"``. File-based datasets must be readable at the same path on
  every node (the embedded MNIST-1D and digits data are generated on the worker).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator


class LocalEngine:
    """Run every task in this process, in order."""

    name = "local"

    def map(self, fn: Callable[[Any, Any], Any], shared: Any, payloads: list) -> Iterator[tuple[int, Any]]:
        for i, p in enumerate(payloads):
            yield i, fn(shared, p)

    def close(self) -> None:
        return None


class RayEngine:
    """One Ray task per payload; ``num_cpus_per_task`` CPUs each (default 1)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, max_retries: int = 3,
                 num_cpus_per_task: float = 1.0):
        try:
            import ray  # optional dependency
        except ImportError:
            raise ValueError('the Ray engine needs Ray: pip install "scrubnet[ray]"') from None
        self.ray = ray
        self.max_retries = int(max_retries)
        self.num_cpus_per_task = float(num_cpus_per_task)
        self._started = False
        if not ray.is_initialized():
            kwargs: dict = {"include_dashboard": False, "log_to_driver": False}
            if address is not None:
                kwargs["address"] = address
            elif num_cpus is not None:
                kwargs["num_cpus"] = int(num_cpus)
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError) as e:
                raise ValueError(f"cannot start or join Ray{' at ' + address if address else ''}: {e}") from None
            self._started = True

    def map(self, fn, shared, payloads):
        ray = self.ray
        if not payloads:
            return
        remote = ray.remote(max_retries=self.max_retries, num_cpus=self.num_cpus_per_task)(fn)
        shared_ref = ray.put(shared)
        refs = [remote.remote(shared_ref, p) for p in payloads]
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                yield index[r], ray.get(r)

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
            self._started = False


def make_engine(name: str, address: str | None = None, num_cpus: int | None = None, max_retries: int = 3):
    """``local`` or ``ray`` (``address`` joins a running cluster)."""
    if name == "local":
        if address is not None:
            raise ValueError("--address is for the Ray engine: add --engine ray")
        return LocalEngine()
    if name == "ray":
        return RayEngine(address=address, num_cpus=num_cpus, max_retries=max_retries)
    raise ValueError(f"unknown engine {name!r}; choose local or ray")
