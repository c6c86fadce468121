"""Self-drafter backends: requantize time after a policy update, per-token draft cost vs the fp32 decode step, and
mean accepted length (k=5, temperature 1) on fresh task rollouts through the embedded engine.

    python scripts/bench_selfquant.py                                   # checkpoints/policy (else a random policy)
    python scripts/bench_selfquant.py policy=/tmp/p variants=[int8/ao,int4/ao] mal_prompts=16

1. Requantize: a fake RL step moves every policy weight; `requantize(policy)` (in place) and
   `load_state_dict(policy.state_dict())` (validation + requantize: what an engine's load_drafter runs) are timed,
   beside the engine's own fp32 snapshot (LeanLlama.refresh).
2. Cost, at each batch size, timed in one process with the variants interleaved round-robin (medians): the fp32
   policy decode step (one token per row at `context`), each drafter's propose of k tokens after a verify that
   accepted all k drafts (it feeds 2 tokens, then chains; ms per drafted token), and one bare quantized forward
   step. Ratios are to the fp32 decode step.
3. MAL: each variant drafts for the fp32 policy (engine.drafter_int8=False: the drafter is already quantized) on
   the same task prompts, sampled at temperature 1. A random-init policy (no checkpoint) makes MAL meaningless:
   the JSON says which policy was used.
Writes bench/selfquant.json and prints three tables. Timings on a shared CPU are noisy: compare ratios.
"""
from __future__ import annotations

import copy
import statistics

import torch
from omegaconf import OmegaConf

from drafttrain.config import Config, resolve_path, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.drafters.selfquant import SelfQuantDrafter
from drafttrain.engines import build_engine
from drafttrain.modeling import LeanLlama
from drafttrain.policy import build_policy, build_tokenizer, encode_prompt, load_policy, make_prompts
from drafttrain.policy.model import check_checkpoint
from drafttrain.report import format_table, write_json
from drafttrain.spec import SamplingParams, SpecStats

DEFAULTS = dict(policy="checkpoints/policy", variants=["int8/ao", "int8/bnb", "int8/ref", "int4/ao", "int4/bnb",
                                                       "int4/ref"],
                group_size=64, batches=[1, 16], k=5, context=64, repeats=15, requant_repeats=5, mal_prompts=32,
                mal_batch=16, max_new_tokens=128, seed=1234, threads=2, out="bench/selfquant.json")


def get_policy(path: str):
    try:
        check_checkpoint(str(resolve_path(path)))
    except FileNotFoundError:
        torch.manual_seed(0)
        return build_policy().eval(), build_tokenizer(), "random-init (no checkpoint: MAL is not meaningful)"
    pol, tok = load_policy(str(resolve_path(path)))
    return pol, tok, str(resolve_path(path))


def moved(policy, seed: int):
    """The policy after a fake RL step: every weight moved by about 1% of its mean magnitude."""
    new = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01 * p.abs().mean())
    return new


def timed(fn) -> float:
    t0 = now()
    fn()
    return (now() - t0) * 1e3


def requantize_rows(policy, drafters, repeats):
    pols = [moved(policy, 1), moved(policy, 2)]
    sds = [p.state_dict() for p in pols]
    lean = LeanLlama(policy, 64)
    rows = [{"variant": "fp32 refresh",
             "requantize_ms": statistics.median(timed(lean.refresh) for _ in range(repeats))}]
    for name, d in drafters.items():
        rq = [timed(lambda: d.requantize(pols[i % 2])) for i in range(repeats)]
        ld = [timed(lambda: d.load_state_dict(sds[i % 2])) for i in range(repeats)]
        rows.append({"variant": name, "requantize_ms": statistics.median(rq),
                     "load_state_dict_ms": statistics.median(ld)})
    return rows


@torch.no_grad()
def cost_rows(policy, drafters, batches, k, context, repeats):
    """Per batch: fp32 decode step vs each drafter's propose (per drafted token) and bare quantized step."""
    lean, V, rows = LeanLlama(policy, context + 2 * k + 4), policy.config.vocab_size, []
    params, gen = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
    for B in batches:
        L = context + 2 * k + 4
        pos = torch.full((B,), context)
        tok1 = torch.randint(0, V, (B, 1), generator=gen)
        ids = torch.randint(0, V, (B, k + 1), generator=gen)
        cache = lean.new_cache(B, L)
        fns = {"fp32 decode": lambda: lean.forward(tok1, pos, cache)}
        for name, d in drafters.items():
            st = d.new_state(B, L)
            st.first = None  # steady state: position 0 already fed

            def propose(d=d, st=st):  # after a verify that accepted all k drafts: 2 tokens to feed, then k drafts
                st.fed, st.fed_pos = ids[:, : k - 1], pos - k
                d.propose(st, ids, None, torch.full((B,), k + 1), pos - k - 1, k, params, False, gen)
            fns[name + " propose"] = propose
            fns[name + " step"] = lambda d=d, st=st: d.body.forward(tok1, pos, st.cache)
        for fn in fns.values():
            fn()  # warm-up
        ts = {n: [] for n in fns}
        for _ in range(repeats):  # interleaved: every variant sees the same machine load
            for n, fn in fns.items():
                ts[n].append(timed(fn))
        base = statistics.median(ts["fp32 decode"])
        rows.append({"variant": "fp32 decode", "batch": B, "ms": base, "ratio": 1.0})
        for name in drafters:
            per_tok = statistics.median(ts[name + " propose"]) / k
            step = statistics.median(ts[name + " step"])
            rows.append({"variant": name, "batch": B, "ms_per_draft_token": per_tok, "ratio": per_tok / base,
                         "step_ms": step, "step_ratio": step / base})
    return rows


def mal_rows(policy, tok, drafters, cfg):
    ecfg = OmegaConf.structured(Config).engine
    ecfg.k, ecfg.drafter_int8, ecfg.max_len = cfg.k, False, policy.config.max_position_embeddings
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(cfg.mal_prompts, seed=cfg.seed)]
    chunks = [prompts[i:i + cfg.mal_batch] for i in range(0, len(prompts), cfg.mal_batch)]
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tok.eos_token_id,),
                            seed=cfg.seed)
    rows = []
    for name, d in [("fp32 AR", None), *drafters.items()]:
        eng = build_engine(ecfg, policy, d)
        eng.generate(chunks[0][:2], params)  # warm-up
        stats, ntok, t0 = SpecStats(), 0, now()
        for ch in chunks:
            b = eng.generate(ch, params, speculative=d is not None)
            stats, ntok = stats.merge(b.stats), ntok + b.num_tokens
        tps = ntok / (now() - t0)
        rows.append({"variant": name, "mal": stats.mean_accepted_length, "tokens": ntok, "tok_per_s": tps,
                     "acceptance_per_position": stats.acceptance_per_position if d is not None else None})
    for r in rows:
        r["vs_ar"] = r["tok_per_s"] / rows[0]["tok_per_s"]
    return rows


def main(cfg) -> dict:
    torch.set_num_threads(cfg.threads)
    policy, tok, source = get_policy(cfg.policy)
    drafters = {}
    for v in cfg.variants:
        quant, backend = v.split("/")
        drafters[v] = SelfQuantDrafter(policy, quant, backend, cfg.group_size).eval()
    print(f"policy: {source}; {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params")
    rq = requantize_rows(policy, drafters, cfg.requant_repeats)
    print(format_table(rq, ["variant", "requantize_ms", "load_state_dict_ms"]))
    cost = cost_rows(policy, drafters, cfg.batches, cfg.k, cfg.context, cfg.repeats)
    print(format_table(cost, ["variant", "batch", "ms", "ms_per_draft_token", "ratio", "step_ms", "step_ratio"]))
    for d in drafters.values():
        d.requantize(policy)  # back to the policy being served
    mal = mal_rows(policy, tok, drafters, cfg)
    print(format_table(mal, ["variant", "mal", "acceptance_per_position", "tokens", "tok_per_s", "vs_ar"]))
    result = {"policy": source, "k": cfg.k, "requantize": rq, "cost": cost, "mal": mal,
              "config": OmegaConf.to_container(cfg)}
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
