"""Drafter checkpoints in the speculators format (EAGLE-3), which the speculators library and vLLM load as is, both
directions; drafttrain.export re-exports it.

    save_drafter(drafter, "checkpoints/eagle3", verifier="checkpoints/policy", k=4)
    drafter = load_drafter("checkpoints/eagle3")

A folder holds config.json (speculators_model_type, transformer_layer_config, speculators_config,
draft_vocab_size, eagle_aux_hidden_state_layer_ids, the norm settings, plus a `drafttrain` block with the exact build
config) and model.safetensors in speculators' tensor names (the decoder layer as layers.0.*). Loading also takes the
original EAGLE naming (midlayer.*) and checkpoints saved by speculators. Writes go to a temporary folder that is
renamed into place: never half-written.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafttrain.atomic import atomic_dir, recover_dir
from drafttrain.drafters import eagle3

FORMAT_VERSION = 1
# settings of a speculators EAGLE-3 checkpoint that change its forward; this drafter implements only these values
_FIXED = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def speculators_config(d: eagle3.Eagle3Drafter, verifier: str, k: int) -> dict:
    c = d.config
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        **_FIXED,  # written out: speculators' training CLI defaults some of them to true
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
        "drafttrain": {"format_version": FORMAT_VERSION, "kind": d.kind, "config": dataclasses.asdict(d.config)},
    }


def save_drafter(d: eagle3.Eagle3Drafter, path: str | Path, verifier: str | Path = "", k: int = 4,
                 extra: dict | None = None) -> Path:
    """Atomic write of config.json + model.safetensors (+ optional extra JSON under drafttrain.extra), in
    speculators' tensor names (the drafter's state_dict: layers.0.*)."""
    path = Path(path)
    cfg = speculators_config(d, str(verifier), k)
    if extra:
        cfg["drafttrain"]["extra"] = extra
    with atomic_dir(path, file_modes={"model.safetensors": 0o644}) as tmp:  # safetensors writes 0600
        weights = {n: t.detach().contiguous().cpu() for n, t in d.state_dict().items()}
        if _identity_vocab_map(d):  # vLLM refuses d2t when the draft vocabulary is the whole vocabulary
            weights.pop("d2t")
            weights.pop("t2d")
        save_file(weights, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def load_drafter(path: str | Path, target_num_layers: int | None = None) -> eagle3.Eagle3Drafter:
    """A speculators EAGLE-3 folder, written here or by speculators (decoder layer as layers.0.* or EAGLE's
    midlayer.*). Every problem is a one-line ValueError naming the file and the field or tensor.
    target_num_layers: the policy's depth, used only for a checkpoint made elsewhere (the format does not record
    it; without it, max(aux ids) + 1 is assumed)."""
    path = Path(path)
    cfg = read_speculators_config(path)
    where = f"drafter checkpoint {path / 'config.json'}"
    if cfg.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{where}: speculators_model_type {cfg.get('speculators_model_type')!r} is not supported "
                         f"(eagle3)")
    block = (cfg.get("drafttrain") or {}).get("config")
    layer = _layer_config(cfg, where)
    c = _config_from_speculators(cfg, layer, where, block["target_num_layers"] if block else target_num_layers)
    w_file = path / "model.safetensors"
    weights = _layout(read_weights(w_file), layer.num_hidden_layers, f"drafter checkpoint {w_file}")
    _check_sizes(c, cfg, weights, where)
    if block:  # this project's exact build config: it must say what the speculators keys say
        diff = [k for k in c if k in block and (list(block[k]) if k == "aux_layer_ids" else block[k]) != c[k]]
        if diff:
            raise ValueError(f"{where}: the drafttrain block's {diff[0]} {block.get(diff[0])} disagrees with the "
                             f"speculators keys' {c[diff[0]]}")
    d = eagle3.Eagle3Drafter(eagle3.Eagle3Config(**c))
    if "d2t" not in weights and _identity_vocab_map(d):
        weights.update(d2t=d.d2t.clone(), t2d=d.t2d.clone())  # omitted on save: the identity map
    unfit = sorted(set(weights) - set(d.state_dict()))
    if unfit:
        raise ValueError(f"drafter checkpoint {w_file}: {len(unfit)} tensors fit neither speculators' layout "
                         f"(layers.0.*) nor EAGLE's (midlayer.*): {', '.join(unfit[:4])}{', ...' * (len(unfit) > 4)}")
    try:
        d.load_state_dict(weights)
    except ValueError as e:
        raise ValueError(f"drafter checkpoint {w_file}: {e}") from None
    return d


def read_weights(w_file: Path) -> dict[str, torch.Tensor]:
    """model.safetensors; a truncated, empty or garbled file is a one-line ValueError naming it."""
    try:
        return load_file(str(w_file))
    except (SafetensorError, OSError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"drafter checkpoint {w_file}: not a readable safetensors file ({msg}); re-export it or "
                         f"point drafter.path at another checkpoint") from None


def _layout(weights: dict, n: int, where: str) -> dict:
    """Tensor names in speculators' layout (layers.0.*); EAGLE's midlayer.* is renamed. Several decoder layers (or
    both namings) are refused in one line."""
    layer_keys = [k for k in weights if k.startswith("layers.")]
    if layer_keys and any(k.startswith(eagle3.EAGLE_LAYER) for k in weights):
        raise ValueError(f"{where}: holds both layers.* and midlayer.* tensors (two namings of the decoder layer)")
    ids = sorted({k.split(".")[1] for k in layer_keys})
    if n != 1 or ids not in ([], ["0"]):
        raise ValueError(f"{where}: {max(n, len(ids))} decoder layers (transformer_layer_config.num_hidden_layers "
                         f"= {n}, tensors under layers.{{{','.join(ids)}}}): this EAGLE-3 drafter has exactly one")
    return eagle3.speculators_names(weights)


def _check_sizes(c: dict, cfg: dict, w: dict, where: str) -> None:
    """Sizes config.json states against the weights' shapes: a disagreement names the key and both sizes."""
    def rows(name):
        return int(w[name].shape[0]) if name in w and w[name].dim() else None

    V, Vd = c["vocab_size"], c["draft_vocab_size"]
    checks = [("transformer_layer_config.hidden_size", c["hidden_size"], "fc.weight", rows("fc.weight")),
              ("transformer_layer_config.vocab_size (the policy's vocabulary)", V, "embed_tokens.weight",
               rows("embed_tokens.weight")),
              ("draft_vocab_size", Vd, "lm_head.weight", rows("lm_head.weight")),
              ("transformer_layer_config.intermediate_size", c["intermediate_size"],
               "layers.0.mlp.gate_proj.weight", rows("layers.0.mlp.gate_proj.weight"))]
    for key, want, name, got in checks:
        if got is not None and got != want:
            raise ValueError(f"{where}: {key} is {want}, the weights' is {got} ({name} has {got} rows)")
    if Vd != V and ("d2t" not in w or "t2d" not in w):
        raise ValueError(f"{where}: a draft vocabulary of {Vd} tokens (draft_vocab_size) for a "
                         f"policy vocabulary of {V} (transformer_layer_config.vocab_size) needs d2t and t2d, and "
                         f"model.safetensors has no {'d2t' if 'd2t' not in w else 't2d'}")
    if (cfg.get("target_hidden_size") or c["hidden_size"]) != c["hidden_size"]:  # fc's input: A policy states of H
        raise ValueError(f"{where}: target_hidden_size {cfg['target_hidden_size']} differs from "
                         f"transformer_layer_config.hidden_size {c['hidden_size']}, which is not supported")


def _identity_vocab_map(d: eagle3.Eagle3Drafter) -> bool:
    return d.config.draft_vocab_size == d.config.vocab_size and not d.d2t.any() and bool(d.t2d.all())


def _layer_config(cfg: dict, where: str):
    """transformer_layer_config read as speculators reads it: the transformers config class of its model_type (a
    saved config leaves out the keys at that class's defaults). Llama only: the layer this drafter implements."""
    from transformers import LlamaConfig

    t = cfg.get("transformer_layer_config")
    if not isinstance(t, dict):
        raise ValueError(f"{where}: transformer_layer_config is missing")
    if t.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: transformer_layer_config.model_type = {t['model_type']!r} is not supported "
                         f"(only 'llama')")
    try:
        return LlamaConfig(**{k: v for k, v in t.items() if k != "model_type"})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: transformer_layer_config: {' '.join(str(e).split())}") from None


def _config_from_speculators(cfg: dict, t, where: str, target_num_layers: int | None = None) -> dict:
    """The drafter's build config from the keys speculators and vLLM read (t: _layer_config's); a setting this
    drafter does not implement (it would compute something else) is refused in one line naming the key."""
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids is required")
    rope = t.rope_parameters or {}
    sliding = "sliding_attention" in (getattr(t, "layer_types", None) or [])
    window = getattr(t, "sliding_window", None) if sliding else None
    unsupported = [(key, cfg.get(key, want), want) for key, want in _FIXED.items()]
    unsupported += [("transformer_layer_config.hidden_act", t.hidden_act, "silu"),
                    ("transformer_layer_config rope type", rope.get("rope_type", "default"), "default"),
                    ("transformer_layer_config.attention_bias", t.attention_bias, False),
                    ("transformer_layer_config.mlp_bias", t.mlp_bias, False),
                    ("transformer_layer_config.sliding_window (sliding attention)", window, None)]
    for key, got, want in unsupported:
        if got != want:
            raise ValueError(f"{where}: {key} = {got!r} is not supported (only {want!r})")
    return dict(hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
                num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
                intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or t.vocab_size), aux_layer_ids=list(aux),
                target_num_layers=int(target_num_layers or max(aux) + 1), rms_norm_eps=float(t.rms_norm_eps),
                rope_theta=float(rope.get("rope_theta", 10000.0)),
                max_position_embeddings=int(t.max_position_embeddings))


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> float:
    """A cheap order-independent checksum used to verify that a swap landed (read-back)."""
    return float(sum(t.double().sum() for t in weights.values() if t.is_floating_point()))


# ---- vLLM: the fields vLLM itself reads from an exported folder, checked against the target ------------------

def read_speculators_config(path: str | Path) -> dict:
    """config.json of a speculators folder; FileNotFoundError naming what is missing, a one-line ValueError naming
    the file when it is not a JSON object."""
    path = Path(path)
    recover_dir(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"drafter checkpoint {path}: missing config.json or model.safetensors")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"drafter checkpoint {path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"drafter checkpoint {path / 'config.json'}: not a JSON object")
    return cfg


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
