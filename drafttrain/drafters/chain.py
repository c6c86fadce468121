"""One-layer chain drafters (EAGLE-3, MTP): what they share. A subclass brings its layer's pieces:

    _fc(aux[B, T, X]) -> hidden [B, T, H]            the policy's states as the layer's hidden input
    _embed(ids) -> emb                               token embeddings as _qkv takes them
    _qkv(emb, hidden, pos, top, q_at) -> q, k, v, residual   attention inputs (q/k rotated; q at q_at only)
    _post_hidden(o, residual) -> (head input [B, m, Hd], hidden out [B, m, H])   the rest of the layer
    head_logits(x [.., Hd]) -> draft logits [.., Vd]   its LM head
    draft_ids(), config (num_attention_heads, num_key_value_heads, head_dim, vocab_size), rope, _fused (None:
    the training form), hard_targets (its loss: soft cross-entropy against the policy, or the rollout tokens)

Position t takes (token_{t+1}, its hidden from the policy's states at t) and predicts token_{t+2}; chain drafting feeds
the layer's output hidden back as the next position's hidden. Training unrolls that chain n steps (training-time
test); inference chains k drafts over the layer's own one-layer KV cache.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttrain.device import module_device
from drafttrain.drafters import ttt
from drafttrain.drafters.contract import TrainableDrafter
from drafttrain.drafters.ttt_attention import ttt_attention
from drafttrain.modeling import KVCache, Rope, attend, linear, step_mask
from drafttrain.spec import draft_chain


class ChainDrafter(nn.Module, TrainableDrafter):
    hard_targets = False  # the loss: soft cross-entropy against the policy (False) or on the rollout tokens (True)
    follows_policy = False  # trained online on the policy's hidden states
    trains = True
    score_grad = True  # False (freeze_scores): the attention scores are constants in training

    def freeze_scores(self) -> None:
        """Train with the attention scores as constants: q_proj and k_proj frozen, and no gradient into the layer's
        input through them (only through v and the residual). Where the drafter's attention is saturated (the shipped
        drafter's: q/k gradients ~1e-7 against ~1e-2 for the other weights) this drops a fifth of a step's work and
        stops AdamW, which scales even such gradients to ~lr-sized steps, from walking q and k on noise."""
        a = self.layers[0].self_attn
        for p in (a.q_proj.weight, a.k_proj.weight):
            p.requires_grad_(False)
        self.score_grad = False

    def _attention_inputs(self, x, pos, top: int | None = None, q_at: torch.Tensor | None = None):
        """The layer's attention input x [B, m, X] at positions pos [B, m] (top: an upper bound of pos, if known) ->
        q [B, Hq, m, D], k, v [B, Hkv, m, D]: layers[0].self_attn's q/k/v projections, q and k rotated.
        q_at [S] (positions shared by the rows): q at those positions only, [B, Hq, S, D]. The training form
        projects q there alone (a quarter of the positions at the default query_frac; the saving: bench/NOTES.md,
        EAGLE-3); the runtime form runs its one fused q|k|v matmul and rotates q and k in one pass."""
        c = self.config
        B, m, _ = x.shape
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self._fused is None:
            a = self.layers[0].self_attn
            xs = x if self.score_grad else x.detach()  # the scores' inputs
            xq, qpos = (xs, pos) if q_at is None else (xs[:, q_at], pos[:, q_at])
            q = Rope.rotate(a.q_proj(xq).view(B, -1, Hq, D), self.rope.tables(qpos, top))
            k = Rope.rotate(a.k_proj(xs).view(B, m, Hkv, D), self.rope.tables(pos, top))
            v = a.v_proj(x).view(B, m, Hkv, D)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        qk, v = linear(x, self._fused["qkv"]).view(B, m, Hq + 2 * Hkv, D).split([Hq + Hkv, Hkv], dim=2)
        q, k = Rope.rotate(qk, self.rope.tables(pos, top)).split([Hq, Hkv], dim=2)
        q = q.transpose(1, 2)
        return (q if q_at is None else q[:, :, q_at]), k.transpose(1, 2), v.transpose(1, 2)

    # ---- training: training-time test ---------------------------------------------------------------------
    def ttt_logits(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int,
                   queries: torch.Tensor | None = None, first_ids=None) -> list[torch.Tensor]:
        """ttt_hidden's steps through the head: `steps` draft-logit tensors [B, T (or S), Vd]."""
        return [self.head_logits(x) for x in self.ttt_hidden(aux, next_ids, steps, queries, first_ids)]

    def ttt_hidden(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int,
                   queries: torch.Tensor | None = None, first_ids=None) -> list[torch.Tensor]:
        """aux [B, T, X] the policy's states it reads at positions t; next_ids [B, T+steps-1] with next_ids[:, t] =
        token_{t+1}. Returns `steps` tensors [B, T, Hd], the head's inputs (head_logits gives the draft logits);
        step i at position t predicts token_{t+2+i}.

        Step i >= 1 feeds token_{t+1+i} with the drafter's own hidden from step i-1 at t, exactly as chain
        drafting does at position t+i. Its query sees the step-0 keys at positions <= t (the policy-derived
        cache) plus, diagonally, its own chain's keys from steps 1..i (SpecForge's TTT attention).

        queries [S] (ascending positions, shared by the rows): those positions only, [B, S, Hd], equal to the full
        result there. Every position still gives its step-0 key and value; the attention, the MLP, the head
        and every later step run for the S queries alone (cheaper training steps over more rollouts).
        Runs in the training form or in the engine's runtime form (fuse_for_inference: scoring what the engine runs)."""
        B, T, _ = aux.shape
        pos = torch.arange(T, device=aux.device).expand(B, T)
        hidden = self._fc(aux)  # [B, T, H]
        ks, vs, outs = [], [], []
        for i in range(steps):
            if i == 0:
                q, k, v, res = self._qkv(self._embed(next_ids[:, :T]), hidden, pos, q_at=queries)  # token_{t+1}
                if queries is not None:
                    res, pos = res[:, queries], pos[:, queries]
            else:
                tok = next_ids[:, i:i + T] if queries is None else next_ids[:, queries + i]  # token_{t+1+i}
                q, k, v, res = self._qkv(self._embed(tok), hidden, pos + i)
            if i == 0:
                k0, v0 = k, v  # [B, Hkv, T, D]
            else:
                ks.append(k)  # [B, Hkv, S, D]
                vs.append(v)
            o = ttt_attention(q, k0, v0, ks, vs, queries)  # [B, Hq, S, D]
            x, hidden = self._post_hidden(o, res)
            outs.append(x)
        return outs

    def ttt_loss(self, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator: torch.Generator | None = None, first_ids=None, objective: ttt.Objective = ttt.KL):
        """ttt.ttt_loss unrolled `steps` steps: soft cross-entropy against the policy's distribution, or (hard_targets)
        cross-entropy on the rollout tokens. first_ids (token_0) is not read: position t's input is token_{t+1} with
        the policy's state there."""
        return ttt.ttt_loss(self, aux, next_ids, targets, valid, steps, decay, query_frac, generator,
                            hard=self.hard_targets, objective=objective)

    # ---- inference: chain drafting over a KV cache --------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "ChainState":
        c = self.config
        return ChainState(KVCache(1, batch, c.num_key_value_heads, max_len, c.head_dim, device=module_device(self)))

    def _cached_step(self, st, emb, hidden, pos0, n_valid=None):
        """m positions per row at pos0[B].. (the first n_valid[b] real, default all) enter the cache; returns (draft
        logits [B, Vd], pre-norm hidden [B, H]) at each row's last real position only. The catch-up positions'
        keys and values depend on their inputs alone (the policy's aux states), so no earlier position's output is
        needed: attention, MLP and head run for one query per row (a prompt catch-up: one instead of P)."""
        B, m, _ = emb.shape
        dev = pos0.device
        pos = pos0.view(B, 1) + torch.arange(m, device=dev).view(1, m) if m > 1 else pos0.view(B, 1)
        top = int(pos0.max())
        q, k, v, res = self._qkv(emb, hidden, pos, top + m - 1)
        if n_valid is not None and int(n_valid.min()) == m:
            n_valid = None  # no padding (one row, or rows all extending by m)
        valid = None if n_valid is None else torch.arange(m, device=dev).view(1, m) < n_valid.view(B, 1)
        length = min(top + m, st.cache.max_len)
        st.cache.expose(length)  # before the write: it zeroes what it newly exposes
        st.cache.write(0, k, v, pos, valid, start=top if B == 1 else None)  # one row: a slice write
        if m > 1:  # the last real query of each row
            last = (n_valid - 1) if n_valid is not None else torch.full((B,), m - 1, device=dev)
            rows = torch.arange(B, device=dev)
            q = q[rows, :, last].unsqueeze(2)  # [B, Hq, 1, D]
            res = res[rows, last].unsqueeze(1)  # [B, 1, H]
            pos0 = pos0 + last
        o = attend(q, st.cache, 0, step_mask(pos0, 1, length, top if B == 1 and m == 1 else None), length)
        x, pre = self._post_hidden(o, res)
        return self.head_logits(x[:, 0]), pre[:, 0]

    def _to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[B, Vd] -> [B, V] with -inf outside the draft vocabulary."""
        if draft_logits.shape[-1] == self.config.vocab_size:  # the draft vocabulary is the whole vocabulary
            return draft_logits
        full = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_ids()] = draft_logits
        return full

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Extend the drafter cache with the n_new[b] newly verified positions of each row (new_ids [B, m] =
        token_{t+1}, aux [B, m, X] at positions start[b] + j), then chain-draft k tokens.
        Returns (draft tokens [B, k], draft probs [B, k, V] or None for one-hot greedy drafts)."""
        lg, h = self._cached_step(st, self._embed(new_ids), self._fc(aux), start, n_new)  # [B, Vd], [B, H]
        pos = start + n_new  # next chain position per row

        def step(d, i):
            nonlocal h
            lg, h = self._cached_step(st, self._embed(d).unsqueeze(1), h.unsqueeze(1), pos + i)
            return self._to_target(lg)

        return draft_chain(self._to_target(lg), step, k, params, greedy_drafts, generator)


class ChainState:
    """Per-generation drafter state: its one-layer KV cache."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.select_rows(idx)


