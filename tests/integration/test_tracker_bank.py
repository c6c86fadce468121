"""DraftTracker under the sync time bank, on a fake clock: what RL time earns, what drafter work spends, and that
an update never buys a step the bank cannot pay for.
"""
from __future__ import annotations

import pytest
import torch

from drafttrain.tracking import capture, scoring
from drafttrain.tracking import tracker as tracker_mod
from tests.integration.conftest import banked_tracker, engine_for, fake_clock, slowed, tracker_with_features

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sync_training_is_held_to_its_time_bank(trained, monkeypatch):
    """online.budget_frac=0.05: each RL second earns 50 ms of drafter work. On a fake clock where only drafter steps
    take time (5 ms a record, 20 ms a batch), the steps per update follow the bank: after a first update of one
    batch (nothing measured yet), whole batches while the bank covers one (with the 1.25 margin: 25 ms), then as
    many records as it covers, never going into debt."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    taken = []
    for rl_s in (1.0, 0.0, 0.0, 10.0):  # RL time before each update
        clock[0] += rl_s
        out = tracker.on_policy_update(trained["policy"], len(taken))
        taken.append(out["drafter_steps"])
        assert out["published"] == (out["drafter_steps"] > 0)
    # 50 ms: the first update (nothing measured yet) takes one batch, 30 ms left; then 1 batch (25 ms predicted)
    # and 1 record (6.25 ms), 5 ms left; 5 ms covers no record: nothing (no debt); 505 ms: 25 batches, 5 ms left
    assert taken == [1, 2, 0, 25]
    assert tracker.bank.bank_s == pytest.approx(0.005)


def test_an_update_waits_until_the_bank_covers_min_steps_whole_batches(trained, monkeypatch):
    """online.min_steps_per_update=2: an update's fixed work is paid once for several steps. After the first update
    (one batch, 30 ms left), 10 ms more (40 ms) covers one batch (25 ms predicted), not two: no update, nothing
    spent (with 1, it would take a batch and two records); 15 ms more (55 ms) covers two: the update starts, takes
    two batches (40 ms) and, as any update, the records the rest covers (two: 10 ms), 5 ms left."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock, "online.min_steps_per_update=2")
    tracker.buffer.records.extend(list(tracker.buffer.records) * 2)  # 3 batches of 4 (else fewer than 2 to wait for)
    tracker._last_update_t = 0.0
    taken = []
    for rl_s in (1.0, 0.2, 0.3):
        clock[0] += rl_s
        taken.append(tracker.on_policy_update(trained["policy"], len(taken))["drafter_steps"])
    assert taken == [1, 0, 3]
    assert tracker.bank.bank_s == pytest.approx(0.005)


def test_an_update_with_no_step_is_idle_not_a_nan_alarm(trained, monkeypatch):
    """The bank covered a record when the update began, but not by the time its first step was due (here the
    buffer's sampling took the time): no drafter step ran. That is an idle update, not "all 0 drafter steps had a
    NaN/inf loss" (the main job logged that false alarm) nor a weight clone and an acceptance estimate for nothing."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock)
    logs = tracker.log.__self__
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1  # 50 ms earned, 30 ms left
    sample = tracker.buffer.sample_groups

    def slow_sample(*a, **kw):
        clock[0] += 0.028
        return sample(*a, **kw)

    monkeypatch.setattr(tracker.buffer, "sample_groups", slow_sample)
    est = []
    monkeypatch.setattr("drafttrain.tracking.scoring.teacher_forced_acceptance", lambda *a, **kw: est.append(1))
    out = tracker.on_policy_update(trained["policy"], 1)
    assert out["drafter_steps"] == 0 and not out["published"] and out["expected_mal"] is None
    assert not any("NOT PUBLISHED" in m for m in logs), logs
    assert est == [] and tracker.bank.bank_s == pytest.approx(0.002)  # the 28 ms spent is charged


def test_time_bank_predicts_each_step_from_its_batch_lengths(trained, monkeypatch):
    """A drafter step costs in proportion to its batch's padded tokens: batches of long rollouts cost several times
    those of short ones. The bank predicts each step from its batch (seconds per token, a moving average), so an
    update never starts a step it cannot pay for and the bank never goes into debt; a per-step average let a long
    batch after short ones overspend it."""
    clock = fake_clock(monkeypatch)
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.budget_frac=0.05",
                                        "online.steps_per_update=50", "train.batch_size=1")
    rec = tracker.buffer.records[0]
    X, H, V = rec["aux"].shape[1], rec["hidden"].shape[1], tracker.head.vocab_size
    g = torch.Generator().manual_seed(0)

    def record(L):
        return {"aux": torch.randn(L, X, generator=g), "hidden": torch.randn(L, H, generator=g),
                "ids": torch.randint(0, V, (L,), generator=g), "start": 1, "version": 0, "heldout": False}

    tracker.buffer.records.clear()
    for L in (4, 4, 4, 40, 4, 4, 4, 40):
        tracker.buffer.records.append(record(L))
    step = tracker.trainer.step

    def step_by_tokens(batch, head=None):  # 0.5 ms per padded position
        clock[0] += 0.0005 * batch["aux"].shape[0] * batch["aux"].shape[1]
        return step(batch, head)

    monkeypatch.setattr(tracker.trainer, "step", step_by_tokens)
    tracker._last_update_t = 0.0
    banks, steps = [], 0
    for i in range(16):
        clock[0] += 0.2  # each RL step earns 10 ms: five short steps, half a long one
        out = tracker.on_policy_update(trained["policy"], i)
        steps += out["drafter_steps"]
        banks.append(tracker.bank.bank_s)
    assert steps >= 16
    assert min(banks[1:]) >= -1e-9, banks  # the first update, with nothing measured yet, may overspend


def test_host_work_outside_rl_steps_earns_no_budget(trained, monkeypatch):
    """Checkpoint saves and logging between RL steps (tracker.outside_rl_step) are not RL time: 1 s of RL plus 10 s
    of saving earns 50 ms, not 550 ms."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 0.5
    with tracker.outside_rl_step():
        clock[0] += 10.0
    clock[0] += 0.5
    tracker.on_policy_update(trained["policy"], 0)  # the first update: one batch (20 ms)
    assert tracker.bank.bank_s == pytest.approx(0.03)


def test_resumed_tracker_keeps_the_banks_cost_predictions(trained, monkeypatch):
    """A resumed run restores the bank and its cost predictions: without them its first update trains whole batches
    unpredicted and overspends (bench_tracking resumes at each checkpoint; it overspent 0.19 s there)."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    tracker.on_policy_update(trained["policy"], 0)
    state = tracker.state_dict()
    fresh = banked_tracker(trained, monkeypatch, clock)
    fresh.load_state_dict(state)
    assert fresh.bank.tok_cost_s == pytest.approx(tracker.bank.tok_cost_s) and fresh.bank.tok_cost_s is not None
    assert fresh.bank.bank_s == pytest.approx(tracker.bank.bank_s)
    fresh._last_update_t = clock[0]
    clock[0] += 0.1  # earns 5 ms: with the 30 ms kept, one batch (25 ms predicted) and two records (12.5 ms)
    assert fresh.on_policy_update(trained["policy"], 1)["drafter_steps"] == 2
    assert fresh.bank.bank_s == pytest.approx(0.005)


def test_time_bank_counts_rl_time_from_the_first_capture(trained, monkeypatch):
    """Set-up before the first rollout or capture (loading, engine builds) is not RL time: 100 s of it must not
    fill the bank. Only the 1 s from the first capture to the update earns: 50 ms, of which the first update (one
    batch, nothing measured yet) spends 20 ms."""
    clock = fake_clock(monkeypatch)
    real_capture = tracker_mod.DraftTracker.start_capture

    def late_capture(self, *a, **kw):
        clock[0] += 100.0  # set-up time between construction and the first capture
        return real_capture(self, *a, **kw)

    monkeypatch.setattr(tracker_mod.DraftTracker, "start_capture", late_capture)
    tracker = banked_tracker(trained, monkeypatch, clock)
    clock[0] += 1.0
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1
    assert tracker.bank.bank_s == pytest.approx(0.03)  # 100 s earning 5 s would have left ~4.98 s


def test_capture_time_is_charged_to_the_time_bank(trained, monkeypatch):
    """Capturing features in the loss forward is online-training work inside the RL step: it does not earn budget
    and the bank pays for it. 1 s of RL with 30 ms of capture earns 0.05 x 0.97 s, less 30 ms: 18.5 ms, one step."""
    clock = fake_clock(monkeypatch)
    slowed(monkeypatch, clock, capture, "build_features", 0.03)
    tracker = banked_tracker(trained, monkeypatch, clock)
    clock[0] += 0.97
    out = tracker.on_policy_update(trained["policy"], 0)
    assert out["capture_s"] == pytest.approx(0.03) and out["drafter_steps"] == 1
    assert tracker.bank.bank_s == pytest.approx(0.0485 - 0.03 - 0.02)


@pytest.mark.parametrize("capture_rows", ["all", "graded"])
def test_a_forward_run_only_for_the_tracker_is_not_rl_time(trained, monkeypatch, capture_rows):
    """The loss forward of rows with no advantage runs only because the tracker reads them (capture(extra=True)):
    its 0.4 s is drafter work where the drafter trains on such rows (online.capture_rows=all: paid from the bank),
    reporting where it is only scored (graded, at a measured step); RL time in neither. It was RL time, so it earned
    budget instead of spending it."""
    clock = fake_clock(monkeypatch)
    tracker = banked_tracker(trained, monkeypatch, clock, f"online.capture_rows={capture_rows}")
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    seqs = [p + [5, 6, 7, 8] for p in trained["prompts"][:2]]
    ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
    with tracker.capture(trained["policy"], response_start=ids.shape[1] - 4, extra=True):
        trained["policy"](input_ids=ids)
        clock[0] += 0.4
    drafter_work = capture_rows == "all"
    assert tracker._capture_s == pytest.approx(0.4 if drafter_work else 0.0)
    assert tracker._measure_s == pytest.approx(0.0 if drafter_work else 0.4)
    out = tracker.on_policy_update(trained["policy"], 0)
    assert out["capture_s"] == pytest.approx(0.4 if drafter_work else 0.0)
    earned = 0.05 * 1.0 - (0.4 if drafter_work else 0.0)  # 1.4 s passed, 1 s of it RL time
    assert out["drafter_steps"] == (0 if drafter_work else 1)  # in debt: no step; else one batch (5 ms a record)
    if drafter_work:
        assert tracker.bank.bank_s == pytest.approx(earned)
    else:  # the batch it took (2 or 4 records) paid from what it earned
        assert earned - tracker.bank.bank_s in (pytest.approx(0.01), pytest.approx(0.02))


def test_measure_time_earns_the_time_bank_nothing(trained, monkeypatch):
    """Scoring the live and frozen drafters (measure, every RL step) is reporting, not RL time: 1 s of RL and 0.6 s
    of measure earn 0.05 x 1 s (50 ms: the first update's batch, 20 ms, leaves 30 ms), not 0.05 x 1.6 s. It took
    1.5 s of a 3.4 s step of the main job, so it had inflated the bank by ~80%."""
    clock = fake_clock(monkeypatch)
    slowed(monkeypatch, clock, scoring, "teacher_forced_acceptance", 0.3)
    tracker = banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    assert tracker.measure()["measure_s"] == pytest.approx(0.6)
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1
    assert tracker.bank.bank_s == pytest.approx(0.05 - 0.02 - 0.3)  # the update's own estimate (0.3 s) is drafter work
