"""RunLogger on resume (a step logged before the kill but after the checkpoint is logged again by the resumed run;
neither the JSONL nor TensorBoard may then hold it twice), and eval.json's accuracy change with its error."""
from __future__ import annotations

import collections
import time

import pytest

from drafttrain.report import RunLogger, read_jsonl


def test_resumed_logger_logs_no_step_twice(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lg = RunLogger(tmp_path, tensorboard=True)
    for s in range(3):  # the first run logged steps 0-2; its last checkpoint holds step 2's start
        lg.log({"step": s, "reward_mean": float(s)})
    lg.close()
    time.sleep(1.1)  # TensorBoard names event files by the second: the resumed run writes a new one
    lg = RunLogger(tmp_path, tensorboard=True, resume_step=2)
    for s in range(2, 4):
        lg.log({"step": s, "reward_mean": 10.0 + s})
    lg.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    events = [(e.step, e.value) for e in ea.Scalars("reward_mean")]
    assert max(collections.Counter(s for s, _ in events).values()) == 1, events  # step 2 was there twice
    assert dict(events) == {0: 0.0, 1: 1.0, 2: 12.0, 3: 13.0}


def test_resume_keeps_every_good_record_around_a_corrupt_line(tmp_path, capsys):
    """Line 5 of a 12-step file cut short: resuming at step 12 keeps the 11 good records (it kept steps 0-3 and
    dropped 4-11 silently) and says which line it dropped."""
    import json

    lines = [json.dumps({"step": s, "reward_mean": float(s)}) for s in range(12)]
    lines[4] = lines[4][:9]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    lg = RunLogger(tmp_path, tensorboard=False, resume_step=12)
    lg.log({"step": 12, "reward_mean": 12.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, *range(5, 13)]
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "line 5" in said[0] and "metrics.jsonl" in said[0], said


def test_accuracy_change_gives_points_and_binomial_standard_error():
    from drafttrain.report import accuracy_change

    ch = accuracy_change({"eval_sampled_acc": 0.5, "eval_greedy_acc": 0.7}, {"eval_sampled_acc": 0.6,
                                                                             "eval_greedy_acc": 0.7}, 100)
    assert ch["eval_sampled_acc"]["change_pts"] == pytest.approx(10.0)
    assert ch["eval_sampled_acc"]["se_pts"] == pytest.approx(100 * ((0.25 + 0.24) / 100) ** 0.5)
    assert ch["eval_greedy_acc"] == {"change_pts": pytest.approx(0.0),
                                     "se_pts": pytest.approx(100 * (0.42 / 100) ** 0.5)}
    assert accuracy_change(None, {"eval_sampled_acc": 0.6}, 100) == {}  # no before: no change to give
    # four times the problems halve the error
    wide = accuracy_change({"a": 0.5}, {"a": 0.6}, 100)["a"]["se_pts"]
    assert accuracy_change({"a": 0.5}, {"a": 0.6}, 400)["a"]["se_pts"] == pytest.approx(wide / 2)
