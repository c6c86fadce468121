"""The user's number: end-to-end RL wall time with drafttrain against plain decoding, same learning (issue 24).

    python scripts/bench_e2e.py                                  # 4 arms x 3 seeds at the default run length
    python scripts/bench_e2e.py seeds=[0] arms=[ar,tracking] overrides=[rl.steps=4,rl.eval_prompts=64]   # a look
    python scripts/bench_e2e.py resummarize=true     # the summary again from bench/e2e.json's runs and run folders

Each run is the main job (module drafttrain.online) in a fresh process, as a user starts it; the arms differ
only in how rollouts are decoded:
  ar        recipe eagle3_frozen with engine.speculative=false: plain decoding, no drafter work, nothing measured
  frozen    recipe eagle3_frozen: SD with the shipped step-0 drafter, never updated
  tracking  recipe eagle3_track: SD with the tracking drafter (the default)
  toggle    eagle3_track with engine.toggle=true and engine.k=auto: SD only where the cost model predicts a gain
Per seed s every arm uses run.seed=s and rl.prompt_seed=1+s (the same prompts), and the runs are interleaved (all
arms at seed 0, then at seed 1, ...; the arm order rotates per seed), so machine drift does not favour one arm.

Per run: the job's wall time (process start to exit: loading, the before/after evaluation included), the RL loop's
wall time (the sum of rl_step_s) and its split by phase: rollout (rollout_wall_s), drafter work (capture hooks,
drafter steps, estimate, publish), measurement (the live/frozen drafter scoring the recipes record each step:
reporting), and policy training with everything else (the remainder); the reward curve; held-out accuracy after the
run (eval.json). Per arm: means over seeds with their sd; the headline, AR's RL-loop wall time over each arm's
(`speedup_over_ar`, per seed then averaged; `speedup_over_ar_no_measure` leaves the reporting out of both), and the
frozen arm's over each tracking arm's (`speedup_over_frozen`); the step's shape: `rollout_share` (rollout over the RL
loop) and `tail10_share` (the decode steps in which only a batch's longest-running 10% of rows were active, over
the rollout time; embedded engine); the tokens generated and the milliseconds per generated token of the loop and
of the rollouts, with the per-token speed-ups over AR (`speedup_over_ar_per_token`, `..._rollout_per_token`: what
the decoder buys, apart from how many tokens each run's trajectory drew); the same on the arm's own batches
(`rollout_speedup_same_batches`, `speedup_same_batches`): AR's rollout cost fitted over its steps at that seed as a
cost per decode step plus a cost per token (r2 in `ar_cost_fit_r2`), applied to each of the arm's steps, and AR's
loop time outside the rollout per token, over the arm's actual times (a run's length and tail vary with its
trajectory: arms at one seed sample different text); and
whether the arm's learning matches AR's: its mean reward and held-out sampled accuracy within `spread` times the
standard error of the difference of the two arms' means over seeds.
Writes bench/e2e.json and bench/e2e.png (RL-loop wall time per arm, stacked by phase), prints tables.
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from drafttrain.config import PROJECT_ROOT, load_recipe, script_config
from drafttrain.report import format_table, read_jsonl, write_json

ARMS = {
    "ar": ("eagle3_frozen", ["engine.speculative=false"]),
    "frozen": ("eagle3_frozen", []),
    "tracking": ("eagle3_track", []),
    "toggle": ("eagle3_track", ["engine.toggle=true", "engine.k=auto"]),
}
PHASES = ("rollout_s", "policy_s", "drafter_s", "measure_s")
DEFAULTS = dict(arms=list(ARMS), seeds=[0, 1, 2], overrides=[], run_dir="runs/bench_e2e", spread=2.0,
                out="bench/e2e.json", plot="bench/e2e.png", resummarize=False)


def phase_split(recs: list[dict]) -> dict:
    """A run's RL-loop wall time (sum of rl_step_s) split by phase: rollout, drafter work (capture, drafter steps,
    estimate, publish), measurement (reporting) and policy training with the rest (the remainder); the tokens
    generated and the loop's and the rollouts' milliseconds per generated token."""
    out = dict.fromkeys(("rl_wall_s", *PHASES, "tail10_s", "tokens"), 0.0)
    for r in recs:
        out["tail10_s"] += r.get("rollout_tail10_s") or 0.0
        out["tokens"] += r.get("rollout_tokens") or (r.get("rollout_tokens_per_s") or 0.0) * (r.get("rollout_wall_s")
                                                                                              or 0.0)
        drafter = sum(r.get(k) or 0.0 for k in ("drafter_train_s", "publish_s", "capture_s"))
        rollout, measure = r.get("rollout_wall_s") or 0.0, r.get("measure_s") or 0.0
        out["rl_wall_s"] += r["rl_step_s"]
        out["rollout_s"] += rollout
        out["drafter_s"] += drafter
        out["measure_s"] += measure
        out["policy_s"] += r["rl_step_s"] - rollout - drafter - measure
    out["rollout_share"] = out["rollout_s"] / out["rl_wall_s"] if out["rl_wall_s"] else None
    out["tail10_share"] = out["tail10_s"] / out["rollout_s"] if out["rollout_s"] else None
    out["rl_ms_per_token"] = 1e3 * out["rl_wall_s"] / out["tokens"] if out["tokens"] else None
    out["rollout_ms_per_token"] = 1e3 * out["rollout_s"] / out["tokens"] if out["tokens"] else None
    return out


def step_series(recs: list[dict]) -> list[list[float]]:
    """Per RL step: [decode steps of the longest row (resp_len_max), tokens generated, rollout s, RL step s]."""
    return [[r["resp_len_max"], r.get("rollout_tokens") or (r.get("rollout_tokens_per_s") or 0.0)
             * (r.get("rollout_wall_s") or 0.0), r.get("rollout_wall_s") or 0.0, r["rl_step_s"]] for r in recs]


def ar_cost(ar: dict) -> dict:
    """AR's rollout cost on its own batches, fitted by least squares over its steps: seconds = c_step x decode steps
    (the longest row's length) + c_token x tokens (each decode step costs a fixed part plus a part per active row);
    r2 says how well. policy_s_per_token: its RL loop outside the rollout, per generated token."""
    import numpy as np

    x = np.array([[m, t] for m, t, _, _ in ar["steps"]], dtype=float)
    y = np.array([r for _, _, r, _ in ar["steps"]], dtype=float)
    c = np.linalg.lstsq(x, y, rcond=None)[0]
    r2 = 1.0 - float(((y - x @ c) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    return {"c_step": float(c[0]), "c_token": float(c[1]), "r2": r2,
            "policy_s_per_token": (ar["rl_wall_s"] - ar["rollout_s"]) / ar["tokens"] if ar.get("tokens") else None}


def same_batches(ar: dict, run: dict) -> tuple[float | None, float | None]:
    """(rollout, RL loop) speed-up over what AR would have taken on this run's own batches: AR's fitted rollout cost
    of each of its steps (ar_cost), and AR's loop time outside the rollout per token, over the run's actual times.
    What the decoder buys, apart from how many tokens and how long a tail each run's trajectory drew."""
    if not ar.get("steps") or not run.get("steps") or not run.get("rollout_s"):
        return None, None
    fit = ar_cost(ar)
    roll = sum(fit["c_step"] * m + fit["c_token"] * t for m, t, _, _ in run["steps"])
    loop = roll + (fit["policy_s_per_token"] or 0.0) * run["tokens"]
    return roll / run["rollout_s"], loop / run["rl_wall_s"]


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def same_learning(a: list[float], b: list[float], spread: float) -> dict:
    """Do two arms' per-seed values agree? Their means' difference against `spread` standard errors of it (the
    seeds' sd over sqrt(seeds), pooled; with one seed per arm there is no spread: undecided, None)."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if ma is None or mb is None:
        return {"diff": None, "se": None, "within_spread": None}
    se = math.sqrt(sa ** 2 / len(a) + sb ** 2 / len(b)) if sa is not None and sb is not None else None
    return {"diff": ma - mb, "se": se, "within_spread": None if se is None else abs(ma - mb) <= spread * max(se, 1e-12)}


def run_one(cfg, arm: str, seed: int) -> dict:
    """One arm at one seed: the main job in a fresh process, timed; its records and evaluation."""
    recipe, extra = ARMS[arm]
    run_dir = Path(cfg.run_dir) / f"{arm}-seed-{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    over = [*cfg.overrides, *extra, f"run.seed={seed}", f"rl.prompt_seed={1 + seed}", f"run.out_dir={run_dir}",
            "run.resume=false", "run.tensorboard=false"]
    load_recipe(recipe, over)  # bad input fails here, in one line, before any run starts
    cmd = [sys.executable, "-m", "drafttrain.online", f"recipe={recipe}", *over]
    print(f"[bench_e2e] {arm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True)
    job_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"error: arm {arm}, seed {seed}: the main job exited with {proc.returncode}: {tail[0]}")
    recs = read_jsonl(run_dir / "metrics.jsonl")
    ev_path = run_dir / "eval.json"
    ev = json.loads(ev_path.read_text()) if ev_path.exists() else None
    after = (ev or {}).get("after") or {}
    return {"arm": arm, "seed": seed, "job_wall_s": job_wall, **phase_split(recs),
            "reward_mean": statistics.fmean(r["reward_mean"] for r in recs),
            "heldout_acc_after": after.get("eval_sampled_acc"),
            "heldout_acc_before": ((ev or {}).get("before") or {}).get("eval_sampled_acc"),
            "rewards": [r["reward_mean"] for r in recs], "steps": step_series(recs)}


def reread(cfg, run: dict) -> dict:
    """A run of an earlier bench_e2e output with its phases, tokens and steps read again from its run folder."""
    recs = read_jsonl(Path(cfg.run_dir) / f"{run['arm']}-seed-{run['seed']}" / "metrics.jsonl")
    return {**run, **phase_split(recs), "steps": step_series(recs)}


def paired(base: dict, runs: list[dict], key: str = "rl_wall_s") -> list[float]:
    """The base arm's `key` over each run's, seed by seed (base: {seed: run}); None where either lacks it."""
    return [base[r["seed"]][key] / r[key] if base[r["seed"]].get(key) and r.get(key) else None
            for r in runs if r["seed"] in base]


def summarize(runs: list[dict], arms: list[str], spread: float) -> dict:
    by = {a: sorted((r for r in runs if r["arm"] == a), key=lambda r: r["seed"]) for a in arms}
    ar = {r["seed"]: r for r in by.get("ar", [])}
    frozen = {r["seed"]: r for r in by.get("frozen", [])}
    out = {}
    for a, rs in by.items():
        s = {}
        for key in ("job_wall_s", "rl_wall_s", *PHASES, "rollout_share", "tail10_share", "tokens", "rl_ms_per_token",
                    "rollout_ms_per_token", "reward_mean", "heldout_acc_after"):
            s[key], s[f"{key}_sd"] = mean_sd([r.get(key) for r in rs])
        curves = [r["rewards"] for r in rs if r.get("rewards")]
        s["reward_curve"] = [statistics.fmean(c[i] for c in curves) for i in range(min(map(len, curves)))] \
            if curves else []  # the mean over seeds of each step's mean reward
        if frozen and a not in ("ar", "frozen"):
            s["speedup_over_frozen"], s["speedup_over_frozen_sd"] = mean_sd(paired(frozen, rs))
        if ar and a != "ar":  # paired by seed: the same prompts, run next to each other
            no_meas = [(ar[r["seed"]]["rl_wall_s"] - ar[r["seed"]]["measure_s"]) / (r["rl_wall_s"] - r["measure_s"])
                       for r in rs if r["seed"] in ar]
            s["speedup_over_ar"], s["speedup_over_ar_sd"] = mean_sd(paired(ar, rs))
            s["speedup_over_ar_no_measure"], s["speedup_over_ar_no_measure_sd"] = mean_sd(no_meas)
            # per generated token: what the decoder buys, apart from how many tokens the run's trajectory drew
            for key, name in (("rl_ms_per_token", "per_token"), ("rollout_ms_per_token", "rollout_per_token")):
                s[f"speedup_over_ar_{name}"], s[f"speedup_over_ar_{name}_sd"] = mean_sd(paired(ar, rs, key))
            same = [same_batches(ar[r["seed"]], r) for r in rs if r["seed"] in ar]
            s["rollout_speedup_same_batches"], s["rollout_speedup_same_batches_sd"] = mean_sd([x for x, _ in same])
            s["speedup_same_batches"], s["speedup_same_batches_sd"] = mean_sd([y for _, y in same])
            s["reward_vs_ar"] = same_learning([r["reward_mean"] for r in rs], [r["reward_mean"] for r in by["ar"]],
                                              spread)
            s["heldout_acc_vs_ar"] = same_learning([r["heldout_acc_after"] for r in rs],
                                                   [r["heldout_acc_after"] for r in by["ar"]], spread)
        if a == "ar" and any(r.get("steps") for r in rs):
            s["ar_cost_fit_r2"] = [round(ar_cost(r)["r2"], 3) for r in rs if r.get("steps")]
        out[a] = s
    return out


def plot(summary: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(arms)
    for phase in PHASES:
        vals = [summary[a][phase] or 0.0 for a in arms]
        ax.bar(arms, vals, bottom=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.errorbar(arms, bottom, yerr=[summary[a]["rl_wall_s_sd"] or 0.0 for a in arms], fmt="none", ecolor="k",
                capsize=4)
    for i, a in enumerate(arms):
        if summary[a].get("speedup_over_ar"):
            ax.annotate(f"{summary[a]['speedup_over_ar']:.2f}x", (i, bottom[i]), ha="center", va="bottom",
                        xytext=(0, 6), textcoords="offset points")
    ax.set_ylabel("RL loop wall time (s), mean over seeds")
    ax.set_title("end-to-end RL wall time by phase (AR over arm annotated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(cfg) -> dict:
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown or not cfg.arms:
        raise SystemExit(f"error: arms: {unknown or 'none given'}: choose from {list(ARMS)}")
    if not cfg.seeds:
        raise SystemExit("error: seeds: give at least one seed")
    arms, runs = list(cfg.arms), []
    if cfg.resummarize:  # the summary again from cfg.out's runs and their run folders: nothing reruns
        runs = [reread(cfg, r) for r in json.loads(Path(cfg.out).read_text())["runs"] if r["arm"] in arms]
    for i, seed in enumerate([] if cfg.resummarize else cfg.seeds):  # interleaved; the order rotates per seed
        for arm in arms[i % len(arms):] + arms[: i % len(arms)]:
            runs.append(run_one(cfg, arm, seed))
    summary = summarize(runs, arms, cfg.spread)
    png = plot(summary, cfg.plot)
    rows = [{"arm": a, **{k: v for k, v in s.items() if not isinstance(v, (dict, list))}} for a, s in summary.items()]
    print(format_table(rows, ["arm", "rl_wall_s", "rl_wall_s_sd", *PHASES, "rollout_share", "tail10_share",
                              "job_wall_s", "speedup_over_ar", "speedup_over_ar_sd", "speedup_over_frozen",
                              "speedup_over_frozen_sd", "speedup_over_ar_no_measure"]))
    print(format_table(rows, ["arm", "tokens", "rl_ms_per_token", "rollout_ms_per_token", "speedup_over_ar_per_token",
                              "speedup_over_ar_per_token_sd", "speedup_over_ar_rollout_per_token",
                              "rollout_speedup_same_batches", "rollout_speedup_same_batches_sd",
                              "speedup_same_batches", "speedup_same_batches_sd"]))
    learn = [{"arm": a, "reward_mean": s["reward_mean"], "heldout_acc_after": s["heldout_acc_after"],
              "reward_within": (s.get("reward_vs_ar") or {}).get("within_spread"),
              "heldout_within": (s.get("heldout_acc_vs_ar") or {}).get("within_spread")} for a, s in summary.items()]
    print(format_table(learn, ["arm", "reward_mean", "heldout_acc_after", "reward_within", "heldout_within"]))
    result = {"arms": {a: {"recipe": ARMS[a][0], "overrides": ARMS[a][1]} for a in arms},
              "overrides": list(cfg.overrides), "seeds": list(cfg.seeds), "spread": cfg.spread, "summary": summary,
              "runs": runs}
    print(f"plot: {png}")
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
