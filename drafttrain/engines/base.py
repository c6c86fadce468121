"""The RolloutEngine contract (both engines pass one contract test suite); build_engine is in engines/__init__.py.

    engine = build_engine(cfg.engine, policy, drafter=None)
    batch = engine.generate(prompts, params, speculative=True)   # -> RolloutBatch
    engine.load_drafter(weights, version)                         # atomic, versioned hot-swap
    engine.drafter_version
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from drafttrain.spec import SamplingParams, SpecStats


@dataclass
class Timeline:
    """What a batch's decode steps did, for benchmarks (an engine fills what it knows; empty where unknown)."""
    ends: list[float] = field(default_factory=list)  # drafttrain.device.now() at the end of each decode step
    schedule: list[dict] = field(default_factory=list)  # SD schedule per decode step: batch, on, k, predicted speed-up
    batch: list[int] = field(default_factory=list)  # active rows in each decode step (embedded engine)
    tokens: list[int] = field(default_factory=list)  # response tokens each decode step emitted (embedded engine)
    # of the batch's wall_s, the prompt processing before the first decode step: set-up, prefill and the first token
    # of each row (embedded engine; 0 where unknown)
    prefill_s: float = 0.0
    # drafts verified at each decode step (0: an AR step; embedded engine): the schedule's k where the end of the
    # context did not cut it
    k: list[int] = field(default_factory=list)


@dataclass
class RolloutBatch:
    tokens: list[list[int]]  # response token ids per prompt (stop token included when one ended the row)
    logprobs: list[list[float]]  # the policy's log-prob of each emitted token under processed_probs
    stats: SpecStats
    drafter_version: int  # version in use when the batch started; see drafter_versions for swaps mid-batch
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length"
    wall_s: float = 0.0
    drafter_versions: list[int] = field(default_factory=list)  # version used at each decode step
    timeline: Timeline = field(default_factory=lambda: Timeline())  # per decode step, for benchmarks


    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


class RolloutEngine(Protocol):
    drafter_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True
                 ) -> RolloutBatch: ...

    def load_drafter(self, weights: dict, version: int) -> None: ...

    def update_policy(self, policy=None) -> None: ...

    def close(self) -> None: ...  # free what the engine holds (processes, temporary files); idempotent


class EngineDied(Exception):
    """The engine's process is gone (killed, crashed): it will not serve again, and a new engine must be built. Not a
    RuntimeError: the canary, which takes an engine's RuntimeError for its drafter's fault, must not see it."""


class StaleVersionError(ValueError):
    """load_drafter with a version that is not newer than the one being served."""


def check_prompts(prompts, max_len: int, vocab_size: int) -> None:
    """generate()'s prompts, for every engine: non-empty, shorter than max_len positions, ids inside the vocabulary
    (one-line ValueError naming the prompt)."""
    if not prompts:
        raise ValueError("generate: prompts is empty")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if len(p) >= max_len:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens; the maximum position is {max_len}")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"generate: prompt {i} has a token id outside the policy vocabulary [0, {vocab_size})")
