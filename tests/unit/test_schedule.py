"""The system-aware SD schedule: toggle, auto k, ladder, and the engine's catch-up after AR steps."""
from __future__ import annotations

import random

import pytest
import torch

from drafttrain.engines import build_engine
from drafttrain.engines.schedule import TRACE_LEN, AcceptanceEstimate, CostModel, SpecController
from drafttrain.spec import SamplingParams
from tests.conftest import engine_cfg
from tests.contract import RAGGED_PROMPTS, fresh_drafter


def synthetic_cost(verify_slope: float = 0.2, draft: float = 0.1, batch_slope: float = 0.05) -> CostModel:
    """T(B, m) = 1 + verify_slope (m-1) + batch_slope B (m-1) ms; D = draft ms per token."""
    bs, ms = [1, 4, 16, 64], [1, 2, 3, 5, 9]
    tgt = {b: {m: 1 + verify_slope * (m - 1) + batch_slope * b * (m - 1) for m in ms} for b in bs}
    return CostModel(tgt, {b: draft for b in bs})


class Scripted:
    """A controller stand-in that replays a fixed k per decode step (0 = AR)."""

    def __init__(self, ks, k_max):
        self.ks, self.k_max, self.trace, self.i, self.mode = list(ks), k_max, [], 0, "fixed"
        self.observed = []  # (num_accepted, k, limit) of every verify step

    def decide(self, batch):
        k = self.ks[min(self.i, len(self.ks) - 1)]
        self.trace.append({"step": self.i, "batch": batch, "on": k > 0, "k": k})  # as a controller records it
        self.i += 1
        return k

    def observe(self, n, k, emitted=None):
        self.observed.append((list(n), k, emitted))

    def begin(self):
        pass

    def observe_step(self, batch, k, ms, typical=True):
        pass


def test_cost_model_interpolates_and_extrapolates():
    c = synthetic_cost()
    assert c.target(1, 1) == pytest.approx(1.0)
    assert c.target(4, 4) == pytest.approx(1 + 0.2 * 3 + 0.05 * 4 * 3)  # m between measured points
    assert c.target(32, 2) == pytest.approx(1 + 0.2 + 0.05 * 32)  # batch between measured points
    assert c.target(1, 12) == pytest.approx(1 + 0.2 * 11 + 0.05 * 11)  # past the last m: linear


def test_measured_step_times_correct_the_cost_model():
    """The model says SD pays at batch 1 (1.0 ms AR vs 2.4 ms for a k=4 step); real SD steps take 4.5 ms, AR steps
    1.2 ms. The measured/modelled ratios move the prediction below the threshold: the toggle turns SD off. A bucket
    without both modes observed (batch 16) reads the pair f_ar / f_sd of the nearest bucket that has both."""
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.8))
    assert ctl.decide(1) == 4 and ctl.speedup(1, 4) > 1.3
    for _ in range(20):
        ctl.observe_step(1, 4, 4.5)
        ctl.observe_step(1, 0, 1.2)
    assert ctl.factor[("sd", 1)] == pytest.approx(4.5 / ctl.model_ms(1, 4))
    assert ctl.factor[("ar", 1)] == pytest.approx(1.2)
    assert ctl.speedup(1, 4) == pytest.approx(AcceptanceEstimate(4, prior=0.8).expected_tokens(4) * 1.2 / 4.5)
    assert ctl.decide(1) == 0 and not ctl.trace[-1]["on"]
    pair1 = ctl.factor[("ar", 1)] / ctl.factor[("sd", 1)]
    assert ctl._ratio(16) == pytest.approx(pair1)  # borrowed as a pair
    ctl.observe_step(16, 4, ctl.model_ms(16, 4))  # SD measured exactly as modelled at 16: AR not yet
    assert ctl._ratio(16) == pytest.approx(pair1)  # one side alone is not read
    ctl.observe_step(16, 0, ctl.model_ms(16, 0))
    assert ctl._ratio(16) == 1.0 and ctl._ratio(31) == 1.0 and ctl._ratio(2) == pytest.approx(pair1)
    ctl.observe_step(16, 4, 1000.0)  # a stall: counts as twice the current ratio, not 1 s
    assert ctl.factor[("sd", 16)] == pytest.approx(0.8 + 0.2 * 2.0)
    for _ in range(40):  # a persistent 6x (a drafter far slower than calibrated) is learnt, not capped
        ctl.observe_step(16, 4, 6 * ctl.model_ms(16, 4))
    assert ctl.factor[("sd", 16)] == pytest.approx(6.0, rel=0.02)


def test_one_modes_ratio_alone_does_not_scale_a_far_bucket():
    # with the toggle probing each batch, SD runs nearly every step; the only AR ratio (2x, at batch 2) must not
    # scale batch 64's AR steps against its SD ratio measured as modelled there
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.8))
    base = ctl.speedup(64, 4)
    ctl.observe_step(2, 0, 2 * ctl.model_ms(2, 0))
    ctl.observe_step(64, 4, ctl.model_ms(64, 4))
    assert ctl.speedup(64, 4) == pytest.approx(base)


def test_step_time_ratios_transfer_across_batch_sizes():
    """SD steps observed only at batch 64 (where a step takes 30 ms more than modelled: 2x its model) must not make
    batch 1 look 10x faster or slower than it is: the borrowed correction is a ratio, so batch 1's predicted
    speed-up is the model's own with both modes scaled alike."""
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.8))
    base = ctl.speedup(1, 4)
    for _ in range(30):
        ctl.observe_step(64, 4, 2 * ctl.model_ms(64, 4))
        ctl.observe_step(64, 0, 2 * ctl.model_ms(64, 0))
    assert ctl.speedup(1, 4) == pytest.approx(base)


def test_toggle_follows_the_cost_model():
    """SD on at small batch (verify nearly free), off at large batch (verify ~ linear in tokens)."""
    ctl = SpecController(4, 8, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(8, prior=0.8))
    assert ctl.decide(1) == 4 and ctl.trace[-1]["on"]
    assert ctl.speedup(64, 4) < 1.0
    assert ctl.decide(64) == 0 and not ctl.trace[-1]["on"]
    # hysteresis: once on, it stays on between threshold - hysteresis and threshold
    ctl2 = SpecController(4, 8, toggle=True, threshold=1.05, hysteresis=0.2, cost=synthetic_cost(),
                          acc=AcceptanceEstimate(8, prior=0.8))
    b_mid = next(b for b in range(1, 65) if 0.9 < ctl2.speedup(b, 4) < 1.05)
    ctl2.on = True
    assert ctl2.decide(b_mid) == 4
    ctl2.on = False
    assert ctl2.decide(b_mid) == 0


def test_auto_k_follows_acceptance():
    acc = AcceptanceEstimate(8, prior=0.5)
    ctl = SpecController("auto", 8, toggle=False, cost=synthetic_cost(verify_slope=0.1, draft=0.05), acc=acc)
    low = ctl.decide(1)
    for _ in range(60):  # every draft accepted: the estimates rise
        acc.observe([8, 8, 8, 8], 8)
    high = ctl.decide(1)
    for _ in range(60):  # nothing accepted: they fall
        acc.observe([0, 0, 0, 0], 8)
    low2 = ctl.decide(1)
    assert high > low and high > low2 and low2 <= 2


def test_ladder_moves_after_two_in_a_row():
    ctl = SpecController("ladder", 8, toggle=False, ladder=(2, 4, 6), cost=synthetic_cost())
    assert ctl.decide(1) == 2
    ctl.observe([2, 2], 2)  # (L-1)/k = 1 >= 0.94
    assert ctl.decide(1) == 2  # one is not enough
    ctl.observe([2, 2], 2)
    assert ctl.decide(1) == 4
    ctl.observe([0, 1], 4)  # 0.125 <= 0.85
    ctl.observe([0, 1], 4)
    assert ctl.decide(1) == 2


def drive(ctls, steps: int, seed: int = 0) -> list[list[int]]:
    """Every controller of `ctls` through the same decode steps: batches shrinking as a generation's do (begin()
    at each new one), rows accepting drafts at a rate that drifts between a good and a poor stretch, step times the
    cost model's x a factor. The k each controller decided per step."""
    rng = random.Random(seed)
    ks = [[] for _ in ctls]
    for i in range(steps):
        if i % 100 == 0:
            for c in ctls:
                c.begin()
        batch = [16, 8, 4, 2, 1][i % 100 // 20]
        p = 0.9 if i // 250 % 2 == 0 else 0.2  # acceptance per draft
        for c, out in zip(ctls, ks):
            out.append(c.decide(batch))
        k = ks[0][-1]
        na = [next((j for j in range(k) if rng.random() > p), k) for _ in range(batch)]
        ms = (1.3 if k else 1.1) * ctls[0].model_ms(batch, k)
        for c in ctls:
            c.observe_step(batch, k, ms)
            c.observe(na, k)
    return ks


def test_trace_keeps_the_latest_decisions_and_the_schedule_decides_as_before():
    """A run decides once per decode step for thousands of RL steps: the trace keeps the latest TRACE_LEN decisions
    (memory does not grow with the run), and the controller decides step for step as one that keeps the whole
    history in a list (as the trace was), whose last TRACE_LEN entries the trace holds."""
    def make():
        return SpecController("auto", 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.8))

    ctl, ref = make(), make()
    ref.trace = []  # the whole history
    n = 3 * TRACE_LEN + 7
    ks, ref_ks = drive([ctl, ref], n)
    assert ks == ref_ks
    assert 0 in ks and max(ks) > 1  # the toggle and auto k both acted: the comparison says something
    assert len(ctl.trace) == TRACE_LEN and len(ref.trace) == n and ctl.step == n
    assert list(ctl.trace) == ref.trace[-TRACE_LEN:]
    assert [t["k"] for t in ctl.trace] == ks[-TRACE_LEN:]


def test_expected_tokens():
    acc = AcceptanceEstimate(3, prior=0.5)
    assert acc.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


@pytest.mark.parametrize("kw", [dict(k="auto", toggle=True), dict(k=3, toggle=True), dict(k="ladder", toggle=True),
                                dict(k="auto")])
def test_toggle_and_k_never_change_greedy_outputs(policy, drafter, kw):
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    ref = build_engine(engine_cfg(), policy, drafter).generate(RAGGED_PROMPTS, params, speculative=False).tokens
    eng = build_engine(engine_cfg(**kw), policy, drafter)
    b = eng.generate(RAGGED_PROMPTS, params)
    assert b.tokens == ref
    assert len(b.timeline.schedule) > 0 and all("on" in t and "k" in t for t in b.timeline.schedule)


@pytest.mark.parametrize("schedule", [[0, 0, 0, 3], [2, 0, 4, 0, 0, 1], [0] * 5 + [4]])
def test_catch_up_after_ar_steps_is_exact(policy, drafter, schedule):
    """AR steps leave the drafter behind; the next SD step feeds it all pending positions (ragged) at once.
    Rows near the cache end with different pending counts used to write padding past the cache (crash)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompts = RAGGED_PROMPTS + [[1] * 30]
    ref = build_engine(engine_cfg(max_len=48), policy, drafter).generate(prompts, params, speculative=False)
    eng = build_engine(engine_cfg(max_len=48, k=4), policy, drafter)
    eng._ctl = Scripted(schedule, 4)
    b = eng.generate(prompts, params)
    assert b.tokens == ref.tokens
    assert b.stats.drafted > 0


def test_catch_up_matches_every_step_drafting(policy):
    """With a drafter that consumes the pending positions, drafting after AR gaps proposes the same tokens as
    a drafter that ran every step: greedy drafts from the same context."""
    d = fresh_drafter(policy, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    eng = build_engine(engine_cfg(k=2, drafter_int8=False), policy, d)
    every = eng.generate(RAGGED_PROMPTS, params)
    eng._ctl = Scripted([2, 0, 2, 0, 0, 2] * 10, 2)
    gaps = eng.generate(RAGGED_PROMPTS, params)
    assert gaps.tokens == every.tokens


def test_calibration_without_drafter_is_an_error(policy):
    eng = build_engine(engine_cfg(toggle=True), policy, None)
    with pytest.raises(ValueError, match="calibration needs a drafter"):
        CostModel.calibrate(eng, 4)


def test_calibration_measures_the_engine(policy, drafter):
    # the batches asked for up to engine.max_batch, and max_batch itself: the largest batch the engine runs is
    # measured, not extrapolated from smaller ones (16 asked for and past max_batch: not measured)
    eng = build_engine(engine_cfg(k="auto", k_max=4, max_batch=6), policy, drafter)
    c = CostModel.calibrate(eng, 4, batches=(1, 4, 16), repeats=2)
    assert set(c.target_ms) == set(c.draft_ms) == {1, 4, 6} and all(v > 0 for v in c.draft_ms.values())
    for ms in c.target_ms.values():
        assert sorted(ms) == [1, 2, 3, 4, 5]  # every tokens-per-row count a step can verify, none interpolated
        vals = [ms[m] for m in sorted(ms)]
        assert vals == sorted(vals)  # monotone in tokens per row


def test_ragged_catch_up_near_the_cache_end(policy, drafter):
    """Row 0 sits near the end of a 16-slot cache with 1 pending position; row 1 has 8 pending from the start.
    The padding of row 0 (positions 15..21) used to be written past the cache: IndexError."""
    st = drafter.new_state(2, 16, torch.zeros(2, 1, dtype=torch.long))
    X = len(drafter.aux_layer_ids) * policy.config.hidden_size
    ids, aux = torch.randint(0, 32, (2, 8)), torch.randn(2, 8, X)
    d, q = drafter.propose(st, ids, aux, torch.tensor([1, 8]), torch.tensor([14, 0]), 1,
                           SamplingParams(temperature=1.0), False, torch.Generator().manual_seed(0))
    assert d.shape == (2, 1) and torch.isfinite(q).all()
    # the real entries landed: row 1's positions 0..7 are written, row 0's position 14 too
    assert st.cache.k[0][1, :, :8].abs().sum(-1).gt(0).all() and st.cache.k[0][0, :, 14].abs().sum() > 0


def test_probes_back_off_and_skip_where_sd_cannot_pay():
    """While off: probe SD after 16 AR steps, then 32, 64, ... (up to 16x); never where even a very good drafter
    (0.9 acceptance per position) would lose: batch 64 here, and batch 12, where only near-perfect drafts pay."""
    def probes(batch, acc, steps=16 * (1 + 2 + 4 + 8)):
        ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=acc),
                             probe_every=16)
        ks = [ctl.decide(batch) for _ in range(steps)]
        return [i for i, k in enumerate(ks) if k > 0]

    assert probes(1, acc=0.05) == [15, 15 + 32, 15 + 32 + 64, 15 + 32 + 64 + 128]  # low acceptance: off, probing
    assert probes(64, acc=0.05) == []  # cannot pay at any acceptance
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.05))
    ratio = ctl.model_ms(12, 0) / ctl.model_ms(12, 4)
    assert 5 * ratio > 1.05 > sum(0.9 ** i for i in range(5)) * ratio  # pays only if nearly every draft is accepted
    assert probes(12, acc=0.05) == []


def test_auto_k_probes_at_the_k_a_good_drafter_would_draft():
    """Auto k, SD off within a batch: the periodic probe asks whether a very good drafter could pay at any k (as
    the first step's probe does) and drafts that k. It asked at the argmax under the current low estimates (k=1);
    on a step-shaped cost curve (every verify of 2+ tokens costs the same, as at batch 1 here) k=1 never pays, so
    it never probed again, while k=8 would (2.4x with a very good drafter)."""
    ms = range(1, 10)
    cost = CostModel({b: {m: (1.0 if m == 1 else 1.8) for m in ms} for b in (1, 64)}, {1: 0.1, 64: 0.1})
    ctl = SpecController("auto", 8, toggle=True, cost=cost, acc=AcceptanceEstimate(8, prior=0.05), probe_every=4)
    best = max(range(1, 9), key=lambda kk: ctl._best_speedup(1, kk))
    assert best == 8 and ctl._best_speedup(1, best) > 2.0 > 1.05 > ctl._best_speedup(1, 1)
    ks = [ctl.decide(1) for _ in range(200)]
    assert [k for k in ks if k] and all(k == best for k in ks if k)


def test_the_probe_bar():
    """A drafter that costs 0.8 of a decode step per token pays at batch 1 only if nearly every draft is accepted.
    Its estimate still at the prior (never measured): probed under a 0.98 bar (probe_alpha), never under the default
    0.9; and a bar below the estimate never bars more than the estimate's own prediction."""
    cost = synthetic_cost(verify_slope=0.02, draft=0.8)

    def run(probe_alpha):
        acc = AcceptanceEstimate(4, prior=0.7, decay=0.0)
        ctl = SpecController(4, 4, toggle=True, cost=cost, acc=acc, probe_every=16, probe_alpha=probe_alpha)
        ks = []
        for _ in range(20):
            ks.append(ctl.decide(1))
            if ks[-1]:
                acc.observe([4], 4)  # every draft accepted
        return ks

    assert SpecController(4, 4, toggle=True, cost=cost, acc=AcceptanceEstimate(4, prior=0.98)).speedup(1, 4) > 1.05
    assert SpecController(4, 4, toggle=True, cost=cost, acc=AcceptanceEstimate(4, prior=0.9)).speedup(1, 4) < 1.0
    assert run(0.9) == [0] * 20
    assert run(0.98) == [0] * 15 + [4] * 5  # the probe at step 15 measures it, and SD stays on
    # an estimate above the bar: a very good drafter is at least as good as this one (the gate never bars more)
    ctl = SpecController(4, 4, toggle=True, cost=cost, acc=AcceptanceEstimate(4, prior=0.99), probe_alpha=0.9)
    assert ctl._best_speedup(1, 4) == ctl.speedup(1, 4)


def test_steps_where_no_drafter_could_pay_do_not_delay_the_next_probe():
    # a large batch where SD cannot pay at any acceptance: no probes there, and no backoff either (it was doubling
    # the gap at each such step, to 16x, so the probe came long after the batch had shrunk to where SD pays)
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.05),
                         probe_every=16)
    assert [ctl.decide(64) for _ in range(200)] == [0] * 200
    assert ctl.decide(1) == 4 and ctl.trace[-1]["probe"]  # the long tail's first step probes


def test_a_new_estimate_is_the_mean_of_what_it_saw():
    # the prior counts for nothing once a row is observed (bias-corrected): one batch-1 probe of a self-drafter
    # (every draft accepted) moved a 0.98-decay average from the prior 0.7 to 0.706, and SD stayed off
    est = AcceptanceEstimate(4, prior=0.7, decay=0.98)
    est.observe([4], 4)
    assert est.a == [1.0] * 4
    est.observe([0], 4)  # two rows: their mean at position 0
    assert est.a[0] == 0.5 and est.a[1:] == [1.0] * 3
    for _ in range(500):  # past ~1/(1-decay) rows: an exponential average again (recent rows count most)
        est.observe([4], 4)
    est.observe([0], 4)
    assert est.a[0] == pytest.approx(0.98, abs=1e-3)


def test_probes_repeat_without_backoff_near_the_threshold():
    """Acceptance that puts the prediction just under the threshold (SD off, but barely): probes every 16 steps,
    no backoff, so the toggle notices soon when acceptance comes back."""
    acc = next(a / 100 for a in range(5, 100) if SpecController(
        4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=a / 100)).speedup(1, 4) >= 0.95)
    ctl = SpecController(4, 4, toggle=True, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=acc),
                         probe_every=16)
    assert 0.95 <= ctl.speedup(1, 4) < 1.05  # off, near the threshold
    ks = [ctl.decide(1) for _ in range(16 * 6)]
    assert [i for i, k in enumerate(ks) if k > 0] == [15, 31, 47, 63, 79, 95]


def test_auto_k_grows_past_the_k_it_measures():
    # auto k started small (a pessimistic prior) must still learn that longer drafts pay: positions past the drafted
    # k follow the deepest measured one (before, they stayed at the prior and k stayed small for good)
    acc = AcceptanceEstimate(8, prior=0.3)
    ctl = SpecController("auto", 8, toggle=False, cost=synthetic_cost(verify_slope=0.1, draft=0.05), acc=acc)
    k0 = ctl.decide(1)
    assert k0 <= 2
    k = k0
    for _ in range(100):  # every drafted token accepted, at whatever k auto picks
        acc.observe([k] * 4, k)
        k = ctl.decide(1)
    assert k >= 6


def test_acceptance_past_a_stop_is_not_observed():
    # a row that stopped in a step: its drafts past the stop token predict no text, so rejections there are not
    # acceptance (they pulled the estimate ~15% low on the long-tail workload, and the toggle with it)
    est, cut = AcceptanceEstimate(3, prior=0.5, decay=0.0), AcceptanceEstimate(3, prior=0.5, decay=0.0)
    est.observe([3, 1], 3)  # row 1: accepted position 0, rejected at 1
    cut.observe([3, 1], 3, emitted=[4, 1])  # ... but it stopped at position 0: position 1 is past its text
    assert est.a == [1.0, 0.5, 1.0] and cut.a == [1.0, 1.0, 1.0]
    ctl = SpecController("ladder", 8, toggle=False, ladder=(2, 4))
    for _ in range(2):
        ctl.observe([2, 0], 2, emitted=[3, 1])  # (L - 1) / k = 0.5: down... the rung is already the lowest
    assert ctl.rung == 0
    for _ in range(2):
        ctl.observe([2, 2], 2, emitted=[3, 1])  # censored to [2, 1]: (L - 1) / k = 0.75, not >= 0.94: no move up
    assert ctl.rung == 0


def test_engine_reports_what_each_row_emitted_to_the_schedule(policy, drafter):
    eng = build_engine(engine_cfg(k=4), policy, drafter)
    eng._ctl = Scripted([4], 4)
    b = eng.generate(RAGGED_PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=7, seed=3))
    steps = [o for o in eng._ctl.observed if o[1] > 0]
    assert len(steps) == len(b.timeline.tokens)
    assert all(all(e <= 5 for e in em) for _, _, em in steps)  # at most k + 1 per row
    # every verify step hands over what each row kept, stopped rows (the last step's, at least) included
    assert [sum(em) for _, _, em in steps] == b.timeline.tokens


def test_a_new_batch_starts_with_an_sd_probe():
    # estimates left by the last batch's long tail (low) must not keep SD off for good at the next batch's start:
    # its first step probes, and what it measures decides the steps after
    acc = AcceptanceEstimate(8, prior=0.2, decay=0.0)
    ctl = SpecController("auto", 8, toggle=True, cost=synthetic_cost(), acc=acc)
    assert ctl.decide(2) == 0  # no new batch announced: the pessimistic estimate keeps SD off
    ctl.begin()
    # it drafts what a very good drafter (0.9 per position) would draft here: every position auto k could use is
    # measured afresh, and not k_max, whose probe at a large batch costs several AR steps
    best = max(range(1, 9), key=lambda kk: sum(0.9 ** i for i in range(kk + 1)) / ctl.model_ms(2, kk))
    assert 1 < best < 8
    assert ctl.decide(2) == best and ctl.trace[-1]["probe"]
    ctl.observe([best] * 2, best)  # the fresh batch drafts well
    assert acc.a == [1.0] * 8  # positions past the probe's follow the deepest one it measured
    assert ctl.decide(2) >= 4 and not ctl.trace[-1]["probe"]
    ctl.begin()
    ctl.decide(2)
    ctl.observe([0] * 2, 8)  # a batch it drafts badly for: back off after the probe
    assert ctl.decide(2) == 0
    slow = SpecController("auto", 8, toggle=True, cost=synthetic_cost(draft=5.0), acc=AcceptanceEstimate(8, prior=0.2))
    slow.begin()  # a drafter too slow to pay even at PROBE_ALPHA (a self-drafter at a large batch): no probe
    assert slow.decide(2) == 0 and not slow.trace[-1]["probe"]
    off = SpecController(4, 4, toggle=False, cost=synthetic_cost(), acc=AcceptanceEstimate(4, prior=0.2))
    off.begin()
    assert off.decide(2) == 4 and not off.trace[-1]["probe"]  # without the toggle SD always runs: no probes


def test_engine_probes_the_first_step_of_each_batch(policy, drafter):
    """Where SD could pay at the batch, every batch's first step is an SD probe. On a synthetic cost model: the
    machine's calibration put the tiny policy's margin at 1.17-1.44 over the 1.05 bar, and a noisy one fell under it
    (CI failed here once)."""
    eng = build_engine(engine_cfg(k=3, toggle=True), policy, drafter)
    eng.controller().cost = synthetic_cost()  # ideal acceptance at batch 5, k=3: 4 tokens / 2.2 = 1.8x
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    for _ in range(2):
        b = eng.generate(RAGGED_PROMPTS, params)
        assert b.timeline.schedule[0]["probe"] and b.timeline.schedule[0]["on"] and b.timeline.schedule[0]["k"] > 0


def test_cost_model_answers_from_its_points_and_set_draft_replaces_them():
    # target() and draft() are memoized per argument; a swapped drafter's recalibrated costs must replace the old
    c = synthetic_cost(draft=0.1)
    assert c.draft(8) == pytest.approx(0.1) and c.target(8, 3) == pytest.approx(1 + 0.2 * 2 + 0.05 * 8 * 2)
    c.set_draft({1: 0.5, 4: 0.5, 16: 0.9, 64: 0.9})
    assert c.draft(8) == pytest.approx(0.5 + 0.4 * (8 - 4) / 12)
    assert c.draft(1) == pytest.approx(0.5) and c.target(8, 3) == pytest.approx(2.2)  # targets unchanged


def test_a_slow_spell_of_the_machine_does_not_set_one_pieces_cost(monkeypatch):
    """Calibration times its pieces in turns: a spell of slow calls as long as one piece's runs used to set that
    piece's fastest time (the cost model then priced every longer draft at it). A fake clock: forwards take 2 ms,
    calls 7-12 take 20."""
    import types

    from drafttrain.engines import schedule

    clock, calls = [0.0], [0]

    def forward(toks, pos, cache, aux_ids):
        calls[0] += 1
        clock[0] += 0.020 if 7 <= calls[0] <= 12 else 0.002

    lean = types.SimpleNamespace(forward=forward, new_cache=lambda b, L: None, vocab_size=8, hidden=4)
    engine = types.SimpleNamespace(lean=lean, drafter=None, device=torch.device("cpu"))
    monkeypatch.setattr(schedule, "now", lambda device=None: clock[0])  # the synchronized clock calibration reads
    c = schedule.measure_costs(engine, 1, [1, 2, 3], 0, repeats=5)
    assert c["target_ms"] == pytest.approx({1: 2.0, 2: 2.0, 3: 2.0})


def test_tokens_measured_at_a_k_replace_the_chain_product():
    # the chain product of per-position acceptances mixes every k's chains; what k itself emitted is measured
    est = AcceptanceEstimate(4, prior=0.5)
    for _ in range(7):
        est.observe([3, 3, 3, 3], 3)
        est.observe([0, 0, 0, 0], 1)
    assert est.expected_tokens(3) == est.chain_tokens(3)  # 28 rows at each k: under MEASURED_ROWS, the chain
    est.observe([3, 3, 3, 3], 3)
    est.observe([0, 0, 0, 0], 1)
    assert est.expected_tokens(3) == 4.0 and est.expected_tokens(1) == 1.0
    assert est.chain_tokens(3) < 3.0  # position 0 read half of k=1's rejections: the chain under-rates k=3
    assert est.expected_tokens(2) == est.chain_tokens(2)  # never drafted at 2
    est.observe([3] * 40, 3, emitted=[2] * 40)  # rows a stop cut inside the step: not k=3's tokens per step
    assert est.expected_tokens(3) == 4.0


def structured_text_run(ctl, seed: int, rows: int = 4, steps: int = 300, period: int = 6) -> list[int]:
    """auto k on text with a hard token every `period` tokens (accepted 10% of the time, others 97%): the k of every
    step. A chain that starts after a hard token reaches the next one at draft period-1, so k = period-1 emits the
    most per step, and the acceptance at a position depends on the k that put the chain's start there."""
    rnd = random.Random(seed)
    pos = [rnd.randrange(period) for _ in range(rows)]
    ks = []
    for _ in range(steps):
        k = ctl.decide(rows)
        n = []
        for r in range(rows):
            a = 0
            while a < k and rnd.random() < (0.1 if (pos[r] + a) % period == period - 1 else 0.97):
                a += 1
            pos[r] += a + 1
            n.append(a)
        ctl.observe(n, k)
        ks.append(k)
    return ks


def test_auto_k_settles_where_the_measured_tokens_pay():
    # before, the chain of acceptances measured at k=2-3 (hard tokens at their chains' ends) said k=5 would not
    # pay, and auto k stayed at 2-3 in 7 of 10 seeds; tokens per step measured at each k bring it to k=5
    settled = []
    for seed in range(10):
        ctl = SpecController("auto", 8, toggle=False, cost=synthetic_cost(verify_slope=0.1, draft=0.05))
        last = structured_text_run(ctl, seed)[-100:]
        settled.append(max(set(last), key=last.count))
    assert settled.count(5) >= 8, settled
