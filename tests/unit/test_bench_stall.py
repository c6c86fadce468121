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
