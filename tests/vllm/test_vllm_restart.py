"""The main job on the vLLM engine when its worker process is killed mid-run (`kill -9` of VLLM::Worker): the job
builds a new engine, the step's record counts the restart, and every step runs once."""
from __future__ import annotations

import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.vllm


def _job_engines(since: float) -> list:
    """The VLLM engine processes started after `since`: the job's, not the session pool's warm engines."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "VLLM" in p.name() and p.create_time() >= since and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _kill_worker_after(latest, step: int, killed: list, since: float) -> None:
    deadline = time.time() + 300
    while time.time() < deadline:
        if latest.is_file() and latest.read_text().strip() == f"step-{step}":
            for p in _job_engines(since):
                try:
                    if p.name().startswith("VLLM::Worker"):
                        p.kill()
                        killed.append(p.pid)
                        return
                except psutil.Error:
                    pass
        time.sleep(0.05)


def test_a_killed_vllm_worker_is_restarted_and_each_step_runs_once(tmp_path, capsys):
    pytest.importorskip("vllm")
    from drafttrain.config import load_recipe
    from drafttrain.rl.job import main

    cfg = load_recipe("eagle3_track", ["engine.kind=vllm", "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=2",
                                       "sampling.max_new_tokens=16", "rl.eval_prompts=0", "run.tensorboard=false",
                                       f"run.out_dir={tmp_path}"])
    killed: list = []
    since = time.time()
    t = threading.Thread(target=_kill_worker_after, args=(tmp_path / "ckpt" / "latest", 1, killed, since),
                         daemon=True)
    t.start()
    recs = main(cfg)
    t.join()
    deadline = time.time() + 30  # the job closed its engine: none of the processes it started is left
    while _job_engines(since) and time.time() < deadline:
        time.sleep(0.5)
    assert not _job_engines(since), _job_engines(since)
    assert killed, "no VLLM::Worker process was found to kill"
    assert [r["step"] for r in recs] == [0, 1, 2] and sum(r["restarts"] for r in recs) == 1
    lines = [s for s in capsys.readouterr().out.splitlines() if "engine died" in s]
    assert len(lines) == 1 and f"(PID {killed[0]}) died" in lines[0] and "restarted" in lines[0], lines
