"""Where SD pays inside one GRPO rollout batch (issue 46): AR, SD at a fixed k, and toggle + auto k with the shipped
EAGLE-3 drafter on the default recipe's batch (16 prompts x 8 samples, T=1, max_new_tokens 496), interleaved over
seeds; the wall time split into decode steps with more than `cut` rows active (the head) and the rest (the tail),
with tokens and MAL in each.

    python bench/probes/tail_split.py [repeats=5] [cut=13] [k=5] [threads=2]
"""
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_drafters import drafter_cfg, engine  # noqa: E402

from drafttrain.config import load_recipe, resolve_path, script_config  # noqa: E402
from drafttrain.drafters import build_drafter  # noqa: E402
from drafttrain.spec import SamplingParams  # noqa: E402
from drafttrain.policy import encode_prompt, load_policy, make_prompts  # noqa: E402


def split(batch, cut: int) -> dict:
    tl = batch.timeline
    starts = [tl.ends[0] - (tl.ends[1] - tl.ends[0]), *tl.ends[:-1]]  # the first step's length: as the second's
    out = {"head_s": 0.0, "tail_s": 0.0, "head_tok": 0, "tail_tok": 0, "head_steps": 0, "tail_steps": 0}
    for s, e, b, t in zip(starts, tl.ends, tl.batch, tl.tokens):
        part = "head" if b > cut else "tail"
        out[f"{part}_s"] += e - s
        out[f"{part}_tok"] += t
        out[f"{part}_steps"] += 1
    out["wall_s"] = batch.wall_s
    return out


def main(cfg):
    torch.set_num_threads(cfg.threads)
    rc = load_recipe("eagle3_track")
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    d = build_drafter(drafter_cfg(rc, "eagle3", ["eagle3"]), policy)
    arms = {"ar": engine(rc, policy, None, k=4, toggle=False), f"sd_k{cfg.k}": engine(rc, policy, d, k=cfg.k,
                                                                                         toggle=False),
            "toggle_auto": engine(rc, policy, d, k="auto", toggle=True)}
    res = {a: [] for a in arms}
    for rep in range(cfg.warmup + cfg.repeats):
        seed = 7000 + rep
        prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(16, seed) for _ in range(8)]
        params = SamplingParams(temperature=1.0, max_new_tokens=rc.sampling.max_new_tokens,
                                stop_token_ids=(tok.eos_token_id,), seed=seed)
        for a, eng in arms.items():
            b = eng.generate(prompts, replace(params))
            if rep >= cfg.warmup:
                res[a].append({**split(b, cfg.cut), "tokens": b.num_tokens, "mal": b.stats.mean_accepted_length})
    base = res["ar"]
    for a, rs in res.items():
        m = {k: statistics.fmean(r[k] or 0 for r in rs) for k in rs[0]}
        ratio = [x["wall_s"] / r["wall_s"] for x, r in zip(base, rs)]
        tail_ratio = [x["tail_s"] / r["tail_s"] for x, r in zip(base, rs) if r["tail_s"]]
        head_ratio = [x["head_s"] / r["head_s"] for x, r in zip(base, rs) if r["head_s"]]
        print(f"{a:12s} wall {m['wall_s']:.3f}s tokens {m['tokens']:.0f} head {m['head_s']:.3f}s/{m['head_tok']:.0f}tok "
              f"tail {m['tail_s']:.3f}s/{m['tail_tok']:.0f}tok ({m['tail_steps']:.0f} steps) mal {m['mal']:.2f} | "
              f"AR/arm wall {statistics.fmean(ratio):.3f} sd {statistics.pstdev(ratio):.3f} "
              f"head {statistics.fmean(head_ratio):.3f} tail {statistics.fmean(tail_ratio):.3f}", flush=True)


if __name__ == "__main__":
    main(script_config(dict(repeats=5, warmup=2, cut=13, k=5, threads=2)))
