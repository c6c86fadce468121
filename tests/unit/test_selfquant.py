"""The self-drafter (drafters/selfquant.py): in-place requantization equals quantizing from scratch in the same
storage; SD with it is lossless (the shared engine contract: greedy identity, the exact output distribution,
log-probs, ragged stops, hot-swap); int8 drafts mostly agree with the policy, int4 less but sanely; bad settings
fail with one-line errors naming the field.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config, ConfigError, load_recipe
from drafttrain.drafters import build_drafter
from drafttrain.drafters.selfquant import SelfQuantDrafter
from drafttrain.engines import build_engine
from drafttrain.quant import pack_int4, quantize_int4, quantize_int8, unpack_int4
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg, set_drafter_keys, tiny_policy

COMBOS = [("int8", "ao"), ("int8", "bnb"), ("int8", "ref"), ("int4", "ao"), ("int4", "bnb"), ("int4", "ref")]




def updated(policy, seed: int = 7, scale: float = 0.05):
    """A copy of the policy after a fake RL step: every weight moved."""
    new = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return new


# ---- requantize: in place, exactly the fresh quantization ------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2():
    return C.family_policy("qwen2")  # q/k/v biases: the bias path of every backend


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("quant,backend", COMBOS)
def test_requantize_in_place_equals_fresh(policy, qwen2, family, quant, backend):
    policy = qwen2 if family == "qwen2" else policy
    # the engine serves a deep copy (its runtime drafter): requantize must work there too
    d = copy.deepcopy(SelfQuantDrafter(policy, quant, backend, group_size=64))
    before = {k: (t.data_ptr(), t.dtype, t.shape) for k, t in d.state_dict().items()}
    old = {k: t.clone() for k, t in d.state_dict().items()}
    new_policy = updated(policy)
    d.requantize(new_policy)
    after = d.state_dict()
    assert {k: (t.data_ptr(), t.dtype, t.shape) for k, t in after.items()} == before  # same storage, no realloc
    fresh_d = SelfQuantDrafter(new_policy, quant, backend, group_size=64)
    fresh = fresh_d.state_dict()
    assert set(fresh) == set(after)
    for k in fresh:
        assert torch.equal(after[k], fresh[k]), k
    assert any(not torch.equal(after[k], old[k]) for k in old)  # it did change
    # the drafter computes with the new weights: the same logits as the fresh build
    ids, pos0 = torch.tensor([[1, 5, 9, 2], [3, 3, 7, 0]]), torch.zeros(2, dtype=torch.long)
    la = d.body.forward(ids, pos0, d.new_state(2, 8).cache)[0]
    lb = fresh_d.body.forward(ids, pos0, fresh_d.new_state(2, 8).cache)[0]
    assert torch.equal(la, lb)
    # load_state_dict(policy state_dict) is the same in-place requantization
    d2 = SelfQuantDrafter(policy, quant, backend, 64)
    ptrs = {k: t.data_ptr() for k, t in d2.state_dict().items()}
    d2.load_state_dict(new_policy.state_dict())
    assert {k: t.data_ptr() for k, t in d2.state_dict().items()} == ptrs
    assert all(torch.equal(d2.state_dict()[k], fresh[k]) for k in fresh)


@pytest.mark.parametrize("family,bias", [("llama", "attention_bias"), ("llama", "mlp_bias"),
                                         ("qwen3", "attention_bias")])
def test_self_drafter_keeps_every_bias(family, bias):
    """The o_proj and MLP biases reach the quantized forward, and a requantize takes their new values: int8 logits
    within quantization error of the policy's (with a bias dropped they were off by ~4)."""
    from tests.unit.test_engine import biased_policy

    pol = biased_policy(family, **{bias: True})
    d = SelfQuantDrafter(pol, "int8", "ref", group_size=64)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    for p_ in (pol, updated(pol, scale=0.5)):
        d.requantize(p_)
        logits = d.body.forward(ids, torch.zeros(1, dtype=torch.long), d.new_state(1, 16).cache)[0]
        with torch.no_grad():
            assert (logits - p_(ids).logits).abs().max() < 0.1


def test_ao_int4_is_the_ref_int4_quantization():
    """aten's int4 kernel (packed 64 rows at a time) computes with exactly the ref path's int4 weights: probed with
    the identity (bf16 activations are exact for it; its bf16 output is the tolerance)."""
    pol = tiny_policy(hidden=256, inter=512, heads=4, kv_heads=2, layers=1, seed=4)  # several 64-row blocks
    ao, ref = SelfQuantDrafter(pol, "int4", "ao", 64), SelfQuantDrafter(pol, "int4", "ref", 64)
    for name in ("qkv", "gate_up", "down"):
        a, r = ao.body.packed[0][name], ref.body.packed[0][name]
        eye = torch.eye(r.packed.shape[1] * 2)
        torch.testing.assert_close(a(eye), r.dequantize().t(), rtol=1e-2, atol=1e-6)


def test_requantize_is_the_pure_quantization(policy):
    """The ref storage holds exactly quantize_int8 / quantize_int4 of the new packed q|k|v weights."""
    new_policy = updated(policy, seed=3)
    a = new_policy.model.layers[1].self_attn
    qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
    d8, d4 = SelfQuantDrafter(policy, "int8", "ref"), SelfQuantDrafter(policy, "int4", "ref", 32)
    d8.requantize(new_policy)
    d4.requantize(new_policy)
    q, s = quantize_int8(qkv)
    assert torch.equal(d8.state_dict()["1.qkv.q"], q) and torch.equal(d8.state_dict()["1.qkv.scale"], s)
    q4, s4 = quantize_int4(qkv, 32)
    assert torch.equal(unpack_int4(d4.state_dict()["1.qkv.packed"]), q4)
    assert torch.equal(d4.state_dict()["1.qkv.scale"], s4)
    assert torch.equal(unpack_int4(pack_int4(q4)), q4) and int(q4.min()) >= -8 and int(q4.max()) <= 7
    # quantization error is what the formats promise
    deq8 = q.float() * s[:, None]
    assert (deq8 - qkv).abs().max() <= s.max() / 2 + 1e-6
    # fbgemm: the re-prepacked weight holds the canonical int8 weight
    dao = SelfQuantDrafter(policy, "int8", "ao")
    dao.requantize(new_policy)
    wq, _ = torch.ops.quantized.linear_unpack(dao.body.packed[1]["qkv"].packed)
    assert torch.equal(wq.int_repr(), q)


def test_state_dict_round_trip_is_exact_and_in_place(policy):
    src = SelfQuantDrafter(updated(policy), "int4", "ao", 64)
    dst = SelfQuantDrafter(policy, "int4", "ao", 64)
    ptrs = {k: t.data_ptr() for k, t in dst.state_dict().items()}
    dst.load_state_dict({k: v.clone() for k, v in src.state_dict().items()})
    assert {k: t.data_ptr() for k, t in dst.state_dict().items()} == ptrs
    assert all(torch.equal(dst.state_dict()[k], v) for k, v in src.state_dict().items())


# ---- lossless: the shared engine contract ------------------------------------------------------------------------

@pytest.mark.parametrize("quant,backend", COMBOS)
def test_greedy_sd_equals_ar(make_engine, policy, quant, backend):
    C.greedy_sd_equals_ar(make_engine, policy, SelfQuantDrafter(policy, quant, backend), drafter_int8=False)


def test_engine_int8_flag_leaves_selfquant_alone(make_engine, policy):
    """engine.drafter_int8 runs quantize_dynamic over nn.Linear modules; the self-drafter holds none."""
    d = SelfQuantDrafter(policy, "int8", "ao")
    eng = make_engine(policy, d, drafter_int8=True)
    assert all(torch.equal(eng.drafter.state_dict()[k], v) for k, v in d.state_dict().items())
    C.greedy_sd_equals_ar(make_engine, policy, d, drafter_int8=True)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_families_greedy_sd_equals_ar(make_engine, family):
    pol = C.family_policy(family)
    C.greedy_sd_equals_ar(make_engine, pol, SelfQuantDrafter(pol, "int8", "ao"), drafter_int8=False)


@pytest.fixture(scope="module")
def vocab5():
    return C.tiny_vocab_policy(vocab=5)


@pytest.mark.parametrize("quant,backend", [("int4", "ref"), ("int8", "ao")])
def test_exact_distribution(make_engine, vocab5, quant, backend):
    """A self-drafter one policy update behind (async RL) so the reject path is exercised: samples match the
    policy's exact sequence distribution; a wrong temperature is rejected."""
    d = SelfQuantDrafter(updated(vocab5, seed=5, scale=1.0), quant, backend, group_size=32)
    C.exact_distribution(make_engine, vocab5, d, SamplingParams(max_new_tokens=3, seed=21), n_rows=3000,
                         wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2, drafter_int8=False)


def test_contract_ragged_lengths_logprobs_and_swaps(make_engine, policy):
    d = SelfQuantDrafter(policy, "int8", "ao")
    C.serving_checks(make_engine, policy, d)
    C.load_drafter_versioned(make_engine, policy, d)


def test_oracle_drafter_accepts_everything(make_engine):
    """A policy whose weights are exactly int8-representable: the ref int8 self-drafter is the policy itself (up to
    float rounding), so every greedy draft is accepted: the drafter's cache, positions and ragged extension are
    right."""
    pol = tiny_policy(seed=2)
    with torch.no_grad():
        for key, w in pol.state_dict().items():  # the linears' weights; their row scales survive the q|k|v packing
            if w.dim() == 2 and "embed" not in key:
                q, s = quantize_int8(w)
                w.copy_(q.float() * s[:, None])
    d = SelfQuantDrafter(pol, "int8", "ref")
    eng = make_engine(pol, d, k=4, drafter_int8=False)
    b = eng.generate(C.RAGGED_PROMPTS, SamplingParams(temperature=0, max_new_tokens=30))
    assert b.stats.accepted >= 0.97 * b.stats.drafted


def test_ragged_extension_past_the_cache_and_rope_end(policy):
    """A row near the last position next to a row with many new tokens: the padded extension runs past the cache
    and the rope tables (both grow); every row drafts what it drafts alone, unpadded."""
    d = SelfQuantDrafter(policy, "int8", "ref")
    P = policy.config.max_position_embeddings
    new_ids = torch.tensor([[7, 0, 0, 0, 0], [3, 9, 4, 1, 2]])
    n_new, start = torch.tensor([1, 5]), torch.tensor([P - 3, 10])
    greedy = SamplingParams(temperature=0)
    st = d.new_state(2, P)
    st.first = None
    both, _ = d.propose(st, new_ids, None, n_new, start, 2, greedy, True)
    assert st.cache.max_len > P and d.body.rope.max_len > P
    for b in range(2):
        one = d.new_state(1, P)
        one.first = None
        alone, _ = d.propose(one, new_ids[b:b + 1, : int(n_new[b])], None, n_new[b:b + 1], start[b:b + 1], 2,
                             greedy, True)
        assert torch.equal(both[b], alone[0])


def test_skipping_cached_accepted_drafts_changes_nothing(make_engine, policy, monkeypatch):
    """propose re-feeds only the tokens its cache lacks; re-feeding all of them (no skip) drafts the same tokens."""
    prompts = C.RAGGED_PROMPTS * 2
    params = SamplingParams(temperature=0, max_new_tokens=30)
    d = SelfQuantDrafter(policy, "int8", "ref")
    fast = make_engine(policy, d, k=4, drafter_int8=False).generate(prompts, params)
    from drafttrain.drafters import selfquant

    calls = []
    orig = selfquant.SelfQuantState.cached_prefix
    monkeypatch.setattr(selfquant.SelfQuantState, "cached_prefix",
                        lambda self, *a: calls.append(orig(self, *a)) or torch.zeros_like(calls[-1]))
    slow = make_engine(policy, d, k=4, drafter_int8=False).generate(prompts, params)
    assert fast.tokens == slow.tokens and fast.stats.to_dict() == slow.stats.to_dict()
    assert sum(int(c.sum()) for c in calls) > 0  # skipping really happens in the fast run


def test_int8_agrees_with_policy_int4_lower_but_sane(make_engine, policy):
    """Greedy acceptance per drafted token on the tiny policy: int8 high, int4 lower but well above chance."""
    prompts = [[i % 32, (3 * i) % 32, (7 * i + 1) % 32] for i in range(12)]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    rate = {}
    for quant, backend in [("int8", "ref"), ("int8", "ao"), ("int4", "ref"), ("int4", "ao")]:
        eng = make_engine(policy, SelfQuantDrafter(policy, quant, backend, 64), k=4, drafter_int8=False)
        s = eng.generate(prompts, params).stats
        rate[quant, backend] = s.accepted / s.drafted
    assert rate["int8", "ref"] >= 0.85 and rate["int8", "ao"] >= 0.75, rate
    assert 0.2 <= rate["int4", "ref"] < rate["int8", "ref"] and 0.2 <= rate["int4", "ao"] < rate["int8", "ao"], rate


# ---- registry, config and bad input -------------------------------------------------------------------------------

def _drafter_cfg(**kw):
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = "selfquant", None
    set_drafter_keys(cfg, **kw)
    return cfg


def test_build_drafter_registry(policy):
    d = build_drafter(_drafter_cfg(quant="int4", backend="ref", group_size=32), policy)
    assert isinstance(d, SelfQuantDrafter) and d.kind == "selfquant" and d.follows_policy and not d.reads.hidden_states
    assert d.in_place_update and (d.quant, d.backend, d.group_size) == ("int4", "ref", 32)


def _one_line_error(fn, *named):
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in named), msg


@pytest.mark.parametrize("kw,named", [
    (dict(quant="int4", backend="ref", group_size=48), ["drafter.selfquant.group_size", "48"]),
    (dict(quant="int4", backend="ao", group_size=16), ["drafter.selfquant.group_size"]),  # not an aten int4 group size
    (dict(quant="int4", backend="bnb", group_size=96), ["drafter.selfquant.group_size"]),  # divides nothing here
    (dict(quant="int4", backend="bnb", group_size=32), ["drafter.selfquant.group_size"]),  # not a bnb blocksize
    (dict(quant="int3"), ["drafter.selfquant.quant", "int3"]),
    (dict(backend="tensorrt"), ["drafter.selfquant.backend", "tensorrt"]),
])
def test_bad_settings(policy, kw, named):
    _one_line_error(lambda: build_drafter(_drafter_cfg(**kw), policy), *named)


def test_ao_int4_needs_out_features_divisible_by_16(vocab5):
    _one_line_error(lambda: SelfQuantDrafter(vocab5, "int4", "ao", 32), "drafter.selfquant.backend", "16")


def test_backend_not_installed(policy, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    for quant in ("int8", "int4"):
        _one_line_error(lambda: SelfQuantDrafter(policy, quant, "bnb"), "drafter.selfquant.backend", "bitsandbytes")


def test_path_must_be_null(policy):
    _one_line_error(lambda: build_drafter(_drafter_cfg(path="checkpoints/eagle3"), policy), "drafter.path")


@pytest.mark.parametrize("override,key", [("drafter.selfquant.quant=int3", "drafter.selfquant.quant"),
                                          ("drafter.selfquant.backend=onnx", "drafter.selfquant.backend"),
                                          ("drafter.selfquant.group_size=0", "drafter.selfquant.group_size"),
                                          ("drafter.kind=selfquant", "drafter.path")])
def test_recipe_validation(override, key):
    with pytest.raises(ConfigError) as e:
        load_recipe("eagle3_track", [override])
    assert key in str(e.value) and "\n" not in str(e.value)


def test_bad_weights_refused(policy):
    d = SelfQuantDrafter(policy, "int8", "ao")
    good = policy.state_dict()
    nan = dict(good)
    name = "model.layers.1.mlp.down_proj.weight"
    nan[name] = good[name].clone()
    nan[name][0, 0] = float("nan")
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    shape = dict(good, **{"lm_head.weight": torch.zeros(3, 3)})
    own = {k: v.clone() for k, v in d.state_dict().items()}
    wrong_dtype = dict(own, **{"0.qkv.q": own["0.qkv.q"].float()})
    for weights, named in ((nan, name), (missing, "model.norm.weight"), (shape, "lm_head.weight"),
                           (wrong_dtype, "0.qkv.q")):
        _one_line_error(lambda: d.load_state_dict(weights), named)


def test_engine_double_buffers_the_self_drafter(policy):
    """load_drafter requantizes into the standby copy and swaps: two copies ping-pong, nothing is reallocated,
    and the served drafter follows the policy update."""
    d = C.fresh_drafter(policy, kind="selfquant")
    eng = build_engine(engine_cfg(drafter_int8=False), policy, d)
    first = eng.drafter
    new_pol = updated(policy)
    eng.load_drafter(new_pol.state_dict(), 1)
    second = eng.drafter
    assert second is not first and eng._standby is first
    ptrs = {k: v.data_ptr() for k, v in first.state_dict().items()}
    eng.load_drafter(policy.state_dict(), 2)
    assert eng.drafter is first and eng._standby is second
    assert {k: v.data_ptr() for k, v in first.state_dict().items()} == ptrs  # same storage, rewritten
    fresh = C.fresh_drafter(new_pol, kind="selfquant")
    for k, v in fresh.state_dict().items():  # the served copy v1 holds exactly the new policy's quantization
        assert torch.equal(second.state_dict()[k], v), k
