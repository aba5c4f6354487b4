"""Shared fixtures: a tiny, fast version of the embedded experiment."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from scrubnet.data.registry import DataConfig
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.methods.base import ForgetContext
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import TrainConfig

# tiny models: one thread is fastest and immune to OpenMP oversubscription on a busy machine
torch.set_num_threads(1)


def tiny_config(**over) -> ExperimentConfig:
    data = DataConfig(n_train_per_class=20, n_test_per_class=20, core_per_class=40, forget_count=5,
                      num_samples=1500)
    train = TrainConfig(wd=0.03, max_epochs=15, pretrain_epochs=2, batch_size=32)
    cfg = ExperimentConfig(data=data, train=train, model="mlp", model_options={"hidden": 32}, seeds=[0],
                           relearn_max_epochs=5)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def tiny_cfg() -> ExperimentConfig:
    return tiny_config()


def protocol_ctx(w0: dict, config: TrainConfig | None = None, loss: str = "cross_entropy", **fields) -> ForgetContext:
    """A context whose recipe is scrubnet's protocol objective pulled toward ``w0`` with ``config``'s decay and
    SGD settings (``config`` also the schedule) and ``loss``: what the tests of a single method need without a
    start model."""
    config = config or TrainConfig()
    recipe = dataclasses.replace(TrainingRecipe.scrubnet_protocol(w0, config), loss=loss)
    return ForgetContext(recipe=recipe, schedule=config, **fields)


# ---------------------------------------------------------------------------------------------------------------
# No process a test starts outlives the suite.
#
# Every child inherits this session's marker in its environment (a test that builds its own environment from
# os.environ keeps it). When the session ends, any process still carrying the marker — a server whose test failed
# before its finaliser ran, a worker a test forgot — is listed, killed, and fails the run: a left-over server would
# hold a port and a checkpoint's lock on the next run, and on CI it would outlive the job.
# ---------------------------------------------------------------------------------------------------------------
import os  # noqa: E402
import signal  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

SESSION_MARKER = "SCRUBNET_TEST_SESSION"


def processes_with_marker(value: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds ``SESSION_MARKER=value``, this one
    excluded (Linux /proc; elsewhere nothing is found)."""
    found, needle = [], f"{SESSION_MARKER}={value}".encode()
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if pid == os.getpid():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            status = (d / "status").read_text()
            if "\nState:\tZ" in status:  # a zombie has exited; its parent has not reaped it yet
                continue
            found.append((pid, (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def pytest_configure(config):
    # a worker process of a distributed run inherits the controller's marker; only the outermost session sets one
    os.environ.setdefault(SESSION_MARKER, uuid.uuid4().hex)
    # the subprocesses the tests start (CLI commands, servers, the documentation's blocks) run tiny models too: one
    # thread each, as this process (above); two threads per process only spin on a 2-core machine running several
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # generated data sets are cached for the session's processes (and its subprocesses) in a directory of its own,
    # never in the user's cache: a run starts from nothing and leaves nothing behind
    if "SCRUBNET_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        where = tempfile.mkdtemp(prefix="scrubnet-test-cache-")
        os.environ["SCRUBNET_CACHE_DIR"] = where
        atexit.register(shutil.rmtree, where, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    left = processes_with_marker(os.environ[SESSION_MARKER])
    if not left:
        return
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # it exited between the scan and the kill: nothing left to stop
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) started by the tests outlived them (killed now):"]
    lines += [f"  pid {pid}: {cmd[:200]}" for pid, cmd in left]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    session.exitstatus = 1


@pytest.fixture(scope="session")
def docs_run(tmp_path_factory):
    """The README's and the site's code blocks, run once for the whole session (``tests/docs_blocks.py``)."""
    from tests.docs_blocks import run_docs

    return run_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every test that runs the Ray engine (its start-up, and each worker's imports,
    cost more than the tests' own work); an engine made while it runs joins it and leaves it running."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()
