"""A rollout engine that is rebuilt when it dies, so that the run goes on: RestartingEngine wraps the engine the job
built and is what GRPO and the tracker hold. When a call raises EngineDied (the engine's process is gone), a new
engine is built serving the current policy (the live module) and the drafter version the old one served (the
publisher's served(), swapped in and read back as at any swap), the call runs again on it, and one line says so.
A second death within the same step stops the run (RunStopped, one line: the engine, the step, the last
checkpoint). Calls are retried, not the step: an optimizer step already taken is never taken twice.

    engine = RestartingEngine(build_engine(cfg.engine, policy, drafter), rebuild, served, "vllm", last, say)
    engine.new_step(step)            # the job, at each step; engine.restarts: this step's restarts
"""
from __future__ import annotations

import copy
import threading

from drafttrain.engines import EngineDied, build_engine
from drafttrain.rl.runfolder import RunStopped


def rebuild_engine(cfg_engine, policy, drafter):
    """(weights, version) -> a new engine on `policy` serving a copy of `drafter` with those weights at that
    version (version 0: as built; later: load_drafter, read back as at any swap)."""
    def build(weights: dict, version: int):
        fresh = None
        if drafter is not None:
            fresh = copy.deepcopy(drafter)
            fresh.load_state_dict(weights)
        engine = build_engine(cfg_engine, policy, fresh)
        if fresh is not None and version > 0:
            engine.load_drafter(weights, version)
        return engine

    return build


class RestartingEngine:
    def __init__(self, engine, rebuild, served, name: str, last_checkpoint, say=print):
        self.engine, self._rebuild, self._served, self.name = engine, rebuild, served, name
        self._last, self._say = last_checkpoint, say
        self.step: int | None = None
        self.restarts = 0  # in this step
        self._lock = threading.RLock()  # async RL: a rollout thread and a publish may both meet the dead engine

    def new_step(self, step: int | None) -> None:
        self.step, self.restarts = step, 0

    def __getattr__(self, name):  # the rest of the engine's surface (timings, worker info, schedule)
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def drafter_version(self) -> int:
        return self.engine.drafter_version

    def generate(self, *args, **kwargs):
        return self._call("generate", args, kwargs)

    def load_drafter(self, *args, **kwargs):
        return self._call("load_drafter", args, kwargs)

    def update_policy(self, *args, **kwargs):
        return self._call("update_policy", args, kwargs)

    def close(self) -> None:
        self.engine.close()

    def _call(self, method: str, args, kwargs):
        while True:
            engine = self.engine
            try:
                return getattr(engine, method)(*args, **kwargs)
            except EngineDied as e:
                self._restart(engine, method, e)

    def _restart(self, dead, method: str, err: EngineDied) -> None:
        with self._lock:
            if self.engine is not dead:  # another thread already replaced it
                return
            where = f"step {self.step}" if self.step is not None else "the evaluation"
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if self.restarts:
                last = self._last()
                raise RunStopped(f"engine.kind={self.name}: the {self.name} engine died again in {where}, after a "
                                 f"restart in it ({why}): stopped; the last checkpoint ({last or 'none yet'}) "
                                 f"stands: rerun the same command to resume") from None
            close = getattr(dead, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001  what is left of a dead engine may fail to close
                    pass
            weights, version = self._served()
            self.engine = self._rebuild(weights, version)
            self.restarts += 1
            self._say(f"[drafttrain] the {self.name} engine died during {method} in {where} ({why}); restarted: a "
                      f"new one serves the current policy and drafter v{version}")
