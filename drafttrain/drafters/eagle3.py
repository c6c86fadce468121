"""EAGLE-3 drafter (Li et al. 2025) in the speculators / vLLM weight layout, with its training-time-test loss.

Layout (speculators' own tensor names, which speculators and vLLM's LlamaForCausalLMEagle3 both load):
    embed_tokens [V, H]                 frozen copy of the policy's embeddings
    fc           [H, A*H]               fuses A aux hidden states of the policy (inputs of layers aux_layer_ids)
    layers.0.*   one Llama decoder layer over concat(input_layernorm(emb), hidden_norm(hidden)) of width 2H
                 (the original EAGLE code's midlayer.*, which this project wrote before: load_state_dict takes it too)
    norm [H], lm_head [Vd, H]           over a draft vocabulary of Vd tokens; d2t[Vd] offsets (target = i + d2t[i]),
                                        t2d[V] bool mask of the target tokens the draft vocabulary covers
A fresh drafter with Vd < V takes its draft vocabulary from token counts of the policy's rollouts (set_draft_vocab,
vocab.draft_vocab); a checkpoint's map is fixed. restrict_draft_vocab cuts a drafter down to fewer tokens.
Position t takes (token_{t+1}, fc(aux_t)) and predicts token_{t+2}. Chain drafting feeds the layer's pre-norm
output back as the next position's hidden. Training unrolls that chain n steps (training-time test): chain.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttrain.drafters.chain import ChainDrafter
from drafttrain.drafters.contract import Reads
from drafttrain.drafters.vocab import default_draft_vocab_size, draft_vocab
from drafttrain.drafters.weights import check_tensors
from drafttrain.modeling import PackedLinear, Rope, fold_norm, linear, rms_norm, rms_unit
from drafttrain.quant import quant_linear


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


class Eagle3Drafter(ChainDrafter):
    kind = "eagle3"

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
        # a fresh drafter over part of the vocabulary: its map is still the placeholder (the first Vd ids) until
        # set_draft_vocab chooses it; a set or loaded map is fixed (the head's rows are those tokens')
        self.vocab_open = c.draft_vocab_size < c.vocab_size
        self._fused: dict | None = None  # the engine's inference form (fuse_for_inference); training never sets it

    # norms are stored as bare parameters; expose the `.weight` names of the speculators layout
    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        return {_to_ext(k): v for k, v in sd.items()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state_dict = speculators_names(state_dict)
        check_weights(self, state_dict)
        self.vocab_open = False  # the weights bring their map
        return super().load_state_dict({_to_int(k): v for k, v in state_dict.items()}, strict=strict, assign=assign)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    @property
    def reads(self) -> Reads:
        return Reads(aux_layers=self.config.aux_layer_ids)

    def set_vocab_map(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd]: the target token ids the draft vocabulary covers (distinct; sorted here)."""
        c = self.config
        ids = draft_ids.to(self.d2t.device).unique()  # sorted
        span = (int(ids[0]), int(ids[-1])) if len(ids) else (0, -1)
        if len(ids) != len(draft_ids) or len(ids) != c.draft_vocab_size or span[0] < 0 or span[1] >= c.vocab_size:
            raise ValueError(f"draft_ids: must be {c.draft_vocab_size} distinct token ids in [0, {c.vocab_size}), "
                             f"got {len(draft_ids)} ({len(ids)} distinct) in {span[0]}..{span[1]}")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self.vocab_open = False

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t  # [Vd] target ids

    def needs_draft_vocab(self) -> bool:
        return self.vocab_open

    def set_draft_vocab(self, counts: torch.Tensor, keep=()) -> torch.Tensor | None:
        """counts [V] or [n, V] (vocab.draft_vocab): a fresh drafter takes the Vd most frequent tokens, `keep` among
        them, as its draft vocabulary and returns them [Vd]; None where its map is fixed already."""
        if not self.vocab_open:
            return None
        ids = draft_vocab(counts.to(self.d2t.device), self.config.draft_vocab_size, keep)
        self.set_vocab_map(ids)
        return ids

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
            return quant_linear("int8", "ao", ws, None, 0) if int8 else PackedLinear.wrap(torch.cat(ws).contiguous())

        self._fused = {"c": torch.tensor((H * c.rms_norm_eps) ** 0.5, device=self.fc.weight.device),  # rms_unit's c
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
    def _qkv(self, emb, hidden, pos, top: int | None = None, q_at=None):
        """emb, hidden [B, m, H], pos [B, m] (top: an upper bound of pos, if known) -> q [B, Hq, m, D],
        k, v [B, Hkv, m, D], residual [B, m, H]."""
        c, L = self.config, self.layers[0]
        if self._fused is None:
            x = torch.cat([rms_norm(emb, L.input_layernorm, c.rms_norm_eps),
                           rms_norm(hidden, L.hidden_norm, c.rms_norm_eps)], -1)  # [B, m, 2H]
        else:  # emb is normed already (_embed); hidden_norm's weight is in the qkv columns
            x = torch.cat([emb, rms_unit(hidden, self._fused["c"])], -1)
        return (*self._attention_inputs(x, pos, top, q_at), hidden)

    def _post_hidden(self, o, residual):
        """attention output o [B, Hq, m, D] -> (the head's input: the final-normed hidden [B, m, H], pre-norm hidden
        [B, m, H])."""
        c, L, f = self.config, self.layers[0], self._fused
        B, _, m, _ = o.shape
        o = o.transpose(1, 2).reshape(B, m, -1)
        if f is None:
            h = L.self_attn.o_proj(o) + residual
            pre = L.mlp(rms_norm(h, L.post_attention_layernorm, c.rms_norm_eps)) + h
            return rms_norm(pre, self.norm, c.rms_norm_eps), pre
        h = linear(o, f["o"]) + residual
        g, u = linear(rms_unit(h, f["c"]), f["gate_up"]).chunk(2, dim=-1)  # norm weights folded (fuse_for_inference)
        pre = linear(F.silu(g) * u, f["down"]) + h
        return rms_unit(pre, f["c"]), pre  # the final norm's weight is in lm_head's columns

    def head_logits(self, x):
        """[.., H] -> draft logits [.., Vd]."""
        return self.lm_head(x) if self._fused is None else linear(x, self._fused["lm_head"])

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


def restrict_draft_vocab(d: Eagle3Drafter, draft_ids: torch.Tensor) -> Eagle3Drafter:
    """A copy of `d` that drafts over draft_ids [Vd'] only (target ids among d.draft_ids(), e.g. vocab.draft_vocab's
    most frequent tokens): its lm_head keeps those tokens' rows and its map covers them, so their logits are d's and
    it drafts what d drafts wherever d's choice is among them. Converts a full-vocabulary drafter."""
    have = d.draft_ids()  # [Vd] ascending
    ids = draft_ids.to(have.device).unique()  # sorted
    rows = torch.searchsorted(have, ids).clamp_max(len(have) - 1)  # each id's row in d's head
    if not len(ids) or not torch.equal(have[rows], ids):
        raise ValueError(f"draft_ids: must be token ids among the drafter's {len(have)}-token draft vocabulary, got "
                         f"{len(ids)} distinct ids, {int((have[rows] != ids).sum())} outside it")
    out = Eagle3Drafter(dataclasses.replace(d.config, draft_vocab_size=len(ids)))
    out.set_vocab_map(ids)
    weights = {**d.state_dict(), "lm_head.weight": d.lm_head.weight.detach()[rows], "d2t": out.d2t, "t2d": out.t2d}
    out.to(device=have.device, dtype=d.lm_head.weight.dtype).load_state_dict(weights)
    return out


def config_from_policy(policy_config, aux_layer_ids=None, draft_vocab_size=None, intermediate_size=None):
    """Size a fresh EAGLE-3 drafter from the policy's HF config."""
    pc = policy_config
    n_heads = pc.num_attention_heads
    return Eagle3Config(
        hidden_size=pc.hidden_size, num_attention_heads=n_heads,
        num_key_value_heads=getattr(pc, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(pc, "head_dim", None) or pc.hidden_size // n_heads,
        intermediate_size=intermediate_size or pc.intermediate_size, vocab_size=pc.vocab_size,
        draft_vocab_size=draft_vocab_size or default_draft_vocab_size(pc.vocab_size),
        aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(pc.num_hidden_layers),
        target_num_layers=pc.num_hidden_layers, rms_norm_eps=pc.rms_norm_eps,
        rope_theta=float(rope_theta_of(pc)), max_position_embeddings=pc.max_position_embeddings)


def rope_theta_of(pc) -> float:
    """The policy config's RoPE base (rope_parameters, else rope_theta, else 10000)."""
    rp = getattr(pc, "rope_parameters", None) or {}
    return rp.get("rope_theta", getattr(pc, "rope_theta", 10000.0))


# ---- its config section: drafter.eagle3 -------------------------------------------------------------------------
@dataclass
class Section:  # drafter.eagle3: sizes of a fresh EAGLE-3 drafter (a checkpoint at drafter.path fixes its own)
    aux_layer_ids: Optional[list[int]] = None  # policy layers whose inputs feed the drafter; null = kind's default
    draft_vocab_size: Optional[int] = None  # null = min(32000, policy vocab); fresh: its most frequent rollout tokens
    intermediate_size: Optional[int] = None  # drafter MLP width; null = the policy's


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.eagle3, message)."""
    return [(s.draft_vocab_size is None or s.draft_vocab_size >= 1, "draft_vocab_size",
             f"must be >= 1 or null (the policy's), got {s.draft_vocab_size}"),
            (s.intermediate_size is None or s.intermediate_size >= 1, "intermediate_size",
             f"must be >= 1 or null (the policy's), got {s.intermediate_size}")]
