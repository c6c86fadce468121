"""Batched speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), no Python loop over rows.

    p: target probs, q: draft probs, d: draft tokens.
    accept d_i  with probability min(1, p_i(d_i) / q_i(d_i)), positions i = 0..k-1, stop at the first rejection n;
    at n < k:   resample from norm(max(0, p_n - q_n));
    at n == k:  all drafts accepted, draw the bonus token from p_k.
The emitted tokens are distributed exactly as AR sampling from p. With q one-hot (a greedy drafter,
`draft_probs=None`) the acceptance test is u < p_i(d_i) and the residual is p_n with d_n removed.
k = 0 is plain AR sampling from p_0, so both engine modes share this function.
"""
from __future__ import annotations

import torch

from drafttrain.spec.sampling import sample


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k+1, V]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None (one-hot drafts)
    draft_tokens: torch.Tensor,  # [B, k] int64
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens[B, k+1] padded with -1, num_accepted[B]); row b emits tokens[b, :num_accepted[b] + 1]."""
    B, k1, V = target_probs.shape
    k = k1 - 1
    if draft_tokens.shape != (B, k):
        raise ValueError(f"draft_tokens must be [B={B}, k={k}], got {list(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, k, V):
        raise ValueError(f"draft_probs must be [B={B}, k={k}, V={V}], got {list(draft_probs.shape)}")
    dev = target_probs.device
    d = draft_tokens.long().unsqueeze(-1)  # [B, k, 1]
    p_d = target_probs[:, :k].gather(-1, d).squeeze(-1)  # [B, k]  p_i(d_i)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)  # one-hot drafts: q_i(d_i) = 1
        q_full = torch.zeros(B, k, V, device=dev, dtype=target_probs.dtype).scatter_(-1, d, 1.0)
    else:
        q_d = draft_probs.gather(-1, d).squeeze(-1)  # [B, k]
        q_full = draft_probs.to(target_probs.dtype)
    u = torch.rand(B, k, generator=generator, device=dev)
    accept = u * q_d < p_d  # u < p/q without dividing; q_d > 0 for any token the drafter sampled
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B] length of the accepted prefix

    # residual at the stop position n: p_n - q_n (q_k := 0, so n == k gives the bonus distribution p_k)
    idx = num_accepted.view(B, 1, 1).expand(B, 1, V)
    p_n = target_probs.gather(1, idx).squeeze(1)  # [B, V]
    q_n = q_full.gather(1, idx.clamp_max(max(k - 1, 0))).squeeze(1) if k else p_n.new_zeros(B, V)
    resid = (p_n - q_n * (num_accepted < k).unsqueeze(-1)).clamp_min(0)  # [B, V]
    mass = resid.sum(-1, keepdim=True)
    # mass == 0 only if p_n <= q_n everywhere, i.e. p_n == q_n, where rejection has probability 0: fall back to p_n
    last = sample(torch.where(mass > 0, resid, p_n), generator).unsqueeze(-1)  # [B, 1]; sample needs no normalizing

    # row b: its n accepted drafts, then `last`, then -1 padding
    n = num_accepted.unsqueeze(-1)
    tokens = torch.cat([draft_tokens.long(), last], 1).scatter_(1, n, last)
    tokens.masked_fill_(torch.arange(k1, device=dev) > n, -1)
    return tokens, num_accepted


def expected_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Per-position acceptance probability sum_v min(p, q): [..., V] x [..., V] -> [...].

    Chained along a teacher-forced sequence, prod_{j<=i} alpha_j is the probability that draft i is accepted,
    which lets a drafter be scored on rollouts it did not generate (no extra generation)."""
    return torch.minimum(target_probs, draft_probs).sum(-1)
