"""The MTP head (drafter.kind=mtp) on the policy's final hidden state: its training-time test unrolls exactly what
chain drafting does, the engine hands it the policy's final normed state, SD with it is lossless (the shared engine
contract), it learns on a drifted policy from the rollout tokens, and its checkpoints are vLLM EAGLE-1 folders."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from drafttrain.config import Config, ConfigError, load_recipe
from drafttrain.drafters import build_drafter
from drafttrain.drafters.mtp import MtpDrafter, save
from drafttrain.export import read_weights
from drafttrain.modeling import LeanLlama
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import dense_targets, tiny_policy


def mtp(policy, seed: int = 1) -> MtpDrafter:
    return C.fresh_drafter(policy, seed=seed, kind="mtp")


def perturbed(d, seed: int = 0):
    d = copy.deepcopy(d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d


@pytest.mark.parametrize("fused", [False, True])
def test_ttt_logits_match_chain_drafting(policy, fused):
    """Step i at position t equals the chain-drafting step at t+i over a cache holding positions <= t, in the
    training form and in the engine's (fused) form."""
    d = perturbed(mtp(policy), seed=3)
    ref = d.ttt_logits  # the training form's, for the fused form to equal
    c = d.config
    B, T, steps = 2, 7, 3
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(B, T, c.hidden_size, generator=g)
    next_ids = torch.randint(0, c.vocab_size, (B, T + steps - 1), generator=g)
    with torch.no_grad():
        want = ref(aux, next_ids, steps)
        if fused:
            d = copy.deepcopy(d).fuse_for_inference(int8=False)
            for a, b in zip(d.ttt_logits(aux, next_ids, steps), want):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        C.ttt_matches_chain(d, aux, next_ids, steps, want, tol=1e-4)


def test_loss_is_cross_entropy_on_the_rollout_tokens(policy):
    """Step i at t is scored on token_{t+2+i} (one-hot), whatever the policy's distribution says."""
    d = perturbed(mtp(policy), seed=4)
    c = d.config
    B, T, steps = 2, 6, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, c.vocab_size, (B, T + steps + 1), generator=g)
    aux = torch.randn(B, T, c.hidden_size, generator=g)
    next_ids = x[:, 1:T + steps]
    probs = torch.softmax(torch.randn(B, T + steps, c.vocab_size, generator=g), -1)  # not the tokens
    valid = torch.ones(B, T + steps, dtype=torch.bool)
    valid[:, -1] = False  # its token (x_{T+steps}) is past next_ids, as build_features never marks valid
    valid[1, 4:] = False  # row 1 ends early
    with torch.no_grad():
        loss, _ = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, 0.5)
        lg = d.ttt_logits(aux, next_ids, steps)
        want = 0.0
        for i in range(steps):
            ce = torch.nn.functional.cross_entropy(lg[i].transpose(1, 2), x[:, 2 + i:2 + i + T], reduction="none")
            m = valid[:, 1 + i:1 + i + T].float()
            want = want + 0.5 ** i * (ce * m).sum() / m.sum()
        want = want / 1.5
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)


def test_engine_hands_the_final_normed_hidden_state(policy):
    """LeanLlama's final-hidden output is HF's last_hidden_state (after the final norm)."""
    lean = LeanLlama(policy, 64)
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    _, aux = lean.forward(ids, torch.zeros(1, dtype=torch.long), lean.new_cache(1, 16), (), final=True)
    with torch.no_grad():
        want = policy.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)


# ---- lossless: the shared engine contract ---------------------------------------------------------------------

@pytest.mark.parametrize("int8", [False, True])
def test_greedy_sd_equals_ar(make_engine, policy, int8):
    C.greedy_sd_equals_ar(make_engine, policy, perturbed(mtp(policy)), drafter_int8=int8)


def test_exact_distribution(make_engine):
    pol = C.tiny_vocab_policy(vocab=5)
    C.exact_distribution(make_engine, pol, perturbed(mtp(pol)), SamplingParams(max_new_tokens=3, seed=51),
                         n_rows=3000, wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2,
                         drafter_int8=False)


def test_contract_ragged_logprobs_swaps_bad_weights(make_engine, policy):
    d = perturbed(mtp(policy))
    C.serving_checks(make_engine, policy, d)
    C.swap_checks(make_engine, policy, d)


def test_learns_on_a_drifted_policy(make_engine, policy):
    C.learns_on_drifted_policy(make_engine, policy, mtp(policy), rows=160)  # hard targets: noisier, more rows


# ---- checkpoints and bad input ----------------------------------------------------------------------------------

def test_save_load_round_trip_as_a_vllm_eagle1_folder(policy, tmp_path):
    from omegaconf import OmegaConf

    d = perturbed(mtp(policy), seed=6)
    save(d, tmp_path / "m", verifier="p", k=4)
    cfg_json = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg_json["architectures"] == ["EagleLlamaForCausalLM"] and cfg_json["num_hidden_layers"] == 1
    assert "layers.0.input_layernorm.weight" not in d.state_dict()  # vLLM's EAGLE-1 layer 0 has none
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = "mtp", str(tmp_path / "m")
    back = build_drafter(cfg, policy)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    cfg.kind = "draft_model"
    with pytest.raises(ValueError, match=r"drafter\.path: .* holds a mtp drafter, not drafter\.kind=draft_model"):
        build_drafter(cfg, policy)
    cfg.kind = "mtp"
    with pytest.raises(ValueError, match=r"drafter\.path: .* MTP head with hidden_size 64; the policy has 32") as e:
        build_drafter(cfg, tiny_policy(hidden=32, heads=2, kv_heads=1))
    assert "\n" not in str(e.value)
    cfg.mtp.intermediate_size = 7
    with pytest.raises(ValueError, match=r"drafter\.mtp\.intermediate_size: 7 differs"):
        build_drafter(cfg, policy)
    cfg.mtp.intermediate_size = None  # a head saved with an LM head of its own (before it shared the policy's)
    w = read_weights(tmp_path / "m" / "model.safetensors")
    head = torch.zeros(policy.config.vocab_size, 64)
    save_file({**w, "lm_head.weight": head}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"drafter\.path: .* an LM head of its own; the head shares the policy's") as e:
        build_drafter(cfg, policy)
    assert "\n" not in str(e.value)


def test_lm_head_is_the_current_policys(make_engine):
    """No LM head of its own: it drafts with the policy's, read live; an engine's copy reads the engine's policy, and
    follows an in-place update and a new policy object."""
    pol, other = tiny_policy(seed=2), tiny_policy(seed=3)
    d = mtp(pol)
    assert not [n for n in d.state_dict() if "lm_head" in n]
    eng = make_engine(other, d)
    rt = eng.drafter
    assert rt.lm_head.policy is other and d.lm_head.policy is pol
    c = d.config
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(2, 5, c.hidden_size, generator=g), torch.randint(0, c.vocab_size, (2, 6), generator=g)
    before = rt.ttt_logits(aux, ids, 2)
    with torch.no_grad():
        other.get_output_embeddings().weight.mul_(2.0)
    eng.update_policy()
    for a, b in zip(rt.ttt_logits(aux, ids, 2), before):
        torch.testing.assert_close(a, 2 * b)  # logits are linear in the head
    third = tiny_policy(seed=4)
    eng.update_policy(third)
    assert eng.drafter.lm_head.policy is third
    with pytest.raises(ValueError, match="not bound to a policy") as e:
        MtpDrafter(c).ttt_logits(aux, ids, 2)
    assert "\n" not in str(e.value)


def test_bad_settings_one_line():
    with pytest.raises(ConfigError, match=r"drafter\.mtp\.intermediate_size"):
        load_recipe("mtp_track", ["drafter.mtp.intermediate_size=0"])
    with pytest.raises(ConfigError, match=r"drafter\.mtp\.bogus"):
        load_recipe("mtp_track", ["drafter.mtp.bogus=1"])
