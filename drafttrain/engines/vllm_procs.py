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
