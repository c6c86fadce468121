"""The drafter registry: adding a drafter kind is one file plus one registration (DRAFTERS, or register_drafter).
A kind brings what it needs (DrafterKind): how to build a fresh one, how to load and save one at drafter.path, the
name of its vLLM form, and its settings: a config section (drafter.<kind>, a dataclass) with its checks, from which
drafter_config.py builds drafter.*. The protocols a kind implements are in contract.py."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from drafttrain.drafters import auto, draft_model, eagle3, mtp, selfquant, speculators, suffix
from drafttrain.drafters.contract import check_compatible
from drafttrain.device import module_device


@dataclass(frozen=True)
class DrafterKind:
    build: Callable  # build(cfg.drafter, policy) -> a fresh drafter (contract.Drafter)
    load: Optional[Callable] = None  # load(cfg.drafter, policy) -> the drafter at cfg.drafter.path; None: no path
    # the name of its vLLM form (a key of engines/vllm_forms.FORMS, which form_of(kind) looks up); None: embedded only.
    # A name, not a module: drafters/ never imports or names an engine module (the vLLM side imports this registry)
    vllm: Optional[str] = None
    # save(drafter, path, verifier=, k=, extra=) -> path: the folder `load` reads back; None: nothing to save
    save: Optional[Callable] = None
    # its settings, drafter.<kind>: a dataclass whose fields' trailing comments are their keys' docs; None: none
    section: Optional[type] = None
    # checks(section) -> [(ok, key within the section, message)]: what types alone cannot say (config.validate)
    checks: Optional[Callable] = None


def _fresh_eagle3(cfg, policy):
    e = cfg.eagle3
    d = eagle3.Eagle3Drafter(eagle3.config_from_policy(
        policy.config, e.aux_layer_ids, e.draft_vocab_size, e.intermediate_size)).to(module_device(policy))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(policy.get_input_embeddings().weight)
    return d


def _load_eagle3(cfg, policy):
    """The speculators-format folder at cfg.path; it fixes its own sizes: drafter.eagle3 settings that ask for other
    ones are an error, not silently overridden."""
    from drafttrain.paths import resolve_path

    d = speculators.load_drafter(resolve_path(cfg.path), target_num_layers=policy.config.num_hidden_layers)
    try:
        check_compatible(d, policy)
    except ValueError as e:  # name the key: the drafter there was made for another policy
        raise ValueError(f"drafter.path: {cfg.path} does not fit the policy: {e} (pretrain one for it with "
                         f"scripts/pretrain_drafter.py, or drafter.path=null for a fresh drafter)") from None
    have = {"aux_layer_ids": list(d.aux_layer_ids), "draft_vocab_size": d.config.draft_vocab_size,
            "intermediate_size": d.config.intermediate_size}
    for key, got in have.items():
        want = getattr(cfg.eagle3, key, None)
        if want is not None and (list(want) if key == "aux_layer_ids" else want) != got:
            raise ValueError(f"drafter.eagle3.{key}: {want} differs from the checkpoint {cfg.path}'s {got} (set "
                             f"it to null to use the checkpoint's, or drafter.path=null for a fresh drafter)")
    return d


def _build_auto(cfg, policy):
    """Each member kind from its drafter.auto.paths entry (null: fresh), with the rest of drafter.* as given."""
    members = {}
    for kind, path in zip(cfg.auto.kinds, cfg.auto.paths):
        member = copy.deepcopy(cfg)
        member.kind, member.path = kind, path
        try:
            members[kind] = build_drafter(member, policy)
        except (ValueError, FileNotFoundError) as e:  # name the member (drafter.path there: its auto.paths entry)
            raise type(e)(f"drafter.auto.paths ({kind}): {e}") from None
    return auto.AutoDrafter(members, runtime_copy)


def _save_eagle3(d, path, **kw):
    return speculators.save_drafter(d, path, **kw)


DRAFTERS: dict[str, DrafterKind] = {
    "eagle3": DrafterKind(_fresh_eagle3, _load_eagle3, "EAGLE3", _save_eagle3, eagle3.Section, eagle3.checks),
    "selfquant": DrafterKind(selfquant.from_config, None, "SELFQUANT", None, selfquant.Section, selfquant.checks),
    "suffix": DrafterKind(suffix.from_config, None, "SUFFIX", None, suffix.Section, suffix.checks),
    "draft_model": DrafterKind(draft_model.fresh, draft_model.load, "DRAFT_MODEL", draft_model.save,
                               draft_model.Section, draft_model.checks),
    "mtp": DrafterKind(mtp.fresh, mtp.load, "MTP", mtp.save, mtp.Section, mtp.checks),
    "auto": DrafterKind(_build_auto, section=auto.Section, checks=auto.checks),
}


def register_drafter(kind: str, build, load=None, vllm: str | None = None, save=None, section=None,
                     checks=None) -> None:
    """Add a drafter kind: build(cfg.drafter, policy) -> a fresh Drafter (contract.py); see DrafterKind. A section
    takes effect in the configs loaded after the registration (load_recipe)."""
    DRAFTERS[kind] = DrafterKind(build, load, vllm, save, section, checks)


def save_drafter(kind: str, drafter, path, **kw):
    """The kind's checkpoint folder at path (what drafter.path loads back); a kind with none: one-line error."""
    save = DRAFTERS[kind].save
    if save is None:
        raise ValueError(f"drafter.kind: {kind} has no checkpoint to save (it trains nothing)")
    return save(drafter, path, **kw)


def build_drafter(cfg, policy):
    """cfg: DrafterConfig. A fresh drafter sized from the policy; the kind loads cfg.path when it is set. Either way
    on the policy's device."""
    if cfg.kind not in DRAFTERS:
        raise ValueError(f"drafter.kind: unknown drafter {cfg.kind!r} (known: {', '.join(sorted(DRAFTERS))})")
    kind = DRAFTERS[cfg.kind]
    if cfg.path and kind.load is None:
        raise ValueError(f"drafter.path: must be null for drafter.kind={cfg.kind} (it loads no checkpoint)")
    if cfg.path:
        _check_kind(cfg)
        return on_device(kind.load(cfg, policy), module_device(policy))
    return on_device(kind.build(cfg, policy), module_device(policy))


def on_device(drafter, device):
    """The drafter with its tensors on `device` (the policy's), moved in place. A kind that holds no module tensors
    is there already: the self-drafter is made from the policy's own weights, the suffix drafter holds host text."""
    if isinstance(drafter, torch.nn.Module):
        drafter.to(device)
    return drafter


def _check_kind(cfg) -> None:
    """A checkpoint of another kind at drafter.path is a one-line error (before its own loader misreads it)."""
    from drafttrain.paths import resolve_path

    path = resolve_path(cfg.path)
    c = speculators.read_speculators_config(path)
    saved = (c.get("drafttrain") or {}).get("kind") or c.get("speculators_model_type")
    if saved is not None and saved != cfg.kind:
        raise ValueError(f"drafter.path: {cfg.path} holds a {saved} drafter, not drafter.kind={cfg.kind} (set "
                         f"drafter.kind={saved}, or point drafter.path at a {cfg.kind} checkpoint)")


def runtime_copy(drafter, int8: bool, owned: bool = False, device=None):
    """The copy of `drafter` the embedded engine drafts with (owned: a fresh copy already, used as is), on `device`
    (the engine's; None: where it is): fused for inference, or, for a drafter with no fused form, its linears
    int8-quantized (int8; not a self-drafter's: quantized already). Also what teacher-forced scoring of the engine's
    drafter scores."""
    rt = (drafter if owned else copy.deepcopy(drafter)).eval().requires_grad_(False)
    if device is not None:
        on_device(rt, device)  # before fusing: the fused forms are not module tensors that .to() moves
    return rt.fuse_for_inference(int8=int8)
