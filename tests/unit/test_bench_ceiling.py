"""bench_longtail's ceiling: an AR rollout's decode steps re-priced at the sweep's best speed at their active batch."""
from __future__ import annotations


import pytest

from drafttrain.engines.base import RolloutBatch, Timeline
from drafttrain.spec import SpecStats
from tests.conftest import load_script


@pytest.fixture(scope="module")
def ceiling_wall():
    return load_script("bench_longtail").ceiling_wall


def _run(prefill, steps):
    """An AR rollout: `prefill` seconds up to the end of the first step, then (active batch, seconds) per step."""
    ends, batch = [prefill], [steps[0][0]]
    for b, dt in steps:
        ends.append(ends[-1] + dt)
        batch.append(b)
    return RolloutBatch([], [], SpecStats(), 0, wall_s=ends[-1] + 0.001, timeline=Timeline(ends=ends, batch=batch))


def test_each_step_is_repriced_at_its_batchs_best_speed(ceiling_wall):
    sweep = [{"batch": 1, "ar_tps": 100.0, "sd_tps": 200.0}, {"batch": 8, "ar_tps": 400.0, "sd_tps": 500.0},
             {"batch": 64, "ar_tps": 1000.0, "sd_tps": 800.0}]  # SD loses at 64: the ceiling decodes AR there
    run = _run(0.05, [(64, 0.010), (40, 0.010), (6, 0.004), (2, 0.003), (1, 0.003)])
    # 40 is nearer 64 than 8 in log scale; 6 and 2 are nearer 8 and 1
    want = 0.05 + 0.001 + 0.010 + 0.010 + 0.004 / 1.25 + 0.003 / 2 + 0.003 / 2
    assert ceiling_wall(run, sweep) == pytest.approx(want)


def test_no_gain_anywhere_is_the_ar_time(ceiling_wall):
    sweep = [{"batch": 1, "ar_tps": 300.0, "sd_tps": 250.0}]
    run = _run(0.02, [(4, 0.005), (1, 0.003)])
    assert ceiling_wall(run, sweep) == pytest.approx(run.wall_s)


def test_the_sweeps_sd_share_counts_the_steps_it_times():
    """toggle_sd_steps_pct is the share of the timed steps (at_batch's) that ran SD: the first step, the forced
    probe after the prefill, is not timed and was counted (a batch of 10 steps, SD only in the first two: 20%
    where the timed steps read 1 of 9)."""
    bench = load_script("bench_longtail")
    on = [True, True] + [False] * 8
    ends = [0.01 * (i + 1) for i in range(10)]
    b = RolloutBatch([], [], SpecStats(), 0, timeline=Timeline(ends=ends, batch=[4] * 10, tokens=[4] * 10,
                                                               schedule=[{"on": x} for x in on]))
    steps = bench.counted_steps(b, 4)
    assert steps == list(range(1, 10))
    assert [b.timeline.schedule[i]["on"] for i in steps].count(True) == 1
    assert bench.at_batch(b, 4) == (36, pytest.approx(0.09))
