"""The publish gate's statistics (tracking/gate.py) on synthetic score streams: per-row MALs of a serving and a
candidate drafter on the same rows, the rows differing widely in how predictable they are (as rollouts do)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from drafttrain.tracking.gate import gate_decision, paired_bound, paired_sums


def stream(n: int, gain: float, gen: torch.Generator, noise: float = 0.3, shape: str = "normal"):
    """(candidate, serving) per-row MAL on n rows: a row's base MAL in [2, 5] is shared (paired), each drafter adds
    its own noise; the candidate's mean gain is `gain`. shape=skewed: the candidate's noise is a centred exponential
    (mostly a little worse, sometimes much better: mean 0 all the same)."""
    base = 2 + 3 * torch.rand(n, generator=gen)
    old = base + noise * torch.randn(n, generator=gen)
    if shape == "normal":
        e = noise * torch.randn(n, generator=gen)
    else:
        e = noise * (torch.empty(n).exponential_(generator=gen) - 1)
    return base + gain + e, old


def publish_rate(n: int, gain: float, trials: int, confidence: float = 0.9, **kw) -> float:
    gen = torch.Generator().manual_seed(1234)
    hits = sum(gate_decision(*paired_sums(*stream(n, gain, gen, **kw)), confidence)["publish"] for _ in range(trials))
    return hits / trials


@pytest.mark.parametrize("shape", ["normal", "skewed"])
@pytest.mark.parametrize("n", [8, 32])
def test_equal_drafters_publish_no_more_often_than_the_bound_allows(n, shape):
    """Mean gain 0: published in at most 1 - confidence of the streams, up to 3 binomial sds of the simulation."""
    trials, alpha = 2000, 0.1
    rate = publish_rate(n, 0.0, trials, shape=shape)
    assert rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / trials), rate
    assert rate > 0.02  # the bound is not so loose that it never publishes (normal: ~0.10; skewed: fewer)


def test_a_real_gain_passes():
    """A gain of 0.15 MAL per row, per-row noise sd 0.3 on each drafter (0.42 on their difference): at 32 rows the
    bound clears with probability ~0.87 at 48 rows (normal approximation); at 128 rows, almost surely."""
    assert publish_rate(48, 0.15, 500) >= 0.8
    assert publish_rate(128, 0.15, 200) >= 0.98


def test_pairing_sees_a_small_consistent_gain_that_row_spread_hides():
    """+0.05 MAL on every row, rows spread over MAL 2-5: the paired bound publishes; two unpaired means (the old gate)
    differ by 0.05 against a spread of ~0.9 per row, which no bound on them could tell from noise at 16 rows."""
    gen = torch.Generator().manual_seed(0)
    old = 2 + 3 * torch.rand(16, generator=gen)
    d = gate_decision(*paired_sums(old + 0.05, old), 0.9)
    assert d["publish"] and d["mean"] == pytest.approx(0.05) and d["lower"] == pytest.approx(0.05)
    assert old.std() / math.sqrt(16) > 0.05 * 3


def test_worse_resets_undecided_does_not():
    gen = torch.Generator().manual_seed(0)
    new, old = stream(64, -0.3, gen)
    d = gate_decision(*paired_sums(new, old), 0.9)
    assert not d["publish"] and d["worse"] and d["upper"] < 0
    old = torch.full((16,), 3.0)
    d = gate_decision(*paired_sums(old + torch.tensor([0.5, -0.5] * 8), old), 0.9)  # mean 0, sd 0.5
    assert not d["publish"] and not d["worse"] and d["lower"] < 0 < d["upper"]


def test_too_few_rows_decide_nothing_and_nan_rows_are_skipped():
    """Fewer than min_rows rows (or under 2: no spread) publish and reset nothing; a row with no verify step (nan
    in either drafter's score) is not a pair."""
    old = torch.tensor([2.0, 3.0, 4.0, math.nan, 5.0])
    new = old + 1.0
    assert paired_sums(new, old) == [4.0, 4.0, 4.0]
    assert gate_decision(*paired_sums(new, old), 0.9, min_rows=4)["publish"]
    assert not gate_decision(*paired_sums(new, old), 0.9, min_rows=5)["publish"]
    one = gate_decision(1.0, 1.0, 1.0, 0.9, min_rows=1)
    assert not one["publish"] and not one["worse"] and one["lower"] == -math.inf
    assert not gate_decision(0.0, 0.0, 0.0, 0.9)["publish"]


def test_margin_and_the_bound_itself():
    """The bound is the one-sided Student t bound: 10 rows with mean 0.2 and sd 0.3 -> 0.2 -+ t_0.9(9) 0.3 / sqrt(10)
    (t_0.9(9) = 1.383); a margin above the lower bound blocks the publish."""
    d = torch.tensor([0.2 + 0.3 * x for x in (-1.5, -1, -0.5, -0.25, 0, 0, 0.25, 0.5, 1, 1.5)])
    d = 0.2 + (d - d.mean()) * 0.3 / d.std()
    b = paired_bound(*paired_sums(d, torch.zeros(10)), 0.9)
    assert b["mean"] == pytest.approx(0.2) and b["sd"] == pytest.approx(0.3)
    assert b["lower"] == pytest.approx(0.2 - 1.383 * 0.3 / math.sqrt(10), abs=1e-3)
    assert b["upper"] == pytest.approx(0.2 + 1.383 * 0.3 / math.sqrt(10), abs=1e-3)
    assert gate_decision(*paired_sums(d, torch.zeros(10)), 0.9, margin=0.05)["publish"]
    assert not gate_decision(*paired_sums(d, torch.zeros(10)), 0.9, margin=0.1)["publish"]


def test_sums_pool_over_processes():
    """Each process sums its own rows; the sum of the sums decides exactly as all the rows in one place."""
    new, old = stream(24, 0.1, torch.Generator().manual_seed(5))
    parts = [paired_sums(new[:10], old[:10]), paired_sums(new[10:], old[10:])]
    pooled = [a + b for a, b in zip(*parts)]
    whole = paired_sums(new, old)
    assert pooled == pytest.approx(whole)
    assert gate_decision(*pooled, 0.9)["lower"] == pytest.approx(gate_decision(*whole, 0.9)["lower"])


def test_the_first_decision_imports_nothing():
    """The first gate decision lazily imported scipy.stats (~2 s on this CPU), inside the drafter's first update: the
    time bank was charged for it and stayed in debt for dozens of RL steps. Every import happens at start-up."""
    code = ("import sys; from drafttrain.tracking.gate import gate_decision; before = set(sys.modules); "
            "gate_decision(8, 1.0, 3.0, 0.9); print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_several_members_publish_noise_no_more_often_than_one_drafter():
    """drafter.kind=auto, each trainable member gated on its own (tracking/gate.py): with three members, none of
    them better, an update publishes some member in at most 1 - confidence of the decisions (at the plain level per
    member it was 0.29); a member with a real gain still passes."""
    from types import SimpleNamespace

    from drafttrain.tracking.gate import gate_members

    oc = SimpleNamespace(gate_confidence=0.9, gate_margin=0.0, gate_min_rows=2)
    gen, trials, alpha, members = torch.Generator().manual_seed(7), 2000, 0.1, ["a", "b", "c"]

    def decide(gains: dict) -> dict:
        rows = {m: stream(32, gains[m], gen) for m in members}
        return gate_members(list, {m: {"row_mal": r[0]} for m, r in rows.items()},
                            {m: {"row_mal": r[1]} for m, r in rows.items()}, members, oc)

    noise = sum(any(g["publish"] for g in decide(dict.fromkeys(members, 0.0)).values()) for _ in range(trials))
    assert noise / trials <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / trials), noise / trials
    real = [decide({"a": 0.3, "b": 0.0, "c": 0.0})["a"]["publish"] for _ in range(200)]
    assert sum(real) / 200 >= 0.9
