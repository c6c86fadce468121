"""One device per process (run.device): which one a run uses, and clocks that wait for it.

    dev = resolve_device("auto")          # cuda:<LOCAL_RANK> when torch sees a GPU, else cpu
    with DeviceTimer(dev) as t: work()    # t.seconds: the device's work, not the kernel launches
    seconds = now(dev)                    # perf_counter after the device's queued work has finished

Everything a run holds (policy, drafters, buffer indices, engine caches, generators) lives on the resolved device;
host memory is named `device="cpu"` where it is meant. A bad spec (no GPU, or an index past the GPUs there) is a
one-line error naming the key.
"""
from __future__ import annotations

import os
import time

import torch

KEY = "run.device"


def resolve_device(spec: str = "auto", key: str = KEY) -> torch.device:
    """auto | cpu | cuda | cuda:N -> torch.device. auto and cuda take the process's local GPU (LOCAL_RANK under a
    launcher) when torch sees one; auto falls back to the CPU, also under an accelerate config with use_cpu (its
    processes are CPU processes: recipes/accelerate/ddp2.yaml), which cuda is refused under."""
    spec = str(spec).strip().lower()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cpu_launch = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")
    if spec == "cpu" or (spec == "auto" and cpu_launch):
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda", local % n) if n else torch.device("cpu")
    if cpu_launch and (spec == "cuda" or spec.startswith("cuda:")):
        raise ValueError(f"{key}: {spec} asked for, but the accelerate config launched CPU processes (use_cpu): "
                         f"launch with a GPU config (accelerate launch --multi_gpu --num_processes N ...) or use cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not n:
            raise ValueError(f"{key}: {spec} asked for, but torch sees no CUDA GPU here "
                             f"(torch {torch.__version__}, cuda build: {torch.version.cuda is not None}); use cpu or auto")
        index = local if spec == "cuda" else spec.split(":", 1)[1]
        if not str(index).isdigit():
            raise ValueError(f"{key}: must be auto, cpu, cuda or cuda:N, got {spec!r}")
        if int(index) >= n:
            raise ValueError(f"{key}: {spec if spec != 'cuda' else f'cuda (local rank {index})'} asked for, "
                             f"but this machine has {n} CUDA GPU(s): cuda:0..cuda:{n - 1}")
        return torch.device("cuda", int(index))
    raise ValueError(f"{key}: must be auto, cpu, cuda or cuda:N, got {spec!r}")


def valid_spec(spec: str) -> bool:
    """The spec's form alone (config validation runs where no GPU may be: resolve_device checks the machine)."""
    s = str(spec).strip().lower()
    return s in ("auto", "cpu", "cuda") or (s.startswith("cuda:") and s[5:].isdigit())


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (a no-op on the CPU); None: the current CUDA device's, once CUDA is in use."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """perf_counter once the device's queued work has finished: the clock of every timing that decides something
    (the schedule's calibration, the toggle, the time bank) or that a benchmark reports."""
    synchronize(device)
    return time.perf_counter()


class DeviceTimer:
    """`with DeviceTimer(dev) as t: ...` -> t.seconds, synchronized at both ends."""

    def __init__(self, device: torch.device | str | None = None):
        self.device, self.seconds = device, 0.0

    def __enter__(self) -> "DeviceTimer":
        self._t0 = now(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = now(self.device) - self._t0


def module_device(module) -> torch.device:
    """The device of a module's first parameter or buffer (the CPU for one with neither)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    """batch's tensors moved to device, in place (copies from pinned host memory do not block); returns batch."""
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.device != device:
            batch[k] = v.to(device, non_blocking=True)
    return batch


def generator_state(gen: torch.Generator) -> dict:
    """A generator's state with the kind of device it came from (load_generator_state checks it)."""
    return {"device": gen.device.type, "state": gen.get_state()}


def load_generator_state(gen: torch.Generator, saved, what: str) -> str | None:
    """Restore saved (generator_state's dict, or an older bare state: a CPU generator's) into gen. A CPU and a CUDA
    generator's states do not convert: gen then keeps its seed and the one line returned says so."""
    saved_on, state = (saved["device"], saved["state"]) if isinstance(saved, dict) else ("cpu", saved)
    if saved_on != gen.device.type:
        return (f"{what}: the checkpoint's random state is a {saved_on} generator's and this run's is on "
                f"{gen.device.type}: it cannot move between them, so these draws restart from the seed (weights, "
                f"optimizer and buffer are restored exactly)")
    gen.set_state(state)
    return None


def device_rng_state(device: torch.device) -> dict | None:
    """The device's own random state (CUDA's; None on the CPU, whose state torch.get_rng_state holds)."""
    device = torch.device(device)
    return {"device": "cuda", "state": torch.cuda.get_rng_state(device)} if device.type == "cuda" else None


def load_device_rng_state(saved: dict | None, device: torch.device, what: str = "run.device") -> str | None:
    """device_rng_state's back on a device of the same kind; written on another kind: None is restored and the one
    line returned says what that changes."""
    device = torch.device(device)
    have = saved["device"] if saved else "cpu"
    if have != device.type:
        return (f"{what}: the checkpoint was written on {have}, this run is on {device.type}: the {have} random "
                f"state does not move to {device.type}, so sampling on it restarts from the seed (weights, optimizers, "
                f"buffer, steps and the CPU random state resume exactly)")
    if saved:
        torch.cuda.set_rng_state(saved["state"], device)
    return None
