"""The benchmark scripts end to end at toy sizes on the shipped policy and drafter: each runs, writes the JSON keys
its issue names, with values of the right kind. Speed itself is the benchmarks' business, never asserted here."""
from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from tests.conftest import load_script

pytestmark = pytest.mark.slow


def _main(name: str, **over):
    mod = load_script(name)
    cfg = OmegaConf.merge(OmegaConf.create(mod.DEFAULTS), over)
    return mod.main(cfg), json.loads(open(cfg.out).read())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_rollout(tmp_path):
    res, js = _main("bench_rollout", batches=[1, 2], n_prompts=2, max_new_tokens=24, out=str(tmp_path / "r.json"))
    cases = {(r["engine"], r["mode"], r["batch"]) for r in js["rows"]}
    assert cases == {(e, m, b) for (e, m) in [("hf", "hf"), ("torch", "ar"), ("torch", "sd")] for b in (1, 2)}
    for r in js["rows"]:
        assert _positive(r["tokens_per_s"])
        assert r["mean_accepted_length"] is None if r["mode"] == "hf" else r["mean_accepted_length"] >= 1.0
    sd = next(r for r in js["rows"] if r["mode"] == "sd" and r["batch"] == 1)
    assert len(sd["acceptance_per_position"]) == js["k"] and sd["mean_accepted_length"] > 1.5  # the shipped drafter
    assert 0 < js["alpha"] < 1 and _positive(js["cost_ratio_c"]) and _positive(js["theory_speedup"])
    # the theory check prices decode steps, so it compares the decode-step ratio; the end-to-end one is beside it
    assert js["measured_over_theory"] == pytest.approx(js["measured_speedup_decode"] / js["theory_speedup"])
    assert js["end_to_end_over_theory"] == pytest.approx(js["measured_speedup"] / js["theory_speedup"])
    for r in js["rows"]:  # decode steps alone: the embedded engine's rows only
        assert (r["decode_tokens_per_s"] is None) == (r["engine"] == "hf")
        assert r["engine"] == "hf" or _positive(r["decode_tokens_per_s"])
    assert set(js["mean_accepted_length_at_k"]) == {"4"} and 1.0 <= js["mean_accepted_length_at_k"]["4"] <= 5.0


def test_bench_longtail(tmp_path):
    out = tmp_path / "l.json"
    res, js = _main("bench_longtail", prompts=2, group=2, drafters=["eagle3", "selfquant_int8"], sweep_batches=[1, 2],
                    repeats=1, sweep_repeats=1, sweep_min_batches=1, max_new_tokens=32, sweep_tokens=32, out=str(out))
    assert all(_positive(js[k]) for k in ("ar_wall_s", "toggle_auto_wall_s", "ladder_wall_s"))
    assert {(r["drafter"], r["mode"]) for r in js["rows"]} >= {("eagle3", "sd_toggle_auto"),
                                                                ("selfquant_int8", "sd_always"), ("-", "ar")}
    assert [r["batch"] for r in js["sweep"]] == [1, 2]
    assert all(_positive(r[k]) for r in js["sweep"] for k in ("ar_tps", "sd_tps", "toggle_tps"))
    for r in js["sweep"]:  # one repeat: the paired ratio is the ratio of that repeat's throughputs
        assert r["toggle_over_best"] == pytest.approx(r["toggle_tps"] / max(r["ar_tps"], r["sd_tps"]))
        assert r["toggle_over_best_of_medians"] == pytest.approx(r["toggle_over_best"])
    assert js["trace"] and {"step", "batch", "on", "k"} <= set(js["trace"][0])
    assert 0 < js["ceiling_wall_s"] <= js["ar_wall_s"]  # a toggle may always decode AR
    assert (tmp_path / "l_trace.png").stat().st_size > 0


def test_bench_tracking(tmp_path):
    """Two seeds of 2 steps at toy sizes: every key the issue names, consistent with the per-seed numbers and the
    per-step series they come from."""
    over = ["rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=24",
            "rl.eval_prompts=4", "run.tensorboard=false", "online.canary_max_new_tokens=8"]
    res, js = _main("bench_tracking", seeds=[0, 1], oracle_rollouts=4, oracle_steps=2, eval_rollouts=4,
                    decay_prompts=4, max_new_tokens=24, run_dir=str(tmp_path / "run"), out=str(tmp_path / "t.json"),
                    overrides=over)
    assert js["overrides"] == over and js["seeds"] == [0, 1] and js["steps"] == 2
    for key in ("tracking_over_frozen", "tracking_over_oracle", "frozen_decay_pct", "rollout_speedup_over_frozen",
                "heldout_accuracy_gain_pts"):
        assert isinstance(js[key], float) and math.isfinite(js[key]), key
        sd = js[key + ("_se" if key.startswith("heldout") else "_sd")]
        assert isinstance(sd, float) and sd >= 0, key
        assert js[key] == pytest.approx(sum(p[key] for p in js["per_seed"]) / 2), key  # the mean over the seeds
    for key in ("overhead_pct", "measure_pct", "swap_stall_decode_steps"):
        assert isinstance(js[key], float) and math.isfinite(js[key]), key
    assert set(js["series"]) == {"0", "1"}
    for seed, p in zip((0, 1), js["per_seed"]):
        recs = js["series"][str(seed)]
        assert [r["step"] for r in recs] == [0, 1]  # the resumed run continued, no step lost or repeated
        last = recs[-1]  # the last quarter of 2 steps: the last step
        assert p["tracking_over_frozen"] == pytest.approx(last["live_tf_mal"] / last["frozen_tf_mal"])
        assert p["frozen_decay_pct"] == pytest.approx(100 * (1 - p["frozen_final_mal"] / p["frozen_step0_mal"]))
    assert [(c["seed"], c["step"]) for c in js["checkpoints"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert set(js["rollout_wall"]) == {"ar", "sd_tracking", "sd_frozen"}
    assert (tmp_path / "run" / "seed-0" / "report.png").stat().st_size > 0
    seed1 = OmegaConf.load(tmp_path / "run" / "seed-1" / "config.yaml")
    assert (seed1.run.seed, seed1.rl.prompt_seed, seed1.rl.lr) == (1, 2, js["rl_lr"])  # the recipe's own lr


def test_bench_selfquant(tmp_path):
    res, js = _main("bench_selfquant", variants=["int8/ao", "int4/ref"], batches=[1], repeats=2, requant_repeats=1,
                    mal_prompts=2, mal_batch=2, max_new_tokens=16, out=str(tmp_path / "s.json"))
    variants = {"int8/ao", "int4/ref"}
    assert {r["variant"] for r in js["requantize"]} == variants | {"fp32 refresh"}
    assert all(_positive(r["requantize_ms"]) for r in js["requantize"])
    assert {r["variant"] for r in js["cost"] if "ms_per_draft_token" in r} == variants
    mal = {r["variant"]: r["mal"] for r in js["mal"]}
    assert mal["fp32 AR"] == 1.0 and all(mal[v] > 1.5 for v in variants)  # a quantized copy of the policy drafts well
