"""python bench/probes/step_ab.py [NAME=KEY=VALUE,...] ...: ms per drafter step (DrafterTrainer.step) on the shipped
policy's own rollouts at the default recipe, one arm per argument (recipe train./drafter. overrides), the arms
interleaved over 8 repeats of 12 batches in one process: median and min per arm (issue 18, session 32). With no
argument, one arm at the recipe as it is: run it with PYTHONPATH at each code tree in turn to compare two versions.
  e.g. python bench/probes/step_ab.py full=train.score_grad=true frozen=train.score_grad=false"""
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf

from drafter_step_cost import setup  # run from anywhere: python puts this script's folder on the path

from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.tracking import DrafterTrainer
from drafttrain.tracking.buffer import collate

cfg, policy, buf = setup()
batches = [collate(g, buf.steps) for g in buf.sample_groups(cfg.train.batch_size, 12)]
arms = {}
for spec in sys.argv[1:] or ["recipe="]:
    name, _, ov = spec.partition("=")
    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in ov.split(",") if o]))
    torch.manual_seed(0)
    arms[name] = DrafterTrainer(build_drafter(c.drafter, policy), c.train, c.drafter, head=TargetHead.of(policy))
ms = {name: [] for name in arms}
for b in batches[:3]:
    for tr in arms.values():
        tr.step(b)
for _ in range(8):
    for name, tr in arms.items():
        t = time.perf_counter()
        for b in batches:
            tr.step(b)
        ms[name].append((time.perf_counter() - t) / len(batches) * 1e3)
for name, x in ms.items():
    print(f"{name}: median {statistics.median(x):.1f} ms, min {min(x):.1f} ms per step")
