"""Draft vocabularies: the tokens a drafter's head covers, chosen by their frequency in the policy's rollouts.

EAGLE-3 drafters in the field draft over the 32,000 most frequent tokens of the target's vocabulary (a head of Vd
rows instead of V: a 152k-token vocabulary makes the head most of a small drafter's cost), mapped back to target ids
by d2t / t2d (eagle3.py). This module picks those tokens; the drafter stores the map.

    counts = token_counts(responses, V, device)              # [V] occurrences in rollouts
    ids = draft_vocab(counts, 32_000, keep=stop_ids)         # [Vd] ascending target ids
"""
from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_DRAFT_VOCAB = 32_000  # drafter.eagle3.draft_vocab_size null, on a vocabulary larger than this


def default_draft_vocab_size(vocab_size: int) -> int:
    """A fresh drafter's draft vocabulary: 32,000 tokens, or the whole vocabulary where it is no larger."""
    return min(vocab_size, DEFAULT_DRAFT_VOCAB)


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device=None) -> torch.Tensor:
    """[V] int64: how often each token id occurs in token_lists."""
    flat = [t for row in token_lists for t in row]
    ids = torch.tensor(flat, dtype=torch.long, device=device)
    if len(flat) and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
        raise ValueError(f"token_counts: token ids must be in [0, {vocab_size}), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return torch.bincount(ids, minlength=vocab_size)


def draft_vocab(counts: torch.Tensor, draft_vocab_size: int, keep: Sequence[int] = ()) -> torch.Tensor:
    """The draft vocabulary [Vd] (target ids, ascending): the tokens in `keep` (those that must be draftable, e.g.
    the stop tokens), then the most frequent by counts [V], or [n, V] with the rows in priority order (a later row
    breaks the ties of the earlier ones: the responses' counts, then the prompts'); remaining ties, tokens never
    seen included, go to the lowest id. Deterministic."""
    counts = counts.view(1, -1) if counts.dim() == 1 else counts  # [n, V]
    V = counts.shape[1]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size: {draft_vocab_size} must be in [1, vocab {V}]")
    keep = sorted(set(int(k) for k in keep))
    if len(keep) > draft_vocab_size or any(not 0 <= k < V for k in keep):
        raise ValueError(f"draft_vocab: keep {keep} must be at most {draft_vocab_size} ids in [0, {V})")
    order = torch.arange(V, device=counts.device)  # the last tie-break: the lowest id first
    # stable sorts from the least to the most significant key: each keeps the order of the keys before it
    for row in counts.flip(0):
        order = order[row[order].argsort(descending=True, stable=True)]
    if keep:
        pinned = torch.zeros(V, dtype=torch.uint8, device=counts.device)
        pinned[torch.tensor(keep, device=counts.device)] = 1
        order = order[pinned[order].argsort(descending=True, stable=True)]  # keep first
    return order[:draft_vocab_size].sort().values


def coverage(counts: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """The share of the tokens counted in counts [V] that draft_ids [Vd] covers (1.0 when nothing was counted)."""
    total = int(counts.sum())
    return 1.0 if total == 0 else int(counts[draft_ids].sum()) / total
