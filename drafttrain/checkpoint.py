"""Checkpoint reads that unpickle nothing but tensors and plain containers (load_checkpoint): the run folder's
state, the drafter trainer's and the deliverable's all load through it."""
from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch
from torch._weights_only_unpickler import get_globals_in_pkl

# every pickle global a checkpoint of this project holds: tensors (rebuilt from typed storages) and ordered dicts;
# the rest is ints, floats, strings, bools, None, lists, tuples and dicts, which need no global
SAFE_GLOBALS = frozenset({"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                          *(f"torch.{t}Storage" for t in ("Bool", "Byte", "Char", "Short", "Int", "Long", "Half",
                                                          "BFloat16", "Float", "Double"))})



class CheckpointError(ValueError):
    """A checkpoint that cannot be read safely: truncated, corrupt, or holding a type outside SAFE_GLOBALS."""


def load_checkpoint(path: str | Path) -> dict:
    """torch.load a checkpoint this project wrote, running no code from it: the pickle's globals are read without
    unpickling and must all be in SAFE_GLOBALS, then torch loads it with weights_only=True."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next(n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl"))
            found = get_globals_in_pkl(io.BytesIO(z.read(pkl)))
    except (OSError, EOFError, StopIteration, ValueError, zipfile.BadZipFile, RuntimeError) as e:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt: {_first_line(e)})") from None
    unsafe = sorted(set(found) - SAFE_GLOBALS)
    if unsafe:
        raise CheckpointError(f"{path} holds {', '.join(unsafe)}, which no drafttrain checkpoint holds: not loaded "
                              f"(unpickling it could run code)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  the weights-only unpickler refuses what the scan could not see
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:160]
