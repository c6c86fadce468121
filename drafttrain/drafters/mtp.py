"""MTP head (drafter.kind=mtp): a DeepSeek-style multi-token-prediction module on the policy's final hidden state,
trained online by cross-entropy on the rollout tokens (as slime / Megatron train MTP: mtp_loss_scaling_factor, the
heads detached from the backbone: the captured states carry no gradient into the policy).

The module, at position t: x = fc([emb(token_{t+1}); h_t]), one Llama decoder block over x (attention without an
input norm, then post-attention norm and MLP), out = the block's output, logits = lm_head(out) predicting
token_{t+2}. h_t is the policy's final hidden state after its final norm (so DeepSeek's hnorm is that norm), emb is
a frozen copy of the policy's embeddings already RMS-normed (DeepSeek's enorm, unit weight, folded into the table),
lm_head is the policy's own, shared as DeepSeek shares it: read live from the policy the head is bound to (never a
copy, never trained here, not in the drafter's weights), so it is always the current policy's in both engines.
Drafting chains the one module: step i feeds out_{i-1} as the next position's h (DeepSeek's module j takes module
j-1's output; vLLM reuses one MTP layer for every step the same way).

Why this form: it is exactly what vLLM's `eagle` (EAGLE-1) path computes for a Llama target (EagleLlamaForCausalLM:
fc over [embedding; target hidden], decoder layer 0 with its input norm removed, output = hidden + residual, own
its own embed_tokens where the checkpoint has one, the target's lm_head, no final norm), so the heads are served
there without approximation. DeepSeek's final norm before the shared head is the one piece that form lacks (the
block learns to feed the head without it).

A fresh head: fc = [0 | I] (x = h_t), the block's output projections zero (the block starts as the identity), the
shared head: it starts by drafting the policy's own next-token distribution one position late, and learns.
Weights: vLLM EAGLE-1 names (embed_tokens.weight, fc.weight, layers.0.*); saved with `save` below.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from drafttrain.device import module_device
from drafttrain.atomic import atomic_dir
from drafttrain.drafters.chain import ChainDrafter
from drafttrain.drafters.contract import Reads
from drafttrain.drafters.eagle3 import rope_theta_of
from drafttrain.drafters.speculators import read_speculators_config, read_weights
from drafttrain.drafters.weights import check_tensors
from drafttrain.modeling import PackedLinear, Rope, fold_norm, linear, rms_norm, rms_unit
from drafttrain.quant import quant_linear

KIND = "mtp"


@dataclass
class MtpConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512

    @property
    def draft_vocab_size(self) -> int:  # the shared head covers the whole vocabulary
        return self.vocab_size


class _RMSNorm(nn.Module):  # a `.weight` parameter: vLLM's name for it
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class _Block(nn.Module):
    def __init__(self, c: MtpConfig):
        super().__init__()
        H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(H, c.num_attention_heads * D, bias=False)
        a.k_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        a.v_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        a.o_proj = nn.Linear(c.num_attention_heads * D, H, bias=False)
        self.post_attention_layernorm = _RMSNorm(H)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.mlp.down_proj = nn.Linear(I, H, bias=False)


class PolicyHead:
    """The LM head of the policy an MTP head is bound to, read at each use. A copy of the drafter (the engine's
    runtime, a staged swap) gets its own binding to the same policy, which the engine may rebind to its own."""

    def __init__(self, policy=None):
        self.policy = policy

    def __deepcopy__(self, memo):
        return PolicyHead(self.policy)

    def weight(self) -> torch.Tensor:
        if self.policy is None:
            raise ValueError("MTP head: not bound to a policy (its LM head is the policy's): build it with "
                             "drafters.build_drafter(cfg, policy), or call bind_policy(policy)")
        return self.policy.get_output_embeddings().weight.detach().float()


class MtpDrafter(ChainDrafter):
    kind = KIND
    hard_targets = True  # cross-entropy on the rollout tokens
    reads = Reads(final_hidden=True)

    def __init__(self, c: MtpConfig, policy=None):
        super().__init__()
        self.config = c
        H, V = c.hidden_size, c.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([_Block(c)])
        self.lm_head = PolicyHead(policy)  # the policy's, shared (not a parameter of the drafter)
        self.rope = Rope.from_theta(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self._fused: dict | None = None

    def bind_policy(self, policy) -> None:
        """Draft with `policy`'s LM head from now on (an engine binds its own copy to the policy it serves)."""
        self.lm_head.policy = policy

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        check_tensors(self.state_dict(), state_dict, hint="an MTP head of another size or vocabulary?")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.fc.weight.device)

    @torch.no_grad()
    def fuse_for_inference(self, int8: bool) -> "MtpDrafter":
        """The engine's form: q|k|v and gate|up fused, every linear prepacked for oneDNN (fp32) or torch.ao dynamic
        int8; the post-attention norm's weight folded into gate|up."""
        L = self.layers[0]
        a, mlp = L.self_attn, L.mlp

        def make(*ws, norm=None):
            ws = [w.detach().float().clone() for w in ws]
            if norm is not None:
                ws = [fold_norm(w, norm.detach().float()) for w in ws]
            return quant_linear("int8", "ao", ws, None, 0) if int8 else PackedLinear.wrap(torch.cat(ws).contiguous())

        c = (self.config.hidden_size * self.config.rms_norm_eps) ** 0.5
        self._fused = {"c": torch.tensor(c, device=self.fc.weight.device),  # rms_unit's constant
                       "emb": self.embed_tokens.weight.detach().float().clone(), "fc": make(self.fc.weight),
                       "qkv": make(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), "o": make(a.o_proj.weight),
                       "gate_up": make(mlp.gate_proj.weight, mlp.up_proj.weight,
                                       norm=L.post_attention_layernorm.weight),
                       "down": make(mlp.down_proj.weight)}
        return self

    # ---- the chain's pieces (chain.py) ------------------------------------------------------------------------
    def _fc(self, aux):
        return aux  # the policy's final hidden state is the hidden input as it is

    def _embed(self, ids):
        return self.embed_tokens(ids) if self._fused is None else F.embedding(ids, self._fused["emb"])

    def _qkv(self, emb, hidden, pos, top: int | None = None, q_at=None):
        both = torch.cat([emb, hidden], -1)  # [B, m, 2H]: vLLM EAGLE-1's order
        x = self.fc(both) if self._fused is None else linear(both, self._fused["fc"])
        return (*self._attention_inputs(x, pos, top, q_at), x)

    def _post_hidden(self, o, residual):
        """attention output o [B, Hq, m, D] -> (the block's output [B, m, H], which is both the head's input and the
        next step's hidden)."""
        c, L, f = self.config, self.layers[0], self._fused
        B, _, m, _ = o.shape
        o = o.transpose(1, 2).reshape(B, m, -1)
        if f is None:
            h = L.self_attn.o_proj(o) + residual
            g = rms_norm(h, L.post_attention_layernorm.weight, c.rms_norm_eps)
            out = L.mlp.down_proj(F.silu(L.mlp.gate_proj(g)) * L.mlp.up_proj(g)) + h
            return out, out
        h = linear(o, f["o"]) + residual
        g, u = linear(rms_unit(h, f["c"]), f["gate_up"]).chunk(2, dim=-1)  # the norm's weight is in gate|up
        out = linear(F.silu(g) * u, f["down"]) + h
        return out, out

    def head_logits(self, x):
        """[.., H] -> logits [.., V] through the policy's current head (shared, never a copy)."""
        return F.linear(x, self.lm_head.weight())


# ---- registry entries: fresh, load, save ----------------------------------------------------------------------------

def config_from_policy(pc, intermediate_size=None) -> MtpConfig:
    n_heads = pc.num_attention_heads
    return MtpConfig(hidden_size=pc.hidden_size, num_attention_heads=n_heads,
                     num_key_value_heads=getattr(pc, "num_key_value_heads", None) or n_heads,
                     head_dim=getattr(pc, "head_dim", None) or pc.hidden_size // n_heads,
                     intermediate_size=intermediate_size or pc.intermediate_size, vocab_size=pc.vocab_size,
                     rms_norm_eps=pc.rms_norm_eps, rope_theta=float(rope_theta_of(pc)),
                     max_position_embeddings=pc.max_position_embeddings)


@torch.no_grad()
def fresh(cfg, policy) -> MtpDrafter:
    c = config_from_policy(policy.config, cfg.mtp.intermediate_size)
    d = MtpDrafter(c, policy).to(module_device(policy))
    H = c.hidden_size
    d.embed_tokens.weight.copy_(rms_norm(policy.get_input_embeddings().weight.float(), None, c.rms_norm_eps))
    d.fc.weight.zero_()
    d.fc.weight[:, H:].copy_(torch.eye(H, device=d.fc.weight.device))  # x = h_t
    d.layers[0].self_attn.o_proj.weight.zero_()  # the block starts as the identity
    d.layers[0].mlp.down_proj.weight.zero_()
    return d


def load(cfg, policy) -> MtpDrafter:
    """The folder at cfg.path (`save`'s): its own config; the policy's hidden and vocabulary sizes must match."""
    from drafttrain.paths import resolve_path

    path = resolve_path(cfg.path)
    block = (read_speculators_config(path).get("drafttrain") or {}).get("config")
    if not isinstance(block, dict):
        raise ValueError(f"drafter.path: {cfg.path} has no drafttrain.config block of an MTP head (save it with "
                         f"scripts/pretrain_drafter.py drafter.kind=mtp)")
    c = MtpConfig(**block)
    pc = policy.config
    for key, want in (("hidden_size", pc.hidden_size), ("vocab_size", pc.vocab_size)):
        if getattr(c, key) != want:
            raise ValueError(f"drafter.path: {cfg.path} is an MTP head with {key} {getattr(c, key)}; the policy has "
                             f"{want} (pretrain one for it with scripts/pretrain_drafter.py drafter.kind=mtp)")
    if cfg.mtp.intermediate_size is not None and cfg.mtp.intermediate_size != c.intermediate_size:
        raise ValueError(f"drafter.mtp.intermediate_size: {cfg.mtp.intermediate_size} differs from the checkpoint "
                         f"{cfg.path}'s {c.intermediate_size} (set it to null to use the checkpoint's)")
    weights = read_weights(path / "model.safetensors")
    if "lm_head.weight" in weights:
        raise ValueError(f"drafter.path: {cfg.path} is an MTP head with an LM head of its own; the head shares the "
                         f"policy's (vLLM's EAGLE-1 form has none): retrain it with scripts/pretrain_drafter.py "
                         f"drafter.kind=mtp")
    d = MtpDrafter(c, policy)
    d.load_state_dict(weights)
    return d


def save(d: MtpDrafter, path, verifier="", k: int = 4, extra: dict | None = None) -> Path:
    """Atomic write of a vLLM EAGLE-1 folder: config.json (a Llama config of one layer, architectures
    EagleLlamaForCausalLM, with a drafttrain block) and model.safetensors."""
    c = d.config
    cfg = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
           "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
           "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}, "torch_dtype": "float32",
           "drafttrain": {"kind": KIND, "config": dataclasses.asdict(c), "verifier": str(verifier), "k": k,
                          **({"extra": extra} if extra else {})}}
    path = Path(path)
    with atomic_dir(path, file_modes={"model.safetensors": 0o644}) as tmp:
        weights = {n: t.detach().contiguous().cpu() for n, t in d.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


# ---- its config section: drafter.mtp ----------------------------------------------------------------------------
@dataclass
class Section:  # drafter.mtp: a DeepSeek-style MTP head on the policy's final hidden state (vLLM: its eagle form)
    intermediate_size: Optional[int] = None  # the head's MLP width; null = the policy's (a checkpoint fixes its own)


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.mtp, message)."""
    return [(s.intermediate_size is None or s.intermediate_size >= 1, "intermediate_size",
             f"must be >= 1 or null (the policy's), got {s.intermediate_size}")]
