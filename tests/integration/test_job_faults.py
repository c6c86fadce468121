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
    left = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("frozen-"))  # the run's frozen drafter
    assert left == ["latest", "step-1"]  # the partial folder is gone
    monkeypatch.undo()
    cli(["recipe=eagle3_track", *args])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]  # each step once


# ---- a rollout engine that dies -------------------------------------------------------------------------------
class Dying:
    """An engine whose process 'dies' at the at-th call of `method`: that call and every later one raise
    EngineDied, as the vLLM engine's calls do once its worker is killed."""

    def __init__(self, engine, method: str, at: int):
        self.inner, self.method, self.at, self.calls, self.dead = engine, method, at, 0, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def drafter_version(self):
        return self.inner.drafter_version

    def _call(self, name, *args, **kwargs):
        from drafttrain.engines import EngineDied

        self.calls += name == self.method
        self.dead |= self.calls == self.at and name == self.method
        if self.dead:
            raise EngineDied("simulated: the engine's process was killed")
        return getattr(self.inner, name)(*args, **kwargs)

    def generate(self, *a, **kw):
        return self._call("generate", *a, **kw)

    def load_drafter(self, *a, **kw):
        return self._call("load_drafter", *a, **kw)

    def update_policy(self, *a, **kw):
        return self._call("update_policy", *a, **kw)


def _dying_engines(monkeypatch, method: str, at: int, again: bool = False) -> list:
    """The job's engine dies at the at-th call of `method`; each rebuilt one (listed) is healthy, or, with `again`,
    dies at its first call of `method`."""
    from drafttrain.rl import job, restart

    built, build = [], job.build_engine
    monkeypatch.setattr(job, "build_engine", lambda *a, **kw: Dying(build(*a, **kw), method, at))
    monkeypatch.setattr(restart, "build_engine",
                        lambda *a, **kw: built.append(Dying(build(*a, **kw), method, 1 if again else 0)) or built[-1])
    return built


@pytest.mark.parametrize("method, at", [("update_policy", 2), ("generate", 3), ("load_drafter", 1)])
def test_a_dead_engine_is_restarted_and_the_run_is_the_same(policy_dir, tmp_path, monkeypatch, capsys, method, at):
    """The engine dies in step 1 (pushing the policy, generating step 2's rollouts) or at the first drafter swap:
    a new engine serves the current policy and the served drafter version, the call runs again, one line says so,
    the step's record counts 1 restart, and the run ends as one with no death."""
    from drafttrain.config import load_recipe
    from drafttrain.rl.job import main

    keys = ["rl.steps=3", "rl.eval_prompts=0", "online.budget_frac=0"]
    ref = main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path / "ref", *keys)))
    ref_policy = torch.load(tmp_path / "ref" / "ckpt" / "step-3" / "state.pt", weights_only=True)["opt"]
    built = _dying_engines(monkeypatch, method, at)
    recs = main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path / "run", *keys)))
    lines = [s for s in capsys.readouterr().out.splitlines() if "engine died" in s]
    assert len(built) == 1 and len(lines) == 1, lines
    assert f"the torch engine died during {method} in step" in lines[0] and "restarted" in lines[0]
    assert sum(r["restarts"] for r in recs) == 1 and all(r["restarts"] in (0, 1) for r in recs)
    assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref]
    assert [r["drafter_version"] for r in recs] == [r["drafter_version"] for r in ref]
    assert built[0].drafter_version == recs[-1]["drafter_version"]  # the served version, swapped into the new one
    got = torch.load(tmp_path / "run" / "ckpt" / "step-3" / "state.pt", weights_only=True)["opt"]
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(got["state"].values(),
                                                                       ref_policy["state"].values()))


def test_a_second_death_in_the_same_step_stops_in_one_line(policy_dir, tmp_path, monkeypatch):
    _dying_engines(monkeypatch, "update_policy", 2, again=True)
    msg = _cli_error(*overrides(policy_dir, tmp_path, "rl.steps=3", "rl.eval_prompts=0"))
    assert msg.startswith("error: engine.kind=torch: the torch engine died again in step 1"), msg
    assert f"the last checkpoint ({tmp_path / 'ckpt' / 'step-1'}) stands" in msg
