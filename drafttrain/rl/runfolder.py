"""What keeps a run folder whole: one job at a time (RunLock), a job that stops cleanly on SIGTERM/SIGINT and never
outlives the process that started it (Stopper), and atomic checkpoints with the resolved config, at a cadence, the
newest kept (Checkpointer); they are read back through drafttrain.checkpoint.load_checkpoint.

Every checkpoint is written to a temporary folder and renamed into place, so a job stopped at any moment leaves the
last complete one behind: stopping at once is always safe, stopping at a step boundary only saves the step's work.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
from omegaconf import OmegaConf

from drafttrain.checkpoint import SHARED
from drafttrain.device import device_rng_state
from drafttrain.config import ConfigError, key_docs


class RunStopped(Exception):
    """The run cannot go on: one line saying why, that the last checkpoint stands, and what to do (the main job's
    error line). Not a RuntimeError: nothing that handles an engine's or a drafter's RuntimeError may take it."""


class RunLock:
    """An exclusive flock on <out>/.lock, which holds the holder's PID. The kernel drops a flock when its holder
    dies, so a lock file left by a process that no longer exists is simply taken over."""

    def __init__(self, out: Path):
        self.path, self.fd, self.created = out / ".lock", None, False

    def acquire(self) -> None:
        import fcntl

        check_out_dir(self.path.parent)
        self.created = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"run.out_dir: {self.path.parent} is in use by another job (PID {holder}); wait for "
                              f"it to end or stop it, or choose another run.out_dir") from None
        if os.read(fd, 32).decode(errors="replace").strip() != str(os.getpid()):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Drops the lock; a folder this lock created and nothing else was written to (the job was refused before it
        began) is removed, so bad input leaves no trace."""
        if self.fd is not None:
            if self.created and [p.name for p in self.path.parent.iterdir()] == [self.path.name]:
                self.path.unlink(missing_ok=True)
                self.path.parent.rmdir()
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def lock_run_folder(out: Path, acc) -> RunLock | None:
    """The main process locks the folder; with N processes the others learn whether it could, and fail with it."""
    lock, err = None, ""
    if acc.is_main_process:
        lock = RunLock(out)
        try:
            lock.acquire()
        except ConfigError as e:
            lock, err = None, str(e)
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        err = broadcast_object_list([err])[0]
    if err:
        raise ConfigError(err)
    return lock


def launched() -> bool:
    """Was this process started by accelerate launch (its simple launcher always sets ACCELERATE_MIXED_PRECISION)
    or by torch's elastic launcher (LOCAL_RANK)?"""
    return "LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ


class Stopper:
    """SIGTERM or SIGINT stops the job at the next step boundary, after that step's checkpoint; a second signal, or
    one outside the RL loop, stops it at once. Started by a launcher (accelerate or torchrun), the job also stops at
    once when that launcher ends (a killed launcher must not leave it training), seen by a thread that polls the
    parent's PID; started from a shell (`python -m drafttrain.online`), it does not follow the shell (nohup works).
    Not PR_SET_PDEATHSIG: it fires when the parent *thread* ends, and under torch elastic a worker got it while its
    launcher was still alive. Each way out prints one line and exits with 128 + the signal."""

    def __init__(self, acc, out: Path):
        self.acc, self.ckpt_root = acc, out / "ckpt"
        self.signum: int | None = None
        self.in_loop, self.step = False, None
        self.parent = os.getppid()
        self._old: dict = {}
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> Stopper:
        if self.parent > 1 and launched():  # parent 1 (or 0): started detached, there is no launcher to follow
            self._watcher = threading.Thread(target=self._watch_parent, name="drafttrain-launcher-watch", daemon=True)
            self._watcher.start()
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._watcher is not None:  # joined: a daemon thread still running at interpreter exit, and dropping the
            self._watcher.join()  # last reference to the job's tensors there, aborts the process (C++ terminate)
            self._watcher = None
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _watch_parent(self) -> None:
        while not self._done.wait(0.2):
            if os.getppid() != self.parent:
                self._exit_now(signal.SIGTERM, f"its launcher, PID {self.parent}, ended")

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if os.getppid() != self.parent:
            self._exit_now(signum, f"its launcher, PID {self.parent}, ended")
        elif self.signum is not None or not self.in_loop:
            self._exit_now(signum, f"{name}{' again' if self.signum is not None else ''}")
        self.signum = signum

    def _exit_now(self, signum: int, why: str) -> None:
        latest = self.ckpt_root / "latest"
        last = f"{self.ckpt_root}/{latest.read_text().strip()}" if latest.is_file() else "none yet"
        where = f" during step {self.step}" if self.step is not None else ""
        self._say(f"[drafttrain] stopped ({why}){where}: the last checkpoint ({last}) stands; rerun the same "
                  f"command to resume", after_bar=self.in_loop)
        os._exit(128 + signum)  # nothing to finish: checkpoints are atomic, and waiting could hang on a gone peer

    def stop_requested(self) -> bool:
        """At a step boundary: did a signal arrive (on any process: they all stop at the same step)?"""
        flag = float(self.signum is not None)
        if self.acc.num_processes > 1:
            flag = float(self.acc.reduce(torch.tensor([flag], device=self.acc.device), "sum").item())
        return flag > 0

    def stop(self, step: int, steps: int) -> None:
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal to another process"
        self._say(f"[drafttrain] stopped by {name} at step {step} of {steps}: saved in {self.ckpt_root}/step-{step}; "
                  f"rerun the same command to resume")
        raise SystemExit(128 + (self.signum or signal.SIGTERM))

    def _say(self, msg: str, after_bar: bool = False) -> None:
        if self.acc.is_main_process:
            try:
                sys.stdout.flush()
                print(("\n" if after_bar else "") + msg, file=sys.stderr, flush=True)  # below the progress bar
            except (OSError, ValueError):  # the terminal went with the launcher
                pass


# keys a resumed run may change: the step budget (raising it continues a finished run), where and how it writes
# (checkpoints included: how often and how many change nothing the run computes)
FREE_ON_RESUME = ("rl.steps", "run.resume", "run.out_dir", "run.tensorboard", "run.checkpoint_every", "engine.urls",
                  "run.keep_checkpoints")


# keys a later version moved: a checkpoint written before keeps its settings under their new names
RENAMED = {f"drafter.{k}": f"drafter.{kind}.{k}" for kind, keys in (
    ("eagle3", ("aux_layer_ids", "draft_vocab_size", "intermediate_size")),
    ("selfquant", ("quant", "backend", "group_size"))) for k in keys}


def changed_settings(saved: dict, cfg, step: int) -> list[str]:
    """'key (saved -> now)' for each setting a resume would change, beyond FREE_ON_RESUME; rl.steps below the
    checkpoint's step too."""
    old = {RENAMED.get(k, k): v for k, v in _flat(saved).items()}
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    # a key the saved run did not have yet (added by a later version) at its default is no change
    new_default = {k for k, (v, _) in key_docs().items() if k not in old and k in now and now[k] == v}
    out = [f"{k} ({_short(old.get(k, '<absent>'))} -> {_short(now.get(k, '<absent>'))})"
           for k in sorted(old.keys() | now.keys())
           if k not in FREE_ON_RESUME and k not in new_default and (k not in old or k not in now or old[k] != now[k])]
    if cfg.rl.steps < step:
        out.append(f"rl.steps ({cfg.rl.steps} is below the checkpoint's step {step})")
    return out


def _flat(d: dict, pre: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}."))
        else:
            out[f"{pre}{k}"] = v
    return out


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class Checkpointer:
    """out/ckpt/step-N/ (policy, state.pt with the resolved config, trainer state), due after every
    run.checkpoint_every steps and after the last; `latest` names the last complete one, and `finished` names it once
    the run's outputs (report, eval) are written. The newest run.keep_checkpoints of the run's are kept, and any of
    them resumes exactly once named in `latest`. The frozen step-0 drafter, the same in every step of a run, is stored
    once beside them (frozen-<id>.pt, which each step's shared.json names)."""

    def __init__(self, out: Path, acc, run_cfg):
        self.root, self.acc = out / "ckpt", acc
        self.every, self.keep = run_cfg.checkpoint_every, run_cfg.keep_checkpoints
        self.base: int | None = None  # the step this job resumed at: the kept steps up to it are the run's
        self.written: set[int] = set()
        self.frozen_file: str | None = None  # this run's frozen drafter's file, once known

    def latest(self) -> Path | None:
        f = self.root / "latest"
        if not f.is_file():
            return None
        p = self.root / f.read_text().strip()
        return p if (p / "state.pt").is_file() else None

    def kept(self) -> list[Path]:
        """The complete checkpoints in the folder, oldest first."""
        steps = [p for p in self.root.glob("step-*") if p.name[5:].isdigit() and (p / "state.pt").is_file()]
        return sorted(steps, key=_step_of)

    def due(self, step: int, steps: int) -> bool:
        """Is a checkpoint written after `step` of `steps` steps?"""
        return step % self.every == 0 or step >= steps

    def resumed(self, last: Path) -> None:
        """This job resumes at `last`: the kept steps up to it are the run's, and so is its frozen drafter's file."""
        self.base = _step_of(last)
        shared = last / SHARED
        self.frozen_file = json.loads(shared.read_text()).get("run_frozen") if shared.is_file() else None

    def resume_hint(self, bad: Path) -> str:
        """What to do when checkpoint `bad` cannot be resumed: start over, or resume from another kept one."""
        others = [p.name for p in self.kept() if p.name != bad.name]
        if not others:
            return "set run.resume=false to start over"
        return (f"set run.resume=false to start over, or write the name of another kept checkpoint "
                f"({', '.join(others)}) into {self.root / 'latest'} to resume from it")

    def finished(self) -> bool:
        f, last = self.root / "finished", self.latest()
        return last is not None and f.is_file() and f.read_text().strip() == last.name

    def mark_finished(self) -> None:
        last = self.latest()
        if self.acc.is_main_process and last is not None:
            _write_atomic(self.root / "finished", last.name)

    def save(self, step: int, grpo, tracker, cfg, eval_before: dict | None) -> None:
        """Writes step-N whole, or not at all; a full disk is RunStopped, in one line, with the partial folder gone.
        Then the checkpoints beyond run.keep_checkpoints go."""
        tmp = self.root / f".tmp-step-{step}"
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        try:
            self._write(step, tmp, grpo, tracker, cfg, eval_before)
        except Exception as e:
            written = _du(tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
            full = self._no_space(e, step, written)
            if full:
                raise RunStopped(full) from None
            raise
        self.written.add(step)
        if self.acc.is_main_process:
            self._prune()
        self.acc.wait_for_everyone()

    def _no_space(self, e: BaseException, step: int, written: int) -> str | None:
        """The one line for a write that failed because the disk is full (ENOSPC anywhere in the chain, or less free
        than a checkpoint takes: torch.save reports a full disk as a bare RuntimeError); None for other failures."""
        chain, x = [], e
        while x is not None and len(chain) < 8:
            chain.append(x)
            x = x.__cause__ or x.__context__
        last = self.latest()
        need = _du(last) if last is not None else written  # the last one's size, or at least what was written
        free = shutil.disk_usage(self.root).free
        enospc = any(getattr(c, "errno", None) == errno.ENOSPC or "No space left" in str(c) for c in chain)
        if not enospc and free >= max(need, 1 << 20):
            return None
        about = f"about {need / 2 ** 20:.0f} MB ({need} bytes)" if last is not None else f"more than {need} bytes"
        return (f"run.out_dir: no space left on the device of {self.root} writing step-{step}: a checkpoint needs "
                f"{about}, {free} bytes are free; the partial checkpoint was removed and the last one "
                f"({last if last is not None else 'none yet'}) stands: free space and rerun the same command to "
                f"resume")

    def _write(self, step: int, tmp: Path, grpo, tracker, cfg, eval_before: dict | None) -> None:
        from drafttrain.policy import save_policy

        d = self.root / f"step-{step}"
        tracker.save_training(tmp)  # every process: its buffer shard
        if self.acc.is_main_process:
            save_policy(grpo.policy, grpo.tok, str(tmp / "policy"))
            frozen = self._frozen(tracker, tmp)
            torch.save({"step": step, "recipe": cfg.recipe, "config": OmegaConf.to_container(cfg, resolve=True),
                        "opt": grpo.opt.state_dict(), "rng": torch.get_rng_state(),
                        "device_rng": device_rng_state(grpo.device), "eval_before": eval_before,
                        "tracker": tracker.state_dict({"run_frozen": frozen, "policy": grpo.policy.state_dict()})},
                       tmp / "state.pt")
            if (tmp / self.frozen_file).is_file():  # the run's first checkpoint: its frozen drafter, beside it
                os.replace(tmp / self.frozen_file, self.root / self.frozen_file)
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)
            _write_atomic(self.root / "latest", d.name)

    def _frozen(self, tracker, tmp: Path) -> dict:
        """The frozen drafter's weights, named in the step's shared.json; written (into tmp) if the run has no file
        of them yet. Each run's file has a name of its own: a run started over keeps the old run's until it goes."""
        weights = tracker.frozen.state_dict()
        if self.frozen_file is None or not (self.root / self.frozen_file).is_file():
            self.frozen_file = self.frozen_file or f"frozen-{os.urandom(4).hex()}.pt"
            torch.save(weights, tmp / self.frozen_file)
        (tmp / SHARED).write_text(json.dumps({"run_frozen": self.frozen_file}) + "\n")
        return weights

    def _prune(self) -> None:
        """Keeps the newest run.keep_checkpoints of the run's checkpoints (those this job wrote, and those up to the
        step it resumed at); removes the rest (another run's, or those after a step restored by hand), temporary
        folders left by a kill, and frozen drafter files no kept step names."""
        base = self.base if self.base is not None else -1
        keep = [p for p in self.kept() if _step_of(p) in self.written or _step_of(p) <= base][-self.keep:]
        for p in [*self.root.glob("step-*"), *self.root.glob(".tmp-step-*")]:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
        named = {f for p in keep if (p / SHARED).is_file() for f in json.loads((p / SHARED).read_text()).values()}
        for f in self.root.glob("frozen-*.pt"):
            if f.name not in named:
                f.unlink(missing_ok=True)


def _step_of(folder: Path) -> int:
    return int(folder.name.split("-")[-1])


def _du(folder: Path) -> int:
    """Bytes of the files under a folder."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_out_dir(out_dir: str | Path) -> None:
    """run.out_dir must be a folder, or one that can be made: its nearest existing ancestor a writable folder."""
    p = Path(out_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"run.out_dir: {p} exists and is not a folder")
    q = p.absolute()
    while not q.exists():
        q = q.parent
    if not q.is_dir():
        raise ConfigError(f"run.out_dir: cannot make {p}: {q} is a file")
    if not os.access(q, os.W_OK | os.X_OK):
        raise ConfigError(f"run.out_dir: cannot write into {q}")
