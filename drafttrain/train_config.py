"""The drafter trainer's config section (train.*) and its checks. Part of the run configuration (config.py imports
it); a field's trailing `# ...` comment is its key's doc there too. DrafterTrainer checks the same fields itself (it
is also built from sections that did not pass config.validate), so the checks live beside the fields."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

LOSSES = ("kl", "tv", "kl_tv")
POSITIONS = ("uniform", "rejected")


@dataclass
class TrainConfig:
    lr: float = 1e-3  # drafter AdamW learning rate
    weight_decay: float = 0.0  # drafter AdamW weight decay
    batch_size: int = 16  # sequences per drafter step
    # every position still feeds the attention's keys; attention, MLP, head and deeper TTT steps run for the queries
    query_frac: float = 1.0  # share of positions the drafter loss is taken at, in (0, 1]
    # kl: soft cross-entropy to the policy (forward KL); tv: total variation 1 - sum min(p, q), the rejection rate
    loss: str = "kl"  # the drafter loss: kl | tv | kl_tv (kl + train.tv_weight * tv)
    tv_weight: float = 1.0  # kl_tv: the TV term's weight (>= 0)
    # rejected: each term weighs the drafter's rejection 1 - alpha there (from the step's own logits: no extra work)
    positions: str = "uniform"  # where the loss weighs: uniform | rejected (in proportion to 1 - acceptance)
    max_grad_norm: float = 1.0  # drafter gradients are clipped to this norm (> 0; inf = no clipping)
    # false: q_proj, k_proj frozen (a saturated attention); a fresh drafter always trains it; the draft model ignores it
    score_grad: bool = True  # the attention scores pass gradient (false: a loaded chain drafter's are held constant)
    seed: int = 0  # the drafter loss's query-position draws
    # a longer record trains on a window of this many positions drawn in its response (its hidden states carry the
    # context before the window); bounds a drafter step's work and memory on very long rollouts
    max_len: Optional[int] = 4096  # positions of one record in a drafter step, at most (null = whole rows)


def train_checks(t) -> list[tuple[bool, str, str]]:
    """(ok, key, message) of train.*; t: the section (a missing field reads as its default)."""
    get = lambda name: getattr(t, name, getattr(TrainConfig, name))  # noqa: E731
    qf, w = float(get("query_frac")), get("tv_weight")
    return [
        (get("lr") > 0, "train.lr", f"must be > 0, got {get('lr')}"),
        (get("batch_size") >= 1, "train.batch_size", f"must be >= 1, got {get('batch_size')}"),
        (0 < qf <= 1, "train.query_frac", f"must be in (0, 1], got {qf}"),
        # a negative norm flips the clipped gradients (the drafter trained away from the target); 0 zeroes them
        (get("max_grad_norm") > 0, "train.max_grad_norm",
         f"must be > 0 (inf = no clipping), got {get('max_grad_norm')}"),
        (get("weight_decay") >= 0, "train.weight_decay", f"must be >= 0, got {get('weight_decay')}"),
        (get("loss") in LOSSES, "train.loss", f"must be one of {', '.join(LOSSES)}, got {get('loss')!r}"),
        (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0, "train.tv_weight",
         f"must be a finite number >= 0, got {w}"),
        (get("positions") in POSITIONS, "train.positions",
         f"must be one of {', '.join(POSITIONS)}, got {get('positions')!r}"),
        (get("max_len") is None or get("max_len") >= 2, "train.max_len",
         f"must be >= 2 or null (whole rows), got {get('max_len')}"),
    ]


def check_train(t) -> None:
    """Raise ValueError (one line, naming the key) at the first failing train.* check."""
    for ok, key, msg in train_checks(t):
        if not ok:
            raise ValueError(f"{key}: {msg}")
