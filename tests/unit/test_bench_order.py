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


def test_each_repeat_draws_new_problems_the_same_for_every_engine():
    """As at each RL step, a repeat's batch holds new problems (the suffix drafter read 3.55 against 1.82 tokens per
    step when every batch re-generated the same problems, which its index held rollouts of); every engine of a
    repeat gets the same batch. same_problems=True keeps the old workload: the same problems every time."""
    from drafttrain.policy.tokenizer import build_tokenizer

    bl = load_script("bench_longtail")
    tok = build_tokenizer()
    fresh, same = (bl.workload(tok, 3, 2, 7, s) for s in (False, True))
    a, b = fresh(7), fresh(8)
    assert len(a) == 6 and a[0] == a[1] != a[2] and a != b and a == fresh(7) == same(8) == same(9)
    seen = defaultdict(list)

    class Engine(Recorder):
        def generate(self, prompts, params, speculative=True):
            seen[params].append((self.name, prompts))

    bl.interleaved({k: (Engine(k, []), True) for k in ("ar", "sd")}, lambda rep: fresh(100 + rep), lambda r: r, 3)
    assert sorted(seen) == [0, 1, 2] and all(len(v) == 2 and v[0][1] == v[1][1] for v in seen.values())
    assert seen[0][0][1] != seen[1][0][1]  # a new batch of problems each repeat


def test_a_pool_workload_draws_each_batch_from_a_fixed_set_of_problems():
    """pool=N: each batch is n distinct problems of one fixed set of N (group copies each), drawn per seed, so the
    problems come back across batches, as an RL run over a dataset draws them."""
    from drafttrain.policy.tokenizer import build_tokenizer

    bl = load_script("bench_longtail")
    tok = build_tokenizer()
    pooled = bl.workload(tok, 3, 2, 7, False, pool=6)
    fixed = {tuple(p) for s in range(6) for p in bl.workload(tok, 6, 1, 7, True)(s)}
    batches = [pooled(s) for s in range(40)]
    assert all(len(b) == 6 and b[0] == b[1] and len({tuple(p) for p in b}) == 3 for b in batches)
    seen = {tuple(p) for b in batches for p in b}
    assert seen == fixed  # every problem of the set, and none other
    assert batches[0] == pooled(0) and len({tuple(map(tuple, b)) for b in batches}) > 5


def test_bench_drafters_warms_up_and_measures_on_new_problems(monkeypatch):
    """bench_drafters' long tail passes its engines a new batch of problems at each warm-up and repeat."""
    bd = load_script("bench_drafters")
    batches = []

    class Engine:
        def generate(self, prompts, params, speculative=True):
            batches.append(tuple(map(tuple, prompts)))
            from drafttrain.engines.base import RolloutBatch, Timeline
            from drafttrain.spec import SpecStats
            return RolloutBatch([[1]], [[0.0]], SpecStats(), 0, wall_s=1.0, timeline=Timeline(schedule=[]))

    monkeypatch.setattr(bd, "engine", lambda *a, **k: Engine())
    monkeypatch.setattr(bd, "build_drafter", lambda *a, **k: None)
    monkeypatch.setattr(bd, "drafter_cfg", lambda *a, **k: None)
    cfg = type("Cfg", (), dict(kinds=["suffix"], warmup=2, repeats=3, seed=0))()
    from drafttrain.spec import SamplingParams

    bd.long_tail(cfg, None, None, lambda seed: [[seed]], SamplingParams())
    # 2 kinds (suffix, auto) x 2 warm-ups, then 3 repeats x 3 engines (ar, suffix, auto)
    assert len(batches) == 13 and len(set(batches)) == 5
