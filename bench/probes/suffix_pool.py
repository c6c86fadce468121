"""The suffix drafter's prompt cache on a dataset-like workload (issue 20): AR, and the suffix drafter with the
cache on and off, each with the toggle and auto k, on long-tail GRPO batches drawn from a fixed set of `pool`
problems (bench_longtail's workload, pool=N), after `warmup` such batches, interleaved over `repeats` batches.
Prints mean wall per engine, AR over each, and each suffix engine's MAL.

    python bench/probes/suffix_pool.py [pool=64] [warmup=16] [repeats=20] [prompts=8] [group=8]
"""
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_drafters import DEFAULTS, drafter_cfg, engine, setup  # noqa: E402
from bench_longtail import interleaved, workload  # noqa: E402

from drafttrain.config import script_config  # noqa: E402
from drafttrain.drafters import build_drafter  # noqa: E402


def main(cfg):
    rc, policy, tok, _, _, params = setup(cfg)
    problems = workload(tok, cfg.prompts, cfg.group, cfg.seed, False, cfg.pool)
    engines = {"ar": (engine(rc, policy, None, k=4, toggle=False), False)}
    for name, cache in (("suffix_cache", 4096), ("suffix_nocache", 0)):
        dc = drafter_cfg(rc, "suffix", ["suffix"])  # a copy of the recipe's
        dc.suffix.prompt_cache = cache
        eng = engine(rc, policy, build_drafter(dc, policy), k="auto", toggle=True)
        for w in range(cfg.warmup):
            eng.generate(problems(cfg.seed + 1 + w), replace(params, seed=cfg.seed + 1 + w))
        engines[name] = (eng, True)
    for w in range(cfg.warmup):  # AR too, for the same machine state
        engines["ar"][0].generate(problems(cfg.seed + 1 + w), replace(params, seed=cfg.seed + 1 + w),
                                  speculative=False)
    runs = interleaved(engines, lambda rep: problems(cfg.seed + 1000 * rep),
                       lambda rep: replace(params, seed=cfg.seed + 1000 * rep), cfg.repeats)
    wall = {k: statistics.fmean(r.wall_s for r in rs) for k, rs in runs.items()}
    for k, rs in runs.items():
        mal = statistics.fmean(r.stats.mean_accepted_length for r in rs)
        print(f"{k:15s} wall {wall[k]:.4f} s  AR/this {wall['ar'] / wall[k]:.3f}  MAL {mal:.3f}")
    ratio = [a.wall_s / b.wall_s for a, b in zip(runs["suffix_nocache"], runs["suffix_cache"])]
    print(f"nocache/cache wall per repeat: mean {statistics.fmean(ratio):.3f} sd {statistics.stdev(ratio):.3f}")


if __name__ == "__main__":
    main(script_config({**DEFAULTS, "pool": 64, "warmup": 16, "repeats": 20, "tracking": False}))
