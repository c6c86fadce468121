"""Per-member publishing (drafter.kind=auto with several trainable members; tracking/gate.py and hotswap.py): a
member's weights are merged in alone, a batch's MAL is split by the member that drafted each step, and the canary
judges and rolls back each member on its own, alone or pooled over processes."""
from __future__ import annotations

import math
import random

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config
from drafttrain.engines.base import RolloutBatch, Timeline
from drafttrain.spec import SamplingParams, SpecStats
from drafttrain.tracking.hotswap import CANARY_ROWS, Publisher
from drafttrain.spec import expected_tokens
from drafttrain.tracking.gate import ALL, members_of, merged
from drafttrain.tracking.hotswap import batch_mal
from tests import contract as C


def test_members_of_and_merged(policy):
    two = C.fresh_drafter(policy, kind="auto", kinds=["suffix", "mtp", "draft_model"], paths=[None] * 3)
    one = C.fresh_drafter(policy, kind="auto", kinds=["eagle3", "suffix"], paths=[None] * 2)
    assert members_of(two) == ["mtp", "draft_model"]
    assert members_of(one) == ["eagle3"] and members_of(C.fresh_drafter(policy)) == [ALL]
    base, new = {"mtp.a": 0, "mtp_x.b": 0, "draft_model.c": 0}, {"mtp.a": 1, "mtp_x.b": 1, "draft_model.c": 1}
    assert merged(base, new, ["mtp"]) == {"mtp.a": 1, "mtp_x.b": 0, "draft_model.c": 0}  # the prefix, not a name
    assert merged(base, new, [ALL]) == new and merged(base, new, []) == base


def test_batch_mal_splits_a_real_generation_by_member(make_engine, policy):
    """On the embedded engine's own batch, the members' steps plus the AR steps add up to the batch's stats."""
    d = C.fresh_drafter(policy, kind="auto", kinds=["mtp", "draft_model"], paths=[None] * 2)
    eng = make_engine(policy, d, k=3, drafter_int8=False)
    b = eng.generate(C.RAGGED_PROMPTS * 3, SamplingParams(temperature=0, max_new_tokens=30))
    tl = b.timeline
    assert len(tl.k) == len(tl.tokens) == len(tl.schedule)
    ar = [i for i, k in enumerate(tl.k) if k == 0]
    assert [s["k"] if s["on"] else 0 for s in tl.schedule] == tl.k  # no step reached the end of the context
    split = {m: batch_mal(b, m)[:2] for m in ("mtp", "draft_model")}
    assert all(rows > 0 for _, rows in split.values()), split  # both members drafted (the chooser tries each)
    rows = sum(r for _, r in split.values()) + sum(tl.batch[i] for i in ar)
    emitted = sum(mal * r for mal, r in split.values()) + sum(tl.tokens[i] for i in ar)
    assert rows == b.stats.verify_rows and math.isclose(emitted, b.stats.emitted)
    # the whole drafter: every step that drafted, not the AR steps (whose one token says nothing of the drafter)
    assert ar and batch_mal(b, ALL)[1] == sum(r for _, r in split.values())
    assert batch_mal(b, ALL)[0] == pytest.approx(sum(mal * r for mal, r in split.values()) / batch_mal(b, ALL)[1])
    b.timeline = Timeline()  # an engine that keeps no schedule (vLLM): the batch's stats
    assert batch_mal(b, ALL) == (b.stats.mean_accepted_length, b.stats.verify_rows - b.stats.ar_rows, None)
    sd_rows = sum(r for _, r in split.values())  # the batch's own MAL: its drafted steps too
    assert b.stats.mean_accepted_length == pytest.approx(sum(mal * r for mal, r in split.values()) / sd_rows)
    assert batch_mal(b, "mtp") == (1.0, 0.0, None)


class FakeEngine:
    """Records what it serves; its batches are scripted (batch())."""

    def __init__(self):
        self.drafter_version, self.served = 0, None
        self.probe: dict[str, float] = {}  # the members that draft in generate(), and their MAL (2 rows each)

    def generate(self, prompts, params, speculative=True):
        if any(math.isnan(v) for v in self.probe.values()):
            raise RuntimeError("NaN draft probabilities")
        return self.batch(self.probe, rows=2)

    def load_drafter(self, weights, version):
        self.served, self.drafter_version = {k: v.clone() for k, v in weights.items()}, version

    def batch(self, mals: dict[str, float], rows: int = CANARY_ROWS, k: int = 4) -> RolloutBatch:
        """A batch of the served version in which each member of `mals` drafted one step (k drafts) at that MAL."""
        kinds = list(mals)
        tl = Timeline(schedule=[{"kind": m, "on": True, "k": k} for m in kinds], batch=[rows] * len(kinds),
                      tokens=[round(mals[m] * rows) for m in kinds], k=[k] * len(kinds))
        st = SpecStats(drafted=8.0, verify_rows=float(rows * len(kinds)), emitted=float(sum(tl.tokens)))
        return RolloutBatch([[1]], [[0.0]], st, self.drafter_version, drafter_versions=[self.drafter_version],
                            timeline=tl)


def est(*members: str, mal: float = 4.0, curve=None) -> dict:
    return {m: {"mal": mal, "curve": curve} for m in members}


def weights(mtp: float, dm: float) -> dict:
    return {"mtp.w": torch.full((2,), mtp), "draft_model.w": torch.full((2,), dm)}


def publisher(pool=None, canary="inline"):
    cfg = OmegaConf.structured(Config).online  # canary_min_ratio 0.5: floor 2.5 at an estimate of 4
    cfg.canary = canary
    eng, logs = FakeEngine(), []
    return Publisher([eng], weights(0, 0), cfg, log=logs.append, pool=pool), eng, logs


def test_each_member_is_judged_on_its_own_steps_and_rolled_back_alone():
    pub, eng, logs = publisher()
    rec = pub.publish(weights(1, 1), members=est("mtp", "draft_model"))
    assert rec["published"] and rec["canary_mal"] is None and eng.drafter_version == 1
    assert pub.observe(eng.batch({"mtp": 4.0}))["member_canary"]["mtp"]["rolled_back"] is False
    assert list(pub.pending["members"]) == ["draft_model"]  # it drafted no step yet: still on probation
    assert torch.equal(pub.good_weights["mtp.w"], torch.ones(2))  # mtp's new weights are good now
    assert torch.equal(pub.good_weights["draft_model.w"], torch.zeros(2))
    rec = pub.observe(eng.batch({"draft_model": 1.0}))
    assert rec["rolled_back"] and rec["member_canary"]["draft_model"]["canary_mal"] == 1.0
    assert eng.drafter_version == 2 == pub.good_version and pub.pending is None
    assert torch.equal(eng.served["mtp.w"], torch.ones(2)) and torch.equal(eng.served["draft_model.w"], torch.zeros(2))
    assert any("ROLLBACK" in m and "draft_model" in m for m in logs), logs
    # the next publish brings one new member; an engine failure on probation takes back every member on it
    pub.publish(weights(1, 2), members=est("draft_model"))
    assert pub.fail(RuntimeError("NaN draft probabilities"))["rolled_back"]
    assert torch.equal(eng.served["draft_model.w"], torch.zeros(2)) and torch.equal(eng.served["mtp.w"], torch.ones(2))


def test_a_member_is_judged_once_it_drafted_enough_rows():
    """A long-tail step holds a few rows: their MAL is noise. A member is judged on its rows summed over the batches
    of the version, once they reach CANARY_ROWS."""
    pub, eng, _ = publisher()
    pub.publish(weights(1, 1), members=est("mtp", "draft_model"))
    few = CANARY_ROWS // 2
    assert pub.observe(eng.batch({"mtp": 1.5, "draft_model": 4.0}, rows=few)) == {}  # neither has enough rows
    rec = pub.observe(eng.batch({"mtp": 4.0}, rows=few))  # mtp: (1.5 + 4.0) / 2 = 2.75 over CANARY_ROWS rows
    assert rec["member_canary"]["mtp"]["canary_mal"] == pytest.approx(2.75) and not rec["rolled_back"]
    assert list(pub.pending["members"]) == ["draft_model"]


def test_a_member_left_on_probation_stays_on_it_through_the_next_publish():
    pub, eng, _ = publisher()
    pub.publish(weights(1, 1), members=est("mtp", "draft_model"))
    pub.observe(eng.batch({"mtp": 4.0}))  # mtp judged good; draft_model not yet
    pub.publish(weights(2, 1), members=est("mtp"))  # only mtp is new; draft_model's weights are still unjudged
    assert set(pub.pending["members"]) == {"mtp", "draft_model"}
    rec = pub.observe(eng.batch({"mtp": 4.0, "draft_model": 1.0}))
    assert rec["rolled_back"] and not rec["member_canary"]["mtp"]["rolled_back"]
    assert torch.equal(eng.served["mtp.w"], torch.full((2,), 2.0)) and torch.equal(eng.served["draft_model.w"],
                                                                                 torch.zeros(2))


def test_version_tags_keep_what_a_rollback_and_a_resume_read_and_stay_few():
    """A run publishes up to once per RL step: the publisher's version tags (the policy version each served version
    was published at) keep only the served and last good versions' and read as a publisher that keeps them all
    reads, through publishes judged good, members and whole drafters rolled back, versions left on probation,
    unjudged ones, and a resume."""
    rng = random.Random(0)
    pub, eng, _ = publisher()
    ref, ref_eng, _ = publisher()
    ref._tag = ref.tags.__setitem__  # every tag kept
    for step in range(60):
        action = rng.randrange(5)
        for p, e in ((pub, eng), (ref, ref_eng)):
            if action == 4:  # unjudged (a requantized self-drafter): good at once
                p.publish(weights(step, step), tag=step)
                continue
            p.publish(weights(step, step), members=est("mtp", "draft_model"), tag=step)
            if action == 1:
                p.observe(e.batch({"mtp": 4.0, "draft_model": 4.0}))  # both good
            elif action == 2:
                p.observe(e.batch({"mtp": 4.0, "draft_model": 1.0}))  # draft_model rolled back alone
            elif action == 3:
                p.fail(RuntimeError("NaN draft probabilities"))  # every member back
            # action 0: left on probation
        assert (pub.version, pub.good_version) == (ref.version, ref.good_version)
        assert pub.tags[pub.version] == ref.tags[ref.version]
        assert pub.tags.get(pub.good_version) == ref.tags.get(ref.good_version)
        assert len(pub.tags) <= 3
    assert len(ref.tags) > 60  # the comparison covered a long history
    resumed, _, _ = publisher()
    resumed.load_state_dict(pub.state_dict())
    ref_resumed, _, _ = publisher()
    ref_resumed.load_state_dict(ref.state_dict())
    assert resumed.tags[resumed.version] == ref_resumed.tags[ref_resumed.version] and len(resumed.tags) <= 3


def test_pooled_member_canary_judges_on_every_process():
    """A second process (simulated: what it adds to the sums) saw draft_model draft badly; this one saw only mtp."""
    other = {"draft_model": (1.0, float(CANARY_ROWS))}

    def pool(xs):  # layout: [failures] + (MAL x rows, rows, expected MAL x rows) per member on probation, in order
        add = [0.0] + [v for m in pub.pending["members"] for v in
                       ((other[m][0] * other[m][1], other[m][1], 4.0 * other[m][1]) if m in other else (0.0,) * 3)]
        return [x + y for x, y in zip(xs, add)]

    pub, eng, _ = publisher(pool)
    pub.publish(weights(1, 1), members=est("mtp", "draft_model"))
    assert pub.observe(eng.batch({"mtp": 4.0})) == {}  # recorded, judged at settle
    rec = pub.settle()
    assert rec["rolled_back"] and set(rec["member_canary"]) == {"mtp", "draft_model"}
    assert torch.equal(eng.served["mtp.w"], torch.ones(2)) and torch.equal(eng.served["draft_model.w"], torch.zeros(2))


def test_a_probe_judges_the_members_it_drafted_with():
    """canary=probe: the probe right after the swap judges the members that drafted in it, however few its rows (it
    is the canary's evidence); the others stay on probation for the rollouts; an engine failure in the probe takes
    back every new member."""
    pub, eng, _ = publisher(canary="probe")
    eng.probe = {"draft_model": 1.0}
    rec = pub.publish(weights(1, 1), members=est("mtp", "draft_model"), probe_prompts=[[1, 2]],
                      params=SamplingParams())
    assert rec["rolled_back"] and set(rec["member_canary"]) == {"draft_model"} and eng.drafter_version == 2
    assert list(pub.pending["members"]) == ["mtp"]
    assert torch.equal(eng.served["mtp.w"], torch.ones(2)) and torch.equal(eng.served["draft_model.w"], torch.zeros(2))
    eng.probe = {"mtp": math.nan}
    rec = pub.publish(weights(1, 2), members=est("draft_model"), probe_prompts=[[1, 2]], params=SamplingParams())
    assert rec["rolled_back"] and pub.pending is None
    assert torch.equal(eng.served["mtp.w"], torch.zeros(2)) and torch.equal(eng.served["draft_model.w"], torch.zeros(2))


def test_a_probe_judges_each_member_on_the_engine_that_reads_worst():
    """Several engines: each member is judged on the engine where it reads furthest below what it should (one
    engine that silently dropped a member's weights fails it, whatever the others read). The per-member probe judged
    on the first engine alone and stopped."""
    pub, eng, _ = publisher(canary="probe")
    other = FakeEngine()
    pub.engines.append(other)
    eng.probe, other.probe = {"mtp": 4.0, "draft_model": 4.0}, {"mtp": 1.0, "draft_model": 3.5}
    rec = pub.publish(weights(1, 1), members=est("mtp", "draft_model"), probe_prompts=[[1, 2]],
                      params=SamplingParams())
    c = rec["member_canary"]
    assert c["mtp"]["rolled_back"] and c["mtp"]["canary_mal"] == 1.0 and not c["draft_model"]["rolled_back"]
    for e in (eng, other):
        assert torch.equal(e.served["mtp.w"], torch.zeros(2)) and torch.equal(e.served["draft_model.w"], torch.ones(2))
    # the whole drafter alike
    other.probe = {ALL: 1.0}
    eng.probe = {ALL: 4.0}
    rec = pub.publish(weights(2, 2), 4.0, probe_prompts=[[1, 2]], params=SamplingParams())
    assert rec["rolled_back"] and rec["canary_mal"] == 1.0 and "member_canary" not in rec
    assert torch.equal(other.served["mtp.w"], torch.zeros(2)) and torch.equal(other.served["draft_model.w"],
                                                                             torch.ones(2))


def test_canary_probe_without_probe_prompts_leaves_the_drafter_on_probation():
    """canary=probe before any rollout gave it prompts to probe with: the whole drafter's new weights became the
    last good ones unjudged (a later rollback would restore them); now the next rollout batch judges them."""
    pub, eng, _ = publisher(canary="probe")
    assert pub.publish(weights(1, 1), 4.0)["published"]
    assert pub.pending is not None and torch.equal(pub.good_weights["mtp.w"], torch.zeros(2))
    rec = pub.observe(eng.batch({ALL: 1.0}, rows=1))
    assert rec["rolled_back"] and torch.equal(eng.served["mtp.w"], torch.zeros(2)) and pub.good_version == 0


def test_a_pooled_probe_judges_at_once():
    """Several processes with canary=probe: every process probes at the same point, so the probes are pooled and
    judged right after the swap (the members' probe waited for the next settle, a whole RL step of serving them)."""
    pub, eng, _ = publisher(lambda xs: [a + b for a, b in zip(xs, [0.0, 4.0, 1.0, 4.0, 1.0, 1.0, 4.0])],
                            canary="probe")
    eng.probe = {"mtp": 4.0, "draft_model": 3.0}  # here both pass (floor 2.5); there draft_model read 1.0
    rec = pub.publish(weights(1, 1), members=est("mtp", "draft_model"), probe_prompts=[[1, 2]],
                      params=SamplingParams())
    c = rec["member_canary"]
    assert c["mtp"]["canary_mal"] == 4.0 and not c["mtp"]["rolled_back"]
    assert c["draft_model"]["canary_mal"] == 2.0 and c["draft_model"]["rolled_back"]  # (3 + 1) / 2 < 2.5
    assert pub.pending is None and eng.drafter_version == 2 and torch.equal(eng.served["draft_model.w"], torch.zeros(2))


def test_a_member_is_judged_against_its_estimate_at_the_k_it_drafted_with():
    """The estimate scores k_max drafts; the engine's auto k drafted 2 at this step. Against the estimate at k_max
    (5.7 here: floor 3.35) a good member's 2.5 was rolled back (the main job rolled back a good draft model this way);
    at k=2 the curve gives 1 + 0.9 + 0.81 = 2.71, times the estimate's cut at the end of rows (5.7 / 6.13 from the
    curve at k=8): 2.52 (floor 1.76): kept. A broken one (1.2) still goes back."""
    curve = [0.9] * 8
    assert expected_tokens(curve, 2) == pytest.approx(2.71)
    full = expected_tokens(curve, 8)
    assert full == pytest.approx(1 + sum(0.9 ** i for i in range(1, 9)))
    pub, eng, _ = publisher()
    pub.publish(weights(1, 1), members=est("mtp", "draft_model", mal=5.7, curve=curve))
    rec = pub.observe(eng.batch({"mtp": 2.5, "draft_model": 1.2}, k=2))
    c = rec["member_canary"]
    assert not c["mtp"]["rolled_back"] and c["mtp"]["expected_mal"] == pytest.approx(2.71 * 5.7 / full)
    assert c["draft_model"]["rolled_back"]
    assert torch.equal(eng.served["mtp.w"], torch.ones(2)) and torch.equal(eng.served["draft_model.w"], torch.zeros(2))


def test_the_whole_drafter_canary_skips_the_toggles_ar_steps():
    """engine.toggle: a batch of 32 rows drafted at MAL 4 and 96 AR rows (one token each) reads 1.75 in the batch's
    stats, under the floor (2.5 at an estimate of 4): a good drafter was rolled back. On its SD steps: kept."""
    pub, eng, _ = publisher()
    assert pub.publish(weights(1, 1), 4.0)["published"]
    tl = Timeline(schedule=[{"on": True, "k": 4}, {"on": False, "k": 0}], batch=[32, 96], tokens=[128, 96], k=[4, 0])
    st = SpecStats(drafted=128.0, verify_rows=128.0, emitted=224.0)
    assert st.mean_accepted_length == 1.75
    rec = pub.observe(RolloutBatch([[1]], [[0.0]], st, 1, drafter_versions=[1, 1], timeline=tl))
    assert rec["canary_mal"] == 4.0 and not rec["rolled_back"] and eng.drafter_version == 1


def test_the_whole_drafter_is_judged_at_the_k_each_step_drafted_with():
    """engine.k=auto with one drafter (eagle3_track engine.k=auto engine.toggle=true rolled back 2 of 5 good
    publishes: engine 2.1-2.4 at auto k against estimates of 4.4-4.5 at k_max 8). At k_max the expectation is the
    estimate itself; at k=2, the curve's 2.71 scaled by the estimate's cut."""
    curve, estimate = [0.9] * 8, 5.7
    pub, eng, logs = publisher()
    pub.publish(weights(1, 1), members={ALL: {"mal": estimate, "curve": curve}})
    assert pub.pending["members"] == {ALL: {"mal": estimate, "curve": curve}}  # the whole drafter's canary
    tl = Timeline(batch=[32], tokens=[80], k=[2])  # MAL 2.5 at k=2
    rec = pub.observe(RolloutBatch([[1]], [[0.0]], SpecStats(drafted=64.0, verify_rows=32.0, emitted=80.0), 1,
                                   drafter_versions=[1], timeline=tl))
    assert rec == {"canary_mal": 2.5, "rolled_back": False} and pub.good_version == 1
    pub.publish(weights(2, 2), members={ALL: {"mal": estimate, "curve": curve}})
    tl = Timeline(batch=[32], tokens=[96], k=[8])  # MAL 3.0 at k_max: floor 3.35
    rec = pub.observe(RolloutBatch([[1]], [[0.0]], SpecStats(drafted=256.0, verify_rows=32.0, emitted=96.0), 2,
                                   drafter_versions=[2], timeline=tl))
    assert rec["rolled_back"] and any("5.70 at k_max" not in m and "estimate at its k 5.70" in m for m in logs), logs


def test_a_step_the_end_of_the_context_cut_to_ar_is_not_a_drafted_step(make_engine, policy):
    """Near engine.max_len the engine cuts the schedule's k (a long-tail row at the end of its context): the step
    runs AR. It counted as a drafted step emitting one token per row (a good drafter read 1.00 and was rolled
    back); the timeline's k is what the engine verified."""
    d = C.fresh_drafter(policy)
    eng = make_engine(policy, d, k=4, max_len=24, drafter_int8=False)
    b = eng.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_new_tokens=40))
    tl = b.timeline
    cut = [i for i, (s, k) in enumerate(zip(tl.schedule, tl.k)) if s["on"] and k < s["k"]]
    assert cut, (tl.schedule, tl.k)  # the last steps were cut
    drafted = [i for i, k in enumerate(tl.k) if k > 0]
    mal, rows, _ = batch_mal(b, ALL)
    assert rows == sum(tl.batch[i] for i in drafted) and mal == sum(tl.tokens[i] for i in drafted) / rows
