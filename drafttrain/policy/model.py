"""Build, save and load the tiny Llama policy (fp32 on CPU).

`PolicyConfig` holds the sizes; `build_policy` makes a fresh
`LlamaForCausalLM`; `save_policy` writes model + tokenizer to a temporary
directory and then renames it into place, so a reader never sees a
half-written checkpoint; `load_policy` checks the directory is complete,
then loads it in fp32.

Why these sizes (hidden 256, 6 layers, 4 heads / 4 KV heads, MLP 768, 5.1M
params, 20 MB in fp32): within scripts/make_policy.py's 10-minute budget on the
2-core CPU, wider models learned the task more slowly per step *and* cost more per
step, so only hidden 256 gets to "decent but imperfect" in budget. 6 layers keep a
1-layer EAGLE-3 drafter at about 1/6 of the policy. The matmuls are most of a
decode step, framework overhead the rest. Measured: see bench/NOTES.md, World.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass

import torch
from safetensors import SafetensorError
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast)

from drafttrain.atomic import atomic_dir, recover_dir
from drafttrain.config import ConfigError
from drafttrain.policy.tokenizer import VOCAB_SIZE, build_tokenizer, load_tokenizer

# one of each: config, weights (single file or sharded), tokenizer
REQUIRED_FILES = (("config.json",), ("model.safetensors", "model.safetensors.index.json"),
                  ("tokenizer.json", "tokenizer_config.json"))
SERVED = ("llama", "qwen2", "qwen3")  # model_type values the embedded engine serves (modeling.py)


@dataclass
class PolicyConfig:
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4  # head_dim 64
    num_key_value_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 512
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False


def build_policy(cfg: PolicyConfig | dict | None = None) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama with the tokenizer's special ids."""
    if cfg is None:
        cfg = PolicyConfig()
    elif isinstance(cfg, dict):
        cfg = PolicyConfig(**cfg)
    tok = build_tokenizer()
    fields = asdict(cfg)
    rope_theta = fields.pop("rope_theta")
    config = LlamaConfig(
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config).float()


def save_policy(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, path: str, extra: dict | None = None,
    save_dtype: torch.dtype | None = None,
) -> None:
    """Written into a temporary folder, then renamed into `path` (atomic_dir); `extra` maps file name -> text.

    `save_dtype` (e.g. torch.bfloat16) stores a cast copy to halve the file; `load_policy`
    casts back to fp32. `model` itself is left untouched.
    """
    with atomic_dir(os.path.abspath(path)) as tmp:
        to_save = copy.deepcopy(model).to(save_dtype) if save_dtype is not None else model
        to_save.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)


def check_checkpoint(path: str) -> None:
    """Raise FileNotFoundError naming `path` if it is not a complete policy checkpoint."""
    recover_dir(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"policy checkpoint not found: {path}")
    missing = [" or ".join(alts) for alts in REQUIRED_FILES
               if not any(os.path.isfile(os.path.join(path, f)) for f in alts)]
    if missing:
        raise FileNotFoundError(f"policy checkpoint {path} is incomplete: missing {', '.join(missing)}")


def load_policy(path: str, engine: str = "torch", device: torch.device | str = "cpu",
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in fp32, eval mode, on device; tokenizer) from an HF checkpoint folder (`save_policy`'s, or the user's
    own). A file that does not parse (truncated, emptied, garbled) is a one-line `ConfigError` naming it; so is a model
    family the embedded engine (engine="torch") does not serve."""
    check_checkpoint(path)
    parsed = {}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(path, name)):
            try:
                with open(os.path.join(path, name), "rb") as f:
                    parsed[name] = json.loads(f.read())
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise _unreadable(os.path.join(path, name), e) from None
    config = parsed["config.json"]
    kind = config.get("model_type")
    if engine == "torch" and kind not in SERVED:
        arch = ", ".join(config.get("architectures") or []) or "no architectures entry"
        raise ConfigError(f"policy.path: {path} is a {kind!r} model ({arch}); the embedded engine serves "
                          f"{', '.join(SERVED)}: use engine.kind=vllm for it")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except SafetensorError as e:
        raise _unreadable(os.path.join(path, "model.safetensors"), e) from None
    model.to(device).eval()
    return model, load_tokenizer(path)


def _unreadable(file: str, e: Exception) -> ConfigError:
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ConfigError(f"policy checkpoint file {file} cannot be read (truncated or corrupt?): {why}")
