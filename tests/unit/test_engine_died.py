"""The vLLM engine's calls say EngineDied when one of its processes is gone (killed, as `kill -9` of VLLM::Worker),
and pass any other failure as it is; no vLLM needed: the engine's processes are stood in for by a child process."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from drafttrain.engines import EngineDied
from drafttrain.engines.vllm_procs import dies_as_engine_died


class Engine:
    def __init__(self, procs):
        self._procs = procs

    @dies_as_engine_died
    def update_policy(self):
        raise Exception("Call to collective_rpc method failed: cancelled")  # what vLLM raised after the kill


def test_a_failed_call_with_a_killed_process_is_engine_died_naming_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        engine = Engine([psutil.Process(child.pid)])
        with pytest.raises(Exception) as e:
            engine.update_policy()
        assert not isinstance(e.value, EngineDied)  # every process runs: not a death, passed as it is
        child.kill()
        child.wait()
        with pytest.raises(EngineDied) as e:
            engine.update_policy()
        msg = str(e.value)
        assert f"(PID {child.pid}) died" in msg and "collective_rpc method failed: cancelled" in msg
        assert "\n" not in msg
    finally:
        child.kill()


def test_a_call_that_hangs_on_a_killed_process_is_engine_died_not_a_hang():
    """The vLLM restart test hung in CI: the worker was killed while the engine core waited on it inside a collective
    RPC (a weight push), and the client waited for ever. A watched call checks the engine's processes while it waits."""
    import threading
    import time

    from drafttrain.engines.vllm_procs import watched

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = [psutil.Process(child.pid)]
    try:
        assert watched(lambda: 7, procs, "quick") == 7  # returns what the call returns
        with pytest.raises(ZeroDivisionError):  # and raises what it raises
            watched(lambda: 1 / 0, procs, "bad")
        never = threading.Event()
        threading.Timer(0.5, child.kill).start()
        t = time.monotonic()
        with pytest.raises(EngineDied, match=rf"\(PID {child.pid}\) died during push"):
            watched(never.wait, procs, "push", poll_s=0.1)  # blocks for ever, as the RPC did
        assert time.monotonic() - t < 10
    finally:
        child.kill()
        child.wait()
