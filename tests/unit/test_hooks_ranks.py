"""DraftTracker's update decisions: a failed background update reaches the RL loop, and under DDP (2 gloo processes,
tiny sizes) every process takes the same drafter steps and the same publish decision, so their drafters stay equal."""
from __future__ import annotations

import os

import pytest
import torch

from drafttrain.config import load_recipe
from tests.conftest import tiny_policy


def _cfg(*over):
    return load_recipe("eagle3_track", ["drafter.path=null", "run.tensorboard=false", "train.batch_size=4",
                                        "online.steps_per_update=2", "sampling.max_new_tokens=16", *over])


def _tracker(c, accelerator=None):
    from drafttrain.drafters import build_drafter
    from drafttrain.rl.hooks import DraftTracker

    policy = tiny_policy()
    torch.manual_seed(1)
    return policy, DraftTracker(c, policy, [], build_drafter(c.drafter, policy), accelerator=accelerator,
                                log=lambda m: None)


def _rl_step(tr, policy, step, gen):
    ids = torch.randint(1, 30, (4, 20), generator=gen)
    with tr.capture(policy, response_start=4):
        policy(input_ids=ids, attention_mask=torch.ones_like(ids))
    return tr.on_policy_update(policy, step)


def test_async_update_error_is_raised_by_wait():
    """online.mode=async: what the background update raises comes out of wait(), not the previous step's record."""
    torch.set_num_threads(1)
    policy, tr = _tracker(_cfg("online.mode=async", "online.publish_gate=false"))
    gen = torch.Generator().manual_seed(0)
    _rl_step(tr, policy, 0, gen)
    assert tr.wait()["drafter_steps"] > 0

    def boom(batch):
        raise RuntimeError("drafter step failed")

    tr.trainer.step = boom
    _rl_step(tr, policy, 1, gen)
    with pytest.raises(RuntimeError, match="drafter step failed") as err:
        tr.wait()
    assert any(e.name == "boom" for e in err.traceback)  # the background thread's traceback, kept
    assert tr.wait() == {}  # raised once; no stale record of step 0 either
