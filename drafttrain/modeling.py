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

from drafttrain.device import module_device


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight tensor; a packed or quantized linear (PackedLinear, drafters/selfquant.py) is a
    callable holding its own bias."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# the overload itself: calling the op packet re-resolves it on every call, and a forward makes many calls
_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None


class PackedLinear:
    """An fp32 linear whose weight also has a oneDNN-prepacked copy (the layout inductor uses on CPU).

    On CPU F.linear over M rows costs close to M times one row for the engine's small weights, while the packed GEMM
    costs about one row's time up to small M: verifying k+1 tokens then costs little more than a decode step. Every
    fp32 linear is packed. `repack()` after the weight changed in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.repack()

    @classmethod
    def wrap(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """A PackedLinear where it pays and oneDNN is there; else the weight itself (F.linear via `linear`)."""
        if ONEDNN and weight.dtype == torch.float32 and weight.device.type == "cpu":
            return cls(weight, bias)
        return weight if bias is None else (lambda x: F.linear(x, weight, bias))

    def repack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR_POINTWISE(x, self._packed, self.bias, "none", [], "")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rms_unit(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """rms_norm without its weight, up to a constant: rms_norm(x, w, eps) == rms_unit(x, c) * (w * sqrt(H)) with
    c = sqrt(H eps) (a 0-d tensor): x / sqrt(||x||^2 + H eps) in 3 ops, against F.rms_norm's ~8 (slower at decode
    sizes on this CPU: bench/NOTES.md, Embedded engine). The inference forms fold w * sqrt(H) into the columns of the
    linear that follows."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), c)


def fold_norm(weight: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    """A linear's weight [N, H] with the rms_norm weight feeding it folded in: linear(rms_unit(x, c), result) ==
    linear(rms_norm(x, norm_w, eps), weight)."""
    return weight * (norm_w * norm_w.shape[-1] ** 0.5)


class Rope(torch.nn.Module):
    """cos/sin tables [max_len, D] from an inv_freq vector (HF's, so any rope scaling it applied carries over), on
    inv_freq's device. Non-persistent buffers: `.to()` on a module holding it moves them; no state_dict entry."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int, scaling: float = 1.0):
        super().__init__()
        t = torch.arange(max_len, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq.float())  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.max_len = max_len
        half = emb.shape[-1] // 2
        # rotate_half(x) * sin == x.roll(D/2) * sin with the sign folded into the table's first half; cos and the
        # signed sin stacked [L, 2, D]: one gather per step reads both
        self.register_buffer("_cs", torch.stack([self.cos, torch.cat([-self.sin[:, :half], self.sin[:, half:]], -1)],
                                                1), persistent=False)

    @staticmethod
    def from_theta(head_dim: int, theta: float, max_len: int, device: torch.device | str = "cpu") -> "Rope":
        """device: where the tables are made (a module built on the CPU and moved later takes them along)."""
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        return Rope(inv, max_len)

    def tables(self, pos: torch.Tensor, top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin at pos [B, m], shaped [B, m, 1, D] (for x [B, m, H, D]). Padding past the table is
        clamped (never read); `top` (an upper bound of pos, if the caller has one) skips the clamp when in range."""
        if top is None or top >= self.max_len:
            pos = pos.clamp_max(self.max_len - 1)
        cs = self._cs[pos]  # [B, m, 2, D]
        return cs[:, :, :1], cs[:, :, 1:]

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = tables
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class KVCache:
    """Static per-layer K/V buffers [B, Hkv, L, D]; rows can be dropped (finished rows cost nothing after)."""

    def __init__(self, n_layers: int, batch: int, n_kv: int, max_len: int, head_dim: int, dtype=torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (batch, n_kv, max_len, head_dim)
        # uninitialized: zeroing B x L x layers up front cost more than a batch-64 prefill here; the forwards zero
        # what they expose (expose) before any read, so masked reads never see NaN garbage (0 * NaN = NaN)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.used = 0  # positions [0, used) are finite (zeroed or written): the high-water mark of expose

    def expose(self, length: int) -> None:
        """Positions [used, length) become readable: zero them once, before the step that first reads them."""
        length = min(length, self.max_len)
        if length > self.used:
            for t in self.k + self.v:
                t[:, :, self.used:length].zero_()
            self.used = length

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              valid: torch.Tensor | None = None, start: int | None = None) -> None:
        """k, v [B, Hkv, m, D] written at pos [B, m]; valid [B, m] (ragged rows) drops the padding entries,
        which may lie past the cache's end. `start`: every row writes positions start..start+m-1 (a slice)."""
        B, H, m, _ = k.shape
        if start is not None and valid is None:
            self.k[layer][:, :, start:start + m].copy_(k)
            self.v[layer][:, :, start:start + m].copy_(v)
            return
        if valid is None:
            bi = torch.arange(B, device=k.device).view(B, 1, 1)
            hi = torch.arange(H, device=k.device).view(1, H, 1)
            self.k[layer].index_put_((bi, hi, pos.view(B, 1, m)), k)
            self.v[layer].index_put_((bi, hi, pos.view(B, 1, m)), v)
            return
        b, j = valid.nonzero(as_tuple=True)  # the real entries only
        p = pos[b, j]
        self.k[layer][b, :, p] = k[b, :, j]
        self.v[layer][b, :, p] = v[b, :, j]

    def head(self, n: int) -> "KVCache":
        """A cache over the first n rows of this one's buffers (views: what it writes, this one holds)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        view.max_len, view.used = self.max_len, self.used
        return view

    def fill_rows(self, head: "KVCache", src: torch.Tensor) -> None:
        """After `head(n)` was written (a prefill of n distinct prompts): rows n.. copy the written positions of the
        head row src[j - n] holding the same prompt."""
        n, upto = len(self.k[0]) - len(src), head.used
        for t in self.k + self.v:
            t[n:, :, :upto] = t[src, :, :upto]
        self.used = max(self.used, upto)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep rows idx (row j of the result is row idx[j]), compacted in place. Only rows that move are copied
        (idx[j] != j; keep_order's order moves as few as there are holes), and only the positions written so far
        (`used`): a finished row costs a copy of a few rows' live prefix, not of every row, nor a new buffer."""
        n = self.used
        dst = (idx != torch.arange(len(idx), device=idx.device)).nonzero().squeeze(1)
        src = idx[dst]

        def take(t):  # compacted into the first rows of the same buffer: no allocation (entries past `used` stay
            if len(dst):  # finite old values, which masked reads may touch)
                t[dst, :, :n] = t[src, :, :n]
            return t[: len(idx)]

        self.k = [take(t) for t in self.k]
        self.v = [take(t) for t in self.v]


def share_prompts(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(order, src): the prompts' indices with the first copy of each distinct prompt first (a GRPO batch holds G
    copies of each), and for each later row of that order the row among the first len(order) - len(src) it repeats.
    The engine prefills the distinct prompts alone and copies their cache (KVCache.head / fill_rows)."""
    rank: dict[tuple[int, ...], int] = {}  # a distinct prompt -> its row among the first ones
    order, rest, src = [], [], []
    for i, p in enumerate(prompts):
        j = rank.setdefault(tuple(p), len(rank))
        if j == len(order):  # a new prompt
            order.append(i)
        else:
            rest.append(i)
            src.append(j)
    return order + rest, src


def keep_order(n: int, done: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The rows to keep when rows `done` of n finish, in the order that moves fewest (KVCache.select_rows): a kept
    row stays where it is unless it sits past the new end, and those fill the finished rows' places, in order."""
    gone = set(done)
    m = n - len(gone)
    tail = iter(j for j in range(m, n) if j not in gone)
    return torch.tensor([next(tail) if j in gone else j for j in range(m)], dtype=torch.long, device=device)


def step_mask(pos0: torch.Tensor, m: int, length: int, pos0_int: int | None = None) -> torch.Tensor | None:
    """Additive [B, 1, m, length] mask: query i of row b sees key j iff j <= pos0[b] + i. None where every key
    is visible (one row, one query at its last position): SDPA is cheaper without a mask. pos0_int: pos0[0] as
    an int, where the caller has it (one row)."""
    if pos0.shape[0] == 1 and m == 1 and length == (int(pos0[0]) if pos0_int is None else pos0_int) + 1:
        return None
    dev = pos0.device
    q = pos0.view(-1, 1, 1) + torch.arange(m, device=dev).view(1, m, 1)  # [B, m, 1]
    see = (torch.arange(length, device=dev).view(1, 1, length) <= q).unsqueeze(1)
    return torch.zeros(see.shape, device=dev).masked_fill_(~see, float("-inf"))


def attend(q: torch.Tensor, cache: KVCache, layer: int, mask: torch.Tensor | None, length: int) -> torch.Tensor:
    """q [B, H, m, D] against the first `length` cache positions -> [B, H, m, D].

    Two kernels, picked by shape. SDPA's CPU kernel (flash) is the faster one for a few queries, but with several
    queries per row over several rows (a verify or a prefill past batch 2) it runs slower here than the plain
    matmul-softmax-matmul, and at batch >= 32 even for one query (measured: bench/NOTES.md, Embedded engine)."""
    k, v = cache.k[layer][:, :, :length], cache.v[layer][:, :, :length]
    B, H, m, D = q.shape
    if H == k.shape[1] and (m > 1 and B >= 4 or B >= 32):
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(D ** -0.5)
        if mask is not None:
            s.add_(mask)
        return torch.matmul(s.softmax(-1), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != k.shape[1])


def hf_layer_names(i: int) -> dict[str, str]:
    """The HF names of decoder layer i's tensors (Llama / Qwen2 / Qwen3), by short name."""
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    return {"q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight", "o": a + "o_proj.weight",
            "qb": a + "q_proj.bias", "kb": a + "k_proj.bias", "vb": a + "v_proj.bias", "ob": a + "o_proj.bias",
            "gb": m + "gate_proj.bias", "ub": m + "up_proj.bias", "db": m + "down_proj.bias",
            "q_norm": a + "q_norm.weight", "k_norm": a + "k_norm.weight",
            "gate": m + "gate_proj.weight", "up": m + "up_proj.weight", "down": m + "down_proj.weight",
            "ln1": f"model.layers.{i}.input_layernorm.weight",
            "ln2": f"model.layers.{i}.post_attention_layernorm.weight"}


def lean_parts(sd: dict, n_layers: int) -> dict:
    """HF policy state_dict -> LeanLlama's names: a linear ("lm_head", "0.qkv", "0.gate_up", ...) as its list of row
    blocks ([q, k, v], [gate, up]); biases "0.qkv_b", "0.o_b", ... (concatenated as their linear); norms and the
    embedding as tensors. No copies (the biases are small copies)."""
    embed = sd["model.embed_tokens.weight"]
    out = {"embed": embed, "norm": sd["model.norm.weight"], "lm_head": [sd.get("lm_head.weight", embed)]}
    for i in range(n_layers):
        n = hf_layer_names(i)
        out[f"{i}.qkv"] = [sd[n["q"]], sd[n["k"]], sd[n["v"]]]
        out[f"{i}.gate_up"] = [sd[n["gate"]], sd[n["up"]]]
        out[f"{i}.o"], out[f"{i}.down"] = [sd[n["o"]]], [sd[n["down"]]]
        out[f"{i}.ln1"], out[f"{i}.ln2"] = sd[n["ln1"]], sd[n["ln2"]]
        if n["qb"] in sd:
            out[f"{i}.qkv_b"] = torch.cat([sd[n["qb"]], sd[n["kb"]], sd[n["vb"]]]).float()
        if n["ob"] in sd:  # Llama's attention_bias, Qwen3's
            out[f"{i}.o_b"] = sd[n["ob"]].float()
        if n["gb"] in sd:  # Llama's mlp_bias
            out[f"{i}.gate_up_b"] = torch.cat([sd[n["gb"]], sd[n["ub"]]]).float()
        if n["db"] in sd:
            out[f"{i}.down_b"] = sd[n["db"]].float()
        if n["q_norm"] in sd:
            out[f"{i}.q_norm"], out[f"{i}.k_norm"] = sd[n["q_norm"]], sd[n["k_norm"]]
    return out


class LeanLlama:
    """Inference-only forward of an HF Llama/Qwen2/Qwen3 causal LM over a KVCache.

    forward(tokens[B, m], pos0[B], cache, aux_ids, final) -> (logits[B, m, V], aux[B, m, X] or None)
    aux layer id i is the input of decoder layer i (HF hidden_states[i]; vLLM's EAGLE-3 convention); final: the final
    hidden state (after the final norm) follows them; X = (len(aux_ids) + final) * H.
    """

    def __init__(self, model: torch.nn.Module, max_len: int):
        cfg = model.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":  # the forward's MLP is silu-gated, as in every Llama/Qwen2/Qwen3 checkpoint shipped
            raise ValueError(f"policy.hidden_act: {act!r} is not supported by the embedded engine (silu only)")
        self.model, self.config = model, cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.device = module_device(model)  # the policy's: the caches, indices and tables it makes live there too
        self._unit_c = torch.tensor((cfg.hidden_size * cfg.rms_norm_eps) ** 0.5, device=self.device)  # rms_unit's c
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
        p = lean_parts(self.model.state_dict(), self.n_layers)
        # the rms_norm weights are folded into the linears they feed (fold_norm); forward normalizes with rms_unit
        snap = {"embed": p["embed"], "lm_head": fold_norm(p["lm_head"][0], p["norm"]), "norm": p["norm"]}
        for i in range(self.n_layers):
            snap[f"{i}.qkv"] = fold_norm(torch.cat(p[f"{i}.qkv"]), p[f"{i}.ln1"])
            snap[f"{i}.gate_up"] = fold_norm(torch.cat(p[f"{i}.gate_up"]), p[f"{i}.ln2"])
            snap[f"{i}.o"], snap[f"{i}.down"] = p[f"{i}.o"][0], p[f"{i}.down"][0]
            # biases and q/k norms where the family has them: each packed linear holds its own (PackedLinear.wrap)
            snap.update({f"{i}.{k}": p[f"{i}.{k}"] for k in ("qkv_b", "o_b", "gate_up_b", "down_b", "q_norm",
                                                             "k_norm") if f"{i}.{k}" in p})
        if not self.weights:
            self.weights = {k: t.detach().float().clone().contiguous() for k, t in snap.items()}
            w = self.weights
            self.packed = []
            for i in range(self.n_layers):
                layer = {k.split(".", 1)[1]: t for k, t in w.items() if k.startswith(f"{i}.")}
                for name in ("qkv", "gate_up", "o", "down"):
                    layer[name] = PackedLinear.wrap(w[f"{i}.{name}"], w.get(f"{i}.{name}_b"))
                self.packed.append(layer)
            self.head = PackedLinear.wrap(w["lm_head"])
        else:
            for k, t in snap.items():
                self.weights[k].copy_(t)
            for lin in [self.head, *(v for layer in self.packed for v in layer.values())]:
                if isinstance(lin, PackedLinear):
                    lin.repack()

    def _norm(self, x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
        """The rms_norm `name` (ln1, ln2, norm) before a linear: its weight is folded into that linear."""
        return rms_unit(x, self._unit_c)

    def new_cache(self, batch: int, length: int) -> KVCache:
        return KVCache(self.n_layers, batch, self.n_kv, length, self.head_dim, device=self.device)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states from forward(..., head=False): [..., hidden] -> [..., V]."""
        return linear(h, self.head)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos0: torch.Tensor, cache: KVCache, aux_ids=(), final: bool = False,
                head: bool = True):
        """(logits [B, m, V], the aux states or None). head=False: the normed hidden states [B, m, hidden] in place
        of the logits, for the caller to run `logits` on the positions and rows it reads (at a real vocabulary the
        prefill's [B, P, V] and a verify's [B, k+1, V] are GBs)."""
        B, m = tokens.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        pos = pos0.view(B, 1) + torch.arange(m, device=pos0.device) if m > 1 else pos0.view(B, 1)  # [B, m]
        length = int(pos0.max()) + m
        mask = step_mask(pos0, m, length, length - m if B == 1 else None)  # [B, 1, m, length] or None
        start = length - m if B == 1 else None  # one row: its cache writes are a slice
        cache.expose(length)
        rope = self.rope.tables(pos, length - 1)  # [B, m, 1, D]: shared by every layer, q and k
        x = F.embedding(tokens, self.weights["embed"])  # [B, m, hidden]
        aux = []
        for i, w in enumerate(self.packed):
            if i in aux_ids:
                aux.append(x)
            qkv = linear(self._norm(x, w, "ln1"), w["qkv"], w.get("qkv_b"))  # [B, m, (H + 2Hkv) D]
            if "q_norm" in w:
                q, k, v = qkv.view(B, m, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
                q = Rope.rotate(rms_norm(q, w["q_norm"], self.eps), rope)
                k = Rope.rotate(rms_norm(k, w["k_norm"], self.eps), rope)
            else:  # q and k rotated in one pass
                qk, v = qkv.view(B, m, H + 2 * Hkv, D).split([H + Hkv, Hkv], dim=2)
                q, k = Rope.rotate(qk, rope).split([H, Hkv], dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, m, D]
            cache.write(i, k, v, pos, start=start)
            o = attend(q, cache, i, mask, length).transpose(1, 2).reshape(B, m, H * D)
            x = x + linear(o, w["o"])
            g, u = linear(self._norm(x, w, "ln2"), w["gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, w["down"])
        h = self._norm(x, self.weights, "norm")
        logits = linear(h, self.head) if head else h  # [B, m, V]
        if aux_ids and len(aux) != len(aux_ids):
            raise ValueError(f"aux_layer_ids {list(aux_ids)} must be distinct layers in [0, {self.n_layers - 1}]")
        if final:  # the final hidden state, after the final norm (an MTP head's input)
            aux.append(rms_norm(x, self.weights["norm"], self.eps))
        return logits, (torch.cat(aux, -1) if aux else None)
