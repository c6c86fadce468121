"""bench_tracking's swap-stall measurement: a stall is time a swap adds to the decode steps it overlaps, measured
against the steps around them, not against the whole generation's median step."""
from __future__ import annotations

import itertools

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def stall_steps():
    return load_script("bench_tracking").stall_steps


def _ends(durs):
    return [0.0, *itertools.accumulate(durs)]


def test_a_shrinking_batch_is_no_stall(stall_steps):
    # steps of 30 ms while the batch is large, then 10 ms (the long tail): the median step is 10 ms. A swap that
    # landed inside step 5 without slowing it is no stall (against the median it read as 2 decode steps)
    durs = [0.030] * 12 + [0.010] * 40
    ends = _ends(durs)
    land = (ends[5] + ends[6]) / 2
    assert stall_steps(ends, [(land, 0.001)]) == pytest.approx([0.0], abs=1e-9)


def test_a_slowed_step_is_a_stall(stall_steps):
    durs = [0.030] * 12 + [0.010] * 40
    durs[5] = 0.045  # the step the swap landed in took half a step longer
    ends = _ends(durs)
    land = (ends[5] + ends[6]) / 2
    assert stall_steps(ends, [(land, 0.001)]) == pytest.approx([0.5])
    # staging that overlapped the steps before it counts them too
    durs[4] = 0.040
    ends = _ends(durs)
    assert stall_steps(ends, [((ends[5] + ends[6]) / 2, 0.030)]) == pytest.approx([0.5 + 1 / 3])


# ---- the seeds' summary ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    return load_script("bench_tracking")


def test_oracle_checkpoints_sit_in_the_last_quarter(bench):
    assert bench.oracle_checkpoints(60, 2) == [53, 60]
    assert bench.oracle_checkpoints(60, 1) == [60]
    assert bench.oracle_checkpoints(2, 2) == [1, 2] and bench.oracle_checkpoints(1, 3) == [1]


def test_tracking_over_frozen_is_the_last_quarter_ratio(bench):
    """8 steps: the last 2 (steps without a score, e.g. a self-drafter's, do not count); ratio of their means."""
    recs = [{"step": s, "live_tf_mal": 3.0 + s, "frozen_tf_mal": 3.0} for s in range(8)]
    recs.append({"step": 8, "live_tf_mal": None, "frozen_tf_mal": None})
    assert bench.tracking_over_frozen(recs) == pytest.approx((9.0 + 10.0) / 2 / 3.0)
    assert bench.tracking_over_frozen(recs[-1:]) is None


def test_over_seeds_and_the_accuracy_gain(bench):
    assert bench.over_seeds([1.0, None, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    assert bench.over_seeds([2.0]) == (2.0, None) and bench.over_seeds([None]) == (None, None)
    ev = {"prompts": 100, "before": {"eval_sampled_acc": 0.2}, "after": {"eval_sampled_acc": 0.5}}
    gain, se = bench.accuracy_gain(ev)
    assert gain == pytest.approx(30.0) and se == pytest.approx(100 * ((0.16 + 0.25) / 100) ** 0.5)
    assert bench.accuracy_gain({"prompts": 4, "before": None, "after": {}}) == (None, None)


def test_the_oracle_keeps_its_own_settings_whatever_the_recipe_trains_online(bench, monkeypatch):
    """The oracle is the bar the online drafter is measured against: a recipe that unrolls fewer TTT steps online
    (or another lr, batch, query share, or frozen attention scores) must not change how the oracle is trained."""
    from types import SimpleNamespace

    import torch.nn as nn

    from drafttrain.config import load_recipe

    seen = []

    class Trainer:  # records the settings train_oracle hands the trainer; trains nothing
        def __init__(self, drafter, train_cfg, drafter_cfg, buffer=None, head=None):
            seen.append((drafter_cfg.ttt_steps, train_cfg.query_frac, train_cfg.lr, train_cfg.batch_size,
                         train_cfg.score_grad))

    monkeypatch.setattr(bench, "DrafterTrainer", Trainer)
    rc = load_recipe("eagle3_track", ["drafter.ttt_steps=2", "train.query_frac=0.25", "train.lr=1e-2",
                                      "train.batch_size=32", "train.score_grad=false"])
    cfg = SimpleNamespace(oracle_lr=3e-4, oracle_batch=16, oracle_ttt_steps=3, oracle_steps=0)
    bench.train_oracle(nn.Linear(1, 1), [], rc, cfg, head=None)
    assert seen == [(3, 1.0, 3e-4, 16, True)]  # every position, full gradient
    assert (rc.drafter.ttt_steps, rc.train.query_frac, rc.train.lr, rc.train.score_grad) == (2, 0.25, 1e-2, False)


def test_a_bad_oracle_unroll_fails_before_any_run(bench):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({**bench.DEFAULTS, "oracle_ttt_steps": 0})
    with pytest.raises(SystemExit, match="oracle_ttt_steps: must be >= 1, got 0"):
        bench.main(cfg)


def test_the_scored_drafter_is_the_one_the_engines_serve(bench, tmp_path):
    """At a checkpoint right after an update published, its canary has not judged it yet, but the engines serve it:
    that version is scored, not the last judged one."""
    import torch
    import torch.nn as nn

    frozen = nn.Linear(2, 2)
    good = {k: torch.zeros_like(v) for k, v in frozen.state_dict().items()}
    newer = {k: torch.ones_like(v) for k, v in frozen.state_dict().items()}
    for pending, want in (({"version": 3, "weights": newer, "members": {"": {"mal": 3.0, "curve": None}}}, 1.0),
                          (None, 0.0)):
        torch.save({"tracker": {"good_weights": good, "pending": pending}}, tmp_path / "state.pt")
        assert torch.all(bench.load_tracking(frozen, tmp_path).weight == want)
