"""The drafter registry: adding a drafter kind is one file plus one line in DRAFTERS (or register_drafter).
The protocols a kind implements are in contract.py."""
from __future__ import annotations

import copy

import torch

from drafttrain.drafters import eagle3, selfquant
from drafttrain.quant import quantize_module_int8


def _fresh_eagle3(cfg, policy):
    d = eagle3.Eagle3Drafter(eagle3.config_from_policy(
        policy.config, cfg.aux_layer_ids, cfg.draft_vocab_size, cfg.intermediate_size))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(policy.get_input_embeddings().weight)
    return d


DRAFTERS = {"eagle3": _fresh_eagle3, "selfquant": selfquant.from_config}  # kind -> build(cfg.drafter, policy)


def register_drafter(kind: str, build) -> None:
    """Add a drafter kind: build(cfg.drafter, policy) -> a fresh Drafter (contract.py)."""
    DRAFTERS[kind] = build


def build_drafter(cfg, policy):
    """cfg: DrafterConfig. A fresh drafter sized from the policy; loads cfg.path when it is set."""
    if cfg.kind not in DRAFTERS:
        raise ValueError(f"drafter.kind: unknown drafter {cfg.kind!r} (known: {', '.join(sorted(DRAFTERS))})")
    if cfg.path and cfg.kind == "selfquant":
        raise ValueError("drafter.path: must be null for drafter.kind=selfquant (it is built from the policy)")
    if cfg.path:
        from drafttrain.config import resolve_path
        from drafttrain.export import load_drafter

        d = load_drafter(resolve_path(cfg.path), target_num_layers=policy.config.num_hidden_layers)
        try:
            check_compatible(d, policy)
        except ValueError as e:  # name the key: the drafter there was made for another policy
            raise ValueError(f"drafter.path: {cfg.path} does not fit the policy: {e} (pretrain one for it with "
                             f"scripts/pretrain_drafter.py, or drafter.path=null for a fresh drafter)") from None
        # the checkpoint fixes its shape: a recipe asking for another one is an error, not silently overridden
        have = {"aux_layer_ids": list(d.aux_layer_ids), "draft_vocab_size": d.config.draft_vocab_size,
                "intermediate_size": d.config.intermediate_size}
        for key, got in have.items():
            want = getattr(cfg, key, None)
            if want is not None and (list(want) if key == "aux_layer_ids" else want) != got:
                raise ValueError(f"drafter.{key}: {want} differs from the checkpoint {cfg.path}'s {got} (set it to "
                                 f"null to use the checkpoint's, or drafter.path=null for a fresh drafter)")
        return d
    return DRAFTERS[cfg.kind](cfg, policy)


def check_compatible(drafter, policy) -> None:
    """A drafter built for another policy fails here, with the mismatching field named: any drafter with a config
    of sizes (EAGLE-3's; a self-drafter's is its policy's own; the Drafter protocol does not require one), and
    its aux layers where it takes them."""
    c, pc = getattr(drafter, "config", None), policy.config
    if c is None or not hasattr(c, "hidden_size"):
        return
    if c.hidden_size != pc.hidden_size:
        raise ValueError(f"drafter hidden_size {c.hidden_size} != policy hidden_size {pc.hidden_size}")
    if c.vocab_size != pc.vocab_size:
        raise ValueError(f"drafter vocab_size {c.vocab_size} != policy vocab_size {pc.vocab_size}")
    aux = drafter.reads.aux_layers
    if not aux:
        return
    if getattr(c, "target_num_layers", pc.num_hidden_layers) != pc.num_hidden_layers or max(
            aux) >= pc.num_hidden_layers:
        raise ValueError(f"drafter aux_layer_ids {list(aux)} do not fit the policy's "
                         f"{pc.num_hidden_layers} layers")


def runtime_copy(drafter, int8: bool, owned: bool = False):
    """The copy of `drafter` the embedded engine drafts with (owned: a fresh copy already, used as is): fused for
    inference, or, for a drafter with no fused form, its linears int8-quantized (int8; not a self-drafter's:
    quantized already). Also what teacher-forced scoring of the engine's drafter scores."""
    rt = (drafter if owned else copy.deepcopy(drafter)).eval().requires_grad_(False)
    if hasattr(rt, "fuse_for_inference"):
        return rt.fuse_for_inference(int8=int8)
    if int8 and not getattr(drafter, "in_place_update", False):
        return quantize_module_int8(rt)
    return rt
