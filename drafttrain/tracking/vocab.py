"""A fresh drafter's draft vocabulary from the policy's own rollouts, before it trains or drafts: what the main job
(rl/job.py) and scripts/pretrain_drafter.py call. drafters/vocab.py picks the tokens from the counts; the drafter
keeps the map (a kind without a draft vocabulary, or a drafter loaded from a checkpoint, chooses nothing).

    note = vocab_from_rollouts(drafter, engine, [prompts], params, V, keep=stop_ids, acc=acc)   # None: nothing chosen
"""
from __future__ import annotations

import torch

from drafttrain.drafters.vocab import coverage, token_counts


def vocab_from_rollouts(drafter, engine, prompt_batches, params, vocab_size: int, keep=(), acc=None) -> str | None:
    """Where the drafter still chooses its draft vocabulary (needs_draft_vocab): the policy's plain (AR) rollouts of
    each batch of prompts through `engine` are counted, their response tokens first, then the prompts' (breaking
    ties), summed over the processes (acc: every process calls this, with its own prompts), and the drafter takes
    the most frequent, `keep` (the stop tokens) among them. Returns the line saying what it chose; None: nothing."""
    if not drafter.needs_draft_vocab():
        return None
    host = torch.device("cpu")  # token lists come from the host
    counts = torch.zeros(2, vocab_size, dtype=torch.long, device=host)  # [responses, prompts] x V
    rows = 0
    for prompts in prompt_batches:
        batch = engine.generate(prompts, params, speculative=False)
        counts[0] += token_counts(batch.tokens, vocab_size, host)
        counts[1] += token_counts(prompts, vocab_size, host)
        rows += len(prompts)
    if acc is not None and acc.num_processes > 1:  # every process chooses the same map
        counts = acc.reduce(counts.to(acc.device), "sum").to(host)
        rows = int(acc.reduce(torch.tensor([rows], device=acc.device), "sum").item())
    ids = drafter.set_draft_vocab(counts, keep)
    if ids is None:
        return None
    ids = ids.to(host)
    seen = int((counts.sum(0)[ids] > 0).sum())  # the rest: tokens never seen, by lowest id
    return (f"[drafttrain] draft vocabulary: {len(ids)} of the policy's {vocab_size} tokens, by frequency in {rows} "
            f"plain rollouts ({seen} of them seen there), covering {100 * coverage(counts[0], ids):.2f}% of their "
            f"{int(counts[0].sum())} response tokens")
