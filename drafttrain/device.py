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
    launcher) when torch sees one; auto falls back to the CPU."""
    spec = str(spec).strip().lower()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda", local % n) if n else torch.device("cpu")
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


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
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
