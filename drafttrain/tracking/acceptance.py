"""Teacher-forced acceptance: score a drafter on rollouts it did not generate, with no extra generation.

Reports the expected value of what the engine's SpecStats would count if it had generated these very sequences
with this drafter (k drafts per step, temperature 1): the same MAL (response tokens emitted per verify step, the
last step cut at the end of the response) and the same per-position acceptance (rate over steps that reached draft
i inside the response). Exact, not a stand-in:

1. Per position t, the drafter's chain is unrolled along the real tokens (training-time test). Given the real token
   x at the target of draft i, P(draft i accepted | drafts < i accepted, x) = min(1, q_i(x) / p_i(x)) =: r_i(t)
   (rejection sampling accepts-and-emits x with probability min(p, q)(x), and emits x at all with p(x)); once
   drafts < i are accepted they equal the real tokens, so the chain's context is the real prefix, as here.
2. From the r_i, spec.expected_row_stats gives the engine's SpecStats in expectation (a forward pass over where
   verify steps start).

Why not the per-position average 1 + sum_i prod_{j<=i} alpha_j(t), alpha = sum_v min(p, q) (the common
estimate)? It is another statistic: the engine starts a step only where the previous one ended, mostly just after
a rejection, so its draft 0 seldom targets a hard token; and chaining alpha_j at the real prefix ignores that an
accepted draft is a token the drafter liked. A row's last verify step is cut at the stop token (SpecStats).
Used for the frozen-drafter baseline, the trainer's estimate the canary compares the engine against, and the
tracking/oracle benchmark. Scored in length_chunks from the first response position on: the same counts, at a
fraction of the padded positions.
"""
from __future__ import annotations

import math

import torch

from drafttrain.device import module_device, to_device
from drafttrain.drafters.targets import TargetHead, Targets, position_chunk, row_lse
from drafttrain.spec import SpecStats, expected_row_stats


@torch.no_grad()
def acceptance_ratios(drafter, batch: dict[str, torch.Tensor], k: int, head: TargetHead,
                      start: int = 0) -> torch.Tensor:
    """r [B, T, k]: r[b, t, i] = min(1, q_i(x) / p(x)) for draft i of the chain at position t (it targets token
    t+2+i, the real token x; p at position t+1+i, the policy's from its hidden state there and `head`), chained along
    the real tokens. 0 where the target is padding, and at positions t < start, which are not computed (every
    position still gives the chain its context). The draft logits exist a chunk of positions at a time."""
    _check_steps(batch, k)
    B, T = batch["aux"].shape[:2]
    dev = batch["aux"].device
    if start >= T:  # no chain starts here (every row's response is a single token)
        return torch.zeros(B, T, k, device=dev)
    was_training = drafter.training
    drafter.eval()
    tq = torch.arange(start, T, device=dev)  # the positions computed
    xs = drafter.ttt_hidden(batch["aux"], batch["next_ids"][:, : T + k - 1], k, tq if start > 0 else None,
                            first_ids=batch.get("first_ids"))
    drafter.train(was_training)
    nxt = batch["next_ids"]
    nxt = torch.cat([nxt, nxt.new_zeros(B, max(0, T + k - nxt.shape[1]))], 1)  # [B, >= T+k]
    targets = Targets(batch["hidden"], head, batch.get("lse"))
    # a target token's place in the draft vocabulary (-1: not in it, q = 0)
    ids = drafter.draft_ids().to(dev)
    t2d = torch.full((targets.vocab_size,), -1, dtype=torch.long, device=dev)
    t2d[ids] = torch.arange(len(ids), device=dev)
    r = torch.zeros(B, T, k, device=dev)
    n = position_chunk(B, len(ids))
    for i, x in enumerate(xs):
        at = 1 + i + tq
        xt = nxt[:, at]  # [B, S] token_{t+2+i}
        d = t2d[xt]
        lq = torch.cat([_log_q(drafter, x[:, c:c + n], d[:, c:c + n]) for c in range(0, x.shape[1], n)], 1)
        qx = torch.where(d >= 0, lq.exp(), torch.zeros_like(lq))
        px = targets.token_probs(at, xt)  # [B, S]
        ok = batch["valid"][:, at] & (px > 0)
        r[:, start:, i] = torch.where(ok, (qx / px.clamp_min(1e-30)).clamp_max(1.0), torch.zeros_like(px))
    return r


def _log_q(drafter, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """log q(d) [B, C] of the draft tokens d (draft-vocabulary places; -1 reads place 0, masked by the caller)."""
    lg = drafter.head_logits(x).float()  # [B, C, Vd]
    return lg.gather(-1, d.clamp_min(0).unsqueeze(-1)).squeeze(-1) - lg.logsumexp(-1)


def _check_steps(batch: dict[str, torch.Tensor], k: int) -> None:
    s = batch["valid"].shape[1] - batch["aux"].shape[1]
    if s < k:
        raise ValueError(f"teacher_forced_acceptance: features were built for {s} TTT steps, need k={k}")


def length_chunks(batch: dict[str, torch.Tensor], k: int, max_pad: float = 1.25) -> list[tuple[dict, int]]:
    """Split a padded feature batch into chunks of rows of similar length, each cut to its own longest row, so
    scoring computes few padded positions (one long rollout pads a batch several-fold). Rows with no response
    target are dropped. Returns [(chunk, first)]: chunk["rows"] are its rows' indices in batch; first = the
    chunk's earliest position a step starts at (its rows' prompts are context only). Padded positions per chunk
    <= max_pad x its real ones, or 4 rows or fewer."""
    valid = batch["valid"]
    B, T = batch["aux"].shape[:2]
    v = valid[:, :T + 1]
    has = v.any(1)
    last = T - v.flip(1).long().argmax(1)  # one past the last position a chain starts from (its aux is needed)
    first = v.long().argmax(1)
    rows = [b for b in torch.argsort(last, descending=True).tolist() if has[b]]
    chunks, cur, real = [], [], 0
    for b in rows:  # longest first: a chunk's first row sets its length
        n = int(last[b])
        if len(cur) >= 4 and (len(cur) + 1) * int(last[cur[0]]) > max_pad * (real + n):
            chunks.append(cur)
            cur, real = [], 0
        cur.append(b)
        real += n
    if cur:
        chunks.append(cur)
    out = []
    for c in chunks:
        idx = torch.tensor(sorted(c), device=valid.device)
        Tc = int(last[idx].max())
        out.append(({"aux": batch["aux"][idx, :Tc], "next_ids": batch["next_ids"][idx, :Tc + k - 1],
                     "hidden": batch["hidden"][idx, :Tc + k], "valid": valid[idx, :Tc + k],
                     **({"lse": batch["lse"][idx, :Tc + k]} if "lse" in batch else {}),
                     "rows": idx, **({"first_ids": batch["first_ids"][idx]} if "first_ids" in batch else {})},
                    int(first[idx].min())))
    return out


@torch.no_grad()
def teacher_forced_acceptance(drafter, batch: dict[str, torch.Tensor], k: int, head: TargetHead) -> dict:
    """batch: features built for >= k TTT steps (build_features / FeatureBuffer.sample); head: the LM head of the
    policy that produced them (its distributions are the targets).
    Returns {"mal", "acceptance_per_position", "stats", "row_mal", "row_steps"}: the engine's mean_accepted_length
    and acceptance_per_position in expectation on these sequences, the expected SpecStats (stats.merge pools
    several batches as the engine pools rows), each row's own MAL [B] (nan: a row with no verify step; the publish
    gate pairs drafters row by row) and expected verify steps [B] (0: none). MAL is 1.0 when no row has a second
    response token.
    Rows are scored in length_chunks, from their first response position on: the same pooled counts as the whole
    padded batch at every position, at a fraction of its cost (bench/NOTES.md, Tracking)."""
    _check_steps(batch, k)  # before length_chunks, whose cuts would hide too few steps
    to_device(batch, module_device(drafter))  # rows collated on the buffer's device (the host, say)
    if "lse" not in batch:  # the policy's normalizers: once per batch, kept for the next drafter scored on it
        batch["lse"] = row_lse(batch["hidden"], batch["lengths"], head)
    st = SpecStats()
    B, dev = batch["aux"].shape[0], batch["aux"].device
    row_mal, row_steps = torch.full((B,), math.nan, device=dev), torch.zeros(B, device=dev)
    for chunk, first in length_chunks(batch, k):
        cs, rm, rs = expected_row_stats(acceptance_ratios(drafter, chunk, k, head, first), chunk["valid"], k)
        st = st.merge(cs)
        row_mal[chunk["rows"]], row_steps[chunk["rows"]] = rm, rs
    return {"mal": st.mean_accepted_length if st.verify_rows else 1.0,
            "acceptance_per_position": st.acceptance_per_position, "stats": st, "row_mal": row_mal,
            "row_steps": row_steps}
