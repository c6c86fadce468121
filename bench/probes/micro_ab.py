"""The policy update's cost with and without the padded-token cap on micro-batches (rl.micro_tokens), on the same
rollout batches of a policy (issue 46): a long-tailed batch's few long rows padded a whole micro-batch.

    python bench/probes/micro_ab.py POLICY [steps=3] [threads=2] [max_new_tokens=496]
"""
import sys
import time

import torch

from drafttrain.config import load_recipe
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy
from drafttrain.rl.grpo import GRPO

src = sys.argv[1]
kv = dict(a.split("=", 1) for a in sys.argv[2:])
torch.set_num_threads(int(kv.get("threads", 2)))
cfg = load_recipe("eagle3_track", [f"policy.path={src}", "engine.speculative=false",
                                   f"sampling.max_new_tokens={kv.get('max_new_tokens', 496)}"])
policy, tok = load_policy(src)
grpo = GRPO.from_config(cfg, policy, tok, build_engine(cfg.engine, policy))
grpo.opt.step = lambda: None  # the cost, not the update
for s in range(int(kv.get("steps", 3))):
    ro = grpo.rollout(s)
    ro.rewards = [float(i % 2) for i in range(len(ro.rewards))]  # every row with an advantage
    lens = sorted(len(r) for r in ro.responses)
    best = {}
    for rep in range(3):
        for name, tokens in (("capped", 2048), ("rows only", 10**9)):
            cfg.rl.micro_tokens = tokens
            t = time.perf_counter()
            grpo.train_step(ro)
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    print(f"step {s}: response tokens max {lens[-1]} p90 {lens[int(.9 * len(lens))]} median {lens[len(lens) // 2]}; "
          f"update s rows only {best['rows only']:.2f}, capped {best['capped']:.2f}: "
          f"{best['rows only'] / best['capped']:.2f}x", flush=True)
