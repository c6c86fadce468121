"""Self-drafter: a weight-quantized copy of the policy that drafts k tokens autoregressively over its own KV cache.
It cannot drift from the policy: after each policy update, `requantize(policy)` writes the new weights into the
existing quantized storage (same tensors, same data pointers). No trainer, no aux hidden states (aux_layer_ids=()).

    d = build_drafter(DrafterConfig(kind="selfquant", path=None, quant="int8", backend="ao"), policy)
    d.requantize(policy)                      # after an RL step: in place
    engine.load_drafter(policy.state_dict() or d.state_dict(), version)

Quantization of the linears (embeddings and norms stay fp32):
    int8   per-output-channel symmetric: q = round(w / s), s = max|w_row| / 127, q in [-127, 127]
    int4   group-wise symmetric along in-features (drafter.group_size): s = max|w_group| / 7 rounded to bf16,
           q = round(w / s) in [-8, 7]   (bitsandbytes uses its own NF4 blocks of group_size instead)
Backends (drafter.backend), each a small class below: __call__(x), requantize_(parts, b), load_(t), storage().
The ao and bnb int8 kernels also quantize activations per call (dynamic W8A8); ref and the int4 paths do not.
    ao   int8: fbgemm dynamic int8 (torch.ops.quantized.linear_dynamic; activations quantized per call, 7-bit as
              quantize_dynamic does). fbgemm's prepacked weight cannot be written in place: the in-place storage
              is the canonical q/scale, and every update re-prepacks from it (one new packed object per linear).
         int4: aten's CPU int4 kernel (_weight_int4pack_mm_for_cpu; bf16 activations), packed storage written in
              place. Needs group_size in {32, 64, 128, 256} and out-features divisible by 16.
    bnb  Linear8bitLt (int8, row-wise absmax of the fp16 weight) / Linear4bit nf4 (blocksize = group_size): the
         GPU path. On CPU with AVX512-BF16, Linear4bit repacks its weight for its CPU kernel; we do so once at
         build and requantize into that layout.
    ref  dequantize-then-matmul in fp32 (weight-only). A faithful acceptance study, not a fast path.

state_dict() is the drafter form: the quantized storage itself (names like "0.qkv.q", "lm_head.scale", "embed"),
specific to (quant, backend, group_size); the tensors alias the live storage. load_state_dict accepts it (copied
in, exact) or a policy state_dict (HF names; requantized). Either way the write is in place, so a drafter must
not be updated while it drafts: the engine loads into a standby copy and swaps (in_place_update = True).

Simplifies on purpose: the forward is LeanLlama's (modeling.py; every matmul goes through modeling.linear), ragged
cache extension pads rows to the longest (stale padding entries are masked, then overwritten), CPU tensors.
"""
from __future__ import annotations

import copy
import logging
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttrain.drafters.weights import check_finite, check_tensors
from drafttrain.modeling import KVCache, LeanLlama, Rope, rms_norm
from drafttrain.spec import draft_chain

QUANTS = ("int8", "int4")
BACKENDS = ("ao", "bnb", "ref")
_AO_INT4_GROUPS = (32, 64, 128, 256)
_BNB_BLOCKS = (64, 128, 256, 512, 1024, 2048, 4096)


# ---- pure quantizers ------------------------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]); w ~ q * scale[:, None]."""
    s = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    return torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8), s.float()


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in [-8, 7], scale bf16 [N, K/group]); w ~ q * scale per group."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    s = (g.abs().amax(-1) / 7.0).clamp_min(1e-12).to(torch.bfloat16)  # [N, K/G]
    q = torch.round(g / s.float()[..., None]).clamp_(-8, 7)
    return q.reshape(N, K).to(torch.int8), s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] in [-8, 7] -> uint8 [N, K/2] (even column in the low nibble)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int8 [N, K] in [-8, 7]."""
    lo, hi = (p & 0xF).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(p.shape[0], -1)


# ---- quantized linears: __call__(x [..., K]) -> [..., N]; requantize_/load_ write the storage in place ------------
# requantize_(parts, b): parts are row blocks of the weight (q|k|v, gate|up) quantized straight into their rows of the
# storage, a block of rows (about _CHUNK_ELEMS weights) at a time: no concatenated fp32 copy, only small temporaries (a
# large fresh allocation costs more in page faults than the quantization itself here), and few blocks for small
# weights (each block is a dozen tensor ops: per-op overhead dominated 128-row blocks of a 256-wide drafter).

_CHUNK_ELEMS = 1 << 18


class _Linear:
    bias: torch.Tensor | None

    def requantize_(self, parts: list[torch.Tensor], b: torch.Tensor | None = None) -> None:
        r0 = 0
        for w in parts:
            rows = max(1, _CHUNK_ELEMS // w.shape[1])
            for c in range(0, w.shape[0], rows):
                blk = w[c:c + rows].float()
                self._rows_(blk, r0 + c, r0 + c + blk.shape[0])
            r0 += w.shape[0]
        if self.bias is not None:
            self.bias.copy_(b)
        self._repack()

    def _rows_(self, w: torch.Tensor, r0: int, r1: int) -> None:
        raise NotImplementedError

    def storage(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_(self, t: dict[str, torch.Tensor]) -> None:
        """Copy drafter-form tensors (names/shapes/dtypes already validated) into the storage."""
        for name, dst in self.storage().items():
            dst.copy_(t[name])
        self._repack()

    def _repack(self) -> None:
        pass

    def _with_bias(self, s: dict) -> dict:
        return {**s, "bias": self.bias} if self.bias is not None else s


class RefInt8(_Linear):
    """Weight-only int8, dequantized in the matmul: y = (x @ q^T) * scale + b."""

    def __init__(self, parts, b, group):
        N, K = sum(w.shape[0] for w in parts), parts[0].shape[1]
        self.q, self.scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N)
        self.bias = None if b is None else torch.empty(N)
        self.requantize_(parts, b)

    def _rows_(self, w, r0, r1):
        q, s = quantize_int8(w)
        self.q[r0:r1].copy_(q)
        self.scale[r0:r1].copy_(s)

    def storage(self):
        return self._with_bias({"q": self.q, "scale": self.scale})

    def __call__(self, x):
        y = F.linear(x, self.q.float()) * self.scale
        return y if self.bias is None else y + self.bias


class RefInt4(_Linear):
    """Weight-only int4 group-wise, dequantized per call: packed nibbles + bf16 group scales."""

    def __init__(self, parts, b, group):
        N, K = sum(w.shape[0] for w in parts), parts[0].shape[1]
        self.group = group
        self.packed = torch.empty(N, K // 2, dtype=torch.uint8)
        self.scale = torch.empty(N, K // group, dtype=torch.bfloat16)
        self.bias = None if b is None else torch.empty(N)
        self.requantize_(parts, b)

    def _rows_(self, w, r0, r1):
        q, s = quantize_int4(w, self.group)
        self.packed[r0:r1].copy_(pack_int4(q))
        self.scale[r0:r1].copy_(s)

    def storage(self):
        return self._with_bias({"packed": self.packed, "scale": self.scale})

    def dequantize(self) -> torch.Tensor:
        N = self.packed.shape[0]
        q = unpack_int4(self.packed).float().view(N, -1, self.group)
        return (q * self.scale.float()[..., None]).view(N, -1)

    def __call__(self, x):
        return F.linear(x, self.dequantize(), self.bias)


_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default  # the overload: skips the packet's per-call checks


class AoInt8(RefInt8):
    """fbgemm dynamic int8. Storage: canonical q/scale (in place); the prepacked weight is rebuilt from it."""

    def _repack(self):
        with warnings.catch_warnings():  # quantized tensor creation is deprecated upstream; fbgemm still needs it
            warnings.simplefilter("ignore")
            wq = torch._make_per_channel_quantized_tensor(
                self.q, self.scale.double(), torch.zeros(len(self.scale), dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(wq, self.bias)

    def __call__(self, x):
        return _LINEAR_DYNAMIC(x, self.packed, True)  # reduce_range: as quantize_dynamic on x86


class AoInt4(_Linear):
    """aten's CPU int4 kernel: weight packed by _convert_weight_to_int4pack_for_cpu, scales/zeros [K/G, N, 2] bf16
    (dequant = (u - 8) * scale + 0, u = q + 8); both written in place. Its packing is row-separable in blocks of 64
    rows (checked against whole-matrix packing in the tests)."""

    def __init__(self, parts, b, group):
        N, K = sum(w.shape[0] for w in parts), parts[0].shape[1]
        self.group, self.N = group, N
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(N, K, dtype=torch.int32), 1)
        self.sz = torch.zeros(K // group, N, 2, dtype=torch.bfloat16)
        self.bias = None if b is None else torch.empty(N)
        self.requantize_(parts, b)

    def requantize_(self, parts, b=None):
        for r0, blk in _row_blocks(parts, 64 if self.N % 64 == 0 else self.N):
            q, s = quantize_int4(blk.float(), self.group)
            self.packed[r0:r0 + len(blk)].copy_(
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1))
            self.sz[:, r0:r0 + len(blk), 0].copy_(s.t())
        if self.bias is not None:
            self.bias.copy_(b)

    def storage(self):
        return self._with_bias({"packed": self.packed, "sz": self.sz})

    def __call__(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed,
                                                       self.group, self.sz)
        y = y.float().view(*x.shape[:-1], self.N)
        return y if self.bias is None else y + self.bias


def _row_blocks(parts: list[torch.Tensor], step: int):
    """(row offset, [step, K] block) over the stacked parts; a block crossing a part boundary is concatenated."""
    N = sum(w.shape[0] for w in parts)
    bounds, r = [], 0
    for w in parts:
        bounds.append((r, w))
        r += w.shape[0]
    for r0 in range(0, N, step):
        r1 = min(r0 + step, N)
        pieces = [w[max(r0 - a, 0):min(r1 - a, len(w))] for a, w in bounds if a < r1 and a + len(w) > r0]
        yield r0, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _Bnb(_Linear):
    mod: nn.Module

    @property
    def bias(self):  # the module's own (a separate alias would not survive a deepcopy)
        return None if self.mod.bias is None else self.mod.bias.data

    def __call__(self, x):
        return self.mod(x)


class BnbInt8(_Bnb):
    """bitsandbytes Linear8bitLt (threshold 0: no fp16 outlier columns). Storage: its matmul state's CB (int8 [N, K])
    and SCB (row absmax [N]), quantized from the fp16 weight row by row as bitsandbytes does."""

    def __init__(self, parts, b, group):
        bnb = _import_bnb()
        w = torch.cat(parts)
        N, K = w.shape
        m = bnb.nn.Linear8bitLt(K, N, bias=b is not None, has_fp16_weights=False, threshold=0.0)
        m.weight = bnb.nn.Int8Params(w.detach().clone(), requires_grad=False, has_fp16_weights=False)
        if b is not None:
            m.bias = nn.Parameter(b.detach().clone().float(), requires_grad=False)
        self.mod = m.to(w.device).eval()
        with torch.no_grad():
            self.mod(torch.zeros(1, K, device=w.device))  # moves CB/SCB into the matmul state: the storage from now on

    def _rows_(self, w, r0, r1):
        cb, scb, _ = _import_bnb().functional.int8_vectorwise_quant(w.to(torch.float16))
        self.mod.state.CB[r0:r1].copy_(cb)
        self.mod.state.SCB[r0:r1].copy_(scb)

    def storage(self):
        return self._with_bias({"CB": self.mod.state.CB, "SCB": self.mod.state.SCB})


class BnbNf4(_Bnb):
    """bitsandbytes Linear4bit nf4, blocksize = group_size, fp32 compute, no double quantization. Storage: its
    packed weight and block absmax (in the CPU-kernel layout where bnb uses one). Quantized whole (the GPU path)."""

    def __init__(self, parts, b, group):
        bnb = _import_bnb()
        w = torch.cat(parts)
        N, K = w.shape
        self.group = group
        m = bnb.nn.Linear4bit(K, N, bias=b is not None, compute_dtype=torch.float32, compress_statistics=False,
                              quant_type="nf4")
        m.weight = bnb.nn.Params4bit(w.detach().clone(), requires_grad=False, quant_type="nf4", blocksize=group,
                                     compress_statistics=False)
        if b is not None:
            m.bias = nn.Parameter(b.detach().clone().float(), requires_grad=False)
        # bnb's CPU kernel repacks the weight at the first eval forward; it asserts N % 32 == 0 (else: train mode,
        # the generic dequantizing path)
        self.mod = m.to(w.device).train(N % 32 != 0)
        with torch.no_grad():
            self.mod(torch.zeros(1, K, device=w.device))
        self.cpu_packed = bool(getattr(self.mod.weight.quant_state, "packing_format_for_cpu", False))

    def requantize_(self, parts, b=None):
        qw, qs = _import_bnb().functional.quantize_4bit(torch.cat(parts).float(), blocksize=self.group,
                                                        compress_statistics=False, quant_type="nf4")
        if self.cpu_packed:
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu  # what Linear4bit.forward does

            qw, qs = _convert_weight_packed_for_cpu(qw, qs)
        self.mod.weight.data.copy_(qw.view(self.mod.weight.data.shape))
        self.mod.weight.quant_state.absmax.copy_(qs.absmax)
        if self.bias is not None:
            self.bias.copy_(b)

    def storage(self):
        return self._with_bias({"weight": self.mod.weight.data, "absmax": self.mod.weight.quant_state.absmax})


LINEARS = {("int8", "ref"): RefInt8, ("int4", "ref"): RefInt4, ("int8", "ao"): AoInt8, ("int4", "ao"): AoInt4,
           ("int8", "bnb"): BnbInt8, ("int4", "bnb"): BnbNf4}


def _import_bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("drafter.backend: bnb needs bitsandbytes, which is not installed "
                         "(pip install bitsandbytes; or drafter.backend=ao|ref)") from None
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)  # a cast warning per matmul
    return bnb


def check_backend(quant: str, backend: str, group: int, sizes: dict[str, tuple[int, int]]) -> None:
    """One-line ValueError naming the drafter.* field. sizes: linear name -> (out, in) features."""
    if quant not in QUANTS:
        raise ValueError(f"drafter.quant: unknown quantization {quant!r} (known: {', '.join(QUANTS)})")
    if backend not in BACKENDS:
        raise ValueError(f"drafter.backend: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if backend == "bnb":
        _import_bnb()
    if backend == "ao" and quant == "int8" and not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        raise ValueError("drafter.backend: ao int8 needs torch's fbgemm/x86 quantized engine, which this torch "
                         "build lacks (use drafter.backend=ref)")
    if backend == "ao" and quant == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("drafter.backend: ao int4 needs aten._weight_int4pack_mm_for_cpu, which this torch build "
                         "lacks (use drafter.backend=ref)")
    if quant != "int4":
        return
    if group < 1:
        raise ValueError(f"drafter.group_size: must be >= 1, got {group}")
    for name, (n_out, n_in) in sizes.items():
        if n_in % group:
            raise ValueError(f"drafter.group_size: {group} does not divide the in-features {n_in} of the policy's "
                             f"{name} (hidden/intermediate size)")
    if backend == "ao" and group not in _AO_INT4_GROUPS:
        raise ValueError(f"drafter.group_size: ao int4 supports {list(_AO_INT4_GROUPS)}, got {group}")
    if backend == "ao":
        bad = next((n for n, (o, _) in sizes.items() if o % 16), None)
        if bad:
            raise ValueError(f"drafter.backend: ao int4 needs out-features divisible by 16; the policy's {bad} has "
                             f"{sizes[bad][0]} (use drafter.backend=ref)")
    if backend == "bnb" and group not in _BNB_BLOCKS:
        raise ValueError(f"drafter.group_size: bnb nf4 blocksize must be one of {list(_BNB_BLOCKS)}, got {group}")


# ---- policy layout --------------------------------------------------------------------------------------------

def _hf_names(i: int) -> dict[str, str]:
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    return {"q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight", "o": a + "o_proj.weight",
            "qb": a + "q_proj.bias", "kb": a + "k_proj.bias", "vb": a + "v_proj.bias", "ob": a + "o_proj.bias",
            "gb": m + "gate_proj.bias", "ub": m + "up_proj.bias", "db": m + "down_proj.bias",
            "q_norm": a + "q_norm.weight", "k_norm": a + "k_norm.weight",
            "gate": m + "gate_proj.weight", "up": m + "up_proj.weight", "down": m + "down_proj.weight",
            "ln1": f"model.layers.{i}.input_layernorm.weight",
            "ln2": f"model.layers.{i}.post_attention_layernorm.weight"}


def _lean_parts(sd: dict, n_layers: int) -> dict:
    """HF policy state_dict -> LeanLlama's names: a linear ("lm_head", "0.qkv", "0.gate_up", ...) as its list of row
    blocks ([q, k, v], [gate, up]); biases "0.qkv_b", "0.o_b", ... (concatenated as their linear); norms and the
    embedding as tensors. No copies (the biases are small copies)."""
    embed = sd["model.embed_tokens.weight"]
    out = {"embed": embed, "norm": sd["model.norm.weight"], "lm_head": [sd.get("lm_head.weight", embed)]}
    for i in range(n_layers):
        n = _hf_names(i)
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
            out[f"{i}.down_b"] = sd[n["db"]].float()
        if n["q_norm"] in sd:
            out[f"{i}.q_norm"], out[f"{i}.k_norm"] = sd[n["q_norm"]], sd[n["k_norm"]]
    return out


# ---- the drafter ------------------------------------------------------------------------------------------------

class _QuantLlama(LeanLlama):
    """LeanLlama's forward over quantized linears (no HF module kept, no fp32 copy of the linears)."""

    def __init__(self, cfg, inv_freq, rope_scaling, weights, packed):
        self.config = cfg
        self.n_layers, self.hidden, self.vocab_size = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = cfg.max_position_embeddings
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.rope = Rope(inv_freq, self.max_len, rope_scaling)
        self.weights, self.packed = weights, packed
        self.head = weights["lm_head"]

    def _norm(self, x, w, name):
        return rms_norm(x, w[name], self.eps)  # quantized linears: the norm weights stay separate (requantize)

    def ensure_rope(self, length: int) -> None:
        """Padding positions of a ragged extension may pass the last real one; grow the tables (rare)."""
        if length > self.rope.max_len:
            self.rope = Rope(self.inv_freq, 2 * length, self.rope_scaling)


class SelfQuantDrafter(nn.Module):
    kind = "selfquant"
    in_place_update = True  # load_state_dict / requantize write the live storage: double-buffer it in an engine

    def __init__(self, policy, quant: str = "int8", backend: str = "ao", group_size: int = 64):
        super().__init__()
        cfg = policy.config
        sd = policy.state_dict()
        t = _lean_parts(sd, cfg.num_hidden_layers)
        # names/shapes a policy state_dict must have (meta tensors: no memory, no reference to the policy)
        self._policy_keys = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
        sizes = {k: (sum(w.shape[0] for w in v), v[0].shape[1]) for k, v in t.items() if _is_linear(k)}
        check_backend(quant, backend, group_size, sizes)
        self.quant, self.backend, self.group_size = quant, backend, group_size
        make = LINEARS[(quant, backend)]
        fp32 = lambda x: x.detach().float().clone()  # noqa: E731
        weights = {"embed": fp32(t["embed"]), "norm": fp32(t["norm"]),
                   "lm_head": make(t["lm_head"], None, group_size)}
        packed = []
        for i in range(cfg.num_hidden_layers):
            w = {k: fp32(t[f"{i}.{k}"]) for k in ("ln1", "ln2", "q_norm", "k_norm") if f"{i}.{k}" in t}
            for k in ("qkv", "o", "gate_up", "down"):
                w[k] = make(t[f"{i}.{k}"], t.get(f"{i}.{k}_b"), group_size)
            packed.append(w)
        rot = policy.model.rotary_emb
        self.config = copy.deepcopy(cfg)
        self.body = _QuantLlama(self.config, rot.inv_freq.detach().clone(),
                                float(getattr(rot, "attention_scaling", 1.0)), weights, packed)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return ()

    # ---- weights: in place ----------------------------------------------------------------------------------------
    def _storage(self) -> dict[str, torch.Tensor]:
        """Name -> the live tensor: the drafter form (what state_dict returns and load_state_dict copies into)."""
        out = {}
        for name, t in self._items():
            if isinstance(t, _Linear):
                out.update({f"{name}.{k}": v for k, v in t.storage().items()})
            else:
                out[name] = t
        return out

    def _items(self):
        yield from self.body.weights.items()
        for i, w in enumerate(self.body.packed):
            yield from ((f"{i}.{k}", v) for k, v in w.items())

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return self._storage()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """A policy state_dict (HF names: requantized) or this drafter's own state_dict (copied); in place."""
        if "model.embed_tokens.weight" in state_dict:
            check_tensors(self._policy_keys, state_dict, "policy", finite=False)  # requantize checks that
            self.requantize(state_dict)
        else:
            store = self._storage()
            check_tensors(store, state_dict, "drafter-form", dtype=True,
                          hint="a different policy size, or a drafter built with other quant settings?")
            for name, t in self._items():
                if isinstance(t, _Linear):
                    t.load_({k: state_dict[f"{name}.{k}"] for k in t.storage()})
                else:
                    t.copy_(state_dict[name])
        return None

    @torch.no_grad()
    def requantize(self, policy) -> None:
        """Quantize the policy's current weights (a module or its state_dict) into the existing storage."""
        sd = policy if isinstance(policy, dict) else policy.state_dict()
        check_finite(sd)  # before any write
        t = _lean_parts(sd, self.config.num_hidden_layers)
        for name, cur in self._items():
            if isinstance(cur, _Linear):
                cur.requantize_(t[name], t.get(f"{name}_b"))
            else:
                cur.copy_(t[name])

    # ---- inference: chain drafting over the drafter's own cache -------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "SelfQuantState":
        """prompts [B, P] right-padded: the drafter reads position 0 there (None: token 0, for timing only)."""
        first = prompts[:, 0].clone() if prompts is not None else torch.zeros(batch, dtype=torch.long)
        return SelfQuantState(self.body.new_cache(batch, max_len), first)

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Extend the cache with the n_new[b] tokens at positions start[b]+1 .. start[b]+n_new[b] (new_ids [B, m],
        right-padded; the first call also feeds position 0), then chain k drafts. aux is unused.
        A leading run of new tokens equal to the drafts this drafter fed at those positions last time (the accepted
        ones) is skipped: same token, position and context, so their cache entries are already right. A verify
        step then costs the drafter 1 token (2 when all k drafts were accepted) instead of n_new.
        Returns (draft tokens [B, k], draft probs [B, k, V] or None for one-hot greedy drafts)."""
        B = new_ids.shape[0]
        rows = torch.arange(B)
        if st.first is not None:
            ids, pos0, last = torch.cat([st.first.view(B, 1), new_ids], 1), start, n_new  # [B, 1+m]
            st.first = None
        else:
            skip = st.cached_prefix(new_ids, n_new, start)  # [B]
            last = n_new - skip - 1
            cols = (skip.view(B, 1) + torch.arange(int(last.max()) + 1)).clamp_max(new_ids.shape[1] - 1)
            ids, pos0 = new_ids.gather(1, cols), start + 1 + skip
        ids = ids[:, : int(last.max()) + 1]  # drop columns that are padding in every row
        m = ids.shape[1]
        pos = pos0 + last + 1  # [B] first chain position per row
        need = max(int(pos0.max()) + m, int(pos.max()) + k)
        st.ensure(need)
        self.body.ensure_rope(need)
        logits, _ = self.body.forward(ids, pos0, st.cache)  # [B, m, V]
        lg = logits[rows, last]  # [B, V] predicts position pos
        draft, q = draft_chain(lg, lambda d, i: self.body.forward(d.view(B, 1), pos + i, st.cache)[0][:, 0], k,
                               params, greedy_drafts, generator)
        st.fed, st.fed_pos = draft[:, : k - 1], pos  # drafts 1..k-1 sit in the cache at pos .. pos+k-2
        return draft, q


class SelfQuantState:
    """Per-generation state: the drafter's own KV cache (all layers); until the first propose, token 0; after each,
    the drafts it fed into the cache (fed [B, k-1] from position fed_pos [B])."""

    def __init__(self, cache: KVCache, first: torch.Tensor):
        self.cache, self.first = cache, first
        self.fed: torch.Tensor | None = None
        self.fed_pos: torch.Tensor | None = None

    def cached_prefix(self, new_ids: torch.Tensor, n_new: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """[B] how many leading new tokens (at most n_new - 1: the last one's logits are needed) the cache holds."""
        if self.fed is None or self.fed.shape[1] == 0:
            return torch.zeros_like(n_new)
        w = min(self.fed.shape[1], new_ids.shape[1])
        j = torch.arange(w).view(1, w)
        same = (new_ids[:, :w] == self.fed[:, :w]) & (j < (n_new - 1).view(-1, 1)) & (
            start + 1 == self.fed_pos).view(-1, 1)
        return same.long().cumprod(1).sum(1)

    def ensure(self, length: int) -> None:
        c = self.cache
        if length > c.max_len:  # rare: ragged padding near the end of max_len
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], length - c.max_len, t.shape[3])], 2)  # noqa
            c.k, c.v, c.max_len = [pad(t) for t in c.k], [pad(t) for t in c.v], length

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.select_rows(idx)
        if self.first is not None:
            self.first = self.first[idx]
        if self.fed is not None:
            self.fed, self.fed_pos = self.fed[idx], self.fed_pos[idx]


def _is_linear(name: str) -> bool:
    return name == "lm_head" or name.split(".")[-1] in ("qkv", "o", "gate_up", "down")


def from_config(cfg, policy) -> SelfQuantDrafter:
    """The registry entry: cfg is a DrafterConfig (quant, backend, group_size)."""
    return SelfQuantDrafter(policy, cfg.quant, cfg.backend, cfg.group_size)
