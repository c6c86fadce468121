"""The attention of a chain drafter's training-time-test unroll (ChainDrafter.ttt_logits), in bounded memory.

Step i's query at position t attends to step 0's keys at positions 0..t (the policy-derived cache, causal) plus its
own chain's keys from steps 1..i at t (the "diagonal"), one softmax over that union. Written densely, that is a
[B, Hq, S, T] score tensor (and a [T, T] mask) per step, which autograd keeps for every step's backward: hundreds of
GB at the 8k-16k-token rollouts users train on. Here the queries run in chunks whose scores hold at most
MAX_SCORES elements, each chunk attending only to the keys up to its last query; under autograd with several chunks
each chunk is checkpointed, so the backward keeps only its inputs and recomputes its scores. Short rows (one chunk)
run as the dense form did, at its cost. GQA heads are grouped (query heads of one KV head share its keys), not
repeated. The diagonal terms make a plain softmax per chunk the simplest exact form (no fused kernel takes them).
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

# Elements of one chunk's scores [B, Hq, C, Tc] (64 MiB in fp32; the chunk's softmax and its backward hold a few
# tensors of that size), unless one query's row [B, Hq, 1, T] is larger. The shipped world (batch 16, 4 heads,
# T <= 512) fits in one chunk.
MAX_SCORES = 2 ** 24


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                  vs: list[torch.Tensor], queries: torch.Tensor | None = None,
                  max_scores: int = MAX_SCORES) -> torch.Tensor:
    """Step i's attention output o [B, Hq, S, D], scaled by 1/sqrt(D).

    q [B, Hq, S, D]: step i's queries at positions `queries` [S] (ascending), or at every position 0..T-1 (None).
    k0, v0 [B, Hkv, T, D]: step 0's keys and values at every position. ks, vs: i tensors [B, Hkv, S, D], steps
    1..i's keys and values at each query's own position (empty at step 0). Hq is a multiple of Hkv."""
    B, Hq, S, D = q.shape
    Hkv, T = k0.shape[1], k0.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, S, D)  # [B, Hkv, r, S, D]: query heads grouped by the KV head they read
    qpos = torch.arange(S, device=q.device) if queries is None else queries.to(q.device)  # [S]
    C = max(1, max_scores // (B * Hq * T))  # queries per chunk, sized for the widest key span T (at least one)
    if C >= S:  # one chunk over every key: no host read, no recompute
        return _chunk(qg, k0, v0, ks, vs, qpos)
    starts = list(range(0, S, C))
    # each chunk's key span: up to its last query's position (one host read for every chunk)
    last = [min(a + C, S) - 1 for a in starts]
    spans = [p + 1 for p in (last if queries is None else qpos[last].tolist())]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k0, v0, *ks, *vs))
    outs = []
    for a, tc in zip(starts, spans):
        args = (qg[:, :, :, a:a + C], k0[:, :, :tc], v0[:, :, :tc], [k[:, :, a:a + C] for k in ks],
                [v[:, :, a:a + C] for v in vs], qpos[a:a + C])
        # checkpointed: the backward keeps these slices (views of tensors kept anyway), not the chunk's scores;
        # nothing in a chunk draws random numbers, so no RNG state is saved
        outs.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False) if grad
                    else _chunk(*args))
    return torch.cat(outs, 2)  # [B, Hq, S, D]


def _chunk(q, k0, v0, ks, vs, qpos):
    """One chunk: q [B, Hkv, r, C, D] at positions qpos [C]; k0, v0 [B, Hkv, Tc, D] (Tc > qpos[-1]); ks, vs: each
    [B, Hkv, C, D]. Returns o [B, Hkv * r, C, D]."""
    B, G, r, C, D = q.shape
    Tc = k0.shape[2]
    scale = 1.0 / math.sqrt(D)
    qf = q.reshape(B, G, r * C, D)
    s0 = (qf @ k0.transpose(-1, -2)).view(B, G, r, C, Tc) * scale  # [B, G, r, C, Tc]
    causal = qpos.view(C, 1) >= torch.arange(Tc, device=q.device).view(1, Tc)  # [C, Tc] keys at or before t
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * kj.unsqueeze(2)).sum(-1) * scale).unsqueeze(-1) for kj in ks]  # each [B, G, r, C, 1]
    p = torch.cat([s0, *diag], -1).softmax(-1)  # [B, G, r, C, Tc + i]
    o = (p[..., :Tc].reshape(B, G, r * C, Tc) @ v0).view(B, G, r, C, D)
    for j, vj in enumerate(vs):
        o = o + p[..., Tc + j:Tc + j + 1] * vj.unsqueeze(2)
    return o.reshape(B, G * r, C, D)
