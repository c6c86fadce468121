"""The shipped world can be learned: GRPO at the default recipe, a few steps on fixed seeds, raises the shipped
policy's held-out accuracy by more than the sampling noise of the measurement (issue 18's test of the world)."""
from __future__ import annotations

import math

import pytest
import torch

from drafttrain.config import load_recipe, resolve_path


@pytest.mark.slow
def test_the_shipped_policy_learns_in_a_short_run():
    from drafttrain.engines import build_engine
    from drafttrain.policy import load_policy
    from drafttrain.rl.grpo import GRPO

    torch.manual_seed(0)
    n_eval, steps = 1024, 12
    cfg = load_recipe("eagle3_track", ["drafter.path=null", f"rl.eval_prompts={n_eval}"])
    policy, tok = load_policy(str(resolve_path(cfg.policy.path)))
    engine = build_engine(cfg.engine, policy)
    grpo = GRPO.from_config(cfg, policy, tok, engine)
    before = grpo.evaluate()["eval_sampled_acc"]
    rewards = []
    for step in range(steps):
        ro = grpo.rollout(step)
        rewards.append(sum(ro.rewards) / len(ro.rewards))
        grpo.train_step(ro)
        engine.update_policy()
    after = grpo.evaluate()["eval_sampled_acc"]
    se = math.sqrt(before * (1 - before) / n_eval + after * (1 - after) / n_eval)
    assert after - before > 2.5 * se, (before, after, se, rewards)
