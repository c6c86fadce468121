"""Checkpoint reads that unpickle nothing but tensors and plain containers (load_checkpoint): the run folder's
state, the drafter trainer's and the deliverable's all load through it. And weight sets stored once (share /
unshare): a checkpoint holds several copies of the drafter (frozen, trained, last good, on probation), often equal."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import torch
from torch._weights_only_unpickler import get_globals_in_pkl

# every pickle global a checkpoint of this project holds: tensors (rebuilt from typed storages) and ordered dicts;
# the rest is ints, floats, strings, bools, None, lists, tuples and dicts, which need no global
SAFE_GLOBALS = frozenset({"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                          *(f"torch.{t}Storage" for t in ("Bool", "Byte", "Char", "Short", "Int", "Long", "Half",
                                                          "BFloat16", "Float", "Double"))})



# in a run folder's ckpt/step-N: {name: file in ckpt/} of the weight sets its state refers to outside itself
SHARED = "shared.json"


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


def share(sets: dict[str, dict | None], outside: dict[str, dict] | None = None) -> dict[str, dict | None]:
    """Weight sets ({name: {key: tensor}}, None: absent) as a checkpoint stores them: a tensor equal (torch.equal) to
    the one at the same key of an earlier set, or of an `outside` set stored elsewhere, becomes that set's name, so
    each distinct tensor is written once. unshare() with the same `outside` sets gives them back."""
    seen, out = dict(outside or {}), {}
    assert not seen.keys() & sets.keys(), "outside sets need names of their own"
    for name, ws in sets.items():
        if ws is not None:
            out[name] = {k: next((n for n, s in seen.items() if _equal(s.get(k), t)), t) for k, t in ws.items()}
            seen[name] = ws
        else:
            out[name] = None
    return out


def unshare(sets: dict[str, dict | None], outside: dict[str, dict] | None = None, where: str = "a checkpoint"
            ) -> dict[str, dict | None]:
    """share()'s sets back, each name replaced by a copy of the tensor it stands for (sets written before share()
    hold only tensors: given back as they are). A name `outside` lacks is a CheckpointError naming `where`."""
    seen, out = dict(outside or {}), {}
    for name, ws in sets.items():
        if ws is None:
            out[name] = None
            continue
        missing = sorted({t for k, t in ws.items() if isinstance(t, str) and k not in seen.get(t, {})})
        if missing:
            raise CheckpointError(f"{where}: its {name} weights refer to {', '.join(missing)}, which is missing")
        out[name] = {k: seen[t][k].clone() if isinstance(t, str) else t for k, t in ws.items()}
        seen[name] = out[name]
    return out


def shared_sets(step_dir: str | Path, policy=None) -> dict[str, dict]:
    """The weight sets a run folder's checkpoint step_dir refers to outside its state.pt (share's `outside`): each
    file its shared.json names (beside the step folders: the run's frozen drafter) and, given the policy loaded from
    its policy/, the policy's weights ("policy")."""
    step_dir = Path(step_dir)
    out = {} if policy is None else {"policy": policy.state_dict()}
    f = step_dir / SHARED
    if f.is_file():
        try:
            names = json.loads(f.read_text())
        except ValueError as e:
            raise CheckpointError(f"{f} is unreadable ({_first_line(e)})") from None
        for name, file in names.items():
            if not (step_dir.parent / file).is_file():
                raise CheckpointError(f"{step_dir.parent / file} is missing ({f} names it)")
            out[name] = load_checkpoint(step_dir.parent / file)
    return out


def _equal(a, b) -> bool:
    return (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and torch.equal(a, b))


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:160]
