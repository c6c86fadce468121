"""Device bugs without a GPU: tensors that drafttrain creates without naming a device land on `meta`.

    with models_on_cpu_tensors_on_meta():
        engine.generate(...)        # a tensor made with no device meets the CPU model: fails at once

A tensor born without a device is on the CPU by default: on a CUDA run it then meets CUDA tensors and fails (or
silently runs on the host). Here the models live on the CPU and every factory call made from drafttrain's own code
without a device goes to `meta` instead, so the same bug fails on this CPU. Library code keeps host tensors on
purpose (AdamW's step counter), so only calls whose nearest caller outside torch is drafttrain are redirected,
module construction included (a module built in drafttrain's code must be moved to the run's device). A generator on
one device used to draw on another fails too (a CPU generator meeting a CUDA draw is the same bug).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import drafttrain

OURS = str(Path(drafttrain.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
# torch code that drafttrain calls and whose tensors are the caller's to place (module construction, parameter init)
PLACED_BY_CALLER = ("/nn/modules/", "/nn/init.py", "/nn/parameter.py")


def _from_ours() -> str | None:
    """drafttrain's frame (file:line) that made this call, or None when other code did."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name == __file__ or name.endswith(("torch/overrides.py", "torch/utils/_device.py")):
            pass  # the mode's own frames
        elif name.startswith(OURS):
            return f"drafttrain{name[len(OURS):]}:{f.f_lineno}"
        elif not (name.startswith(TORCH) and any(p in name for p in PLACED_BY_CALLER)):
            return None  # accelerate, transformers, torch.optim...: they place their own tensors
        f = f.f_back
    return None


def _device_of(args, kwargs):
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class MetaForOurs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.redirected: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            where = _from_ours()
            if where is not None:
                kwargs["device"] = "meta"
                self.redirected.add(where)
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator):
            dev = _device_of(args, kwargs)
            if dev is not None and dev.type != gen.device.type:
                raise RuntimeError(f"{getattr(func, '__name__', func)}: a generator on {gen.device} draws on {dev}")
        return func(*args, **kwargs)


@contextmanager
def models_on_cpu_tensors_on_meta():
    """Build models before entering; inside, drafttrain's device-less tensors go to meta."""
    mode = MetaForOurs()
    with mode:
        yield mode
