"""The run folder's guards without running a job: checkpoint reads that run no code, the folder lock (one holder, a
stale lock taken over, every process failing with the main one), and the settings a resume may not change."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from drafttrain.config import ConfigError, load_recipe
from drafttrain.checkpoint import CheckpointError, load_checkpoint
from drafttrain.rl.runfolder import RunLock, Stopper, changed_settings, lock_run_folder


class Touch:
    """Unpickling it runs code: it creates the file at `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


def test_checkpoint_with_code_in_its_pickle_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "state.pt"
    torch.save({"step": 1, "tracker": {"x": Touch(marker)}}, path)
    torch.load(path, weights_only=False)  # the trap works: an unsafe load runs it
    assert marker.is_file()
    marker.unlink()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert str(path) in msg and "builtins.exec" in msg and "\n" not in msg, msg
    assert not marker.exists()


def test_checkpoint_of_plain_state_loads_exactly(tmp_path):
    state = {"step": 3, "opt": {"state": {0: {"exp_avg": torch.randn(4)}}, "param_groups": [{"lr": 1e-3}]},
             "rng": torch.get_rng_state(), "w": OrderedDict(a=torch.ones(2, dtype=torch.bfloat16)),
             "flags": [True, None, 1.5, "x"], "ids": torch.arange(3), "mask": torch.ones(2, dtype=torch.bool)}
    torch.save(state, tmp_path / "s.pt")
    got = load_checkpoint(tmp_path / "s.pt")
    assert torch.equal(got["rng"], state["rng"]) and got["flags"] == state["flags"]
    assert torch.equal(got["opt"]["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])
    assert got["w"]["a"].dtype == torch.bfloat16


@pytest.mark.parametrize("how", ["truncated", "empty", "garbled"])
def test_unreadable_checkpoint_is_one_line_naming_it(tmp_path, how):
    path = tmp_path / "trainer.pt"
    torch.save({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbled": data[:200] + b"x" * 500}[how])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


HOLD = ("import sys; from pathlib import Path; from drafttrain.rl.runfolder import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); sys.stdin.read()")


def _holder(out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert p.stdout.readline().strip() == "locked"
    return p


def test_lock_held_by_a_live_process_names_it_and_a_dead_ones_is_taken(tmp_path):
    out = tmp_path / "run"
    p = _holder(out)
    try:
        with pytest.raises(ConfigError) as e:
            RunLock(out).acquire()
        assert f"PID {p.pid}" in str(e.value) and "run.out_dir" in str(e.value)
    finally:
        p.stdin.close()
        p.wait()
    assert (out / ".lock").read_text().strip() == str(p.pid)  # its holder is gone: the lock is stale
    lock = RunLock(out)
    lock.acquire()
    assert (out / ".lock").read_text().strip() == str(os.getpid())
    lock.release()


def _rank_lock(rank: int, out: str, port: int, result: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from accelerate import Accelerator, InitProcessGroupKwargs

    from drafttrain.tracking.collective import Collective

    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    try:
        lock_run_folder(Path(out), acc)
        msg = "locked"
    except ConfigError as e:
        msg = str(e)
    Path(f"{result}.{rank}").write_text(msg)
    Collective(acc).settle()  # as the main job ends: see Collective.settle
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_every_process_fails_when_the_main_one_cannot_lock(tmp_path):
    """Only the main process takes the lock; under N processes the others fail with it, instead of running on."""
    import socket

    out = tmp_path / "run"
    p = _holder(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_lock, args=(r, str(out), port, str(tmp_path / "res"))) for r in range(2)]
    try:
        for q in procs:
            q.start()
        deadline = time.monotonic() + 120
        for q in procs:
            q.join(max(1.0, deadline - time.monotonic()))
    finally:
        for q in procs:
            if q.is_alive():
                q.kill()
        p.stdin.close()
        p.wait()
    msgs = [(tmp_path / f"res.{r}").read_text() for r in range(2)]
    assert all(f"PID {p.pid}" in m for m in msgs), msgs


def test_changed_settings_lists_the_keys_a_resume_would_change():
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(load_recipe("eagle3_track", ["rl.steps=60"]), resolve=True)
    assert changed_settings(saved, load_recipe("eagle3_track", ["rl.steps=80", "run.out_dir=/x"]), 60) == []
    got = changed_settings(saved, load_recipe("eagle3_track", ["rl.steps=10", "engine.k=auto"]), 60)
    assert got == ["engine.k (5 -> 'auto')", "rl.steps (10 is below the checkpoint's step 60)"]


def test_a_checkpoint_from_before_a_new_key_resumes_when_the_key_is_at_its_default():
    """A run checkpointed by a version without the data.* / reward.* sections (or any later key) resumed with them
    at their defaults: refused before ("data.path (<absent> -> None)"), though nothing a resume would change."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(load_recipe("eagle3_track", ["rl.steps=60"]), resolve=True)
    del saved["data"], saved["reward"], saved["online"]["min_steps_per_update"]
    assert changed_settings(saved, load_recipe("eagle3_track", ["rl.steps=80"]), 60) == []
    got = changed_settings(saved, load_recipe("eagle3_track", ["rl.steps=80", "reward.fn=m:f"]), 60)
    assert got == ["reward.fn ('<absent>' -> 'm:f')"]


def test_a_checkpoint_from_before_the_per_kind_drafter_sections_resumes_under_the_new_names():
    """drafter.quant / .backend / .group_size became drafter.selfquant.*, drafter.aux_layer_ids and the EAGLE-3 sizes
    drafter.eagle3.*: a checkpoint with the old names and the same values resumes; other values are named."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(load_recipe("selfdraft_int4_track", ["rl.steps=60"]), resolve=True)
    d = saved["drafter"]
    d.update(d.pop("selfquant"), **d.pop("eagle3"))  # as the old flat section held them
    assert "quant" in d and "aux_layer_ids" in d
    assert changed_settings(saved, load_recipe("selfdraft_int4_track", ["rl.steps=80"]), 60) == []
    got = changed_settings(saved, load_recipe("selfdraft_int4_track", ["rl.steps=80", "drafter.selfquant.quant=int8"]),
                           60)
    assert got == ["drafter.selfquant.quant ('int4' -> 'int8')"]


def test_a_job_started_from_a_shell_outlives_the_shell(tmp_path):
    """Only a launcher's child follows its parent: `nohup python -m drafttrain.online ... &` must survive logout.
    A middle process starts the job (no launcher variables) and exits; the job must still be running after it."""
    alive, started = tmp_path / "alive", tmp_path / "started"
    job = ("import os, sys, time\n"
           "from pathlib import Path\n"
           "from drafttrain.rl.runfolder import Stopper\n"
           "class Acc: num_processes, is_main_process = 1, True\n"
           f"with Stopper(Acc(), Path({str(tmp_path)!r})):\n"
           f"    Path({str(started)!r}).touch()\n"
           "    time.sleep(2.5)\n"
           f"    Path({str(alive)!r}).write_text(str(os.getppid()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION")}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    middle = ("import os, subprocess, sys, time\n"  # exits once the job follows (or not) this, its parent
              f"subprocess.Popen([sys.executable, '-c', {job!r}], start_new_session=True)\n"
              f"while not os.path.exists({str(started)!r}): time.sleep(0.05)\n")
    subprocess.run([sys.executable, "-c", middle], env=env, check=True, timeout=60)
    deadline = time.time() + 30
    while not alive.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert alive.exists(), "the job stopped when the process that started it ended"


def test_the_launcher_watch_ends_with_the_stopper(monkeypatch, tmp_path):
    """A launched job's watcher thread is gone when the Stopper's block ends. One that outlives it wakes during
    interpreter exit and drops the job's last references there, freeing tensors, which aborts the process ("terminate
    called without an active exception", SIGABRT after a finished run: 3 of 8 two-process smoke runs)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(os, "getppid", lambda: 4242)  # a launcher that stays (pytest itself may have PPID 1)

    class Acc:
        num_processes, is_main_process = 1, True

    before = set(threading.enumerate())
    with Stopper(Acc(), tmp_path):
        started = set(threading.enumerate()) - before
        assert len(started) == 1, started  # launched: one thread follows the launcher
    assert [t for t in started if t.is_alive()] == []


def test_checkpoint_settings_may_change_on_resume():
    """How often and how many checkpoints change nothing a run computes: a resume may change them."""
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(load_recipe("eagle3_track", ["rl.steps=60"]), resolve=True)
    now = load_recipe("eagle3_track", ["rl.steps=60", "run.checkpoint_every=10", "run.keep_checkpoints=5"])
    assert changed_settings(saved, now, 60) == []


# ---- weight sets stored once, the checkpoints kept ----------------------------------------------------------
def test_equal_weights_are_stored_once_and_given_back_whole(tmp_path):
    from drafttrain.checkpoint import share, unshare

    g = torch.Generator().manual_seed(0)
    emb, w1, w2 = (torch.randn(64, 64, generator=g) for _ in range(3))
    run = {"emb": emb.clone(), "w": w1.clone()}  # stored elsewhere
    sets = {"a": {"emb": emb.clone(), "w": w2.clone()}, "b": {"emb": emb.clone(), "w": w2.clone()},
            "c": {"emb": emb.clone(), "w": w1 + 1}, "none": None}
    packed = share(sets, {"run": run})
    assert packed["a"]["emb"] == "run" and torch.is_tensor(packed["a"]["w"]) and packed["none"] is None
    assert packed["b"] == {"emb": "run", "w": "a"} and torch.is_tensor(packed["c"]["w"])
    torch.save(packed, tmp_path / "s.pt")
    assert (tmp_path / "s.pt").stat().st_size < 2.2 * w1.numel() * 4  # two distinct tensors, not eight
    got = unshare(load_checkpoint(tmp_path / "s.pt"), {"run": run})
    assert got["none"] is None
    for name in ("a", "b", "c"):
        assert all(torch.equal(got[name][k], sets[name][k]) for k in ("emb", "w")), name
    got["a"]["w"].zero_()  # each set its own tensors, as before
    assert torch.equal(got["b"]["w"], w2) and torch.equal(run["emb"], emb)
    with pytest.raises(CheckpointError, match="refer to run, which is missing"):
        unshare(load_checkpoint(tmp_path / "s.pt"))


class _Acc:
    num_processes, is_main_process = 1, True

    def wait_for_everyone(self):
        pass


def _checkpointer(out: Path, keep: int, every: int = 1):
    from types import SimpleNamespace

    from drafttrain.rl.runfolder import Checkpointer

    return Checkpointer(out, _Acc(), SimpleNamespace(checkpoint_every=every, keep_checkpoints=keep))


def _step(out: Path, n: int, frozen: str) -> None:
    d = out / "ckpt" / f"step-{n}"
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(b"x")
    (d / "shared.json").write_text(f'{{"run_frozen": "{frozen}"}}')
    (out / "ckpt" / frozen).write_bytes(b"x")


def test_the_newest_checkpoints_of_the_run_are_kept_and_the_rest_go(tmp_path):
    """Resumed at step 4 (its frozen drafter's file: a), the run writes step 5: step 4 and 5 are kept (2), steps 1
    and 2 are older, step 6 was written after step 4 before it was restored by hand, the temporary folder was left by
    a kill, and the frozen file b is no kept step's."""
    out = tmp_path / "run"
    for n, f in ((1, "frozen-a.pt"), (2, "frozen-b.pt"), (4, "frozen-a.pt"), (6, "frozen-a.pt"), (5, "frozen-a.pt")):
        _step(out, n, f)
    (out / "ckpt" / ".tmp-step-7").mkdir()
    ck = _checkpointer(out, keep=2)
    ck.resumed(out / "ckpt" / "step-4")
    assert ck.frozen_file == "frozen-a.pt"
    ck.written.add(5)
    ck._prune()
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["frozen-a.pt", "step-4", "step-5"]


def test_a_run_started_over_keeps_none_of_the_old_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    for n in (3, 6):
        _step(out, n, "frozen-old.pt")
    _step(out, 1, "frozen-new.pt")
    ck = _checkpointer(out, keep=3)  # not resumed (run.resume=false)
    ck.written.add(1)
    ck._prune()
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["frozen-new.pt", "step-1"]


def test_a_checkpoint_is_due_at_the_cadence_and_after_the_last_step(tmp_path):
    ck = _checkpointer(tmp_path, keep=2, every=3)
    assert [n for n in range(1, 8) if ck.due(n, 7)] == [3, 6, 7]
    assert [n for n in range(1, 4) if _checkpointer(tmp_path, keep=2).due(n, 3)] == [1, 2, 3]


def test_the_resume_hint_names_the_other_kept_checkpoints(tmp_path):
    out = tmp_path / "run"
    ck = _checkpointer(out, keep=3)
    _step(out, 2, "frozen-a.pt")
    assert ck.resume_hint(out / "ckpt" / "step-2") == "set run.resume=false to start over"
    for n in (4, 6):
        _step(out, n, "frozen-a.pt")
    hint = ck.resume_hint(out / "ckpt" / "step-6")
    assert hint.endswith(f"another kept checkpoint (step-2, step-4) into {out / 'ckpt' / 'latest'} to resume from it")
