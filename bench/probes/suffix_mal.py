"""python bench/probes/suffix_mal.py [overrides...]: the suffix drafter's mean accepted length at k=4 on the long-tail
GRPO batch (8 prompts x 8 samples of the shipped task, stop token on), seeds 0-2 of the batch, each after one warm-up
generation of the same problems on the same engine (its index holds their earlier rollouts: problems revisited; the
RL loop draws new ones, where it reads ~1.8, bench/NOTES.md session 25); then its drafting
cost over a decode step at batch 1 and 64 (issue 20: one-hot drafts against drafts sampled from the counts)."""
import statistics
import sys

import torch

from drafttrain.config import load_recipe
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.engines.schedule import measure_costs
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.spec import SamplingParams

torch.set_num_threads(1)
rc = load_recipe("suffix_track", ["engine.k=4", *sys.argv[1:]])
policy, tok = load_policy(rc.policy.path)
mals = []
for seed in (0, 1, 2):
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(8, seed=4321 + seed) for _ in range(8)]
    eng = build_engine(rc.engine, policy, build_drafter(rc.drafter, policy))
    eng.generate(prompts, SamplingParams(max_new_tokens=256, stop_token_ids=(tok.eos_token_id,), seed=seed + 100))
    b = eng.generate(prompts, SamplingParams(max_new_tokens=256, stop_token_ids=(tok.eos_token_id,), seed=seed))
    mals.append(b.stats.mean_accepted_length)
    print(f"seed {seed}: MAL {mals[-1]:.3f}", flush=True)
print(f"mean {statistics.fmean(mals):.3f} (sd {statistics.stdev(mals):.3f})")
for B in (1, 64):
    c = measure_costs(eng, B, [1], 4, repeats=10)
    print(f"batch {B}: drafting {c['draft_ms_per_token'] / c['target_ms'][1]:.4f} of a decode step per token")
