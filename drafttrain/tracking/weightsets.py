"""The drafter weight sets in a tracker's checkpoint state: the frozen step-0 drafter ("frozen"), the trainer's
weights ("trained"), the publisher's last good ones ("good_weights") and those on probation ("pending"'s "weights").
They are often equal (nothing published yet, or the last update passed its canary), and they share tensors that never
train (embeddings): stored() keeps each distinct tensor once (checkpoint.share), whole() gives every set back.
"""
from __future__ import annotations

from pathlib import Path

from drafttrain.checkpoint import load_checkpoint, share, shared_sets, unshare


def _sets(state: dict) -> dict:
    p = state.get("pending")
    return {"frozen": state.get("frozen"), "trained": state.get("trained"), "good_weights": state["good_weights"],
            "pending": None if p is None else p["weights"]}


def _with(state: dict, sets: dict) -> dict:
    p = state.get("pending")
    return {**state, "frozen": sets["frozen"], "trained": sets["trained"], "good_weights": sets["good_weights"],
            "pending": None if p is None else {**p, "weights": sets["pending"]}}


def stored(state: dict, shared: dict | None = None) -> dict:
    """A tracker state with its sets as a checkpoint stores them; shared: {name: weight set} stored elsewhere (the
    run folder's frozen drafter, the policy), which whole() must then be given."""
    return _with(state, share(_sets(state), shared))


def weight_sets(state: dict, shared: dict | None = None) -> dict[str, dict | None]:
    """stored()'s sets, each whole (None where absent); a state written before stored() holds whole sets already.
    CheckpointError: it refers to a shared set not given."""
    return unshare(_sets(state), shared, "the drafter tracker's state")


def checkpoint_sets(step_dir, policy=None) -> dict[str, dict | None]:
    """weight_sets of a run folder's checkpoint step_dir (policy: the policy loaded from its policy/, where a set
    refers to it: a self-drafter's)."""
    return weight_sets(load_checkpoint(Path(step_dir) / "state.pt")["tracker"], shared_sets(step_dir, policy))


def whole(state: dict, shared: dict | None = None) -> dict:
    """stored()'s state with every set whole."""
    return _with(state, weight_sets(state, shared))
