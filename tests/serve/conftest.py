"""The serve tests' session guard: no server a test started outlives the session, whatever failed."""
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def no_server_left_running():
    """After the session: stop every ``scrubnet serve`` a test started and left running (its process group
    killed), then fail naming them — a leak is a bug in the test that started it."""
    yield
    helper = sys.modules.get("test_serve")
    if helper is None:
        return
    left = list(helper.LIVE)
    for srv in left:
        srv.stop(kill=True)
    assert not left, f"{len(left)} server(s) left running by the tests: ports {[s.port for s in left]}"


@pytest.fixture
def servers():
    """Start servers with ``servers(ckpt, tmp, extra=..., env=..., cls=Server)`` (``test_serve.Server`` or a
    subclass); every one is stopped after the test, whatever happens."""
    import test_serve
    started = []

    def start(*args, cls=None, **kwargs):
        srv = (cls or test_serve.Server)(*args, **kwargs)
        started.append(srv)
        return srv
    yield start
    for srv in started:
        srv.stop(kill=True)
