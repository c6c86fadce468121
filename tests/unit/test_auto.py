"""drafter.kind=auto: several drafters at once, one (or none) chosen per decode step. The chooser converges to the
arm with the best reward per batch bucket and tracks a change; the controller routes each step to the chosen member
and rewards the arm with the step's measured speed-up; SD with it is lossless (the shared engine contract: greedy
identity, the exact distribution, log-probs, ragged rows, versioned loads); bad settings are one line."""
from __future__ import annotations

import random

import pytest
import torch

from drafttrain.config import ConfigError, load_recipe
from drafttrain.engines.chooser import AR, Chooser, ChooserController
from drafttrain.engines.schedule import TRACE_LEN, CostModel, SpecController
from drafttrain.spec import SamplingParams
from tests import contract as C


def auto(policy, kinds=("eagle3", "suffix"), seed: int = 1):
    return C.fresh_drafter(policy, seed=seed, kind="auto", kinds=list(kinds), paths=[None] * len(kinds))


def run(ch: Chooser, means: dict[int, dict[str, float]], steps: int, rng: random.Random) -> dict[int, list[str]]:
    """steps picks per batch, each rewarded N(mean of the picked arm, 0.1) (a synthetic cost model)."""
    picks: dict[int, list[str]] = {b: [] for b in means}
    for _ in range(steps):
        for b, m in means.items():
            arm = ch.pick(b)
            ch.observe(b, arm, rng.gauss(m[arm], 0.1))
            picks[b].append(arm)
    return picks


def test_chooser_converges_per_bucket_and_follows_a_change():
    rng = random.Random(0)
    ch = Chooser(["eagle3", "suffix", AR], seed=3)
    means = {1: {"eagle3": 1.6, "suffix": 1.2, AR: 1.0}, 64: {"eagle3": 0.8, "suffix": 1.1, AR: 1.0}}
    picks = run(ch, means, 300, rng)
    assert picks[1][-100:].count("eagle3") >= 90, picks[1][-100:]
    assert picks[64][-100:].count("suffix") >= 90, picks[64][-100:]
    first = picks[1][:3] + picks[64][:3]  # the first six picks, whichever bucket: each arm twice
    assert all(first.count(a) == 2 for a in ("eagle3", "suffix", AR)), first
    # the drafter went stale at batch 1 (a swap, the policy's drift): evidence fades and the choice follows
    means[1]["eagle3"] = 0.7
    picks = run(ch, means, 300, rng)
    assert picks[1][-100:].count("suffix") >= 90, picks[1][-100:]


def test_a_new_bucket_starts_from_the_nearest_ones_estimate():
    rng = random.Random(1)
    ch = Chooser(["eagle3", "suffix", AR], seed=4)
    run(ch, {1: {"eagle3": 1.6, "suffix": 1.0, AR: 1.0}}, 100, rng)
    picks = [ch.pick(2) for _ in range(50)]  # bucket 2: never run, no observations added
    assert picks.count("eagle3") >= 40, picks


class _Serving:
    def __init__(self):
        self.used = []

    def use(self, kind):
        self.used.append(kind)

    def plan(self, kinds):
        self.planned = list(kinds)


def test_controller_routes_and_rewards_the_measured_speedup():
    serving = _Serving()
    cost = CostModel({1: {m: 10.0 for m in range(1, 10)}}, {1: 1.0})

    def make():
        c = SpecController(3, 8, False)
        c.cost = cost
        return c

    ctl = ChooserController(["eagle3", "suffix"], lambda: serving, make, seed=0)
    ctl.begin()
    seen = {}
    for _ in range(60):
        k = ctl.decide(1)
        arm = ctl.trace[-1]["kind"]
        assert (k == 0) == (arm == AR) and (arm == AR or serving.used[-1] == arm)
        ms = {"eagle3": 10.0, "suffix": 20.0, AR: 10.0}[arm]  # eagle3 emits 3 tokens in 10 ms: 3x the AR step
        ctl.observe_step(1, k, ms)
        ctl.observe([2 if arm != AR else 0], k, [3 if arm == "eagle3" else 1])
        seen[arm] = ctl.chooser.stats[(1, arm)][1]
    assert seen == pytest.approx({"eagle3": 3.0, "suffix": 0.5, AR: 1.0})
    assert [t["kind"] for t in list(ctl.trace)[-20:]].count("eagle3") >= 18


def test_trace_keeps_the_latest_decisions_and_arm_steps_counts_the_run():
    """The chooser's trace keeps its latest TRACE_LEN decisions however long the run; it picks step for step as one
    that keeps the whole history in a list (as the trace was), and arm_steps counts what that history holds."""
    cost = CostModel({b: {m: 10.0 for m in range(1, 10)} for b in (1, 8)}, {1: 1.0, 8: 1.0})

    def make():
        c = SpecController(3, 8, False)
        c.cost = cost
        return c

    ctl, ref = (ChooserController(["eagle3", "suffix"], lambda: _Serving(), make, seed=0) for _ in range(2))
    ref.trace = []  # the whole history
    rng = random.Random(0)
    n = 2 * TRACE_LEN + 5
    for i in range(n):
        if i % 64 == 0:  # a generation
            for c in (ctl, ref):
                c.begin()
        batch = 8 if i % 64 < 40 else 1
        k = ctl.decide(batch)
        assert ref.decide(batch) == k and ref.trace[-1] == ctl.trace[-1]
        arm = ctl.trace[-1]["kind"]
        rate = ({"eagle3": 0.8, "suffix": 0.5}, {"eagle3": 0.3, "suffix": 0.7})[i >= n // 2]  # they swap halfway
        emitted = [1 + sum(rng.random() < rate.get(arm, 0.0) for _ in range(k)) for _ in range(batch)]
        for c in (ctl, ref):
            c.observe_step(batch, k, 10.0 + k)
            c.observe([e - 1 for e in emitted], k, emitted)
    assert len(ctl.trace) == TRACE_LEN and list(ctl.trace) == ref.trace[-TRACE_LEN:]
    assert ctl.arm_steps == {a: sum(t["kind"] == a for t in ref.trace) for a in ctl.chooser.arms}
    assert sum(ctl.arm_steps.values()) == n and min(ctl.arm_steps.values()) > 0  # every arm ran


def test_plan_serves_the_winners_of_the_buckets_that_take_the_time_and_brings_back_a_set_aside_arm():
    """A generation serves the winners of the buckets that hold its decode time (not a tail bucket's noisy winner);
    an arm set aside fades until it is planned again."""
    rng = random.Random(2)
    ch = Chooser(["eagle3", "mtp", "suffix", AR], seed=5)
    assert ch.plan() == ["eagle3", "mtp", "suffix", AR]  # before every arm's tries: all
    means = {64: {"eagle3": 1.2, "mtp": 1.5, "suffix": 0.8, AR: 1.0}, 1: {"eagle3": 2.0, "mtp": 1.0, "suffix": 1.0,
                                                                          AR: 1.0}}
    for _ in range(200):
        for b, m, ms in ((64, means[64], 30.0), (1, means[1], 0.5)):  # bucket 1: ~2% of the time
            arm = ch.pick(b)
            ch.observe(b, arm, rng.gauss(m[arm], 0.05), ms)
    plans = [ch.plan() for _ in range(20)]
    assert sum(p == ["mtp", AR] for p in plans) >= 18, plans
    later = [ch.plan() for _ in range(400)]  # eagle3 and suffix set aside: their evidence fades, draws widen
    assert any("eagle3" in p for p in later) and any("suffix" in p for p in later)


def test_with_the_toggle_the_members_toggle_decides_ar_and_a_generation_does_not_switch_back_and_forth():
    """engine.toggle on: no chooser-level AR arm (it trapped the long tail in AR: a member's first step after AR
    steps pays its catch-up and scores low); a member's AR step informs every member's AR timing. Within a
    generation a bucket keeps its planned arm: no switch per step between close members."""
    cost = CostModel({b: {m: 10.0 for m in range(1, 10)} for b in (1, 64)}, {1: 1.0, 64: 1.0})

    def make():
        c = SpecController(3, 8, True)
        c.cost = cost
        return c

    serving = _Serving()
    ctl = ChooserController(["eagle3", "mtp"], lambda: serving, make, seed=0)
    assert ctl.chooser.arms == ["eagle3", "mtp"]
    ctl.ctls["mtp"].on = False  # mtp's own toggle is off: its step is an AR step
    ctl._arm = "mtp"
    ctl.observe_step(64, 0, 12.0)
    assert all(c.factor[("ar", 64)] == pytest.approx(1.2) for c in ctl.ctls.values())
    for arm in ("eagle3", "mtp"):  # two members of equal measured speed at batch 64 and 32, both buckets busy
        ctl.chooser.tries[arm] = 5
        ctl.chooser.stats[(64, arm)] = [5.0, 3.0, 0.25]
        ctl.chooser.stats[(32, arm)] = [5.0, 3.0, 0.25]
    ctl.chooser.ms.update({64: 100.0, 32: 100.0})
    served = []
    for _ in range(16):
        ctl.begin()
        for b in (64,) * 6 + (32,) * 6:
            ctl.decide(b)
        for b in (64, 32):
            arms = {t["kind"] for t in list(ctl.trace)[-12:] if t["batch"] == b}
            assert len(arms) == 1, list(ctl.trace)[-12:]  # a bucket keeps one member all generation
            served += arms
    assert set(served) == {"eagle3", "mtp"}  # the exploring is per generation: both get generations


def test_a_generation_serves_and_reads_only_the_planned_members(make_engine, policy):
    """With one member planned, the policy's forward returns only what it reads (no EAGLE-3 aux layers), the
    generation has its state only, and the output is the AR output; a member not served is refused in one line."""
    d = auto(policy, ("eagle3", "mtp", "suffix"))
    assert d.generation_reads().aux_layers  # all planned: EAGLE-3's layers are read
    d.plan(["mtp"])
    assert d.generation_reads().aux_layers == () and d.generation_reads().final_hidden
    st = d.new_state(2, 16)
    assert list(st.states) == ["mtp"]
    d.use("eagle3")
    with pytest.raises(ValueError, match="'eagle3' is not served") as e:
        d.propose(st, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, policy.config.hidden_size),
                  torch.ones(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 2, SamplingParams(), True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="plan names no member"):
        d.plan(["draft_model"])
    eng = make_engine(policy, d, k="auto", toggle=False, drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    eng.generate(C.RAGGED_PROMPTS, params)  # warm-up: every arm is tried, then the plan narrows
    ctl = eng.controller()
    for _ in range(6):
        sd = eng.generate(C.RAGGED_PROMPTS, params)
        served = ctl.serving().planned
        assert {t["kind"] for t in sd.timeline.schedule} <= {*served, AR}
        assert sd.tokens == eng.generate(C.RAGGED_PROMPTS, params, speculative=False).tokens


# ---- lossless: the shared engine contract ---------------------------------------------------------------------

def test_greedy_sd_equals_ar(make_engine, policy):
    C.greedy_sd_equals_ar(make_engine, policy, auto(policy), drafter_int8=False)


def test_exact_distribution(make_engine):
    pol = C.tiny_vocab_policy(vocab=5)
    C.exact_distribution(make_engine, pol, auto(pol, ("eagle3", "mtp", "suffix")), SamplingParams(max_new_tokens=3,
                         seed=61), n_rows=3000, wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2,
                         drafter_int8=False)


def test_contract_ragged_logprobs_swaps_bad_weights(make_engine, policy):
    d = auto(policy, ("mtp", "draft_model", "suffix"))
    C.serving_checks(make_engine, policy, d)
    C.swap_checks(make_engine, policy, d, same_stats=False)  # the chooser learns across calls


def test_every_member_drafts_and_catches_up(make_engine, policy):
    """Every arm runs (each member catching up on every position since it last drafted), and the greedy output is
    the AR output."""
    eng = make_engine(policy, auto(policy, ("eagle3", "mtp", "suffix")), k=3, drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    sd = eng.generate(C.RAGGED_PROMPTS * 3, params)
    ar = eng.generate(C.RAGGED_PROMPTS * 3, params, speculative=False)
    assert sd.tokens == ar.tokens
    kinds = {arm for arm, n in eng.controller().arm_steps.items() if n}
    assert kinds == {"eagle3", "mtp", "suffix", AR}, kinds
    texts = [p + r for p, r in zip(C.RAGGED_PROMPTS * 3, sd.tokens)]  # the suffix member indexed every row whole
    suffix = eng.drafter.members["suffix"]
    assert sorted(map(tuple, suffix.texts[-1].rows)) == sorted(map(tuple, texts))
    eng.load_drafter(auto(policy, ("eagle3", "mtp", "suffix"), seed=2).state_dict(), 1)  # a hot-swap: new members
    assert eng.drafter.members["suffix"] is not suffix and eng.drafter.members["suffix"].texts is suffix.texts


def test_timing_an_engine_whose_generation_serves_some_members(make_engine, policy):
    """measure_costs (a benchmark's, a swap's recalibration) on an auto engine after a narrowed plan: it hands
    new_state's members the columns they read (it built the full union's and mtp's fc got 4 blocks: a shape error)."""
    from drafttrain.engines.schedule import measure_costs

    d = auto(policy, ("eagle3", "mtp"))
    eng = make_engine(policy, d, k=2, drafter_int8=False)
    eng.drafter.plan(["mtp"])
    eng.drafter.use("mtp")
    assert measure_costs(eng, 2, [], 2, repeats=1)["draft_ms_per_token"] > 0


# ---- online training: the trainable members together -----------------------------------------------------------

def test_members_learn_on_a_drifted_policy(make_engine, policy):
    """The members that train (MTP, draft model) learn together; the suffix drafter rides along (no weights)."""
    d = auto(policy, ("suffix", "draft_model", "mtp"))
    assert d.trains and d.scored == "draft_model"  # the first trainable member is scored
    before = {k: v.clone() for k, v in d.state_dict().items()}
    C.learns_on_drifted_policy(make_engine, policy, d)
    moved = {k.split(".")[0] for k, v in d.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == {"mtp", "draft_model"}, moved


def test_the_loss_is_the_sum_of_the_members_and_scoring_reads_the_scored_ones_columns(policy):
    """Each member's loss on its own columns of the captured union; ttt_logits are the scored member's."""
    from drafttrain.drafters import TargetHead, Targets
    from drafttrain.tracking.capture import teacher_forced_features

    d = auto(policy, ("eagle3", "mtp", "suffix"))
    assert d.reads.aux_layers and d.reads.final_hidden
    prompts, resp = [[1, 2, 3, 4]] * 2, [[5, 6, 7, 8, 9, 10]] * 2
    f = teacher_forced_features(policy, prompts, resp, d.reads, 3)
    args = (f["next_ids"], Targets(f["hidden"], TargetHead.of(policy)), f["valid"], 3, 0.8)
    total, _ = d.ttt_loss(f["aux"], *args, first_ids=f["first_ids"])
    e3, mt = d.members["eagle3"], d.members["mtp"]
    H = policy.config.hidden_size
    A = len(e3.reads.aux_layers)
    want = (e3.ttt_loss(f["aux"][..., :A * H], *args)[0] + mt.ttt_loss(f["aux"][..., A * H:], *args)[0])
    assert torch.allclose(total, want)
    got = d.ttt_logits(f["aux"], f["next_ids"], 3)
    assert all(torch.equal(a, b) for a, b in zip(got, e3.ttt_logits(f["aux"][..., :A * H], f["next_ids"], 3)))
    assert torch.equal(d.draft_ids(), e3.draft_ids())
    served = auto(policy, ("suffix",))
    assert not served.trains
    with pytest.raises(ValueError, match="no member trains"):
        served.draft_ids()


@pytest.mark.parametrize("override,key", [(["drafter.auto.paths=[null]"], "drafter.auto.paths"),
                                          (["drafter.auto.kinds=[eagle3,selfquant]", "drafter.auto.paths=[null,null]"],
                                           "drafter.auto.kinds"),
                                          (["drafter.auto.kinds=[suffix,suffix]", "drafter.auto.paths=[null,null]"],
                                           "drafter.auto.kinds"),
                                          (["drafter.path=checkpoints/eagle3"], "drafter.path")])
def test_bad_settings_one_line(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_recipe("auto_track", override)
    assert "\n" not in str(e.value)


def test_a_member_checkpoint_that_does_not_fit_names_the_member(policy, tmp_path):
    from drafttrain.drafters import build_drafter

    cfg = load_recipe("auto_track", [f"drafter.auto.paths=[{tmp_path / 'none'},null]"]).drafter
    with pytest.raises(FileNotFoundError, match=r"^drafter\.auto\.paths \(eagle3\): drafter checkpoint .*none") as e:
        build_drafter(cfg, policy)
    assert "\n" not in str(e.value)
