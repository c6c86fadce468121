"""Functional Llama-family building blocks with a static, per-row KV cache: the lean forward used by the
embedded engine (policy) and by the EAGLE-3 drafter's decoder layer, in inference and in training.

Each row b of a batch sits at its own position pos[b]; a step feeds m tokens per row at pos[b] .. pos[b]+m-1.
The cache is [B, Hkv, L, D] per layer; entries past a row's position are stale (padding, rejected drafts) and
are masked out, then overwritten. Weights are read from the HF module (Llama, Qwen2 with qkv bias, Qwen3 with
q/k norms); q/k/v and gate/up are packed into one matrix each; `refresh()` re-snapshots the weights in place.
Every matmul goes through `linear`, so the self-drafter (drafters/selfquant.py) runs this same forward over
quantized linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight tensor; a quantized linear (drafters/selfquant.py) is a callable holding its own bias."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope:
    """cos/sin tables [max_len, D] from an inv_freq vector (HF's, so any rope scaling it applied carries over)."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int, scaling: float = 1.0):
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling
        self.max_len = max_len

    @staticmethod
    def from_theta(head_dim: int, theta: float, max_len: int) -> "Rope":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return Rope(inv, max_len)

    def apply(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, m, D], pos [B, m] absolute positions (padding past the table is clamped: never read)."""
        pos = pos.clamp_max(self.max_len - 1)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, m, D]
        return x * cos + rotate_half(x) * sin


class KVCache:
    """Static per-layer K/V buffers [B, Hkv, L, D]; rows can be dropped (finished rows cost nothing after)."""

    def __init__(self, n_layers: int, batch: int, n_kv: int, max_len: int, head_dim: int, dtype=torch.float32):
        shape = (batch, n_kv, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
        """k, v [B, Hkv, m, D] written at pos [B, m]; valid [B, m] (ragged rows) drops the padding entries,
        which may lie past the cache's end."""
        B, H, m, _ = k.shape
        if valid is None:
            bi = torch.arange(B).view(B, 1, 1)
            hi = torch.arange(H).view(1, H, 1)
            self.k[layer].index_put_((bi, hi, pos.view(B, 1, m)), k)
            self.v[layer].index_put_((bi, hi, pos.view(B, 1, m)), v)
            return
        b, j = valid.nonzero(as_tuple=True)  # the real entries only
        p = pos[b, j]
        self.k[layer][b, :, p] = k[b, :, j]
        self.v[layer][b, :, p] = v[b, :, j]

    def select_rows(self, idx: torch.Tensor) -> None:
        self.k = [t.index_select(0, idx) for t in self.k]
        self.v = [t.index_select(0, idx) for t in self.v]


def step_mask(pos0: torch.Tensor, m: int, length: int) -> torch.Tensor:
    """[B, 1, m, length] bool: query i of row b sees key j iff j <= pos0[b] + i."""
    q = pos0.view(-1, 1, 1) + torch.arange(m).view(1, m, 1)  # [B, m, 1]
    return (torch.arange(length).view(1, 1, length) <= q).unsqueeze(1)


def attend(q: torch.Tensor, cache: KVCache, layer: int, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, m, D] against the first mask.shape[-1] cache positions -> [B, H, m, D]."""
    L = mask.shape[-1]
    k, v = cache.k[layer][:, :, :L], cache.v[layer][:, :, :L]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class LeanLlama:
    """Inference-only forward of an HF Llama/Qwen2/Qwen3 causal LM over a KVCache.

    forward(tokens[B, m], pos0[B], cache, aux_ids) -> (logits[B, m, V], aux[B, m, len(aux_ids)*H] or None)
    aux layer id i is the input of decoder layer i (HF hidden_states[i]; vLLM's EAGLE-3 convention).
    """

    def __init__(self, model: torch.nn.Module, max_len: int):
        cfg = model.config
        self.model, self.config = model, cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        max_pos = getattr(cfg, "max_position_embeddings", max_len)
        self.max_len = min(max_len, max_pos)
        rot = model.model.rotary_emb
        self.rope = Rope(rot.inv_freq, self.max_len, float(getattr(rot, "attention_scaling", 1.0)))
        self.layers = list(model.model.layers)
        self.weights: dict[str, torch.Tensor] = {}
        self.packed: list[dict] = []
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Snapshot the policy's current weights into the engine's own buffers (packed q|k|v and gate|up).
        In place after the first call: no reallocation, and training the policy never touches a decode step."""
        m = self.model
        snap = {"embed": m.model.embed_tokens.weight, "norm": m.model.norm.weight, "lm_head": m.lm_head.weight}
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            snap[f"{i}.qkv"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            snap[f"{i}.gate_up"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            snap[f"{i}.o"], snap[f"{i}.down"] = a.o_proj.weight, mlp.down_proj.weight
            snap[f"{i}.ln1"], snap[f"{i}.ln2"] = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            if a.q_proj.bias is not None:
                snap[f"{i}.qkv_b"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            if getattr(a, "q_norm", None) is not None:
                snap[f"{i}.q_norm"], snap[f"{i}.k_norm"] = a.q_norm.weight, a.k_norm.weight
        if not self.weights:
            self.weights = {k: t.detach().float().clone().contiguous() for k, t in snap.items()}
            self.packed = [{k.split(".", 1)[1]: t for k, t in self.weights.items() if k.startswith(f"{i}.")}
                           for i in range(self.n_layers)]
        else:
            for k, t in snap.items():
                self.weights[k].copy_(t)

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(self.n_layers, batch, self.n_kv, length, self.head_dim)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos0: torch.Tensor, cache: KVCache, aux_ids=()):
        B, m = tokens.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        pos = pos0.view(B, 1) + torch.arange(m).view(1, m)  # [B, m]
        length = int(pos0.max()) + m
        mask = step_mask(pos0, m, length)  # [B, 1, m, length]
        x = F.embedding(tokens, self.weights["embed"])  # [B, m, hidden]
        aux = []
        for i, w in enumerate(self.packed):
            if i in aux_ids:
                aux.append(x)
            h = rms_norm(x, w["ln1"], self.eps)
            qkv = linear(h, w["qkv"], w.get("qkv_b"))  # [B, m, (H + 2Hkv) D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, m, H, D).transpose(1, 2)  # [B, H, m, D]
            k = k.view(B, m, Hkv, D).transpose(1, 2)
            v = v.view(B, m, Hkv, D).transpose(1, 2)
            if "q_norm" in w:
                q, k = rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
            q, k = self.rope.apply(q, pos), self.rope.apply(k, pos)
            cache.write(i, k, v, pos)
            o = attend(q, cache, i, mask).transpose(1, 2).reshape(B, m, H * D)
            x = x + linear(o, w["o"])
            h = rms_norm(x, w["ln2"], self.eps)
            g, u = linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, w["down"])
        logits = linear(rms_norm(x, self.weights["norm"], self.eps), self.weights["lm_head"])  # [B, m, V]
        if aux_ids and len(aux) != len(aux_ids):
            raise ValueError(f"aux_layer_ids {list(aux_ids)} must be distinct layers in [0, {self.n_layers - 1}]")
        return logits, (torch.cat(aux, -1) if aux_ids else None)
