"""Teacher-forced acceptance: score a drafter on rollouts it did not generate, with no extra generation.

At each position t the drafter's chain is unrolled along the real tokens (its training-time-test forward): draft
i has acceptance probability alpha_i(t) = sum_v min(p, q_i) against the policy's distribution p at t+1+i, and
draft i survives with probability prod_{j<=i} alpha_j(t). So

    expected accepted length E[L](t) = 1 + sum_{i<k} prod_{j<=i} alpha_j(t)

averaged over response positions. Exact for a sampling drafter when the real token equals the accepted draft,
and the standard stand-in otherwise. Used for the frozen-drafter baseline, the trainer's estimate the canary
compares the engine against, and the tracking/oracle benchmark.
"""
from __future__ import annotations

import torch

from drafttrain.spec import expected_acceptance


@torch.no_grad()
def teacher_forced_acceptance(drafter, batch: dict[str, torch.Tensor], k: int) -> dict:
    """batch: features built for >= k TTT steps (build_features / FeatureBuffer.sample).
    Returns {"mal": E[L], "acceptance_per_position": [P(accept i | accepted < i)]}."""
    s = batch["valid"].shape[1] - batch["aux"].shape[1]
    if s < k:
        raise ValueError(f"teacher_forced_acceptance: features were built for {s} TTT steps, need k={k}")
    was_training = drafter.training
    drafter.eval()
    T = batch["aux"].shape[1]
    logits = drafter.ttt_logits(batch["aux"], batch["next_ids"][:, : T + k - 1], k)
    drafter.train(was_training)
    ids = drafter.draft_ids()
    base = batch["valid"][:, 1:1 + T]  # positions whose first draft lands in the response
    surv = torch.ones_like(base, dtype=torch.float32)  # prod_{j<i} alpha_j
    reach, acc = [], []
    total = torch.zeros_like(surv)
    for i, lg in enumerate(logits):
        p = batch["target_probs"][:, 1 + i:1 + i + T].float()  # [B, T, V]
        q = torch.zeros_like(p)
        q[..., ids] = lg.float().softmax(-1)
        a = expected_acceptance(p, q) * batch["valid"][:, 1 + i:1 + i + T].float()  # [B, T]
        reach.append(float((surv * base).sum()))
        surv = surv * a
        acc.append(float((surv * base).sum()))
        total = total + surv
    n = base.float().sum().clamp_min(1.0)
    return {"mal": 1.0 + float((total * base).sum() / n),
            "acceptance_per_position": [a / r if r > 0 else 0.0 for a, r in zip(acc, reach)]}
