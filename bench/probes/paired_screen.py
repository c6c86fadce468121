"""python paired_screen.py OUT SEEDS ARM=TREE[:OVERRIDE,...] ...: a paired screen of tracker variants (issue 18,
session 30). Each arm runs the default main job from code tree TREE (PYTHONPATH) with engine.speculative=false:
AR rollouts make the policy the same in every arm of a seed (only the tracker differs), so the per-seed difference
of last-quarter live/frozen teacher-forced MAL has far less noise than unpaired runs (sd ~0.015 per seed here).
The first arm is the reference. Runs are skipped if OUT/ARM-SEED already finished; one at a time.
  e.g. python paired_screen.py /tmp/pair 0,1,2 base=. bs8=.:train.batch_size=8
"""
import json, os, statistics, subprocess, sys
from pathlib import Path

out, seeds, arms = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], []
for spec in sys.argv[3:]:
    name, rest = spec.split("=", 1)
    tree, _, ov = rest.partition(":")
    arms.append((name, str(Path(tree).resolve()), [o for o in ov.split(",") if o]))


def records(d: Path) -> list[dict]:
    p = d / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


res = {}
for s in seeds:
    for name, tree, ov in arms:
        d = out / f"{name}-{s}"
        recs = records(d)
        if not recs or recs[-1]["step"] < 59:  # the default recipe's 60 steps
            cmd = [sys.executable, "-m", "drafttrain.online", "recipe=eagle3_track", "engine.speculative=false",
                   f"run.seed={s}", f"rl.prompt_seed={1 + s}", f"run.out_dir={d}", "run.resume=false",
                   "rl.eval_prompts=0", "run.tensorboard=false", *ov]
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"{name}-{s}.log", "w") as log:
                subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdout=log, stderr=log,
                               check=True)
            recs = records(d)
        q = recs[-len(recs) // 4:]
        res[name, s] = {"ratio": statistics.fmean(r["live_tf_mal"] for r in q)
                        / statistics.fmean(r["frozen_tf_mal"] for r in q),
                        "steps": sum(r.get("drafter_steps") or 0 for r in recs),
                        "publishes": sum(bool(r.get("published")) for r in recs)}
ref = arms[0][0]
for name, _, _ in arms:
    print(name, " ".join(f"s{s}: {res[name, s]['ratio']:.3f} ({res[name, s]['steps']} steps, "
                         f"{res[name, s]['publishes']} pub)" for s in seeds))
    if name != ref:
        d = [res[name, s]["ratio"] - res[ref, s]["ratio"] for s in seeds]
        sd = f"{statistics.stdev(d):.4f}" if len(d) > 1 else "-"
        print(f"  vs {ref}: mean {statistics.fmean(d):+.4f} sd {sd}", [round(x, 3) for x in d])
