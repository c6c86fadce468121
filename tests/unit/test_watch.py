"""The collapse watch: one line when a sign of collapse lasts rl.collapse_steps steps, said once per streak; a
non-finite loss or gradient norm is Diverged, naming rl.lr."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from drafttrain.config import load_recipe
from drafttrain.rl.watch import CollapseWatch, Diverged, check_finite


def _ro(step, rewards, lens, stop=None):
    return SimpleNamespace(step=step, rewards=rewards, responses=[[5] * (n - 1) + [stop or 5] for n in lens])


def test_each_sign_is_said_once_when_it_lasts_collapse_steps():
    cfg = load_recipe("eagle3_track", ["rl.collapse_steps=2", "sampling.max_new_tokens=4"])
    said = []
    w = CollapseWatch(cfg, stop_ids=(2,), say=said.append)
    w.see(_ro(0, [0.0, 1.0], [4, 4]))  # a row rewarded: no reward streak; every row cut: length streak 1
    w.see(_ro(1, [0.0, 0.0], [4, 4]))
    assert len(said) == 1 and "sampling.max_new_tokens (4)" in said[0] and "steps 0-1" in said[0]
    w.see(_ro(2, [0.0, 0.0], [4, 4]))
    assert len(said) == 2 and "reward has been 0 on every row" in said[1] and "steps 1-2" in said[1]
    w.see(_ro(3, [0.0, 0.0], [4, 4]))
    assert len(said) == 2  # said once per streak
    w.see(_ro(4, [0.0, 0.0], [4, 4], stop=2))  # ended by the stop token at the cap: finished, not cut
    w.see(_ro(5, [1.0, 0.0], [2, 4]))
    w.see(_ro(6, [0.0, 0.0], [4, 4]))
    assert len(said) == 2 and all("\n" not in s and "rl.collapse_steps=2" in s for s in said)


def test_collapse_steps_0_is_off_and_a_negative_one_is_refused():
    said = []
    w = CollapseWatch(load_recipe("eagle3_track", ["rl.collapse_steps=0"]), (2,), said.append)
    for s in range(5):
        w.see(_ro(s, [0.0], [256]))
    assert said == []
    with pytest.raises(Exception) as e:
        load_recipe("eagle3_track", ["rl.collapse_steps=-1"])
    assert str(e.value).startswith("rl.collapse_steps:")


@pytest.mark.parametrize("v", [math.nan, math.inf])
def test_a_non_finite_loss_or_gradient_is_diverged_naming_rl_lr(v):
    check_finite("loss", 1.5, 3, 100.0)
    with pytest.raises(Diverged) as e:
        check_finite("gradient norm", v, 3, 100.0)
    assert str(e.value).startswith("rl.lr: the policy's gradient norm is") and "step 3" in str(e.value)
