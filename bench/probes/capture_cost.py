"""python bench/probes/capture_cost.py [REPEATS]: the tracker's capture cost on the shipped policy: 8 micro-batches of 16
right-padded rollout-like sequences (prompt 20-40, response 30-200 tokens), loss forward + backward under
tracker.capture, repeated; capture seconds per RL-step equivalent, and the forward + backward beside it."""
import sys, time, torch
from drafttrain.config import load_recipe, resolve_path
from drafttrain.policy import load_policy
from drafttrain.tracking.tracker import DraftTracker
torch.set_num_threads(2)
cfg = load_recipe("eagle3_track", ["run.out_dir=/tmp/capture_cost_run"])
policy, tok = load_policy(str(resolve_path(cfg.policy.path)))
tr = DraftTracker(cfg, policy, [], log=lambda m: None)
g = torch.Generator().manual_seed(0)
batches = []
for mb in range(8):
    P = torch.randint(20, 41, (16,), generator=g); R = torch.randint(30, 201, (16,), generator=g)
    L = int((P + R).max())
    ids = torch.randint(3, 48, (16, L), generator=g); mask = torch.zeros(16, L, dtype=torch.long)
    for j in range(16): mask[j, :P[j] + R[j]] = 1
    batches.append((ids, mask, P))
def step():
    tc = tr._capture_s; t0 = time.perf_counter()
    for ids, mask, P in batches:
        with tr.capture(policy, response_start=P):
            out = policy(input_ids=ids, attention_mask=mask).logits
        out.float().mean().backward()
    policy.zero_grad(set_to_none=True)
    tr.pending.clear()
    return tr._capture_s - tc, time.perf_counter() - t0
for _ in range(3): step()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
cs, ws = zip(*[step() for _ in range(n)])
cs, ws = sorted(cs), sorted(ws)
print(f"capture per step: median {cs[n//2]*1e3:.1f} ms (min {cs[0]*1e3:.1f}); fwd+bwd+capture median {ws[n//2]*1e3:.0f} ms; buffer {len(tr.buffer)} recs {tr.buffer.nbytes/1e6:.0f} MB")
