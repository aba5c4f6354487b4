"""The suite's own hygiene: the check that no process outlives the tests finds a left-over child."""
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import SESSION_MARKER, processes_with_marker
from tests.hang_guard import HANG_GUARD_S


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_child_carrying_the_marker_is_found_until_it_is_stopped():
    marker = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                         env={**os.environ, SESSION_MARKER: marker})
    try:
        assert [pid for pid, _ in processes_with_marker(marker)] == [p.pid]
    finally:
        p.stdin.close()  # the child exits on end of input: an event, not a sleep
        p.wait(timeout=HANG_GUARD_S)
    assert processes_with_marker(marker) == []
    # the session's own marker is set for every test and inherited by its children
    assert os.environ[SESSION_MARKER]
