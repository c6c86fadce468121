"""EAGLE-3 drafter (Li et al. 2025) in the speculators / vLLM weight layout, with its training-time-test loss.

Layout (speculators' own tensor names, which speculators and vLLM's LlamaForCausalLMEagle3 both load):
    embed_tokens [V, H]                 frozen copy of the policy's embeddings
    fc           [H, A*H]               fuses A aux hidden states of the policy (inputs of layers aux_layer_ids)
    layers.0.*   one Llama decoder layer over concat(input_layernorm(emb), hidden_norm(hidden)) of width 2H
                 (the original EAGLE code's midlayer.*, which this project wrote before: load_state_dict takes it too)
    norm [H], lm_head [Vd, H]           over a draft vocabulary of Vd tokens; d2t[Vd] offsets (target = i + d2t[i]),
                                        t2d[V] bool mask of the target tokens the draft vocabulary covers
Position t takes (token_{t+1}, fc(aux_t)) and predicts token_{t+2}. Chain drafting feeds the layer's pre-norm
output back as the next position's hidden. Training unrolls that chain n steps (training-time test).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttrain.drafters import ttt
from drafttrain.drafters.contract import Reads
from drafttrain.drafters.weights import check_tensors
from drafttrain.modeling import KVCache, PackedLinear, Rope, attend, fold_norm, linear, rms_norm, rms_unit, step_mask
from drafttrain.quant import AoInt8
from drafttrain.spec import draft_chain


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the policy's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512

    def __post_init__(self):
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)


def default_aux_layer_ids(n_layers: int) -> tuple[int, ...]:
    """(1, n//2, n-1): distinct for any n >= 3 (vLLM's default (2, n//2, n-3) collides on small targets)."""
    return (1, n_layers // 2, n_layers - 1)


class _Attn(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, D = c.num_attention_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(H * D, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.hidden_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.self_attn = _Attn(c)
        self.mlp = _MLP(c)


class Eagle3Drafter(nn.Module):
    kind = "eagle3"
    follows_policy = False  # trained online on the policy's hidden states
    trains = True

    def __init__(self, c: Eagle3Config):
        super().__init__()
        if len(set(c.aux_layer_ids)) != len(c.aux_layer_ids) or any(
                not 0 <= i < c.target_num_layers for i in c.aux_layer_ids) or list(c.aux_layer_ids) != sorted(
                c.aux_layer_ids):
            raise ValueError(f"drafter.eagle3.aux_layer_ids: {list(c.aux_layer_ids)} must be distinct, ascending "
                             f"layers of the policy in [0, {c.target_num_layers - 1}]")
        if not 0 < c.draft_vocab_size <= c.vocab_size:
            raise ValueError(f"drafter.eagle3.draft_vocab_size: {c.draft_vocab_size} must be in [1, policy vocab "
                             f"{c.vocab_size}]")
        self.config = c
        A, H = len(c.aux_layer_ids), c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(A * H, H, bias=False)
        self.layers = nn.ModuleList([_MidLayer(c)])  # one decoder layer: speculators' layers.0.*
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.rope = Rope.from_theta(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self._fused: dict | None = None  # the engine's inference form (fuse_for_inference); training never sets it

    # norms are stored as bare parameters; expose the `.weight` names of the speculators layout
    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        return {_to_ext(k): v for k, v in sd.items()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state_dict = speculators_names(state_dict)
        check_weights(self, state_dict)
        return super().load_state_dict({_to_int(k): v for k, v in state_dict.items()}, strict=strict, assign=assign)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    @property
    def reads(self) -> Reads:
        return Reads(aux_layers=self.config.aux_layer_ids)

    def set_vocab_map(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd]: the target token ids the draft vocabulary covers, ascending."""
        ids = draft_ids.sort().values
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size) + self.d2t  # [Vd] target ids

    @torch.no_grad()
    def fuse_for_inference(self, int8: bool) -> "Eagle3Drafter":
        """The engine's runtime form (a copy that is never trained): q|k|v and gate|up fused into one matmul each,
        every linear prepacked for oneDNN (fp32) or torch.ao dynamic int8 per channel (int8 only changes acceptance,
        never the output distribution). RMS norms are folded away: the embedding table is stored already normed, and
        every other norm's weight is folded into the columns of the linear it feeds (modeling.fold_norm)."""
        c, L = self.config, self.layers[0]
        a, mlp = L.self_attn, L.mlp
        H = c.hidden_size

        def make(*ws, norm=None, cols=slice(None)):
            ws = [w.detach().float().clone() for w in ws]
            if norm is not None:
                for w in ws:
                    w[:, cols] = fold_norm(w[:, cols], norm.detach().float())
            return AoInt8(ws, None, 0) if int8 else PackedLinear.wrap(torch.cat(ws).contiguous())

        self._fused = {"c": torch.tensor((H * c.rms_norm_eps) ** 0.5),  # rms_unit's constant
                       "emb": rms_norm(self.embed_tokens.weight.float(), L.input_layernorm, c.rms_norm_eps),
                       "qkv": make(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, norm=L.hidden_norm,
                                   cols=slice(H, 2 * H)),
                       "o": make(a.o_proj.weight),
                       "gate_up": make(mlp.gate_proj.weight, mlp.up_proj.weight, norm=L.post_attention_layernorm),
                       "down": make(mlp.down_proj.weight), "fc": make(self.fc.weight),
                       "lm_head": make(self.lm_head.weight, norm=self.norm)}
        return self

    def _fc(self, aux):
        return self.fc(aux) if self._fused is None else linear(aux, self._fused["fc"])

    def _embed(self, ids):
        """Token embeddings as _qkv takes them: raw (training form) or already normed (inference form)."""
        return self.embed_tokens(ids) if self._fused is None else F.embedding(ids, self._fused["emb"])

    # ---- the decoder layer -------------------------------------------------------------------------------
    def _qkv(self, emb, hidden, pos, top: int | None = None):
        """emb, hidden [B, m, H], pos [B, m] (top: an upper bound of pos, if known) -> q [B, Hq, m, D],
        k, v [B, Hkv, m, D], residual [B, m, H]."""
        c, L = self.config, self.layers[0]
        if self._fused is None:
            x = torch.cat([rms_norm(emb, L.input_layernorm, c.rms_norm_eps),
                           rms_norm(hidden, L.hidden_norm, c.rms_norm_eps)], -1)  # [B, m, 2H]
        else:  # emb is normed already (_embed); hidden_norm's weight is in the qkv columns
            x = torch.cat([emb, rms_unit(hidden, self._fused["c"])], -1)
        B, m, _ = x.shape
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self._fused is None:
            a = L.self_attn
            qkv = torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)
        else:
            qkv = linear(x, self._fused["qkv"])
        qk, v = qkv.view(B, m, Hq + 2 * Hkv, D).split([Hq + Hkv, Hkv], dim=2)
        q, k = Rope.rotate(qk, self.rope.tables(pos, top)).split([Hq, Hkv], dim=2)  # q and k in one pass
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), hidden

    def _post(self, o, residual):
        """attention output o [B, Hq, m, D] -> (draft logits [B, m, Vd], pre-norm hidden [B, m, H])."""
        c, L, f = self.config, self.layers[0], self._fused
        B, _, m, _ = o.shape
        o = o.transpose(1, 2).reshape(B, m, -1)
        if f is None:
            h = L.self_attn.o_proj(o) + residual
            pre = L.mlp(rms_norm(h, L.post_attention_layernorm, c.rms_norm_eps)) + h
            return self.lm_head(rms_norm(pre, self.norm, c.rms_norm_eps)), pre
        h = linear(o, f["o"]) + residual
        g, u = linear(rms_unit(h, f["c"]), f["gate_up"]).chunk(2, dim=-1)  # norm weights folded (fuse_for_inference)
        pre = linear(F.silu(g) * u, f["down"]) + h
        return linear(rms_unit(pre, f["c"]), f["lm_head"]), pre

    # ---- training: training-time test ---------------------------------------------------------------------
    def ttt_logits(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int,
                   queries: torch.Tensor | None = None, first_ids=None) -> list[torch.Tensor]:
        """aux [B, T, A*H] policy aux states at positions t; next_ids [B, T+steps-1] with next_ids[:, t] =
        token_{t+1}. Returns `steps` draft-logit tensors [B, T, Vd]; step i at position t predicts token_{t+2+i}.

        Step i >= 1 feeds token_{t+1+i} with the drafter's own hidden from step i-1 at t, exactly as chain
        drafting does at position t+i. Its query sees the step-0 keys at positions <= t (the policy-derived
        cache) plus, diagonally, its own chain's keys from steps 1..i (SpecForge's TTT attention).

        queries [S] (ascending positions, shared by the rows): logits at those positions only, [B, S, Vd], equal to
        the full result there. Every position still gives its step-0 key and value; the attention, the MLP, the head
        and every later step run for the S queries alone (cheaper training steps over more rollouts).
        Runs in the training form or in the engine's runtime form (fuse_for_inference: scoring what the engine runs)."""
        c = self.config
        B, T, _ = aux.shape
        pos = torch.arange(T).expand(B, T)
        hidden = self._fc(aux)  # [B, T, H]
        scale = 1.0 / math.sqrt(c.head_dim)
        rep = c.num_attention_heads // c.num_key_value_heads
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        if queries is not None:
            causal = causal[queries]  # [S, T]
        ks, vs, outs = [], [], []
        for i in range(steps):
            if i == 0:
                q, k, v, res = self._qkv(self._embed(next_ids[:, :T]), hidden, pos)  # token_{t+1}
                if queries is not None:
                    q, res = q[:, :, queries], res[:, queries]
                    pos = pos[:, queries]
            else:
                tok = next_ids[:, i:i + T] if queries is None else next_ids[:, queries + i]  # token_{t+1+i}
                q, k, v, res = self._qkv(self._embed(tok), hidden, pos + i)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, Hq, T (step 0) or S, D]
            if i == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, Hq, S, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [((q * kj).sum(-1) * scale).unsqueeze(-1) for kj in ks]  # each [B, Hq, S, 1]
            p = torch.cat([s0, *diag], -1).softmax(-1)
            o = p[..., :T] @ v0
            for j, vj in enumerate(vs):
                o = o + p[..., T + j:T + j + 1] * vj
            logits, hidden = self._post(o, res)
            outs.append(logits)
        return outs

    def ttt_loss(self, aux, next_ids, target_probs, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator: torch.Generator | None = None, first_ids=None):
        """Soft cross-entropy against the policy's distribution, unrolled `steps` steps (ttt.ttt_loss); first_ids
        (token_0) is not read: position t's input is token_{t+1} with the policy's state there."""
        return ttt.ttt_loss(self, aux, next_ids, target_probs, valid, steps, decay, query_frac, generator)

    # ---- inference: chain drafting over a KV cache --------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "Eagle3State":
        c = self.config
        return Eagle3State(KVCache(1, batch, c.num_key_value_heads, max_len, c.head_dim))

    def _cached_step(self, st, emb, hidden, pos0, n_valid=None):
        """m positions per row at pos0[B].. (the first n_valid[b] real, default all) enter the cache; returns (draft
        logits [B, Vd], pre-norm hidden [B, H]) at each row's last real position only. The catch-up positions'
        keys and values depend on their inputs alone (the policy's aux states), so no earlier position's output is
        needed: attention, MLP and head run for one query per row (a prompt catch-up: one instead of P)."""
        B, m, _ = emb.shape
        pos = pos0.view(B, 1) + torch.arange(m).view(1, m) if m > 1 else pos0.view(B, 1)
        top = int(pos0.max())
        q, k, v, res = self._qkv(emb, hidden, pos, top + m - 1)
        if n_valid is not None and int(n_valid.min()) == m:
            n_valid = None  # no padding (one row, or rows all extending by m)
        valid = None if n_valid is None else torch.arange(m).view(1, m) < n_valid.view(B, 1)
        length = min(top + m, st.cache.max_len)
        st.cache.expose(length)  # before the write: it zeroes what it newly exposes
        st.cache.write(0, k, v, pos, valid, start=top if B == 1 else None)  # one row: a slice write
        if m > 1:  # the last real query of each row
            last = (n_valid - 1) if n_valid is not None else torch.full((B,), m - 1)
            rows = torch.arange(B)
            q = q[rows, :, last].unsqueeze(2)  # [B, Hq, 1, D]
            res = res[rows, last].unsqueeze(1)  # [B, 1, H]
            pos0 = pos0 + last
        o = attend(q, st.cache, 0, step_mask(pos0, 1, length, top if B == 1 and m == 1 else None), length)
        logits, pre = self._post(o, res)
        return logits[:, 0], pre[:, 0]

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
        token_{t+1}, aux [B, m, A*H] at positions start[b] + j), then chain-draft k tokens.
        Returns (draft tokens [B, k], draft probs [B, k, V] or None for one-hot greedy drafts)."""
        lg, h = self._cached_step(st, self._embed(new_ids), self._fc(aux), start, n_new)  # [B, Vd], [B, H]
        pos = start + n_new  # next chain position per row

        def step(d, i):
            nonlocal h
            lg, h = self._cached_step(st, self._embed(d).unsqueeze(1), h.unsqueeze(1), pos + i)
            return self._to_target(lg)

        return draft_chain(self._to_target(lg), step, k, params, greedy_drafts, generator)


class Eagle3State:
    """Per-generation drafter state: its one-layer KV cache."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.select_rows(idx)


_NORMS = ("layers.0.input_layernorm", "layers.0.hidden_norm", "layers.0.post_attention_layernorm", "norm")
EAGLE_LAYER, LAYER = "midlayer.", "layers.0."  # the original EAGLE naming of the decoder layer, speculators' naming


def speculators_names(weights: dict) -> dict:
    """weights with the decoder layer under speculators' layers.0.* (EAGLE's midlayer.* renamed; other names kept)."""
    if not any(k.startswith(EAGLE_LAYER) for k in weights):
        return weights
    return {(LAYER + k[len(EAGLE_LAYER):] if k.startswith(EAGLE_LAYER) else k): v for k, v in weights.items()}


def _to_ext(k: str) -> str:
    return k + ".weight" if k in _NORMS else k


def _to_int(k: str) -> str:
    return k[: -len(".weight")] if k.endswith(".weight") and k[: -len(".weight")] in _NORMS else k


def check_weights(drafter: nn.Module, weights: dict) -> None:
    """One-line error naming the first missing, unexpected or mis-shaped tensor, or a non-finite one."""
    check_tensors(drafter.state_dict(), speculators_names(weights), hint="policy/drafter size or vocabulary mismatch?")


def config_from_policy(policy_config, aux_layer_ids=None, draft_vocab_size=None, intermediate_size=None):
    """Size a fresh EAGLE-3 drafter from the policy's HF config."""
    pc = policy_config
    n_heads = pc.num_attention_heads
    return Eagle3Config(
        hidden_size=pc.hidden_size, num_attention_heads=n_heads,
        num_key_value_heads=getattr(pc, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(pc, "head_dim", None) or pc.hidden_size // n_heads,
        intermediate_size=intermediate_size or pc.intermediate_size, vocab_size=pc.vocab_size,
        draft_vocab_size=draft_vocab_size or pc.vocab_size,
        aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(pc.num_hidden_layers),
        target_num_layers=pc.num_hidden_layers, rms_norm_eps=pc.rms_norm_eps,
        rope_theta=float(_rope_theta(pc)), max_position_embeddings=pc.max_position_embeddings)


def _rope_theta(pc) -> float:
    rp = getattr(pc, "rope_parameters", None) or {}
    return rp.get("rope_theta", getattr(pc, "rope_theta", 10000.0))
