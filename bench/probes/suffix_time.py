"""python bench/probes/suffix_time.py: the suffix drafter's Python per long-tail batch (new_state, propose, extend,
draft; wrapped timers over 10 batches after 3 warm-up ones), and its wall time beside AR's."""
import sys, time, statistics
from dataclasses import replace
sys.path.insert(0, "scripts")
from bench_drafters import DEFAULTS, drafter_cfg, engine, setup
from drafttrain.config import script_config
from drafttrain.drafters import build_drafter
from drafttrain.drafters import suffix as S
cfg = script_config({**DEFAULTS})
rc, policy, _, _, prompts, params = setup(cfg)
T = {"new_state": 0.0, "propose": 0.0, "extend": 0.0, "draft": 0.0}
def wrap(name, cls):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; return r
    setattr(cls, name, g)
for n in T: wrap(n, S.SuffixDrafter)
d = build_drafter(drafter_cfg(rc, "suffix", []), policy)
eng = engine(rc, policy, d, k="auto", toggle=True)
for w in range(3):
    eng.generate(prompts, replace(params, seed=cfg.seed + 1 + w))
for k in T: T[k] = 0.0
walls = []
ar = engine(rc, policy, None, k=4, toggle=False)
arw = []
for r in range(10):
    walls.append(eng.generate(prompts, replace(params, seed=cfg.seed + 1000 * r)).wall_s)
    arw.append(ar.generate(prompts, replace(params, seed=cfg.seed + 1000 * r), speculative=False).wall_s)
print("suffix wall", round(statistics.fmean(walls), 4), "ar", round(statistics.fmean(arw), 4), "per gen ms", {k: round(v / 10 * 1e3, 1) for k, v in T.items()})
