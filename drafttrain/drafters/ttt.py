"""The training-time-test loss every trainable kind shares (its ttt_loss calls this with its own ttt_hidden and head).

Step i at position t is scored against the policy's distribution p at t+1+i and weighs decay**i. The loss there
(Objective.loss): `kl`, soft cross-entropy -sum p log q (forward KL to the policy's, up to a constant); `tv`, the
total variation 1 - sum_x min(p(x), q(x)), which is exactly the rejection rate of speculative sampling at that
position (acceptance alpha = sum_x min(p, q)), so it spends nothing on the tails of p that acceptance ignores;
`kl_tv`, kl + tv_weight * tv. With hard=True the target is the rollout token x instead (MTP's loss as
slime/Megatron train it): kl is -log q(x), tv is 1 - q(x). Shapes: aux [B, T, X]; next_ids [B, T+steps-1];
targets: the policy's distributions (drafters/targets.py: recomputed from its final hidden state, never stored);
valid [B, T+steps] bool (the target there is a real response token).
Over a draft vocabulary the kl target is p restricted to it and renormalized (what the drafter can put mass on:
the draft-vocabulary rows of the policy's head alone); the TV target is p itself (its mass off the draft vocabulary
is rejected whatever q does), which needs the full normalizer.
query_frac < 1: the loss over a random subset of that share of the positions whose step-0 target is valid in some
row (ttt_hidden's queries; prompt and padding positions would score nothing). positions=rejected: each (row, position)
term of step i weighs its own rejection 1 - alpha there, read from the step's logits (no extra pass; detached, and
normalized to mean 1 over the valid terms), so the loss is what positions drawn in proportion to the drafter's
rejection would give, in expectation: spent where the drafter is rejected (drawing the positions instead needs a
no-grad pass over every position first, a large share of a step: bench/NOTES.md, EAGLE-3).
The head and the loss run in chunks of positions (targets.CHUNK logits at most), each recomputed in the backward
(activation checkpointing) when there are several: a step's memory grows with the positions times the hidden size,
never times the vocabulary; with one chunk (short rows, small vocabularies) it runs as one piece, at no extra cost.
first_ids [B]: token_0 of each row (read by a draft model; None: not given).
Returns (loss, per-step accuracy list), accuracy = draft argmax == policy argmax (hard: == the rollout token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from drafttrain.drafters.targets import position_chunk


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


def rejection(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """1 - alpha per term (alpha = sum_x min(p, q), the acceptance of drafting from q for target p), detached: the
    weight of a term under positions=rejected, before its normalization to mean 1 over the valid terms (ttt_loss
    divides by the mean, summed over the chunks). Weighting a uniform draw's terms by r / mean(r) equals drawing the
    terms in proportion to 1 - alpha, in expectation."""
    return tv_loss(p, q).detach().clamp_min(0.0)


def query_positions(valid: torch.Tensor, T: int, query_frac: float, generator) -> torch.Tensor | None:
    """[S] ascending positions the loss is taken at (None: every position): a random query_frac of the chain starts
    that draft a response token in some row (not prompt, not padding)."""
    if query_frac >= 1.0:
        return None
    cand = valid[:, 1:T + 1].any(0).nonzero().flatten()
    if not len(cand):
        cand = torch.arange(T, device=valid.device)
    n = max(1, math.ceil(query_frac * len(cand)))
    on = generator.device if generator is not None else cand.device  # the draws on the generator's device
    pick = torch.randperm(len(cand), generator=generator, device=on)[:n].to(cand.device)
    return cand[pick].sort().values


def ttt_loss(drafter, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
             generator: torch.Generator | None = None, hard: bool = False, first_ids=None,
             objective: Objective = KL):
    T = aux.shape[1]
    S = query_positions(valid, T, query_frac, generator)
    xs = drafter.ttt_hidden(aux, next_ids, steps, S, first_ids=first_ids)  # steps x [B, S, Hd]: the head's inputs
    ids = drafter.draft_ids().to(aux.device)
    # hard: the rollout token's place in the draft vocabulary, -1 outside it (no loss there)
    t2d = None
    if hard:
        t2d = torch.full((targets.vocab_size,), -1, dtype=torch.long, device=aux.device)
        t2d[ids] = torch.arange(len(ids), device=aux.device)
    nxt = torch.cat([next_ids, next_ids.new_zeros(next_ids.shape[0], 1)], 1)  # [B, T+steps]
    total, accs, wsum = 0.0, [], 0.0
    for i, x in enumerate(xs):
        at = torch.arange(1 + i, 1 + i + T, device=aux.device) if S is None else 1 + i + S  # step i's positions
        m = valid[:, at].float()  # [B, S]
        d = t2d[nxt[:, at]] if hard else None  # [B, S] the rollout token in the draft vocabulary
        if d is not None:
            m = m * (d >= 0).float()
        term, r_sum, hits = _step_terms(drafter, x, targets, at, m, d, ids, objective)
        M = m.sum()
        denom = M.clamp_min(1.0)
        if objective.positions == "rejected":  # weights r / mean(r) over the valid terms: the mean is detached
            term = term * (M.clamp_min(1.0) / r_sum.clamp_min(1e-12))
        total = total + (decay ** i) * term / denom
        wsum += decay ** i
        accs.append(float(hits / denom))
    return total / wsum, accs


def _step_terms(drafter, x, targets, at, m, d, ids, objective):
    """One TTT step's (sum of weighted loss terms, sum of rejection weights, hits) over its positions, in chunks of
    positions: each chunk's head logits [B, C, Vd] exist only inside it (recomputed in the backward if there are
    several). Weighted terms: per-term loss x m (x the rejection r under positions=rejected)."""
    B, S = x.shape[:2]
    width = len(ids) + (targets.vocab_size if _needs_lse(objective, d is not None, len(ids), targets) else 0)
    n = position_chunk(B, width)
    term, r_sum, hits = 0.0, x.new_zeros(()), x.new_zeros(())
    for c in range(0, S, n):
        sl = slice(c, c + n)
        args = (x[:, sl], at[sl], m[:, sl], None if d is None else d[:, sl])
        fn = lambda xc, atc, mc, dc: _chunk_terms(drafter, xc, targets, atc, mc, dc, ids, objective)  # noqa: E731
        if S > n and torch.is_grad_enabled():
            t, r, h = checkpoint(fn, *args, use_reentrant=False)
        else:
            t, r, h = fn(*args)
        term, r_sum, hits = term + t, r_sum + r, hits + h
    return term, r_sum, hits


def _needs_lse(objective: Objective, hard: bool, Vd: int, targets) -> bool:
    """Does the target need p unnormalized over the draft vocabulary (the full normalizer)?"""
    soft_p = (objective.loss != "kl" and not hard) or objective.positions == "rejected"
    return soft_p and Vd < targets.vocab_size


def _chunk_terms(drafter, x, targets, at, m, d, ids, objective):
    """(sum of weighted terms, sum of r x m (rejected), hits) for positions `at` of one step; x [B, C, Hd]."""
    use_kl, use_tv = objective.loss in ("kl", "kl_tv"), objective.loss in ("tv", "kl_tv")
    weigh = objective.positions == "rejected"
    tv_w = 1.0 if objective.loss == "tv" else float(objective.tv_weight)
    lg = drafter.head_logits(x).float()  # [B, C, Vd]
    lp = lg.log_softmax(-1)
    q = lp.exp() if (use_tv and d is None) or weigh else None  # the draft distribution (TV, the weights)
    # the policy's mass on the draft vocabulary: renormalized where only the kl target reads it
    p = None
    if d is None or weigh:
        p = targets.probs(at, ids) if (use_tv and d is None) or weigh else targets.draft_probs(at, ids)
    if d is not None:  # the rollout token x = token_{t+2+i}
        lpx = lp.gather(-1, d.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [B, C]
        per = (-lpx if use_kl else 0.0) + (tv_w * (1.0 - lpx.exp()) if use_tv else 0.0)
        hit = lg.argmax(-1) == d
    else:
        per = 0.0
        if use_kl:
            tp = p / p.sum(-1, keepdim=True).clamp_min(1e-8)
            per = -(tp * lp).sum(-1)  # [B, C]
        if use_tv:  # against p itself: its mass off the draft vocab is rejected whatever q does
            per = per + tv_w * tv_loss(p, q)
        hit = lg.argmax(-1) == p.argmax(-1)
    w = m
    r_sum = m.new_zeros(())
    if weigh:  # (1 - alpha) per term; normalized to mean 1 over the valid terms by the caller
        r = rejection(p, q)
        w = m * r
        r_sum = (r * m).sum()
    return (per * w).sum(), r_sum, (hit.float() * m).sum().detach()
