"""The vLLM engine's processes: vLLM runs its engine core and worker in spawned processes. close() (also the
context manager, garbage collection and interpreter exit) shuts them down and reaps them; a failed start cleans up
as well; if the owning process dies without closing (SIGKILL), a watchdog thread in the worker takes the engine
down within a second. Scripts that build an engine need an `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path


def children() -> list:
    """Child processes, without multiprocessing's resource tracker (it serves the whole process until exit)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in a for a in p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def shutdown(llm, tmp: Path, procs: list) -> None:
    """Stop the engine core (it stops its worker), make sure the engine's processes are gone (vLLM's own
    shutdown gives up after a few seconds), reap them, then remove the temporary folder."""
    import psutil

    try:
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        multiprocessing.active_children()  # reap the exited engine processes (no zombies left behind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dead_process(procs: list) -> str | None:
    """'its NAME process (PID n)' for the first of the engine's processes that is gone (exited, killed, a zombie);
    None while all run."""
    import psutil

    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            pass
        try:
            name = p.name()
        except psutil.Error:
            name = "engine"
        return f"its {name} process (PID {p.pid})"
    return None


def watched(call, procs: list, what: str, poll_s: float = 0.5):
    """call() in a daemon thread, waiting for it while checking the engine's processes every poll_s: a worker killed
    while the engine core waits on it left that wait (a collective RPC) hanging for ever. A process gone is
    EngineDied; the hung thread is left behind (daemon: it does not hold the interpreter at exit)."""
    import threading

    from drafttrain.engines.base import EngineDied

    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"vllm-{what}")
    t.start()
    while True:
        t.join(poll_s)
        if not t.is_alive():
            if "error" in out:
                raise out["error"]
            return out["value"]
        gone = dead_process(procs)
        if gone is not None:
            raise EngineDied(f"vLLM engine: {gone} died during {what}")


def dies_as_engine_died(method):
    """An engine method whose failure, when one of the engine's processes is gone (or vLLM says its engine is dead),
    is EngineDied: the run may build a new engine (rl/restart.py). Other failures pass as they are."""
    import functools

    from drafttrain.engines.base import EngineDied

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except EngineDied:
            raise
        except Exception as e:
            gone = dead_process(self._procs) or ("its engine core" if type(e).__name__ == "EngineDeadError" else None)
            if gone is None:
                raise
            why = (str(e).strip().splitlines() or [""])[0][:160]
            raise EngineDied(f"vLLM engine: {gone} died ({type(e).__name__}: {why})") from e

    return call
