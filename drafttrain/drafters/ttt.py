"""The training-time-test loss every trainable kind shares (its ttt_loss calls this with its own ttt_logits).

Step i at position t is scored against the policy's distribution at t+1+i (soft cross-entropy: forward KL to the
policy's, up to a constant) or, with hard=True, against the rollout token there (cross-entropy on the tokens, MTP's
loss as slime/Megatron train it); step i weighs decay**i. Shapes: aux [B, T, X]; next_ids [B, T+steps-1];
target_probs [B, T+steps, V]; valid [B, T+steps] bool (the target there is a real response token).
query_frac < 1: the loss over a random subset of that share of the positions whose step-0 target is valid in some
row (ttt_logits' queries; prompt and padding positions would score nothing).
first_ids [B]: token_0 of each row (read by a draft model; None: not given).
Returns (loss, per-step accuracy list), accuracy = draft argmax == policy argmax (hard: == the rollout token).
"""
from __future__ import annotations

import math

import torch


def ttt_loss(drafter, aux, next_ids, target_probs, valid, steps: int, decay: float, query_frac: float = 1.0,
             generator: torch.Generator | None = None, hard: bool = False, first_ids=None):
    T = aux.shape[1]
    ids = drafter.draft_ids()
    S = None  # every position
    if query_frac < 1.0:  # drawn among the chain starts that draft a response token (not prompt, not padding)
        cand = valid[:, 1:T + 1].any(0).nonzero().flatten()
        if not len(cand):
            cand = torch.arange(T)
        n = max(1, math.ceil(query_frac * len(cand)))
        S = cand[torch.randperm(len(cand), generator=generator)[:n]].sort().values
    logits = drafter.ttt_logits(aux, next_ids, steps, S, first_ids=first_ids)
    nxt = torch.cat([next_ids, next_ids.new_zeros(next_ids.shape[0], 1)], 1) if hard else None  # [B, T+steps]
    total, accs, wsum = 0.0, [], 0.0
    for i, lg in enumerate(logits):
        at = slice(1 + i, 1 + i + T) if S is None else 1 + i + S  # the positions step i is scored at
        m = valid[:, at].float()  # [B, S]
        lp = lg.log_softmax(-1)
        if hard:  # the rollout token x = token_{t+2+i} = next_ids[:, t+1+i]; a token outside the draft vocab: no loss
            x = nxt[:, at]
            t2d = torch.full((target_probs.shape[-1],), -1, dtype=torch.long)
            t2d[ids] = torch.arange(len(ids))
            d = t2d[x]
            m = m * (d >= 0).float()
            ce = -lp.gather(-1, d.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, S]
            hit = lg.argmax(-1) == d
        else:
            tp = target_probs[:, at].float()[..., ids]  # [B, S, Vd] policy mass on draft vocab
            tp = tp / tp.sum(-1, keepdim=True).clamp_min(1e-8)
            ce = -(tp * lp).sum(-1)  # [B, S]
            hit = lg.argmax(-1) == tp.argmax(-1)
        denom = m.sum().clamp_min(1.0)
        total = total + (decay ** i) * (ce * m).sum() / denom
        wsum += decay ** i
        accs.append(float((hit.float() * m).sum() / denom))
    return total / wsum, accs
