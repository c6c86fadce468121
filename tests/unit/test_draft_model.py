"""The draft model (drafter.kind=draft_model): the policy cut to its first layers, its own KV cache, distilled online.
A full-depth draft model is the policy itself, so every draft is accepted: cache, positions, token_0 and the TTT
step alignment are right in the engine, in teacher-forced scoring and in the loss. SD with it is lossless (the
shared engine contract), it learns on a drifted policy, and bad input is one line."""
from __future__ import annotations

import pytest
import torch

from drafttrain.config import Config, ConfigError, load_recipe
from drafttrain.drafters import TargetHead, Targets, build_drafter
from drafttrain.drafters.draft_model import DraftModelDrafter, save
from drafttrain.spec import SamplingParams
from drafttrain.tracking import teacher_forced_features
from drafttrain.tracking.acceptance import acceptance_ratios
from tests import contract as C
from tests.conftest import tiny_policy

K = 3


def draft_model(policy, layers: int = 1, seed: int = 1) -> DraftModelDrafter:
    return C.fresh_drafter(policy, seed=seed, kind="draft_model", layers=layers)


def test_full_depth_draft_model_is_the_policy(make_engine, policy):
    d = draft_model(policy, layers=policy.config.num_hidden_layers)
    for int8 in (False,):  # int8 rounds the copy away from the policy; fp32 is exact
        eng = make_engine(policy, d, k=K, drafter_int8=int8)
        b = eng.generate(C.RAGGED_PROMPTS, SamplingParams(max_new_tokens=20, seed=4))
        assert b.stats.acceptance_rate == 1.0, b.stats.to_dict()
    prompts, resp = C.rollouts(make_engine, policy, n=4)
    f = teacher_forced_features(policy, prompts, resp, d.reads, K)
    head = TargetHead.of(policy)
    r = acceptance_ratios(d.fuse_for_inference(False), f, K, head)
    ok = f["valid"][:, 1:1 + r.shape[1]]
    assert torch.allclose(r[..., 0][ok], torch.ones(()), atol=1e-4)
    _, accs = d.ttt_loss(f["aux"], f["next_ids"], Targets(f["hidden"], head), f["valid"], K, 0.8,
                         first_ids=f["first_ids"])
    assert accs == [1.0] * K


def test_fresh_is_the_policys_first_layers(policy):
    d = draft_model(policy, layers=2)
    assert d.model.config.num_hidden_layers == 2
    sd, psd = d.state_dict(), policy.state_dict()
    assert set(sd) <= set(psd) and all(torch.equal(sd[k], psd[k]) for k in sd)
    assert not d.model.get_input_embeddings().weight.requires_grad
    assert torch.equal(d.draft_ids(), torch.arange(policy.config.vocab_size))


# ---- lossless: the shared engine contract ---------------------------------------------------------------------

@pytest.mark.parametrize("int8", [False, True])
def test_greedy_sd_equals_ar(make_engine, policy, int8):
    C.greedy_sd_equals_ar(make_engine, policy, draft_model(policy), drafter_int8=int8)


def test_exact_distribution(make_engine):
    pol = C.tiny_vocab_policy(vocab=5)
    C.exact_distribution(make_engine, pol, draft_model(pol), SamplingParams(max_new_tokens=3, seed=41), n_rows=3000,
                         wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2, drafter_int8=False)


def test_contract_ragged_logprobs_swaps_bad_weights(make_engine, policy):
    d = draft_model(policy)
    C.serving_checks(make_engine, policy, d)
    C.swap_checks(make_engine, policy, d)


# ---- it learns ---------------------------------------------------------------------------------------------

def test_learns_on_a_drifted_policy(make_engine, policy):
    C.learns_on_drifted_policy(make_engine, policy, draft_model(policy, layers=1))


# ---- checkpoints and bad input ----------------------------------------------------------------------------------

def test_save_load_round_trip_and_kind_checks(policy, tmp_path):
    from omegaconf import OmegaConf

    d = draft_model(policy)
    with torch.no_grad():
        d.model.lm_head.weight.mul_(1.5)
    save(d, tmp_path / "dm", verifier="p", k=4)
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = "draft_model", str(tmp_path / "dm")
    back = build_drafter(cfg, policy)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    cfg.kind = "eagle3"  # a checkpoint of another kind
    with pytest.raises(ValueError, match=r"drafter\.path: .* holds a draft_model drafter, not drafter\.kind=eagle3"):
        build_drafter(cfg, policy)
    cfg.kind = "draft_model"
    other = tiny_policy(vocab=40)  # another vocabulary
    with pytest.raises(ValueError, match=r"drafter\.path: .* over 32 tokens; the policy has 40") as e:
        build_drafter(cfg, other)
    assert "\n" not in str(e.value)


def test_bad_settings_one_line(policy):
    with pytest.raises(ConfigError, match=r"drafter\.draft_model\.layers"):
        load_recipe("draft_model_track", ["drafter.draft_model.layers=0"])
    with pytest.raises(ValueError, match=r"drafter\.draft_model\.layers: must be in \[1, the policy's 4 layers\]"):
        draft_model(policy, layers=5)
