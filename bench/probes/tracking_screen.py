"""python tracking_screen.py NAME SEED [overrides...]: one default main job (seed as bench_tracking's) -> last-quarter
live/frozen MAL, overhead, drafter steps, updates, publishes; appended to /tmp/scr/results.jsonl."""
import sys, json, statistics
from drafttrain.config import load_recipe
from drafttrain.rl.job import main
from drafttrain.report import last_quarter, overhead, read_jsonl
name, seed, ov = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
out = f"/tmp/scr/{name}-s{seed}"
cfg = load_recipe("eagle3_track", [f"run.seed={seed}", f"rl.prompt_seed={1 + seed}", f"run.out_dir={out}",
                                   "run.resume=false"] + ov)
main(cfg)
recs = read_jsonl(f"{out}/metrics.jsonl")
q = last_quarter(recs)
live = statistics.fmean(r["live_tf_mal"] for r in q); fr = statistics.fmean(r["frozen_tf_mal"] for r in q)
res = {"name": name, "seed": seed, "ratio": live / fr, "live": live, "frozen": fr,
       "overhead": overhead(recs)["overhead_pct"], "steps": sum(r.get("drafter_steps") or 0 for r in recs),
       "updates": sum(1 for r in recs if r.get("gate_rows")), "publishes": sum(bool(r.get("published")) for r in recs),
       "rl_loop_s": sum(r["rl_step_s"] for r in recs), "measure_s": sum(r.get("measure_s") or 0 for r in recs),
       "reward_last_quarter": statistics.fmean(r["reward_mean"] for r in q)}
print("RESULT", json.dumps(res))
open("/tmp/scr/results.jsonl", "a").write(json.dumps(res) + "\n")
