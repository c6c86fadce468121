"""python kind_screen.py KIND NAME SEED [overrides]: one main job of KIND's recipe (its shipped checkpoint as the step-0
drafter) -> last-quarter live/frozen teacher-forced MAL, overhead, publishes; appended to /tmp/scr/results.jsonl."""
import sys, json, statistics, subprocess
from drafttrain.report import last_quarter, overhead, read_jsonl
kind, name, seed, ov = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
import os; os.makedirs("/tmp/scr", exist_ok=True)
out = f"/tmp/scr/{kind}-{name}-s{seed}"
subprocess.run([sys.executable, "-m", "drafttrain.online", f"recipe={kind}_track", f"drafter.path=checkpoints/{kind}",
                f"run.seed={seed}", f"run.out_dir={out}", "run.resume=false", "run.tensorboard=false", *ov],
               check=True, capture_output=True)
recs = read_jsonl(f"{out}/metrics.jsonl")
recs = [r for r in recs if r.get("live_tf_mal") is not None]
q = last_quarter(recs)
live = statistics.fmean(r["live_tf_mal"] for r in q); fr = statistics.fmean(r["frozen_tf_mal"] for r in q)
res = {"kind": kind, "name": name, "seed": seed, "ov": ov, "ratio": round(live / fr, 4), "live": round(live, 3),
       "frozen": round(fr, 3), "overhead": overhead(read_jsonl(f"{out}/metrics.jsonl"))["overhead_pct"],
       "publishes": sum(bool(r.get("published")) for r in recs)}
print("RESULT", json.dumps(res))
open("/tmp/scr/results.jsonl", "a").write(json.dumps(res) + "\n")
