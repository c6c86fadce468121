"""DraftTracker's scoring: the publish gate on paired held-out rows, measure()'s live vs frozen scores, the drafter
lag and the policy version captured features carry.
"""
from __future__ import annotations

import pytest
import torch

from drafttrain.tracking import scoring
from drafttrain.tracking import gate as gate_mod
from tests.integration.conftest import banked_tracker, engine_for, fake_clock, tracker_with_features

pytestmark = pytest.mark.usefixtures("one_thread")


def as_this_steps_rows(tracker) -> None:
    """Replay: the buffer's records become the rollouts of the step now ending (the estimate's rows when none are
    held out)."""
    for r in tracker.buffer.records:
        r["version"] = tracker.policy_version


def test_drafter_lag_counts_policy_updates_since_the_serving_drafter_was_published(trained, monkeypatch):
    """The time bank skips the third update: the drafter is one policy update behind, and the next publish brings
    it level again (0). The version counters' difference stayed 1 from then on (the main job's ended at 5 while its
    drafter was published the step before). A rollback serves older weights: their lag."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    lags = []
    for step, rl_s in enumerate((1.0, 0.0, 0.0, 10.0)):  # the bank pays for updates 0, 1 and 3 (the bank test)
        clock[0] += rl_s
        tracker.on_policy_update(trained["policy"], step)
        lags.append((tracker.drafter_lag, tracker.policy_version - tracker.version))
    assert lags == [(0, 0), (0, 0), (1, 1), (0, 1)]
    policy = trained["policy"]
    ids = torch.tensor([p[:3] + [5, 6, 7, 8] for p in trained["prompts"][:2]])
    with tracker.capture(policy, response_start=3):  # rollouts: the next update has an estimate, its canary
        policy(input_ids=ids)
    clock[0] += 10.0
    out = tracker.on_policy_update(policy, 4)  # v4, published at policy version 5, on probation
    assert out["published"] and tracker.publisher.pending is not None and tracker.drafter_lag == 0
    assert tracker.publisher.fail(RuntimeError("NaN draft probabilities"))["rolled_back"]
    assert tracker.drafter_lag == 1  # the engines serve v3's weights again, published at policy version 4
    fresh = banked_tracker(trained, monkeypatch, clock)  # a resumed run keeps the lag
    fresh.load_state_dict(tracker.state_dict())
    assert fresh.drafter_lag == 1


def test_publish_gate_decides_on_paired_rows(trained, monkeypatch):
    """online.publish_gate: the update's weights and the serving drafter's are scored on the same rows, and the gate
    takes the per-row MAL differences (tracking/gate.py), not the two pooled MALs. A higher pooled MAL whose rows
    disagree is not published and training goes on from the update (undecided); a small loss on every row resets
    to the serving weights (worse); a small gain on every row is published. The serving drafter's runtime form is
    built once per engine version, and after a publish it is the form the update's own estimate scored."""
    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine, "online.publish_gate=true", "online.gate_min_rows=4",
                                        "online.holdout_frac=0")
    served = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}
    base = torch.tensor([2.0, 3.0, 4.0, 5.0])  # the serving drafter's MAL on each of the 4 rows
    scores, calls = [], []  # the update's per-row MAL offsets; the drafters scored, in order

    def scripted(drafter, batch, k, head=None):
        new = len(calls) % 2 == 0  # each update scores its new weights, then the serving ones
        rows = base + scores[-1] if new else base
        calls.append(drafter)
        return {"mal": float(rows.mean()), "acceptance_per_position": [], "stats": None, "row_mal": rows}

    monkeypatch.setattr(scoring, "teacher_forced_acceptance", scripted)
    cases = [(torch.tensor([0.6, -0.4, 0.6, -0.4]), "undecided"), (torch.full((4,), -0.05), "worse"),
             (torch.full((4,), 0.05), "published"), (torch.full((4,), 0.05), "published")]
    for offsets, want in cases:
        scores.append(offsets)
        as_this_steps_rows(tracker)
        before = tracker.version
        out = tracker.on_policy_update(trained["policy"], len(scores))
        publish = want == "published"
        assert out["gated"] == (not publish) and out["published"] == publish, (want, out)
        assert out["expected_mal"] == pytest.approx(3.5 + float(offsets.mean())) and out["serving_mal"] == 3.5
        assert out["gate_rows"] == 4 and out["gate_mean_diff"] == pytest.approx(float(offsets.mean()), abs=1e-6)
        assert (out["gate_lower"] > 0) == publish
        assert tracker.version == before + publish and engine.drafter_version == tracker.version
        kept = all(torch.equal(v, served[k]) for k, v in tracker.drafter.state_dict().items())
        assert kept == (want == "worse")  # undecided: the trainer goes on from the update's weights
        served = {k: v.clone() for k, v in tracker.scorer.serving_weights().items()}
    assert len(calls) == 8 and calls[1] is calls[3] is calls[5]  # one serving form per served version
    assert calls[7] is calls[4]  # the third update's estimate form serves as the fourth's reference


def _capture_with_held_out_rows(tracker, trained) -> int:
    """Three captured forwards of 4 rows each, so that some rows are held out; returns how many were."""
    policy = trained["policy"]
    for extra in range(3):
        seqs = [p + list(range(5, 12 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 7 - extra):
            policy(input_ids=ids)
    return sum(r["heldout"] for r in tracker.buffer.records)


def test_publish_gate_scores_each_held_out_row_once_per_serving_version(trained, monkeypatch):
    """The serving drafter's score of a held-out row is kept with the row: an update that adds no rows to the gate's
    and publishes nothing scores its own weights only; after a publish (a new serving version) the rows are scored
    again, by the new serving drafter."""
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.holdout_frac=0.5",
                                        "online.estimate_rows=64")
    policy = trained["policy"]
    held = _capture_with_held_out_rows(tracker, trained)
    assert held >= 2
    scored, decide = [], iter([False, True, False])  # publish at the second update only
    real = scoring.teacher_forced_acceptance

    def spy(drafter, batch, k, head):
        scored.append((drafter is tracker.scorer.serving_form(), batch["aux"].shape[0]))
        return real(drafter, batch, k, head)

    monkeypatch.setattr(scoring, "teacher_forced_acceptance", spy)
    monkeypatch.setattr(gate_mod, "gate_decision", lambda n, *a: {"n": int(n), "mean": 0.0, "lower": 0.0,
                                                                "publish": next(decide), "worse": False})
    versions = []
    for step in range(3):
        tracker.on_policy_update(policy, step)  # after the first, no new rows: the gate's stay
        versions.append(tracker.version)
    assert versions == [0, 1, 1]
    assert scored == [(False, held), (True, held), (False, held), (False, held), (True, held)]


def test_measure_scores_the_served_drafter_on_the_gates_rows_for_it(trained, monkeypatch):
    """measure() (reporting: it scores the served drafter every step anyway) takes the step's held-out rows first,
    and its scores of them are the publish gate's: the update then scores only its own weights, and the serving MAL
    it reports is the one a fresh scoring of those rows gives."""
    from drafttrain.tracking.acceptance import teacher_forced_acceptance
    from drafttrain.tracking.buffer import collate
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.holdout_frac=0.5",
                                        "online.measure_rows=64", "online.gate_min_rows=2", "online.estimate_rows=64")
    policy = trained["policy"]
    held = _capture_with_held_out_rows(tracker, trained)
    assert held >= 2
    tracker.measure()
    serving = tracker.scorer.serving_form()
    scored = []
    real = scoring.teacher_forced_acceptance

    def spy(drafter, batch, k, head):
        scored.append((drafter is serving, batch["aux"].shape[0]))
        return real(drafter, batch, k, head)

    monkeypatch.setattr(scoring, "teacher_forced_acceptance", spy)
    out = tracker.on_policy_update(policy, 0)
    assert scored == [(False, held)] and out["gate_rows"] == held
    rows = collate(tracker.scorer.estimate_records(tracker.buffer, 0), tracker.steps)
    fresh = teacher_forced_acceptance(serving, rows, tracker.steps, tracker.head)["mal"]
    assert out["serving_mal"] == pytest.approx(fresh, rel=1e-5)


def test_the_estimate_scores_rollouts_held_out_of_training(trained, monkeypatch):
    """online.holdout_frac: captured rows drawn out of the training buffer; the update's estimate (the publish gate's
    and the canary's reference) scores only those. It scored the latest step's rows, which the update had just
    trained on: every update looked better than the serving drafter (+0.1% on average on the main job) while the
    live drafter fell 0.9% below the frozen one on fresh rollouts."""
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.holdout_frac=0.5")
    policy = trained["policy"]
    for extra in range(6):  # 24 more rows, of distinct lengths per capture
        seqs = [p + list(range(5, 12 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 7 - extra):
            policy(input_ids=ids)
    held = sum(r["heldout"] for r in tracker.buffer.records)
    assert len(tracker.buffer) == 28 and 0 < held < 28
    assert tracker.buffer.trainable() == 28 - held  # held-out rows are never drawn for training
    held_aux = {r["aux"].float().sum().item() for r in tracker.buffer.records if r["heldout"]}
    drawn = tracker.buffer.sample_groups(4, 100)
    assert sum(map(len, drawn)) == 28 - held and not any(r["heldout"] for g in drawn for r in g)
    scored = []
    real = scoring.teacher_forced_acceptance

    def spy(drafter, batch, k, head):
        scored.extend(batch["aux"][b, :int(batch["lengths"][b])].sum().item() for b in range(len(batch["lengths"])))
        return real(drafter, batch, k, head)

    monkeypatch.setattr(scoring, "teacher_forced_acceptance", spy)
    out = tracker.on_policy_update(policy, 0)
    assert out["expected_mal"] is not None and scored and set(scored) <= held_aux


def test_the_estimate_takes_a_random_sample_of_a_steps_held_out_rows(trained):
    """online.estimate_rows of a step's held-out rows, drawn at random among them: the newest (the loss forward's last
    micro-batches, its longest rows) were the estimate's rows every time, a biased gate."""
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.holdout_frac=0.5",
                                        "online.estimate_rows=2")
    _capture_with_held_out_rows(tracker, trained)
    held = [r for r in tracker.buffer.records if r["heldout"]]
    assert len(held) >= 4
    chosen = []
    for _ in range(30):
        for r in held:
            r.pop("estimate", None)
        tracker.scorer.keep_heldout(tracker.buffer, 0)
        got = tracker.scorer.estimate_records(tracker.buffer, 0)
        assert len(got) == 2 and all(r["heldout"] for r in got)
        chosen.append({next(i for i, h in enumerate(held) if h is r) for r in got})
    assert set().union(*chosen) == set(range(len(held)))  # every held-out row drawn at some point
    assert len({frozenset(c) for c in chosen}) > 3


def test_a_resumed_tracker_estimates_on_the_held_out_rows_it_had(trained, tmp_path):
    """The estimate's (and the publish gate's) held-out rows span the last steps: a tracker resumed from a checkpoint
    scores its next update on the rows the one that ran on does. They were not saved: after a resume the run's
    expected_mal, and with it the gate's verdicts, parted from the uninterrupted run's."""
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker

    policy = trained["policy"]
    a, _ = tracker_with_features(trained, engine_for(trained), "online.holdout_frac=0.5")
    a.on_policy_update(policy, 0)
    assert any(r.get("estimate") for r in a.buffer.records)
    state = a.state_dict()
    a.save_training(tmp_path)
    b = DraftTracker(a.cfg, policy, [engine_for(trained)], build_drafter(a.cfg.drafter, policy), log=lambda m: None)
    b.load_state_dict(state, tmp_path)
    seqs = [p + list(range(5, 14)) for p in trained["prompts"][:4]]
    ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
    outs = []
    for t in (a, b):
        with t.capture(policy, response_start=ids.shape[1] - 9):
            policy(input_ids=ids)
        outs.append(t.on_policy_update(policy, 1))
    assert outs[0]["expected_mal"] is not None and outs[0]["expected_mal"] == outs[1]["expected_mal"]


def test_measure_scores_a_random_sample_of_the_steps_rollouts(trained, monkeypatch):
    """online.measure_rows=3 of 12 captured rows: a sample drawn over all of them. The loss forward runs
    zero-advantage sequences last, sorted by length, so "the last rows" (the old rule) always scored the same kind."""
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.measure_rows=3")
    policy = trained["policy"]
    for extra in (2, 4):  # rows of 3 response lengths: 6 (the helper's), 8, 10
        seqs = [p + list(range(5, 11 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 6 - extra):
            policy(input_ids=ids)
    seen = []
    n_rows = lambda b: b["aux"].shape[0]  # noqa: E731
    monkeypatch.setattr(scoring, "teacher_forced_acceptance",
                        lambda d, batch, k, head: seen.append(batch["valid"].sum(1).tolist()) or
                        {"mal": 2.0, "acceptance_per_position": [0.5] * k, "row_mal": torch.full((n_rows(batch),), 2.0),
                         "row_steps": torch.ones(n_rows(batch))})
    for _ in range(10):
        tracker.measure()
    assert len(seen) == 20 and all(len(rows) == 3 for rows in seen)
    assert {n for rows in seen for n in rows} == {6, 8, 10}, seen  # every length drawn from


def test_measure_scores_the_drafters_the_engine_runs(trained):
    """engine.drafter_int8 (the default): the engine drafts with int8 linears, so measure() scores the live and the
    frozen drafter in that form (what the engine's acceptance is), not the fp32 training form. Live is what the
    engines serve, not the trainer's weights, which an undecided publish gate keeps training unpublished."""
    import copy

    from drafttrain.tracking.acceptance import teacher_forced_acceptance
    from drafttrain.tracking.buffer import collate

    tracker, _ = tracker_with_features(trained, engine_for(trained), "engine.drafter_int8=true")
    with torch.no_grad():
        for p in tracker.drafter.parameters():  # live and frozen differ
            p.add_(0.01 * torch.randn_like(p))
    tracker.publisher.good_weights = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}  # served
    batch = collate(tracker.buffer.of_version(0), tracker.steps)  # all 4 rows
    head = tracker.head
    want = {name: teacher_forced_acceptance(copy.deepcopy(d).eval().fuse_for_inference(True), batch, 5, head)["mal"]
            for name, d in (("live", tracker.drafter), ("frozen", tracker.frozen))}
    fp32 = teacher_forced_acceptance(tracker.frozen, batch, 5, head)["mal"]
    with torch.no_grad():
        for p in tracker.drafter.parameters():  # an update the publish gate has not passed yet: not what serves
            p.add_(0.05 * torch.randn_like(p))
    got = tracker.measure(5)
    assert got["live_tf_mal"] == pytest.approx(want["live"], abs=1e-6)
    assert got["frozen_tf_mal"] == pytest.approx(want["frozen"], abs=1e-6)
    assert want["live"] != want["frozen"] and got["frozen_tf_mal"] != fp32


def test_captured_features_carry_the_policy_version(trained):
    # the buffer's recency weighting (online.buffer_half_life) needs each record's policy version
    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine)
    n0 = len(tracker.buffer)
    assert tracker.buffer.half_life == 2.0 and {r["version"] for r in tracker.buffer.records} == {0}
    tracker.on_policy_update(trained["policy"], 4)
    seqs = [p + [5, 6, 7, 8] for p in trained["prompts"][:2]]
    ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
    with tracker.capture(trained["policy"], response_start=ids.shape[1] - 4):
        trained["policy"](input_ids=ids)
    assert [r["version"] for r in tracker.buffer.records] == [0] * n0 + [5] * (len(tracker.buffer) - n0)
    assert len(tracker.buffer) > n0


def test_auto_members_are_gated_each_on_its_own(trained, monkeypatch):
    """drafter.kind=auto with two trainable members: each member's update is paired with its own serving weights on
    the same rows. One that gains is published alone (the other's serving weights stay in the engines), one shown
    worse goes back to its serving weights in the trainer, and an undecided one trains on; the record says which."""
    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker
    from tests.unit.test_members import FakeEngine

    cfg = load_recipe("auto_track", ["drafter.auto.kinds=[mtp,draft_model]", "drafter.auto.paths=[null,null]",
                                     "engine.drafter_int8=false", "train.batch_size=4", "online.steps_per_update=2",
                                     "online.budget_frac=0", "online.gate_min_rows=4", "online.holdout_frac=0"])
    policy, engine = trained["policy"], FakeEngine()
    torch.manual_seed(0)
    tracker = DraftTracker(cfg, policy, [engine], build_drafter(cfg.drafter, policy), log=lambda m: None)
    seqs = [p + [5, 6, 7, 8, 9, 10] for p in trained["prompts"][:4]]
    ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
    with tracker.capture(policy, response_start=ids.shape[1] - 6):
        policy(input_ids=ids)
    base = torch.tensor([2.0, 3.0, 4.0, 5.0])
    gain = {}  # member -> per-row offsets of its new weights over its serving ones

    def scripted(drafter, batch, k, head=None):
        serving = drafter is tracker.scorer.serving_form()
        rows = base if serving else base + gain[drafter.scored]
        return {"mal": float(rows.mean()), "acceptance_per_position": [], "stats": None, "row_mal": rows}

    monkeypatch.setattr(scoring, "teacher_forced_acceptance", scripted)
    part = lambda sd, m: {k: v.clone() for k, v in sd.items() if k.startswith(m + ".")}  # noqa: E731
    served = {m: part(tracker.drafter.state_dict(), m) for m in ("mtp", "draft_model")}
    same = lambda a, b: all(torch.equal(v, b[k]) for k, v in a.items())  # noqa: E731
    # mtp gains on every row, draft_model loses on every row
    gain.update(mtp=torch.full((4,), 0.05), draft_model=torch.full((4,), -0.05))
    as_this_steps_rows(tracker)
    out = tracker.on_policy_update(policy, 0)
    assert out["published"] and not out["gated"] and engine.drafter_version == 1
    assert {m: (g["passed"], g["worse"]) for m, g in out["member_gates"].items()} == {
        "mtp": (True, False), "draft_model": (False, True)}
    trained_mtp = part(tracker.drafter.state_dict(), "mtp")
    assert not same(trained_mtp, served["mtp"])  # the update moved mtp ...
    assert same(part(engine.served, "mtp"), trained_mtp)  # ... and published it
    assert same(part(engine.served, "draft_model"), served["draft_model"])  # draft_model stays served as it was
    assert same(part(tracker.drafter.state_dict(), "draft_model"), served["draft_model"])  # and trains on from it
    assert list(tracker.publisher.pending["members"]) == ["mtp"]  # on probation: mtp alone
    assert tracker.publisher.pending["members"]["mtp"]["mal"] == pytest.approx(3.55)
    # mtp undecided, draft_model gains: draft_model alone is published; mtp trains on from its update
    gain.update(mtp=torch.tensor([0.6, -0.4, 0.6, -0.4]), draft_model=torch.full((4,), 0.05))
    as_this_steps_rows(tracker)
    out = tracker.on_policy_update(policy, 1)
    assert out["published"] and engine.drafter_version == 2
    assert {m: (g["passed"], g["worse"]) for m, g in out["member_gates"].items()} == {
        "mtp": (False, False), "draft_model": (True, False)}
    assert same(part(engine.served, "mtp"), trained_mtp)  # the served mtp is the first update's
    assert not same(part(tracker.drafter.state_dict(), "mtp"), trained_mtp)  # the trainer's went on
    assert same(part(engine.served, "draft_model"), part(tracker.drafter.state_dict(), "draft_model"))
    # neither shown better: nothing published
    gain.update(mtp=torch.full((4,), -0.05), draft_model=torch.tensor([0.6, -0.4, 0.6, -0.4]))
    as_this_steps_rows(tracker)
    out = tracker.on_policy_update(policy, 2)
    assert out["gated"] and not out["published"] and engine.drafter_version == 2
