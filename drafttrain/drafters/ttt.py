"""The training-time-test loss every trainable kind shares (its ttt_loss calls this with its own ttt_logits).

Step i at position t is scored against the policy's distribution p at t+1+i and weighs decay**i. The loss there
(Objective.loss): `kl`, soft cross-entropy -sum p log q (forward KL to the policy's, up to a constant); `tv`, the
total variation 1 - sum_x min(p(x), q(x)), which is exactly the rejection rate of speculative sampling at that
position (acceptance alpha = sum_x min(p, q)), so it spends nothing on the tails of p that acceptance ignores;
`kl_tv`, kl + tv_weight * tv. With hard=True the target is the rollout token x instead (MTP's loss as
slime/Megatron train it): kl is -log q(x), tv is 1 - q(x). Shapes: aux [B, T, X]; next_ids [B, T+steps-1];
target_probs [B, T+steps, V]; valid [B, T+steps] bool (the target there is a real response token).
query_frac < 1: the loss over a random subset of that share of the positions whose step-0 target is valid in some
row (ttt_logits' queries; prompt and padding positions would score nothing). positions=rejected: each (row, position)
term of step i weighs its own rejection 1 - alpha there, read from the step's logits (no extra pass; detached, and
normalized to mean 1 over the valid terms), so the loss is what positions drawn in proportion to the drafter's
rejection would give, in expectation: spent where the drafter is rejected (drawing the positions instead needs a
no-grad pass over every position first, a large share of a step: bench/NOTES.md, EAGLE-3).
first_ids [B]: token_0 of each row (read by a draft model; None: not given).
Returns (loss, per-step accuracy list), accuracy = draft argmax == policy argmax (hard: == the rollout token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Objective:
    """What the drafter loss optimizes (train.loss, train.tv_weight) and where (train.positions)."""
    loss: str = "kl"
    tv_weight: float = 1.0
    positions: str = "uniform"

    @classmethod
    def of(cls, cfg_train) -> "Objective":
        """From a train section (train_config.check_train has passed on it)."""
        return cls(*(getattr(cfg_train, f, getattr(cls, f)) for f in ("loss", "tv_weight", "positions")))


KL = Objective()


def tv_loss(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """1 - sum_x min(p, q) over the last dim: the rejection rate of drafting from q for target p, = 1/2 sum |p - q|
    when both sum to 1 (p may carry mass outside q's support: that part is always rejected)."""
    return 1.0 - torch.minimum(p, q).sum(-1)


def rejection_weights(p: torch.Tensor, q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(1 - alpha) per term for target p and draft q [..., Vd], mask m: detached, mean 1 over the terms m marks (all
    accepted: every weight 0, no loss). Weighting a uniform draw's terms by these equals drawing the terms in
    proportion to 1 - alpha, in expectation."""
    r = tv_loss(p, q).detach().clamp_min(0.0)
    return r * m.sum().clamp_min(1.0) / (r * m).sum().clamp_min(1e-12)


def ttt_loss(drafter, aux, next_ids, target_probs, valid, steps: int, decay: float, query_frac: float = 1.0,
             generator: torch.Generator | None = None, hard: bool = False, first_ids=None,
             objective: Objective = KL):
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
    use_kl, use_tv = objective.loss in ("kl", "kl_tv"), objective.loss in ("tv", "kl_tv")
    weigh = objective.positions == "rejected"
    tv_w = 1.0 if objective.loss == "tv" else float(objective.tv_weight)
    total, accs, wsum = 0.0, [], 0.0
    for i, lg in enumerate(logits):
        at = slice(1 + i, 1 + i + T) if S is None else 1 + i + S  # the positions step i is scored at
        m = valid[:, at].float()  # [B, S]
        lp = lg.log_softmax(-1)
        q = lp.exp() if use_tv or weigh else None  # the draft distribution, read by the TV and the weights
        p = target_probs[:, at].float()[..., ids]  # [B, S, Vd] the policy's mass on the draft vocab
        if hard:  # the rollout token x = token_{t+2+i} = next_ids[:, t+1+i]; a token outside the draft vocab: no loss
            x = nxt[:, at]
            t2d = torch.full((target_probs.shape[-1],), -1, dtype=torch.long)
            t2d[ids] = torch.arange(len(ids))
            d = t2d[x]
            m = m * (d >= 0).float()
            lpx = lp.gather(-1, d.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, S]
            per = (-lpx if use_kl else 0.0) + (tv_w * (1.0 - lpx.exp()) if use_tv else 0.0)
            hit = lg.argmax(-1) == d
        else:
            per = 0.0
            if use_kl:
                tp = p / p.sum(-1, keepdim=True).clamp_min(1e-8)
                per = -(tp * lp).sum(-1)  # [B, S]
            if use_tv:  # against p itself: its mass off the draft vocab is rejected whatever q does
                per = per + tv_w * tv_loss(p, q)
            hit = lg.argmax(-1) == p.argmax(-1)
        # the terms' weights (sum w = sum m); acceptance is p against q whatever the target (hard: the token)
        w = m * rejection_weights(p, q, m) if weigh else m
        denom = m.sum().clamp_min(1.0)
        total = total + (decay ** i) * (per * w).sum() / denom
        wsum += decay ** i
        accs.append(float((hit.float() * m).sum() / denom))
    return total / wsum, accs
