"""DeepSpeed ZeRO-2 through accelerate on 2 CPU processes (gloo), with the shipped recipes/accelerate configs:
pretrain_drafter under ZeRO-2 ends on the weights a DDP run reaches from the same data (within float tolerance),
also when stopped and resumed through accelerate's save_state; each process holds less optimizer state; a step that
is non-finite on one process is skipped on both; weights set from outside survive the next step.
(The main job under ZeRO-2, killed and resumed: test_two_processes.py.)"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.config import PROJECT_ROOT


def _launch(config: str, script: str, *args: str) -> str:
    cmd = ["accelerate", "launch", "--config_file", f"recipes/accelerate/{config}.yaml", script, *args]
    r = subprocess.run(cmd, cwd=PROJECT_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


@pytest.mark.slow
def test_zero2_pretrain_matches_ddp_resumes_and_shards_the_optimizer(policy_dir, tmp_path):
    args = [f"policy.path={policy_dir}", "sampling.max_new_tokens=12", "train.batch_size=2", "prompts=16", "chunk=8",
            "bucket=4", "warmup=1", "threads=1"]
    script = "scripts/pretrain_drafter.py"
    _launch("ddp2", script, *args, f"out={tmp_path / 'ddp'}", "max_steps=6")
    _launch("zero2", script, *args, f"out={tmp_path / 'zero'}", "max_steps=3")
    state = tmp_path / "zero.state" / "trainer.ds"
    assert len(list(state.rglob("zero_pp_rank_*optim_states.pt"))) == 2  # one optimizer shard per process
    assert not (tmp_path / "zero.state" / "trainer.pt").exists()
    log = _launch("zero2", script, *args, f"out={tmp_path / 'zero'}", "max_steps=6")
    assert "resumed from" in log and "at step 3" in log
    a, b = load_file(tmp_path / "ddp" / "model.safetensors"), load_file(tmp_path / "zero" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    mb = {name: json.loads((tmp_path / name / "config.json").read_text())["drafttrain"]["extra"]["pretrain"]
          ["optimizer_state_mb"] for name in ("ddp", "zero")}
    assert len(mb["ddp"]) == len(mb["zero"]) == 2
    # DDP: both AdamW moments of every weight on each process; ZeRO-2: half of them plus a half fp32 master copy
    for d, z in zip(mb["ddp"], mb["zero"]):
        assert 0.6 * d < z < 0.85 * d, mb


@pytest.mark.slow
def test_zero2_skips_a_step_nonfinite_on_one_process_and_keeps_weights_set_from_outside(policy_dir, tmp_path):
    _launch("zero2", "tests/integration/zero_worker.py", str(policy_dir), str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["deepspeed"] and not r["first_nonfinite"] and r["first_moved"] > 0
        assert r["second_nonfinite"] and r["second_moved"] == 0  # NaN on process 1 only: skipped on both
        assert r["after_set_weights_moved"] == 0  # not written back over by DeepSpeed's fp32 master copy
        assert r["steps"] == 2
    assert res[0]["weight_sum"] == res[1]["weight_sum"]
