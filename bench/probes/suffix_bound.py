"""How far can the suffix drafter go on the long-tail batch of new problems (issue 20's 1.3x AR target), on this CPU?

1. The suffix drafter at fixed k (no toggle) on bench_drafters' long-tail workload (8 new problems x 8 samples per
   batch, after `warmup` batches): its MAL, and how many tokens of each row's draft the index matched (0: nothing
   matched, the draft repeats the last token).
2. The verify cost on this CPU: the policy's forward of k+1 tokens per row over one token per row, per batch size.
3. An upper bound on the long-tail speed-up over AR with a free drafter: at each batch size b, SD is worth at most
   max(1, MAL / cost_b), weighted by the time the AR long-tail batch spends at b.

    python bench/probes/suffix_bound.py [k=4] [warmup=4] [repeats=4]
"""
import collections
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_drafters import DEFAULTS, drafter_cfg, engine, setup  # noqa: E402
from bench_longtail import workload  # noqa: E402

from drafttrain.config import script_config  # noqa: E402
from drafttrain.drafters import build_drafter  # noqa: E402
from drafttrain.drafters.suffix import SuffixDrafter  # noqa: E402
from drafttrain.engines.schedule import measure_costs  # noqa: E402


def main(cfg):
    rc, policy, tok, _, _, params = setup(cfg)
    problems = workload(tok, cfg.prompts, cfg.group, cfg.seed, False, 0)
    k = cfg.k
    matched = collections.Counter()
    draft = SuffixDrafter.draft

    def counting(self, text, k_, u):  # the drafter's own draft, and how many of its tokens the index matched
        row, qs = draft(self, text, k_, u)
        m = 0
        while m < k_ and self.continuations((text + row[:m])[-self.max_ngram:]) is not None:
            m += 1
        matched[m] += 1
        return row, qs

    SuffixDrafter.draft = counting
    sd = engine(rc, policy, build_drafter(drafter_cfg(rc, "suffix", ["suffix"]), policy), k=k, toggle=False)
    ar = engine(rc, policy, None, k=k, toggle=False)
    for w in range(cfg.warmup):
        sd.generate(problems(cfg.seed + 1 + w), replace(params, seed=cfg.seed + 1 + w))
    matched.clear()
    mals, at_b = [], collections.Counter()
    for r in range(cfg.repeats):
        batch, p = problems(cfg.seed + 1000 * r), replace(params, seed=cfg.seed + 1000 * r)
        mals.append(sd.generate(batch, p).stats.mean_accepted_length)
        tl = ar.generate(batch, p, speculative=False).timeline
        for i in range(1, len(tl.ends)):
            at_b[tl.batch[i]] += tl.ends[i] - tl.ends[i - 1]
    SuffixDrafter.draft = draft
    n = sum(matched.values())
    mal = statistics.fmean(mals)
    print(f"suffix MAL at k={k}: {mal:.3f} (batches: {', '.join(f'{x:.2f}' for x in mals)})")
    print("rows by matched draft tokens:", {m: round(c / n, 3) for m, c in sorted(matched.items())})

    cost = {}
    for b in (1, 2, 4, 8, 16, 32, 64):  # the cost model's own timing (fastest of 20 interleaved runs) at context 150
        ms = measure_costs(ar, b, [1, k + 1], 0, context=150)["target_ms"]
        cost[b] = ms[k + 1] / ms[1]
        print(f"batch {b:3d}: decode {ms[1]:6.2f} ms, verify {k + 1} tokens {ms[k + 1]:6.2f} ms, ratio {cost[b]:.2f}")
    total = sum(at_b.values())
    print("AR long-tail time by batch:", {b: round(s / total, 3) for b, s in sorted(at_b.items())})
    for m in sorted({round(mal, 2), 2.0, 2.5, 3.0, 4.0}):
        sd_s = sum(s / max(1.0, m / cost[min(cost, key=lambda x: abs(x - b))]) for b, s in at_b.items())
        print(f"MAL {m:.2f}: at most {total / sd_s:.3f}x AR on the long tail (free drafting)")


if __name__ == "__main__":
    main(script_config({**DEFAULTS, "k": 4, "warmup": 4, "repeats": 4, "tracking": False}))
