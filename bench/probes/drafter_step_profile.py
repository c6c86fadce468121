"""python bench/probes/drafter_step_profile.py: where one drafter step's time goes (torch profiler, ops grouped by
input shape), at the default recipe's query_frac and batch, on the shipped policy's own rollouts; set up as
drafter_step_cost.py does (issue 18: is a cheaper drafter step left to take?)."""
import time

from torch.profiler import ProfilerActivity, profile

from drafttrain.config import load_recipe, resolve_path, sampling_params
from drafttrain.data import Prompts, stop_ids
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy
from drafttrain.tracking import DrafterTrainer, FeatureBuffer, teacher_forced_features
from drafttrain.tracking.buffer import collate

cfg = load_recipe("eagle3_track")
policy, tok = load_policy(str(resolve_path(cfg.policy.path)))
src = Prompts(cfg, tok, stop_ids(policy, tok))
prompts = [src.encode(r) for r in src.rows(128, seed=5)]
resp = build_engine(cfg.engine, policy).generate(prompts, sampling_params(cfg, stop_token_ids=src.stop_ids, seed=5),
                                                 speculative=False).tokens
drafter = build_drafter(cfg.drafter, policy)
buf = FeatureBuffer(256 << 20, seed=0)
for i in range(0, 128, 16):
    buf.add(teacher_forced_features(policy, prompts[i:i + 16], resp[i:i + 16], drafter.aux_layer_ids,
                                    cfg.drafter.ttt_steps))
tr = DrafterTrainer(build_drafter(cfg.drafter, policy), cfg.train, cfg.drafter)
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
