"""The roofline simulator: each term against its formula on hand-computed cases, and the papers' numbers reproduced
from the committed bench inputs."""
from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from drafttrain.config import ConfigError
from drafttrain.simulate import (GPUS, MODELS, SUFFIX_ROW_S, Gpu, Mode, Model, Replica, Workload, draft_model,
                                 eagle3_forward, eagle3_params, expected_distinct_experts, expected_tokens, kv_rows,
                                 ladder_k, lognormal_lengths, mtp_forward, mtp_params, policy_forward, rl_step,
                                 rollout_s, roofline_s, sigma_from_mean_p90, toggle_on, uniform_curve)
from tests.conftest import load_script

GPU = Gpu(hbm_bytes_s=1e12, flops_s=1e15, link_bytes_s=1e11, hbm_bytes=1e12)
# 1 layer, hidden 4, 2 heads of 2, 1 kv head, MLP 8, vocab 10
TINY = Model(layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)


def test_roofline_is_the_max_of_memory_and_compute_plus_overhead():
    assert roofline_s(2e12, 1e15, GPU) == pytest.approx(2.0)  # memory-bound: 2 s against 1 s
    assert roofline_s(1e12, 3e15, GPU) == pytest.approx(3.0)  # compute-bound
    assert roofline_s(2e12, 1e15, GPU, n_gpus=2, overhead_s=0.5) == pytest.approx(1.5)
    assert roofline_s(1e12, 0, GPU, mbu=0.5) == pytest.approx(2.0)


def test_policy_forward_bytes_and_flops_by_hand():
    # attention: q, o 4x4 each, k, v 4x2 each = 48; MLP 3*4*8 = 96; lm_head 40; embedding 40 (not read)
    assert TINY.attn_params == 48 and TINY.expert_params == 96 and TINY.params() == 48 + 96 + 80
    n_bytes, flops = policy_forward(TINY, batch=3, t=2, ctx=5)
    kv_per_token = 2 * 1 * 1 * 2 * 2.0  # k and v, 1 layer, 1 kv head of 2, bf16
    assert n_bytes == pytest.approx((48 + 96 + 40) * 2.0 + kv_per_token * 3 * (5 + 2))
    assert flops == pytest.approx(2 * (48 + 96 + 40) * 6 + 4 * 1 * 4 * 5 * 6)  # matmuls + QK^T, AV over ctx 5
    int4_bytes, _ = policy_forward(TINY, 3, 2, 5, wbytes=0.5)
    assert n_bytes - int4_bytes == pytest.approx((48 + 96 + 40) * 1.5)


def test_eagle3_head_by_hand():
    # fc 3*4*4 = 48; q 8x4, k 8x2, v 8x2 on the 2H input = 64; o 4x4 = 16; MLP 3*4*8 = 96; draft lm_head 32000x4
    assert eagle3_params(TINY) == 48 + 64 + 16 + 96 + 32000 * 4
    n_bytes, flops = eagle3_forward(TINY, batch=3, ctx=5)
    assert n_bytes == pytest.approx(eagle3_params(TINY) * 2.0 + 2 * 1 * 2 * 2.0 * 3 * 6)  # + one layer's KV
    assert flops == pytest.approx(2 * eagle3_params(TINY) * 3 + 4 * 4 * 5 * 3)


def test_mtp_draft_model_and_suffix_by_hand():
    # MTP: fc 2*4*4 = 32; one layer: attention 48, MLP 3*4*8 = 96; the policy's lm_head (10x4) read, not its own
    assert mtp_params(TINY) == 32 + 48 + 96
    n_bytes, flops = mtp_forward(TINY, batch=3, ctx=5)
    assert n_bytes == pytest.approx((176 + 40) * 2.0 + 2 * 1 * 2 * 2.0 * 3 * 6)  # + one layer's KV
    assert flops == pytest.approx(2 * (176 + 40) * 3 + 4 * 4 * 5 * 3)
    two = Model(layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    assert draft_model(two) == TINY  # the policy's first layer, its embedding and lm_head
    rep = Replica(two, GPU, overhead_s=0.25, row_s=(0.0, 1e-3, 0.0))
    assert rep.draft_s("draft_model", 3, 5) == pytest.approx(
        roofline_s(*policy_forward(TINY, 3, 1, 5), GPU, mbu=0.8, mfu=0.6, overhead_s=0.25) + 3e-3)
    assert rep.draft_s("suffix", 3, 5) == pytest.approx(3 * SUFFIX_ROW_S + 3e-3)  # host-side: no forward
    big = Gpu(1e12, 1e15, 1e11, hbm_bytes=1e6)
    free, kv = 1e6 * 0.9 - two.params() * 2.0, two.kv_bytes_per_token()
    rep = Replica(two, big)
    assert kv_rows(rep, {"suffix": []}, ctx=100) == kv_rows(rep, {}, ctx=100) == int(free // (kv * 100))
    assert kv_rows(rep, {"mtp": []}, ctx=100) == int((free - 2.0 * mtp_params(two)) // (1.5 * kv * 100))
    assert kv_rows(rep, {"draft_model": []}, ctx=100) == int((free - 2.0 * TINY.params()) // (1.5 * kv * 100))


def test_moe_expected_distinct_experts():
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8.0)  # one token: its own 8
    assert expected_distinct_experts(2, 128, 8) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert expected_distinct_experts(10_000, 128, 8) == pytest.approx(128.0)
    moe = Model(1, 4, 2, 1, 2, 8, 10, experts=16, active_experts=2)
    one, _ = policy_forward(moe, 1, 1, 0)
    many, _ = policy_forward(moe, 1000, 1, 0)
    kv = 2 * 2 * 2.0
    assert one - kv == pytest.approx((48 + 2 * 96 + 40) * 2.0)  # B=1 reads its 2 experts
    assert many - 1000 * kv == pytest.approx((48 + 16 * 96 + 40) * 2.0, rel=1e-6)  # a large batch reads all 16


def test_expected_accepted_length():
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1.9)  # a rejection stops the chain
    assert expected_tokens([0.8, 0.8], 1) == pytest.approx(1.8)
    flat = uniform_curve(2.47, 3, k_max=8)
    assert len(flat) == 8 and len(set(flat)) == 1 and expected_tokens(flat, 3) == pytest.approx(2.47)


def test_toggle_rule_and_ladder():
    rep = Replica(TINY, GPU, overhead_s=1e-3, sd_overhead_s=0.0)
    acc = [0.9] * 4
    t_ar, d, v = rep.forward_s(1, 1, 8), rep.draft_s("int4", 1, 8), rep.forward_s(1, 4, 8)
    # speedup = L / (k r + v) with r = D / T_ar and v = T_verify / T_ar
    assert rep.speedup("int4", acc, 1, 3, 8) == pytest.approx(expected_tokens(acc, 3) / (3 * d / t_ar + v / t_ar))
    assert toggle_on(1.05) and not toggle_on(1.049) and toggle_on(1.2, threshold=1.1)
    assert ladder_k([1.0] * 8) == 8  # every draft accepted: climb to the top rung
    assert ladder_k([0.5] * 8) == 2  # (L-1)/k well under 0.94: stay at the bottom
    assert ladder_k([0.97] * 8) == 4  # 2: 0.955 >= 0.94 -> 4: 0.928 < 0.94
    assert ladder_k([0.97] * 12, ladder=(5, 7, 9, 11)) == 5


def test_per_row_costs_and_shared_kv():
    base = Replica(TINY, GPU)
    rep = Replica(TINY, GPU, row_s=(1e-3, 2e-3, 3e-3))
    assert rep.forward_s(4, 1, 8) - base.forward_s(4, 1, 8) == pytest.approx(4e-3)  # decode: 1 ms per row
    assert rep.draft_s("int4", 4, 8) - base.draft_s("int4", 4, 8) == pytest.approx(8e-3)  # draft: 2 ms per row
    assert rep.forward_s(4, 5, 8) - base.forward_s(4, 5, 8) == pytest.approx(12e-3)  # verify: 3 ms per row
    big = Replica(TINY, Gpu(1e12, 1e15, 1e11, hbm_bytes=1e6))
    own, shared = kv_rows(big, {"int4": []}, 100), kv_rows(big, {"int4": []}, 100, shared_kv=True)
    assert shared == int((1e6 * 0.9 - TINY.params() * (2.0 + 0.53125)) // (TINY.kv_bytes_per_token() * 100))
    assert own < shared


def test_toggle_turns_sd_off_where_it_loses():
    rep = Replica(TINY, GPU)
    slow = Mode({"int8": [0.01] * 8}, k=4, toggle=True)
    per_tok, sd = slow.plan(rep, 1, 8)
    assert not sd and per_tok == pytest.approx(rep.forward_s(1, 1, 8))
    always = Mode({"int8": [0.01] * 8}, k=4)
    assert always.plan(rep, 1, 8)[1] and always.plan(rep, 1, 8)[0] > per_tok


def test_chooser_takes_the_fastest_drafter_per_batch():
    rep = Replica(MODELS["8b"], GPUS["H100"])
    kinds = {"eagle3": [0.7] * 8, "int4": [0.99] * 8}
    both = Mode(kinds, k=4, toggle=True)
    for batch in (1, 256):
        each = [Mode({kd: a}, k=4, toggle=True).plan(rep, batch, 2048)[0] for kd, a in kinds.items()]
        assert both.plan(rep, batch, 2048)[0] == pytest.approx(min(each))


def test_long_tail_rollout_integrates_the_shrinking_batch():
    rep = Replica(TINY, GPU, overhead_s=1.0)  # overhead-bound: every forward costs 1 s
    r = rollout_s(rep, [3, 10], prompt_len=0, mode=Mode({}))
    assert r["seconds"] == pytest.approx(1.0 + 10.0)  # prefill + 10 decode steps (2 rows for 3, then 1 for 7)
    one_slot = rollout_s(rep, [3, 10], prompt_len=0, mode=Mode({}), max_rows=1)
    assert one_slot["seconds"] == pytest.approx(1.0 + 13.0) and one_slot["concurrency"] == 1  # one row after the other
    two_of_three = rollout_s(rep, [3, 10, 4], prompt_len=0, mode=Mode({}), max_rows=2)
    assert 1.0 + 10.0 <= two_of_three["seconds"] <= 1.0 + 14.0  # the queued row takes a freed slot


def test_kv_capacity_counts_weights_and_every_drafter_cache():
    big = Gpu(1e12, 1e15, 1e11, hbm_bytes=1e6)
    rep = Replica(TINY, big)
    free = 1e6 * 0.9 - TINY.params() * 2.0
    kv = TINY.kv_bytes_per_token()
    assert kv_rows(rep, {}, ctx=100) == int(free // (kv * 100))
    # a self-drafter holds a quantized weight copy and a KV cache of its own: about half the rows
    assert kv_rows(rep, {"int4": []}, ctx=100) == int((free - TINY.params() * 0.53125) // (2 * kv * 100))
    assert kv_rows(Replica(TINY, big, tp=2), {}, ctx=100) > 2 * kv_rows(rep, {}, ctx=100) - 2


def test_async_overlaps_rollout_and_training_sync_adds_them():
    rep = Replica(TINY, GPU, overhead_s=1.0)
    wl = Workload(n_gpus=1, prompts=1, group=2, prompt_len=4, mean_len=8, max_len=16)
    r = rl_step(rep, wl, Mode({}), sigma=0.5, drafter_budget=0.05)
    assert r["drafter_s"] == pytest.approx(0.05 * (r["rollout_s"] + r["train_s"] + r["sync_s"]))
    assert r["step_sync_s"] == pytest.approx(r["rollout_s"] + r["train_s"] + r["drafter_s"] + r["sync_s"])
    assert r["step_async_s"] == pytest.approx(max(r["rollout_s"], r["train_s"] + r["drafter_s"]) + r["sync_s"])
    assert r["step_async_s"] < r["step_sync_s"]


def test_lengths_follow_the_fitted_lognormal():
    s = sigma_from_mean_p90(100.0, 100.0 * math.exp(1.2816 * 0.6 - 0.18))
    assert s == pytest.approx(0.6, abs=1e-3)
    ls = lognormal_lengths(1000, 100.0, 0.6, cap=10**6)
    assert sum(ls) / len(ls) == pytest.approx(100.0, rel=0.02) and ls == sorted(ls)
    assert max(lognormal_lengths(1000, 100.0, 0.6, cap=150)) == 150


@pytest.fixture(scope="module")
def sim():
    return load_script("simulate")


def test_reproduction_within_tolerance_on_the_committed_inputs(sim):
    cfg = OmegaConf.create(sim.DEFAULTS)
    repro, assumptions = sim.reproduce(sim.load_inputs(cfg), cfg)
    assert len(repro) == 4 and {"shared", "nemo_rl", "efficientrollout"} <= set(assumptions)
    for row in repro:
        assert abs(row["simulated"] - row["paper_value"]) <= 0.25 * row["paper_value"], row


def test_every_drafter_kind_projected_from_bench_drafters(sim, tmp_path):
    """The MTP head and the draft model tracked and frozen, the suffix drafter, and the chooser over them, from
    bench/drafters.json's numbers (flat curves at their measured lengths); without that file, no such rows."""
    dr = tmp_path / "d.json"
    dr.write_text(json.dumps({"kinds": [{"kind": "suffix", "mal_k4": 2.5}],
                              "tracking": [{"kind": "mtp", "k": 4, "live_tf_mal": 4.0, "frozen_tf_mal": 3.0},
                                           {"kind": "draft_model", "live_tf_mal": 4.2, "frozen_tf_mal": 3.5}]}))
    curves = tmp_path / "c.json"  # per-position curves, where the run recorded them, win over the mean lengths
    curves.write_text(json.dumps({"tracking": [{"kind": "mtp", "live_tf_mal": 4.0, "frozen_tf_mal": 3.0,
                                                "live_tf_acc_pos": [0.9, 0.8], "frozen_tf_acc_pos": [0.7]}]}))
    got = sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "drafters": str(curves)}))["kinds"]
    assert got == {"mtp": ([0.9] + [0.8] * 7, [0.7] * 8)}
    cfg = OmegaConf.create({**sim.DEFAULTS, "drafters": str(dr), "gpus": ["H100"]})
    inp = sim.load_inputs(cfg)
    km = cfg.k_max
    assert inp["kinds"]["mtp"] == (uniform_curve(4.0, 4, km), uniform_curve(3.0, 4, km))
    assert inp["kinds"]["draft_model"][1] == uniform_curve(3.5, 4, km)  # the recipe's k (draft_model_track: 4)
    assert inp["kinds"]["suffix"] == (uniform_curve(2.5, 4, km),) * 2
    rows = {(r["model"], r["setting"]): r for r in sim.project(inp, cfg)}
    for setting in ("mtp_frozen", "mtp_tracking_toggle", "draft_model_frozen", "draft_model_tracking_toggle",
                    "suffix_toggle", "chooser", "chooser_with_self"):
        assert ("8b", setting) in rows, setting
    r = rows[("8b", "mtp_tracking_toggle")]
    assert r["rollout_speedup"] > rows[("8b", "mtp_frozen")]["rollout_speedup"] > 1.0
    none = sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "drafters": str(tmp_path / "absent.json")}))
    assert none["kinds"] == {}


def test_explicit_curves_and_bad_inputs(sim, tmp_path):
    cfg = OmegaConf.create({**sim.DEFAULTS, "live_acceptance": [0.8, 0.7], "frozen_acceptance": [0.5]})
    inp = sim.load_inputs(cfg)
    assert inp["steps"] == [([0.8] + [0.7] * 7, [0.5] * 8)]
    bad = OmegaConf.create({**sim.DEFAULTS, "live_acceptance": [1.5], "frozen_acceptance": [0.5]})
    with pytest.raises(ConfigError, match="live_acceptance"):
        sim.load_inputs(bad)
    empty = tmp_path / "t.json"
    empty.write_text(json.dumps({"series": [{"step": 0}]}))
    with pytest.raises(ConfigError, match="no series with live_tf_acc_pos"):
        sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "tracking": str(empty)}))
    mixed = tmp_path / "m.json"  # a step without curves, or with a bad value, is skipped; lengths from longtail
    mixed.write_text(json.dumps({"series": [{"live_tf_acc_pos": [0.9], "frozen_tf_acc_pos": [0.8]},
                                            {"live_tf_acc_pos": [0.9, None], "frozen_tf_acc_pos": [0.8]},
                                            {"step": 2}]}))
    lt = tmp_path / "lt.json"
    lt.write_text(json.dumps({"rows": [{"mode": "ar", "len_p50": 20, "len_max": 128}],
                              "config": {"prompts": 16, "group": 4}}))
    inp = sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "tracking": str(mixed), "longtail": str(lt)}))
    assert len(inp["steps"]) == 1
    assert inp["sigma"] == pytest.approx(math.log(128 / 20) / 2.4175, rel=1e-3)  # z of 1 - 1/128
    per_seed = tmp_path / "s.json"  # bench_tracking's layout: one series per seed, every seed's steps read
    per_seed.write_text(json.dumps({"series": {"0": [{"live_tf_acc_pos": [0.9], "frozen_tf_acc_pos": [0.8]}],
                                               "1": [{"live_tf_acc_pos": [0.7], "frozen_tf_acc_pos": [0.6]}]}}))
    inp = sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "tracking": str(per_seed), "longtail": str(lt)}))
    assert [a[0] for a, _ in inp["steps"]] == [0.9, 0.7]
    broken = tmp_path / "b.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="tracking="):
        sim.load_inputs(OmegaConf.create({**sim.DEFAULTS, "tracking": str(broken)}))


def test_every_drafting_kind_of_the_registry_has_a_simulated_shape():
    """A kind added to the registry without a DraftShape fails here (the self-drafter is the policy's own forward
    at its weight width, the chooser picks among the others)."""
    from drafttrain.drafters import DRAFTERS
    from drafttrain.simulate import SHAPES

    assert set(SHAPES) == set(DRAFTERS) - {"selfquant", "auto"}
