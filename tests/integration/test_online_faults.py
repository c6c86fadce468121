"""The main job's run folder under faults: checkpoints that would run code or are cut short, a second job in a held
folder, reruns of a finished run or with other settings, and stopping by signal or by the launcher's death."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from drafttrain.config import PROJECT_ROOT
from drafttrain.report import read_jsonl
from tests.integration.test_job import overrides
from tests.unit.test_runfolder import Touch, _holder


@pytest.fixture(scope="module")
def finished(policy_dir, tmp_path_factory):
    from drafttrain.online import cli

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("finished")
    cli(["recipe=eagle3_track", *overrides(policy_dir, out)])
    return out


@pytest.fixture
def run(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _files(root: Path) -> dict:
    return {p.relative_to(root): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _cli_error(policy_dir, out, *extra) -> str:
    from drafttrain.online import cli

    with pytest.raises(SystemExit) as e:
        cli(["recipe=eagle3_track", *overrides(policy_dir, out), *extra])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def _ckpt(out: Path, name: str) -> Path:
    return out / "ckpt" / (out / "ckpt" / "latest").read_text().strip() / name


@pytest.mark.parametrize("name", ["state.pt", "trainer.pt"])
def test_resume_refuses_a_checkpoint_that_would_run_code(run, policy_dir, tmp_path, name):
    marker = tmp_path / "ran"
    path = _ckpt(run, name)
    state = torch.load(path, weights_only=False)
    state["extra" if name == "trainer.pt" else "tracker"]["x"] = Touch(marker)
    torch.save(state, path)
    before = _files(run)
    msg = _cli_error(policy_dir, run)
    assert msg.startswith("error: run.resume: ") and str(path) in msg and "builtins.exec" in msg, msg
    assert not marker.exists() and _files(run) == before


@pytest.mark.parametrize("name", ["state.pt", "trainer.pt"])
def test_truncated_checkpoint_is_one_line_with_a_way_out(run, policy_dir, name):
    path = _ckpt(run, name)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = _files(run)
    msg = _cli_error(policy_dir, run)
    assert str(path) in msg and "truncated" in msg and "run.resume=false" in msg, msg
    assert _files(run) == before


def test_second_job_in_a_held_folder_fails_naming_the_holder(policy_dir, tmp_path):
    out = tmp_path / "run"
    p = _holder(out)
    try:
        msg = _cli_error(policy_dir, out)
    finally:
        p.stdin.close()
        p.wait()
    assert f"in use by another job (PID {p.pid})" in msg and "run.out_dir" in msg, msg
    assert [f.name for f in out.iterdir()] == [".lock"]  # nothing else written


def test_finished_run_is_left_untouched(run, policy_dir, capsys):
    from drafttrain.online import cli

    before = _files(run)
    cli(["recipe=eagle3_track", *overrides(policy_dir, run)])
    assert "holds a finished run (1 of 1 steps): nothing to do" in capsys.readouterr().out
    assert _files(run) == before  # no config, metrics, report or eval.json rewritten


def test_resume_with_other_settings_is_refused_listing_them(run, policy_dir):
    """The README's example rerun into the default run's folder: it resumed, trained nothing, and rewrote the run's
    config.yaml and eval.json."""
    before = _files(run)
    msg = _cli_error(policy_dir, run, "rl.steps=0", "engine.k=auto", "online.canary_prompts=3")
    assert msg.startswith("error: run.resume: ") and "other settings" in msg, msg
    assert "engine.k (5 -> 'auto')" in msg and "online.canary_prompts (2 -> 3)" in msg and "rl.steps (0 " in msg
    assert _files(run) == before


def test_raising_rl_steps_continues_a_finished_run(run, policy_dir):
    from drafttrain.config import load_recipe
    from drafttrain.rl.job import main

    recs = main(load_recipe("eagle3_track", overrides(policy_dir, run, "rl.steps=2")))
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1] and recs[-1]["step"] == 1


# ---- stopping: by signal, by the launcher's death ---------------------------------------------------------------
def _start(cmd, out: Path, at_step: int = 1, pipe=subprocess.PIPE) -> subprocess.Popen:
    """Starts the job; returns once its checkpoint has reached `at_step`."""
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=pipe,
                            stderr=pipe, text=True)
    latest, deadline = out / "ckpt" / "latest", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and int(latest.read_text().strip().split("-")[1]) >= at_step:
            return proc
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the job ended or stalled before step {at_step}: {(proc.communicate()[1] or '')[-2000:]}")


def _children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid]


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _rerun_and_check(cmd, out: Path, steps: int) -> None:
    r = subprocess.run(cmd, cwd=PROJECT_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == list(range(steps))  # each step once


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_at_a_step_boundary_with_one_line(policy_dir, tmp_path, sig):
    out, steps = tmp_path / "run", 5
    cmd = [sys.executable, "-m", "drafttrain.online", "recipe=eagle3_track",
           *overrides(policy_dir, out, f"rl.steps={steps}", "rl.eval_prompts=0")]
    proc = _start(cmd, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    stopped = [ln for ln in err.splitlines() if "[drafttrain] stopped" in ln]
    assert len(stopped) == 1 and sig.name in stopped[0], err[-2000:]
    at = int((out / "ckpt" / "latest").read_text().strip().split("-")[1])
    assert f"at step {at} of {steps}" in stopped[0] and at < steps
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == list(range(at))  # stopped after the checkpoint
    _rerun_and_check(cmd, out, steps)


@pytest.mark.slow
def test_job_does_not_outlive_its_launcher(policy_dir, tmp_path):
    """`accelerate launch ...`, then only the launcher killed: the job trained on with PPID 1, beside its rerun.
    (A SIGTERM ends accelerate's launcher as a SIGKILL does: the job sees its parent end either way.)"""
    out, steps = tmp_path / "run", 60  # an orphan runs all 60; steps take ~0.1 s, the watcher polls every 0.2 s
    args = ["recipe=eagle3_track", *overrides(policy_dir, out, f"rl.steps={steps}", "rl.eval_prompts=0")]
    launcher = _start([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "drafttrain/online.py", *args], out, pipe=subprocess.DEVNULL)
    (job,) = _children(launcher.pid)
    launcher.kill()
    launcher.wait()
    at_kill = _latest_step(out)
    deadline = time.time() + 180  # long enough for an orphan to finish the run
    while time.time() < deadline and Path(f"/proc/{job}").exists():
        time.sleep(0.1)
    alive = Path(f"/proc/{job}").exists()
    if alive:
        os.kill(job, signal.SIGKILL)
    assert not alive and _latest_step(out) < min(at_kill + 20, steps), "the job outlived its launcher"
    _rerun_and_check([sys.executable, "-m", "drafttrain.online", *args], out, steps)


def _latest_step(out: Path) -> int:
    return int((out / "ckpt" / "latest").read_text().strip().split("-")[1])
