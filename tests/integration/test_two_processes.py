"""The main job under `accelerate launch` with 2 processes (gloo, CPU), with the shipped DDP and DeepSpeed ZeRO-2
accelerate configs: killed with SIGKILL mid-run, then resumed by the same command, it loses no step and duplicates
none, and at the end both processes serve the same drafter version with equal weights (the job checks that with a
collective and says so). Under ZeRO-2 the checkpoint holds each process's optimizer shard."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from drafttrain.config import PROJECT_ROOT
from drafttrain.report import read_jsonl
from tests.integration.conftest import kill_at_checkpoint
from tests.integration.test_job import overrides



@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp2", "zero2"])
def test_two_processes_kill_and_resume_lose_no_step_and_end_with_equal_drafters(policy_dir, tmp_path, config):
    out, steps = tmp_path / "run", 6
    cmd = ["accelerate", "launch", "--config_file", f"recipes/accelerate/{config}.yaml", "drafttrain/online.py",
           "recipe=eagle3_track", *overrides(policy_dir, out, f"rl.steps={steps}", "online.budget_frac=0")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    latest = out / "ckpt" / "latest"
    kill_at_checkpoint(cmd, env, latest, 2, timeout_s=400, group=True)  # the launcher and both workers at once
    ckpt = out / "ckpt" / latest.read_text().strip()
    state = torch.load(ckpt / "state.pt", weights_only=False)
    step, version = state["step"], state["tracker"]["version"]
    assert 2 <= step < steps
    if config == "zero2":  # accelerate's save_state: the engine's weights and one optimizer shard per process
        shards = sorted(p.name for p in (ckpt / "trainer.ds").rglob("zero_pp_rank_*optim_states.pt"))
        assert len(shards) == 2, shards

    r = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=500)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"[drafttrain] resumed {out} at step {step}, drafter v{version}" in log
    recs = read_jsonl(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(steps))  # no lost or duplicated steps
    assert recs[step]["rollout_drafter_version"] == version
    final = recs[-1]["drafter_version"]
    assert final > version  # the resumed run trained and published on both processes
    assert f"[drafttrain] 2 processes agree: drafter v{final} on each, equal weights; equal policies" in log
    if config == "zero2":  # resumed under DDP: one line naming the cause, not a traceback from deep in a load
        cmd[3] = "recipes/accelerate/ddp2.yaml"
        r = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0
        assert "error: run.resume: trainer state" in r.stderr + r.stdout
        assert "saved with DeepSpeed, resumed without it" in r.stderr + r.stdout
