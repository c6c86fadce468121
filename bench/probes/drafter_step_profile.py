"""python bench/probes/drafter_step_profile.py: where one drafter step's time goes (torch profiler, ops grouped by
input shape), at the default recipe's query_frac and batch, on the shipped policy's own rollouts; set up as
drafter_step_cost.py does (issue 18: is a cheaper drafter step left to take?)."""
import time

from torch.profiler import ProfilerActivity, profile

from drafter_step_cost import setup  # run from anywhere: python puts this script's folder on the path

from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.tracking import DrafterTrainer
from drafttrain.tracking.buffer import collate

cfg, policy, buf = setup()
tr = DrafterTrainer(build_drafter(cfg.drafter, policy), cfg.train, cfg.drafter, head=TargetHead.of(policy))
batches = [collate(g, buf.steps) for g in buf.sample_groups(cfg.train.batch_size, 12)]
for b in batches[:3]:  # warm-up
    tr.step(b)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
    for b in batches[3:]:
        tr.step(b)
print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
t = time.perf_counter()
for b in batches[3:]:
    tr.step(b)
print(f"{(time.perf_counter() - t) / len(batches[3:]) * 1e3:.1f} ms per step (unprofiled)")
