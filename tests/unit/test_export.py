"""Drafter checkpoints on disk: both namings of the EAGLE-3 decoder layer load, any other layout and every damaged
or inconsistent file is refused in one line naming the file and the field or tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafttrain.drafters import build_drafter
from drafttrain.export import load_drafter, save_drafter
from tests.unit.test_drafter import drafter_cfg, perturbed, propose_once


def one_line(e: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, msg
    return msg


@pytest.fixture
def ckpt(tmp_path, drafter):
    return save_drafter(perturbed(drafter, seed=1), tmp_path / "d", verifier="checkpoints/policy")


def rewrite(path, weights=None, cfg=None):
    """Edit a saved checkpoint: weights -> new tensors (given the old), cfg -> edits config.json in place."""
    if weights:
        w = weights(load_file(str(path / "model.safetensors")))
        save_file(w, str(path / "model.safetensors"))
    if cfg:
        c = json.loads((path / "config.json").read_text())
        cfg(c)
        (path / "config.json").write_text(json.dumps(c))


def renamed(w: dict, old: str, new: str) -> dict:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in w.items()}


# ---- layouts ----------------------------------------------------------------------------------------------------

def test_the_export_uses_speculators_names(ckpt):
    names = set(load_file(str(ckpt / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.0.hidden_norm.weight" in names
    assert not any(n.startswith("midlayer.") for n in names)


@pytest.mark.parametrize("external", [False, True])
def test_eagle_midlayer_naming_loads(ckpt, external):
    """Checkpoints in the original EAGLE naming (midlayer.*, what this project wrote before) load unchanged."""
    want = load_drafter(ckpt)
    rewrite(ckpt, weights=lambda w: renamed(w, "layers.0.", "midlayer."),
            cfg=(lambda c: c.pop("drafttrain")) if external else None)
    assert any(k.startswith("midlayer.") for k in load_file(str(ckpt / "model.safetensors")))
    got = load_drafter(ckpt, target_num_layers=want.config.target_num_layers)
    assert got.state_dict().keys() == want.state_dict().keys()
    for k, v in want.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    (t1, _), (t2, _) = propose_once(want, 4, greedy=True), propose_once(got, 4, greedy=True)
    assert torch.equal(t1, t2)
    fresh = perturbed(got, seed=8)  # a run's saved state in the old naming (trainer.pt, the frozen drafter) resumes
    fresh.load_state_dict(renamed(want.state_dict(), "layers.0.", "midlayer."))
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in want.state_dict().items())


def test_other_layouts_are_refused_naming_the_tensors(ckpt):
    rewrite(ckpt, weights=lambda w: {"model." + k: v for k, v in w.items()})  # an HF-style prefix
    with pytest.raises(ValueError) as e:
        load_drafter(ckpt)
    one_line(e, "model.safetensors", "fit neither", "model.embed_tokens.weight", "layers.0.*", "midlayer.*")


def test_both_namings_at_once_are_refused(ckpt):
    rewrite(ckpt, weights=lambda w: {**w, "midlayer.hidden_norm.weight": w["layers.0.hidden_norm.weight"].clone()})
    with pytest.raises(ValueError) as e:
        load_drafter(ckpt)
    one_line(e, "model.safetensors", "layers.*", "midlayer.*")


def test_several_decoder_layers_are_refused(ckpt):
    """speculators allows num_hidden_layers > 1; this drafter (its chain, KV cache and fused form) has one layer."""
    def two_layers(w):
        second = {k.replace("layers.0.", "layers.1."): v.clone() for k, v in w.items() if k.startswith("layers.0.")}
        return {**w, **second}

    rewrite(ckpt, weights=two_layers, cfg=lambda c: c["transformer_layer_config"].update(num_hidden_layers=2))
    with pytest.raises(ValueError) as e:
        load_drafter(ckpt)
    one_line(e, "2 decoder layers", "num_hidden_layers", "exactly one")


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc"),
    (lambda c: c.update(fc_norm=True), "fc_norm"),
    (lambda c: c.update(norm_output=True), "norm_output"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=64),
     "sliding_window"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type"),
    (lambda c: c.update(target_hidden_size=128), "target_hidden_size"),
], ids=["norm_before_fc", "fc_norm", "norm_output", "sliding", "qwen3", "target_hidden_size"])
def test_settings_this_drafter_does_not_compute_are_refused(ckpt, edit, key):
    """speculators' variants (its training CLI defaults norm_before_fc, norm_output and sliding attention on) change
    the forward: refused in one line naming the key, not loaded into a drafter that computes something else (they
    were ignored)."""
    rewrite(ckpt, cfg=edit)
    with pytest.raises(ValueError) as e:
        load_drafter(ckpt)
    one_line(e, "config.json", key)


# ---- damaged or inconsistent files ------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "emptied", "garbled"])
def test_unreadable_weights_file(ckpt, policy, damage):
    """Was a SafetensorError traceback naming no file."""
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    garbled = data[:8] + bytes((b * 7 + 3) % 256 for b in data[8:200]) + data[200:]  # header bytes scrambled
    f.write_bytes({"truncated": data[: len(data) // 2], "emptied": b"", "garbled": garbled}[damage])
    with pytest.raises(ValueError) as e:
        build_drafter(drafter_cfg(path=str(ckpt)), policy)
    one_line(e, str(f), "safetensors")


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_invalid_config_json(ckpt, policy, text):
    """Was a JSON error without the file's name."""
    (ckpt / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        build_drafter(drafter_cfg(path=str(ckpt)), policy)
    one_line(e, str(ckpt / "config.json"))


def test_hidden_size_that_disagrees_with_the_weights(ckpt, policy):
    """Was silently ignored (the drafttrain block was built, transformer_layer_config never read)."""
    rewrite(ckpt, cfg=lambda c: c["transformer_layer_config"].update(hidden_size=128))
    with pytest.raises(ValueError) as e:
        build_drafter(drafter_cfg(path=str(ckpt)), policy)
    one_line(e, "config.json", "transformer_layer_config.hidden_size is 128", "the weights' is 64")


@pytest.mark.parametrize("external", [False, True])
def test_vocabulary_mismatch_names_the_sizes(ckpt, external):
    """A config.json giving the policy's vocabulary as 40 over weights made for 32 tokens: was "missing tensor d2t"
    (or, with the drafttrain block, silently ignored); now both vocabulary sizes are named."""
    def edit(c):
        c["transformer_layer_config"].update(vocab_size=40)
        if external:
            c.pop("drafttrain")

    rewrite(ckpt, cfg=edit)
    with pytest.raises(ValueError) as e:
        load_drafter(ckpt)
    msg = one_line(e, "vocab", "40", "32")
    assert "missing tensor" not in msg


def test_draft_vocabulary_without_its_map_names_the_sizes(tmp_path, policy):
    """Was "missing tensor 'd2t'"."""
    d = build_drafter(drafter_cfg(draft_vocab_size=20), policy)
    d.set_vocab_map(torch.randperm(32, generator=torch.Generator().manual_seed(0))[:20])
    out = save_drafter(d, tmp_path / "small")
    rewrite(out, weights=lambda w: {k: v for k, v in w.items() if k != "d2t"})
    with pytest.raises(ValueError) as e:
        load_drafter(out)
    one_line(e, "draft vocabulary of 20", "policy vocabulary of 32", "no d2t")

