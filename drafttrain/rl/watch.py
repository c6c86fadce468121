"""Signs that the policy collapsed, each said once in one line: the reward 0 on every row, or every response cut
at sampling.max_new_tokens, for rl.collapse_steps steps in a row (warnings: the run goes on; a streak broken and
begun again is said again); and a non-finite policy loss or gradient norm (Diverged: the update is not taken, and
the job stops with its last checkpoint standing).

    watch = CollapseWatch(cfg, stop_ids, say)
    watch.see(ro)                                  # each step's rollouts, before the step trains on them
    check_finite("loss", loss, step, cfg.rl.lr)    # in the policy update, before the optimizer step
"""
from __future__ import annotations

import math


def unfinished(tokens: list[int], cap: int, stop: set[int]) -> bool:
    """A response cut at the token cap before any stop token."""
    return len(tokens) >= cap and (not tokens or tokens[-1] not in stop)


class Diverged(RuntimeError):
    """The policy's loss or gradient norm is NaN/inf: the update it would have taken is not taken."""


def check_finite(what: str, value, step: int, lr: float) -> None:
    v = float(value.detach()) if hasattr(value, "detach") else float(value)
    if not math.isfinite(v):
        raise Diverged(f"rl.lr: the policy's {what} is {v} at step {step} (rl.lr={lr} too high?); its update was "
                       f"not taken")


class CollapseWatch:
    def __init__(self, cfg, stop_ids, say=print):
        self.n, self.lr, self.cap = cfg.rl.collapse_steps, cfg.rl.lr, cfg.sampling.max_new_tokens
        self.stop, self.say = set(stop_ids), say
        self.streak = {"reward": 0, "length": 0}

    def see(self, ro) -> None:
        """A step's rollouts (grpo.Rollouts): extends or breaks each streak; says the one that reaches n."""
        hits = {"reward": all(r == 0 for r in ro.rewards),
                "length": all(unfinished(t, self.cap, self.stop) for t in ro.responses)}
        for key, hit in hits.items():
            self.streak[key] = self.streak[key] + 1 if hit else 0
            if self.n and self.streak[key] == self.n:
                self.say(self._line(key, ro.step))

    def _line(self, key: str, step: int) -> str:
        what = ("the reward has been 0 on every row" if key == "reward" else
                f"every response has run to sampling.max_new_tokens ({self.cap}) unfinished")
        return (f"[drafttrain] WARNING: {what} for rl.collapse_steps={self.n} steps (steps {step - self.n + 1}-"
                f"{step}): the policy may have collapsed (rl.lr={self.lr} too high?); the run goes on")
