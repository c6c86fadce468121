"""The main job under faults that are not the user's input: a policy that collapses or diverges, a full disk, and a
rollout engine that dies (simulated in the embedded engine). Each ends in one line, or is recovered from, and the
run folder stays resumable."""
from __future__ import annotations

import math

import pytest
import torch

from drafttrain.report import read_jsonl
from tests.integration.test_job import overrides

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli_error(*args) -> str:
    from drafttrain.online import cli

    with pytest.raises(SystemExit) as e:
        cli(["recipe=eagle3_track", *args])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


# ---- a policy that collapses or diverges ----------------------------------------------------------------------
def test_a_reward_of_0_on_every_row_is_warned_in_one_line(policy_dir, tmp_path, capsys):
    from drafttrain.online import cli

    cli(["recipe=eagle3_track", *overrides(policy_dir, tmp_path, "rl.steps=2", "rl.collapse_steps=2",
                                           "rl.eval_prompts=0")])  # a random policy: never the right answer
    lines = [s for s in capsys.readouterr().out.splitlines() if "reward has been 0 on every row" in s]
    assert len(lines) == 1 and "rl.collapse_steps=2 steps (steps 0-1)" in lines[0], lines


def test_a_non_finite_gradient_stops_at_the_last_checkpoint_in_one_line(policy_dir, tmp_path, monkeypatch):
    calls, clip = [], torch.nn.utils.clip_grad_norm_

    def nan_at_step_1(params, *a, **kw):
        calls.append(1)
        norm = clip(params, *a, **kw)
        return torch.tensor(math.nan) if len(calls) == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_at_step_1)
    msg = _cli_error(*overrides(policy_dir, tmp_path, "rl.steps=3", "rl.eval_prompts=0"))
    assert msg.startswith("error: rl.lr: the policy's gradient norm is nan at step 1") and "not taken" in msg, msg
    assert f"the last checkpoint ({tmp_path / 'ckpt' / 'step-1'}) stands" in msg, msg
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]


# ---- a full disk --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["enospc", "torch"])
def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(policy_dir, tmp_path, monkeypatch, how):
    """At step 2's checkpoint the disk fills: as OSError ENOSPC (safetensors, open, write) or as torch.save's own
    RuntimeError, with the free space below a checkpoint's size. A rerun, space freed, resumes exactly."""
    import errno
    import shutil

    from drafttrain.online import cli

    save, usage = torch.save, shutil.disk_usage

    def full_at_step_2(obj, f, *a, **kw):
        if ".tmp-step-2" in str(f):
            open(f, "wb").write(b"partial")
            if how == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    if how == "torch":
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=4096))
    args = overrides(policy_dir, tmp_path, "rl.steps=3", "rl.eval_prompts=0")
    msg = _cli_error(*args)
    ckpt = tmp_path / "ckpt"
    assert msg.startswith(f"error: run.out_dir: no space left on the device of {ckpt} writing step-2"), msg
    assert "bytes" in msg and f"the last one ({ckpt / 'step-1'}) stands" in msg and "free space and rerun" in msg
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-1"]  # the partial folder is gone
    monkeypatch.undo()
    cli(["recipe=eagle3_track", *args])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]  # each step once
