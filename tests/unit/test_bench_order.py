"""bench_longtail's interleaving: engines take turns in an order that does not keep who runs right before whom."""
from __future__ import annotations

from collections import defaultdict

from tests.conftest import load_script


class Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def generate(self, prompts, params, speculative=True):
        self.log.append(self.name)
        return params


def test_no_engine_always_runs_right_after_the_same_one():
    interleaved = load_script("bench_longtail").interleaved
    log = []
    keys = ["ar", "sd_always", "sd_toggle", "sd_toggle_auto", "sd_toggle_ladder"]
    runs = interleaved({k: (Recorder(k, log), True) for k in keys}, [[1]], lambda rep: rep, 30)
    assert all(runs[k] == list(range(30)) for k in keys)  # every engine once per repeat, with that repeat's params
    assert all(sorted(log[i:i + 5]) == sorted(keys) for i in range(0, len(log), 5))
    before = defaultdict(set)
    for prev, cur in zip(log, log[1:]):
        before[cur].add(prev)
    # a rotation of one fixed order gave each engine two predecessors (SD-always: AR in four repeats of five)
    assert all(len(before[k]) >= 3 for k in keys), dict(before)
    assert {log[i] for i in range(0, len(log), 5)} == set(keys)  # each runs first in some repeat
