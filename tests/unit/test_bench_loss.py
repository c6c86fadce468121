"""bench_loss hands its settings to each job process: they arrive as given. A null max_new_tokens once arrived as
the string "None" and every online job failed at its oracle's rollouts (the smoke run sets max_new_tokens)."""
from __future__ import annotations

from drafttrain.config import script_config
from tests.conftest import load_script


def test_a_jobs_settings_round_trip_nulls_and_lists():
    B = load_script("bench_loss")
    cfg = script_config(B.DEFAULTS, ["overrides=[rl.steps=2,sampling.max_new_tokens=16]", "seeds=[0,2]"])
    back = script_config(B.DEFAULTS, B.child_argv(cfg))
    assert back.max_new_tokens is None and back.online_arms is None
    assert list(back.arms) == list(cfg.arms) and list(back.overrides) == ["rl.steps=2", "sampling.max_new_tokens=16"]
    assert list(back.seeds) == [0, 2] and back.offline_k == cfg.offline_k and back.online is True
