"""GRPO probe with AR rollouts: python rl.py <policy> <out> <steps> <lr> [prompt_seed] [threads]"""
import sys, json, time, re
import torch
from drafttrain.config import load_recipe
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy, save_policy, decode
from drafttrain.rl.grpo import GRPO
from drafttrain.policy.task import wrong_rule_share
src, out, steps, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
torch.set_num_threads(int(sys.argv[6]) if len(sys.argv) > 6 else 1)
torch.manual_seed(seed)
extra = [a for a in sys.argv[7:]]
cfg = load_recipe("eagle3_track", [f"policy.path={src}", f"rl.lr={lr}", f"rl.prompt_seed={seed}"] + extra)
policy, tok = load_policy(src)
engine = build_engine(cfg.engine, policy, None)
g = GRPO.from_config(cfg, policy, tok, engine)
log = []
t0 = time.time()
for s in range(steps):
    ro = g.rollout(s)
    texts = [decode(tok, r) for r in ro.responses]
    m = g.train_step(ro)
    engine.update_policy()
    rec = dict(step=s, reward=sum(ro.rewards) / len(ro.rewards), wrong=round(wrong_rule_share(texts), 3),
               len=sum(map(len, ro.responses)) / len(ro.responses), t=round(time.time() - t0))
    log.append(rec); print(json.dumps(rec), flush=True)
save_policy(policy, tok, out)
json.dump(log, open(out + "/rl_log.json", "w"))
