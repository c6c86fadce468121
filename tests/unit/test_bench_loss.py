"""bench_loss hands its settings to each job process: they arrive as given. A null max_new_tokens once arrived as
the string "None" and every online job failed at its oracle's rollouts (the smoke run sets max_new_tokens). Its
summary pairs arms by seed; each part's arms are checked."""
from __future__ import annotations

import pytest

from drafttrain.config import script_config
from tests.conftest import load_script


def test_a_jobs_settings_round_trip_nulls_and_lists():
    B = load_script("bench_loss")
    cfg = script_config(B.DEFAULTS, ["overrides=[rl.steps=2,sampling.max_new_tokens=16]", "seeds=[0,2]"])
    back = script_config(B.DEFAULTS, B.child_argv(cfg))
    assert back.max_new_tokens is None and back.online_arms is None
    assert list(back.arms) == list(cfg.arms) and list(back.overrides) == ["rl.steps=2", "sampling.max_new_tokens=16"]
    assert list(back.seeds) == [0, 2] and back.offline_k == cfg.offline_k and back.online is True


def test_the_summary_pairs_gains_by_seed_and_reports_each_arms_oracle():
    B = load_script("bench_loss")
    cfg = script_config(B.DEFAULTS, ["arms=[kl:uniform,tv:uniform]", "seeds=[0,1]"])
    per_seed = {("kl:uniform", 0): dict(live_mal=4.0, end_oracle_tf_mal=4.4, tracking_over_oracle=0.9),
                ("kl:uniform", 1): dict(live_mal=2.0, end_oracle_tf_mal=4.2, tracking_over_oracle=0.8),
                ("tv:uniform", 0): dict(live_mal=4.4, end_oracle_tf_mal=4.0, tracking_over_oracle=1.1),
                ("tv:uniform", 1): dict(live_mal=2.2, end_oracle_tf_mal=3.8, tracking_over_oracle=0.9)}
    out = B.summarize(cfg, per_seed, {"kl:uniform": [10.0, 12.0], "tv:uniform": [11.0, 11.0]})
    s, rows = out["summary"], {r["arm"]: r for r in out["rows"]}
    # +10% on both seeds, paired: 10 with sd 0 (unpaired means would give 3.3 / 3.0 = +10% too, but an sd of 0 says
    # the pairing was used)
    assert s["online_mal_gain_pct_arm"] == "tv:uniform"
    assert abs(s["online_mal_gain_pct"] - 10) < 1e-9 and abs(s["online_mal_gain_pct_sd"]) < 1e-9
    assert abs(rows["tv:uniform"]["oracle_mal"] - 3.9) < 1e-9 and abs(rows["kl:uniform"]["oracle_mal"] - 4.3) < 1e-9
    assert s["best_tracking_over_oracle"] == 1.0 and s["step_cost_ratio"] == 1.0
    assert out["online_arms"] == ["kl:uniform", "tv:uniform"] and "offline_mal_gain_pct" not in s


@pytest.mark.parametrize("part,value", [("online", "[tv:uniform]"), ("offline", "[kl:uniform,l2:uniform]")])
def test_a_parts_arms_must_be_arms_with_the_reference_among_them(part, value):
    B = load_script("bench_loss")
    cfg = script_config(B.DEFAULTS, [f"{part}_arms={value}"])
    with pytest.raises(SystemExit, match=f"^error: {part}_arms: must be arms, the reference kl:uniform among them"):
        B.part_arms(cfg, part)
    assert B.part_arms(script_config(B.DEFAULTS, [f"{part}_arms=null"]), part) == list(cfg.arms)
