"""Drafter checkpoints in the speculators format, which vLLM loads as is, both directions.

    save_drafter(drafter, "checkpoints/eagle3", verifier="checkpoints/policy", k=4)
    drafter = load_drafter("checkpoints/eagle3")

A folder holds config.json (speculators_model_type, transformer_layer_config, speculators_config,
draft_vocab_size, eagle_aux_hidden_state_layer_ids, plus a `drafttrain` block with the exact build config) and
model.safetensors. Writes go to a temporary folder that is renamed into place: never half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafttrain.atomic import recover_dir, replace_dir
from drafttrain.drafters import eagle3

FORMAT_VERSION = 1


def speculators_config(d: eagle3.Eagle3Drafter, verifier: str, k: int) -> dict:
    c = d.config
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "norm_before_residual": False,  # residual is the un-normed hidden, as in eagle3.py
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "transformer_layer_config": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        },
        "drafttrain": {"format_version": FORMAT_VERSION, "kind": d.kind, "config": eagle3.config_dict(d)},
    }


def save_drafter(d: eagle3.Eagle3Drafter, path: str | Path, verifier: str | Path = "", k: int = 4,
                 extra: dict | None = None) -> Path:
    """Atomic write of config.json + model.safetensors (+ optional extra JSON under drafttrain.extra)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = speculators_config(d, str(verifier), k)
    if extra:
        cfg["drafttrain"]["extra"] = extra
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        weights = {n: t.detach().contiguous().cpu() for n, t in d.state_dict().items()}
        if _identity_vocab_map(d):  # vLLM refuses d2t when the draft vocabulary is the whole vocabulary
            weights.pop("d2t")
            weights.pop("t2d")
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for p, mode in ((tmp, 0o755), (tmp / "model.safetensors", 0o644)):  # mkdtemp/safetensors give 0700/0600
            os.chmod(p, mode)
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_drafter(path: str | Path, target_num_layers: int | None = None) -> eagle3.Eagle3Drafter:
    """target_num_layers: the policy's depth, used only for a speculators checkpoint made elsewhere (the format
    does not record it; without it, max(aux ids) + 1 is assumed)."""
    path = Path(path)
    recover_dir(path)
    cfg_file, w_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not w_file.is_file():
        raise FileNotFoundError(f"drafter checkpoint {path}: missing config.json or model.safetensors")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise ValueError(f"drafter checkpoint {path}: speculators_model_type "
                         f"{cfg.get('speculators_model_type')!r} is not supported (eagle3)")
    if "drafttrain" in cfg:
        d = eagle3.build(cfg["drafttrain"]["config"])
    else:  # a speculators checkpoint made elsewhere
        d = eagle3.build(_config_from_speculators(cfg, path, target_num_layers))
    weights = load_file(str(w_file))
    if "d2t" not in weights and "t2d" not in weights and _identity_vocab_map(d):
        weights.update(d2t=d.d2t.clone(), t2d=d.t2d.clone())  # omitted on save: the identity map
    d.load_state_dict(weights)
    return d


def _identity_vocab_map(d: eagle3.Eagle3Drafter) -> bool:
    return d.config.draft_vocab_size == d.config.vocab_size and not d.d2t.any() and bool(d.t2d.all())


def _config_from_speculators(cfg: dict, path: Path, target_num_layers: int | None = None) -> dict:
    t = cfg["transformer_layer_config"]
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"drafter checkpoint {path}: eagle_aux_hidden_state_layer_ids is required")
    # settings that change the forward and that this drafter does not implement: refused, not silently dropped
    rope = t.get("rope_scaling") or t.get("rope_parameters") or {}
    unsupported = [("norm_before_residual", cfg.get("norm_before_residual", False), False),
                   ("transformer_layer_config.hidden_act", t.get("hidden_act", "silu"), "silu"),
                   ("transformer_layer_config rope type", rope.get("rope_type", rope.get("type", "default")),
                    "default")]
    for key, got, want in unsupported:
        if got != want:
            raise ValueError(f"drafter checkpoint {path}: {key} = {got!r} is not supported (only {want!r})")
    theta = (t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))
    return dict(hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                num_key_value_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
                head_dim=t.get("head_dim", t["hidden_size"] // t["num_attention_heads"]),
                intermediate_size=t["intermediate_size"], vocab_size=t["vocab_size"],
                draft_vocab_size=cfg.get("draft_vocab_size") or t["vocab_size"], aux_layer_ids=aux,
                target_num_layers=target_num_layers or max(aux) + 1, rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                rope_theta=theta, max_position_embeddings=t.get("max_position_embeddings", 2048))


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> float:
    """A cheap order-independent checksum used to verify that a swap landed (read-back)."""
    return float(sum(t.double().sum() for t in weights.values() if t.is_floating_point()))


# ---- vLLM: the fields vLLM itself reads from an exported folder, checked against the target ------------------

def read_speculators_config(path: str | Path) -> dict:
    """config.json of a speculators folder; FileNotFoundError naming what is missing."""
    path = Path(path)
    recover_dir(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"drafter checkpoint {path}: missing config.json or model.safetensors")
    return json.loads((path / "config.json").read_text())


def check_vllm_target(cfg: dict, target: dict, where: str = "drafter") -> None:
    """One-line ValueError when a speculators config does not fit the target's HF config (a dict with
    num_hidden_layers, hidden_size, vocab_size). Checks what vLLM reads, not the `drafttrain` block: vLLM takes
    eagle_aux_hidden_state_layer_ids as the inputs of those target layers, so they must be distinct and in
    [0, num_hidden_layers); an unchecked collision only surfaces as a reshape error inside the engine."""
    n, V, H = int(target["num_hidden_layers"]), int(target["vocab_size"]), int(target["hidden_size"])
    if cfg.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{where}: speculators_model_type {cfg.get('speculators_model_type')!r} is not supported "
                         f"by the vLLM engine (eagle3)")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids is missing (vLLM's default ids collide on "
                         f"small targets)")
    aux = [int(i) for i in aux]
    if len(set(aux)) != len(aux):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} collide (each target layer at most once)")
    if any(not 0 <= i < n for i in aux):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} exceed the target's {n} layers "
                         f"(valid ids: 0..{n - 1})")
    t = cfg.get("transformer_layer_config") or {}
    if int(t.get("hidden_size", H)) != H or int(cfg.get("target_hidden_size", H)) != H:
        raise ValueError(f"{where}: hidden size {t.get('hidden_size')} does not match the target's {H}")
    if int(t.get("vocab_size", V)) != V:
        raise ValueError(f"{where}: vocab_size {t.get('vocab_size')} does not match the target's {V}")
    dv = int(cfg.get("draft_vocab_size") or t.get("vocab_size", V))
    if not 0 < dv <= V:
        raise ValueError(f"{where}: draft_vocab_size {dv} is larger than the target's vocabulary {V}")
    block = (cfg.get("drafttrain") or {}).get("config")
    if block and (list(block["aux_layer_ids"]) != aux or int(block["draft_vocab_size"]) != dv):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids/draft_vocab_size {aux}/{dv} disagree with "
                         f"the drafttrain block {list(block['aux_layer_ids'])}/{block['draft_vocab_size']}")
    if block and int(block.get("target_num_layers", n)) != n:  # built for another depth (the embedded engine's
        raise ValueError(f"{where}: built for a policy of {block['target_num_layers']} layers, the target has {n}")
