"""The main job's command line: --help / -h print the usage, and bad input that ended in a traceback ends in one
line naming the key or the file (a damaged policy checkpoint, rows too short for the task, run.out_dir an existing
file, an empty drafter.path), with nothing written. Under `accelerate launch -q` no accelerate traceback follows."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from drafttrain.config import PROJECT_ROOT, RECIPES_DIR



@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage(capsys, flag):
    from drafttrain.online import cli

    cli(["recipe=eagle3_frozen", flag, "engine.kind=tpu"])  # help wins over whatever else is on the line
    out = capsys.readouterr().out
    assert out.startswith("usage: accelerate launch") and "python -m drafttrain.online" in out
    assert all(f"  {p.stem} " in out for p in RECIPES_DIR.glob("*.yaml"))
    assert "  train.max_grad_norm=1.0 " in out and "  run.out_dir=runs/${recipe} " in out


def _accelerate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "drafttrain/online.py", *args]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_accelerate_launch_passes_help_to_the_script_and_q_drops_its_traceback():
    r = _accelerate("--help")  # after the script's path, --help is the script's
    assert r.returncode == 0 and r.stdout.startswith("usage: accelerate launch"), (r.stdout + r.stderr)[-2000:]
    r = _accelerate("engine.kind=tpu")
    assert r.returncode != 0
    assert "error: engine.kind: " in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def _damaged(policy_dir, tmp_path):
    import shutil

    bad = tmp_path / "policy"
    shutil.copytree(policy_dir, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    return bad


@pytest.mark.parametrize("case", ["policy_truncated", "max_len", "out_dir_file", "drafter_path_empty"])
def test_bad_input_is_one_line_naming_it(policy_dir, tmp_path, case):
    from drafttrain.online import cli

    out = tmp_path / "run"
    (tmp_path / "notes.md").write_text("a file\n")
    args, expect = {
        "policy_truncated": ([f"policy.path={_damaged(policy_dir, tmp_path)}"], "model.safetensors"),
        "max_len": (["engine.max_len=8"], "engine.max_len"),
        "out_dir_file": ([f"run.out_dir={tmp_path / 'notes.md'}"], "run.out_dir"),
        "drafter_path_empty": (["drafter.path="], "drafter.path"),
    }[case]
    over = [f"policy.path={policy_dir}", "drafter.path=null", "rl.steps=1", "rl.prompts_per_step=2",
            "rl.group_size=2", "sampling.max_new_tokens=16", "rl.eval_prompts=0", "run.tensorboard=false",
            f"run.out_dir={out}"]
    with pytest.raises(SystemExit) as e:
        cli([*over, *args])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and expect in msg, msg
    assert not out.exists()  # refused before anything was written
    assert (tmp_path / "notes.md").read_text() == "a file\n"
