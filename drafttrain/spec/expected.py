"""The engine's SpecStats in expectation, from per-draft acceptance probabilities (no model, no sampling).

r [B, T, k]: r[b, t, i] = P(draft i of the chain at position t is accepted | drafts < i accepted) (teacher-forced
acceptance computes it along the real tokens). A verify step starting after response token s accepts n >= j
drafts with probability prod_{i<j} r_i, emits min(n + 1, tokens left) and the next step starts there. A forward
pass over s gives the probability pi(s) that a step starts at s, hence the expected verify steps sum_s pi(s), the
expected reached / accepted draft counts at each position, and MAL = (response tokens - 1) / E[verify steps],
pooled over rows as the engine pools. A row's last step is cut at its end, as SpecStats counts it.
"""
from __future__ import annotations

import math

import torch

from drafttrain.spec.stats import SpecStats


def expected_tokens(acc: list[float], k: int) -> float:
    """L(k) = 1 + sum_{i<k} prod_{j<=i} a_j: tokens per SD step (the accepted drafts, then one bonus/resampled)."""
    e, surv = 1.0, 1.0
    for a in acc[:k]:
        surv *= a
        e += surv
    return e


def expected_spec_stats(r: torch.Tensor, valid: torch.Tensor, k: int) -> SpecStats:
    """expected_row_stats' pooled SpecStats."""
    return expected_row_stats(r, valid, k)[0]


def expected_row_stats(r: torch.Tensor, valid: torch.Tensor, k: int
                       ) -> tuple[SpecStats, torch.Tensor, torch.Tensor]:
    """r [B, T, k] (acceptance_ratios), valid [B, >=T+1] (a contiguous run per row: position j predicts response
    token j+1) -> (the engine's SpecStats in expectation (float counts), as the module docstring says; each
    row's own MAL [B], nan for a row with no verify step; each row's expected verify steps [B]).

    Everything a step starting after token s does is linear in w = P(a step starts there), so the per-draft
    factors are computed for every s at once; only the propagation of w along s is a loop, of 3 ops per s (a loop
    over s and j of ~8 ops each is several times slower)."""
    B, T, _ = r.shape
    v = valid[:, :T + 1].long()
    R = v.sum(1)  # response tokens per row
    first = v.argmax(1)  # drafter position of the prefill's token: its step drafts response token 1
    S = int(R.max()) if B else 0
    n = max(S - 1, 0)  # step starts s = 0 .. S-2
    dev = r.device
    s_idx = torch.arange(n, device=dev)
    t_idx = (first.view(B, 1) + s_idx.view(1, -1)).clamp_max(T - 1)  # [B, n] drafter position of step start s
    rr = r.gather(1, t_idx.unsqueeze(-1).expand(B, n, k)).transpose(0, 1)  # [n, B, k]
    left = R.view(1, B) - 1 - s_idx.view(n, 1)  # [n, B] tokens still to emit
    inside = left.unsqueeze(-1) > torch.arange(k, device=dev)  # [n, B, k] draft j targets a response token
    factor = torch.where(inside, rr, torch.ones_like(rr))
    surv = torch.cat([torch.ones(n, B, 1, device=dev), factor.cumprod(-1)], -1)  # [n, B, k+1] P(drafts < j accepted) / w
    ok = surv[..., :k] * rr * inside  # P(draft j accepted) / w
    out = (surv[..., :k] - ok) * inside  # P(rejected at j: j + 1 tokens emitted) / w
    alive = (left > 0).float()  # [n, B]
    full = surv[..., k] * alive  # all drafts inside the response accepted: k + 1 tokens, or a cut at the end
    end = s_idx.view(n, 1) + left.clamp_min(0).clamp_max(k + 1)  # [n, B]
    rows = torch.arange(B, device=dev)
    pi = torch.zeros(B, S + k + 1, device=dev)  # P(a verify step starts after response token s)
    pi[:, 0] = 1.0
    W = torch.zeros(n, B, device=dev)
    for s in range(n):
        w = pi[:, s] * alive[s]
        W[s] = w
        pi[:, s + 1:s + k + 1] += w.unsqueeze(1) * out[s]
        pi[rows, end[s]] += w * full[s]
    Wk = W.unsqueeze(-1)
    reach, acc = (Wk * surv[..., :k] * inside).sum((0, 1)), (Wk * ok).sum((0, 1))
    drafted = k * W.sum() - (W * full * (k - left).clamp_min(0)).sum()  # drafts past the end not counted
    st = SpecStats(drafted=float(drafted), accepted=float(acc.sum()), verify_rows=float(W.sum()),
                   emitted=float((R - 1).clamp_min(0).sum()))
    st.accepted_per_position, st.reached_per_position = acc.tolist(), reach.tolist()
    steps = W.sum(0)  # [B] expected verify steps per row
    row_mal = torch.where(steps > 0, (R - 1).clamp_min(0) / steps.clamp_min(1e-30), torch.full_like(steps, math.nan))
    return st, row_mal, steps
