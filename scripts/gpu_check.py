"""Measure the policy's decode step on this machine's accelerator and compare it with the simulator's roofline.

    python scripts/gpu_check.py                                   # 8B (Llama-3-8B shape, random weights), vLLM
    python scripts/gpu_check.py backend=torch batches=[1,16] out=/tmp/gpu_check.json
    python scripts/gpu_check.py model=tiny backend=torch device=cpu gpu=H100      # the plumbing, on a CPU

The model is built from drafttrain.simulate.MODELS' shape with random weights (no download): vLLM serves it with
load_format=dummy; the torch backend runs HF Llama eagerly (launch-bound at batch 1: an upper bound). A decode step
is timed as (generate n+1 tokens - generate 1 token) / n at a context of about `ctx`. Each row of the JSON gives
measured and simulated seconds (simulate.Replica(model, gpu).forward_s(batch, 1, ctx)) and their ratio; `gpu` is
the simulator's name for this accelerator (auto: read from the device name).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from drafttrain.simulate import GPUS, MODELS, Model, Replica

TINY = Model(2, 64, 4, 2, 16, 128, 256)  # the plumbing check's model (model=tiny)


@dataclass
class GpuCheckConfig:
    model: str = "8b"  # a key of simulate.MODELS, or tiny
    backend: str = "vllm"  # vllm | torch
    device: str = "cuda"  # torch backend only
    gpu: str = "auto"  # simulate.GPUS name used for the simulated cost; auto: from the device name
    batches: list = field(default_factory=lambda: [1, 8, 32])
    ctx: int = 512  # context length the decode steps run at
    new_tokens: int = 64  # decode steps timed per measurement
    repeats: int = 3  # measurements per batch (median)
    out: str = "gpu_check.json"


def gpu_name(device_name: str) -> str:
    """The simulator's GPU for a device name such as 'NVIDIA H200' (longest key found in the name)."""
    hits = [k for k in GPUS if k.lower() in device_name.lower()]
    if not hits:
        raise ValueError(f"gpu: no simulator spec for device {device_name!r} (known: {', '.join(GPUS)}); pass gpu=NAME")
    return max(hits, key=len)


def hf_config(m: Model) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden,
            "intermediate_size": m.intermediate, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def decode_step_s(gen, cfg: GpuCheckConfig, sync=lambda: None) -> float:
    """Median over cfg.repeats of (gen(n + 1) - gen(1)) / n, n = cfg.new_tokens: one decode step with the prefill
    taken out; `gen(n)` generates n tokens for the whole batch. One warm-up call first."""
    gen(2)
    n = cfg.new_tokens
    return statistics.median((_timed(lambda: gen(n + 1), sync) - _timed(lambda: gen(1), sync)) / n
                             for _ in range(cfg.repeats))


def measure_torch(m: Model, cfg: GpuCheckConfig) -> dict[int, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if cfg.device != "cpu" else torch.float32
    with torch.device(cfg.device):
        model = LlamaForCausalLM(LlamaConfig(**hf_config(m))).to(dtype).eval()
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else (lambda: None)
    out = {}
    for B in cfg.batches:
        ids = torch.randint(3, m.vocab, (B, cfg.ctx - cfg.new_tokens // 2), device=cfg.device)

        def gen(n):
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        out[B] = decode_step_s(gen, cfg, sync)
    return out


def measure_vllm(m: Model, cfg: GpuCheckConfig) -> dict[int, float]:
    from vllm import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    (folder / "config.json").write_text(json.dumps(hf_config(m)))
    llm = LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=cfg.ctx + cfg.new_tokens + 8, max_num_seqs=max(cfg.batches), gpu_memory_utilization=0.85)
    out = {}
    for B in cfg.batches:
        n = cfg.ctx - cfg.new_tokens // 2
        prompts = [{"prompt_token_ids": [3 + (i * 7919 + j) % (m.vocab - 3) for j in range(n)]} for i in range(B)]

        def gen(n):
            llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0,
                                                 detokenize=False), use_tqdm=False)
        out[B] = decode_step_s(gen, cfg)  # LLM.generate returns once the batch is done
    return out


def main(cfg: GpuCheckConfig) -> dict:
    if cfg.model != "tiny" and cfg.model not in MODELS:
        raise ValueError(f"model: unknown {cfg.model!r} (known: tiny, {', '.join(MODELS)})")
    if cfg.backend not in ("vllm", "torch"):
        raise ValueError(f"backend: must be vllm or torch, got {cfg.backend!r}")
    m = TINY if cfg.model == "tiny" else MODELS[cfg.model]
    name = cfg.gpu
    if name == "auto":
        import torch

        name = gpu_name(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    if name not in GPUS:
        raise ValueError(f"gpu: unknown {name!r} (known: {', '.join(GPUS)})")
    measured = (measure_vllm if cfg.backend == "vllm" else measure_torch)(m, cfg)
    rep = Replica(m, GPUS[name])
    rows = [{"batch": B, "ctx": cfg.ctx, "measured_s": s, "simulated_s": rep.forward_s(B, 1, cfg.ctx),
             "measured_over_simulated": s / rep.forward_s(B, 1, cfg.ctx)} for B, s in measured.items()]
    result = {"model": cfg.model, "backend": cfg.backend, "gpu": name, "rows": rows}
    Path(cfg.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"batch {r['batch']:>4}: measured {1e3 * r['measured_s']:8.3f} ms  "
              f"simulated {1e3 * r['simulated_s']:8.3f} ms  ratio {r['measured_over_simulated']:.2f}")
    return result


if __name__ == "__main__":
    schema = OmegaConf.structured(GpuCheckConfig)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist(sys.argv[1:])))
        main(cfg)
    except ValueError as e:
        sys.exit(f"error: {e}")
