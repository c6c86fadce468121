"""Rollout throughput: HF `generate` AR vs the embedded engine's AR vs its speculative decoding with the shipped
EAGLE-3 drafter, on the same task prompts, at several batch sizes. Prints a table, writes bench/rollout.json.

    python scripts/bench_rollout.py                      # batches 1,4,16,64
    python scripts/bench_rollout.py batches=[1] n_prompts=8 max_new_tokens=128
    python scripts/bench_rollout.py overrides=[engine.k=5]   # recipe overrides
    python scripts/bench_rollout.py vllm=true            # + engine=vllm rows (AR vs SD on one vLLM engine at
                                                         #   vllm_batches), drafter swap and policy update latency

Theory check: with per-token acceptance alpha (solved from the measured mean accepted length) and drafter cost
ratio c (one drafted token / one AR decode step, both at batch 1), the textbook speed-up is
(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); it assumes verifying k+1 tokens costs one decode step. On this CPU
that is false, so the table also gives the verify cost ratio v and the corrected E[tokens] / (k c + v).
The formula prices decode steps only, so measured/theory also comes from the decode steps alone (`decode_*`: the
response tokens after each row's first over the time after the prefill); the headline ratios are end to end.

mal_ks: the shipped drafter's mean accepted length at other draft lengths (the issue's target is set at k=4), on
the same fresh prompts at batch mal_batch.
"""
from __future__ import annotations

import sys

import torch
from omegaconf import OmegaConf

from drafttrain.config import load_recipe, max_draft_len, resolve_path, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.engines.schedule import measure_costs
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import format_table, write_json
from drafttrain.spec import SamplingParams

# n_prompts=128: on fewer prompts the batch-1 SD/AR moved with the prompt set (bench/NOTES.md, Embedded engine)
DEFAULTS = dict(recipe="eagle3_track", overrides=[], batches=[1, 4, 16, 64], n_prompts=128, max_new_tokens=256,
                seed=1234,
                out="bench/rollout.json", hf=True, threads=2, vllm=False, vllm_batches=[1], vllm_swaps=10,
                mal_ks=[4], mal_batch=16)


def alpha_from_mal(mal: float, k: int) -> float:
    """Solve (1 - a^(k+1)) / (1 - a) = mal for a in [0, 1) by bisection."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(100):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < mal:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def hf_generate(policy, tok, prompts, params):
    """HF generate, left-padded, sampling at the same temperature; counts tokens up to and including EOS."""
    eos = tok.eos_token_id
    P = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens, do_sample=True,
                          temperature=params.temperature, top_k=0, top_p=1.0, eos_token_id=eos,
                          pad_token_id=tok.pad_token_id)
    n = 0
    for row in out[:, P:].tolist():
        n += row.index(eos) + 1 if eos in row else len(row)
    return n


def vllm_bench(cfg, rc, policy, drafter, prompts, params, torch_ar: dict) -> tuple[list[dict], dict]:
    """engine=vllm rows: AR vs SD on one vLLM engine (the recipe's engine config, kind=vllm) at cfg.vllm_batches;
    then the drafter swap and the policy update into the running engine, cfg.vllm_swaps times each.
    torch_ar: batch -> the embedded engine's AR tokens/s (vs_embedded_ar where it has that batch)."""
    import statistics

    rows = []
    with build_engine(OmegaConf.merge(rc.engine, {"kind": "vllm"}), policy, drafter) as engine:
        engine.generate(prompts[:2], params)  # warm-up
        for B in cfg.vllm_batches:
            chunks = [prompts[i:i + B] for i in range(0, len(prompts), B)]
            for mode in ("ar", "sd"):
                t0, ntok, stats = now(), 0, None
                for ch in chunks:
                    b = engine.generate(ch, params, speculative=(mode == "sd"))
                    ntok += b.num_tokens
                    stats = b.stats if stats is None else stats.merge(b.stats)
                dt = now() - t0
                rows.append({"engine": "vllm", "mode": mode, "batch": B, "tokens_per_s": ntok / dt, "tokens": ntok,
                             "wall_s": dt, "mean_accepted_length": stats.mean_accepted_length,
                             "acceptance_per_position": stats.acceptance_per_position if mode == "sd" else None,
                             "vs_embedded_ar": ntok / dt / torch_ar[B] if B in torch_ar else None})
                print(f"  batch {B:>3} vllm/{mode}: {ntok / dt:8.1f} tok/s", file=sys.stderr)
        weights = drafter.state_dict()
        swaps, updates = [], []
        for v in range(1, cfg.vllm_swaps + 1):
            engine.load_drafter(weights, v)
            swaps.append(engine.last_swap_s * 1e3)
            engine.update_policy(policy)
            updates.append(engine.last_policy_update_s * 1e3)
    speed = {r["batch"]: {} for r in rows}
    for r in rows:
        speed[r["batch"]][r["mode"]] = r["tokens_per_s"]
    info = {f"sd_over_ar_batch{B}": m["sd"] / m["ar"] for B, m in speed.items()}
    info.update(swap_ms_median=statistics.median(swaps), swap_ms_max=max(swaps),
                policy_update_ms_median=statistics.median(updates), policy_update_ms_max=max(updates))
    return rows, info


def main(cfg) -> dict:
    torch.set_num_threads(cfg.threads)
    rc = load_recipe(cfg.recipe, list(cfg.overrides))
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    drafter = build_drafter(rc.drafter, policy)
    engine = build_engine(rc.engine, policy, drafter)
    k = max_draft_len(rc.engine)
    problems = make_prompts(cfg.n_prompts, seed=cfg.seed)
    prompts = [encode_prompt(tok, p.prompt) for p in problems]
    params = SamplingParams(temperature=rc.sampling.temperature, max_new_tokens=cfg.max_new_tokens,
                            stop_token_ids=(tok.eos_token_id,), seed=cfg.seed)
    engine.generate(prompts[:2], params)  # warm-up
    rows = []
    for B in cfg.batches:
        chunks = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        cases = [("hf", "hf"), ("torch", "ar"), ("torch", "sd")] if cfg.hf else [("torch", "ar"), ("torch", "sd")]
        wall, ntok, stats = {c: 0.0 for c in cases}, {c: 0 for c in cases}, {c: None for c in cases}
        dec_s, dec_tok = {c: 0.0 for c in cases}, {c: 0 for c in cases}  # decode steps only (embedded engine)
        for ch in chunks:  # the cases take turns on each chunk: a slow spell of the machine hits them all alike
            for case in cases:
                t0 = now()
                if case[1] == "hf":
                    ntok[case] += hf_generate(policy, tok, ch, params)
                else:
                    b = engine.generate(ch, params, speculative=(case[1] == "sd"))
                    ntok[case] += b.num_tokens
                    stats[case] = b.stats if stats[case] is None else stats[case].merge(b.stats)
                    dec_s[case] += b.wall_s - b.timeline.prefill_s
                    dec_tok[case] += b.num_tokens - len(ch)  # each row's first token comes from the prefill
                wall[case] += now() - t0
        for case in cases:
            st, dt = stats[case], wall[case]
            rows.append({"engine": case[0], "mode": case[1], "batch": B, "tokens_per_s": ntok[case] / dt,
                         "tokens": ntok[case], "wall_s": dt,
                         "decode_tokens_per_s": dec_tok[case] / dec_s[case] if dec_s[case] else None,
                         "mean_accepted_length": st.mean_accepted_length if st else None,
                         "acceptance_per_position": st.acceptance_per_position if case[1] == "sd" else None})
            print(f"  batch {B:>3} {case[0]}/{case[1]}: {rows[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
    ar = {r["batch"]: r for r in rows if r["mode"] == "ar"}
    for r in rows:
        r["vs_embedded_ar"] = r["tokens_per_s"] / ar[r["batch"]]["tokens_per_s"]
        r["decode_vs_embedded_ar"] = (r["decode_tokens_per_s"] / ar[r["batch"]]["decode_tokens_per_s"]
                                      if r["decode_tokens_per_s"] else None)
    mal_at_k = {}
    for kk in cfg.mal_ks:  # the shipped drafter at other draft lengths, on the same fresh prompts
        eng_k = build_engine(OmegaConf.merge(rc.engine, {"k": kk}), policy, drafter)
        st = None
        for i in range(0, len(prompts), cfg.mal_batch):
            b = eng_k.generate(prompts[i:i + cfg.mal_batch], params)
            st = b.stats if st is None else st.merge(b.stats)
        mal_at_k[str(kk)] = st.mean_accepted_length

    costs = measure_costs(engine, 1, [1, k + 1], k)
    c = costs["draft_ms_per_token"] / costs["target_ms"][1]
    v = costs["target_ms"][k + 1] / costs["target_ms"][1]
    sd1 = next(r for r in rows if r["mode"] == "sd" and r["batch"] == cfg.batches[0])
    alpha = alpha_from_mal(sd1["mean_accepted_length"], k)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    theory = expected / (k * c + 1)
    theory_cpu = expected / (k * c + v)
    measured, decode = sd1["vs_embedded_ar"], sd1["decode_vs_embedded_ar"]
    result = {"rows": rows, "alpha": alpha, "cost_ratio_c": c, "verify_cost_ratio_v": v, "k": k,
              "theory_speedup": theory, "theory_speedup_cpu": theory_cpu, "measured_speedup": measured,
              "measured_speedup_decode": decode, "measured_over_theory": decode / theory,
              "measured_over_theory_cpu": decode / theory_cpu, "end_to_end_over_theory": measured / theory,
              "theory_batch": cfg.batches[0], "mean_accepted_length_at_k": mal_at_k, "costs_ms": costs,
              "config": OmegaConf.to_container(cfg)}
    if cfg.vllm:
        ar_speed = {b: r["tokens_per_s"] for b, r in ar.items()}
        vrows, result["vllm"] = vllm_bench(cfg, rc, policy, drafter, prompts, params, ar_speed)
        rows += vrows
    print(format_table(rows, ["engine", "mode", "batch", "tokens_per_s", "vs_embedded_ar", "decode_vs_embedded_ar",
                              "mean_accepted_length", "acceptance_per_position"]))
    if cfg.vllm:
        print("vllm: " + "  ".join(f"{k}={v:.3g}" for k, v in result["vllm"].items()))
    print(f"\nk={k}  alpha={alpha:.3f}  c={c:.3f}  v={v:.2f}  theory={theory:.2f}x  theory(v)={theory_cpu:.2f}x  "
          f"measured={measured:.2f}x (decode steps {decode:.2f}x)  measured/theory={decode / theory:.2f}  "
          f"measured/theory(v)={decode / theory_cpu:.2f}  (end to end {measured / theory:.2f})")
    if mal_at_k:
        print("mean accepted length at " + "  ".join(f"k={kk}: {m:.2f}" for kk, m in mal_at_k.items()))
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
