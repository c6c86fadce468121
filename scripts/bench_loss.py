"""Which drafter loss buys the longest accepted length? train.loss x train.positions arms, paired by seed.

    python scripts/bench_loss.py                # 6 arms (4 offline) x seeds 0-2, offline and online
    python scripts/bench_loss.py arms=[kl:uniform,tv:uniform] offline_arms=[kl:uniform,tv:uniform] seeds=[0]  # a look

An arm is `loss:positions` (train.loss, train.positions); the first arm is the reference (today's kl:uniform).
online_arms / offline_arms (null: every arm) run that part for those arms alone (the reference among them): a screen
can take the offline leaders online, and an online-only arm needs no offline job.
Per seed s and arm, each a job of its own (`parallel` at once, one torch thread each; a finished job's JSON under
run_dir is reused, so a stopped benchmark picks up where it was):
1. Offline: scripts/pretrain_drafter.py from scratch (seed s: the same data, cached per seed, the same initial
   drafter and the same eval prompts in every arm) for the same steps (`offline_prompts` rollouts, `offline_epochs`),
   then its mean accepted length at k = `offline_k` in speculative rollouts of held-out prompts (offline_mal).
2. Online: the default main job (recipe, run.seed=s, rl.prompt_seed=1+s) with AR rollouts, so the policy is the
   same in every arm of a seed and only the drafter's training differs (pairing), scoring the live and the frozen
   step-0 drafter at every step. Its last quarter: live_mal and tracking_over_frozen. At its end, an oracle (the
   step-0 drafter trained to convergence on fresh rollouts of the final policy, bench_tracking's, with the arm's
   loss) and the run's drafter are scored on other fresh rollouts: tracking_over_oracle (the oracle is the bar, so
   it is trained the same way as the arm); oracle_mal is the oracle's own MAL there, what the arm's loss can reach.
3. Step cost: ms per drafter step at the recipe (DrafterTrainer.step on the shipped policy's own rollouts), the arms
   interleaved in this process over `step_repeats` rounds (step_ms: median of the rounds, step_ms_sd their sd).
Writes `out` (bench/loss.json): `rows`, one per arm with each metric's mean over seeds and `_sd`; `per_seed`; and
`summary`: offline_mal_gain_pct / online_mal_gain_pct (the best arm over the reference, paired by seed, with
`_sd`, and which arm), best_tracking_over_oracle and step_cost_ratio (the best online arm's step over the
reference's). Prints the table.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from omegaconf import ListConfig, OmegaConf

from drafttrain.config import PROJECT_ROOT, load_recipe, max_draft_len, resolve_path, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.report import format_table, read_jsonl, write_json

DEFAULTS = dict(recipe="eagle3_track", seeds=[0, 1, 2], overrides=[],
                arms=["kl:uniform", "tv:uniform", "kl_tv:uniform", "kl:rejected", "tv:rejected", "kl_tv:rejected"],
                # offline (pretraining from scratch, the costly part): each loss, and the positions on kl
                online_arms=None, offline_arms=["kl:uniform", "tv:uniform", "kl_tv:uniform", "kl:rejected"],
                offline=True, online=True, step_cost=True, parallel=2, run_dir="runs/bench_loss",
                offline_prompts=2048, offline_epochs=3.0, offline_k=5, offline_eval=128, offline_overrides=[],
                oracle_rollouts=96, oracle_steps=300, oracle_lr=3e-4, oracle_batch=16, oracle_ttt_steps=3,
                eval_rollouts=48, max_new_tokens=None, step_batches=12, step_repeats=8,
                job="", arm="", seed=0, out="bench/loss.json")
METRICS = ("offline_mal", "live_mal", "tracking_over_frozen", "tracking_over_oracle", "oracle_mal", "step_ms")
SOURCE = {"oracle_mal": "end_oracle_tf_mal"}  # a metric under another name in a job's JSON


def arm_overrides(arm: str) -> list[str]:
    loss, _, positions = arm.partition(":")
    return [f"train.loss={loss}", f"train.positions={positions or 'uniform'}"]


def job_file(cfg, kind: str, arm: str, seed: int) -> Path:
    return Path(cfg.run_dir) / kind / f"{arm.replace(':', '-')}-{seed}.json"


# ---- the jobs (each in its own process) ------------------------------------------------------------------------
def offline_job(cfg, arm: str, seed: int) -> dict:
    """pretrain_drafter.py from scratch for this arm and seed; its eval's mean accepted length."""
    d = Path(cfg.run_dir) / "offline"
    cmd = [sys.executable, str(PROJECT_ROOT / "scripts" / "pretrain_drafter.py"), f"recipe={cfg.recipe}",
           "threads=1", f"seed={seed}", f"prompts={cfg.offline_prompts}", f"epochs={cfg.offline_epochs}",
           f"eval_prompts={cfg.offline_eval}", f"out={d / (arm.replace(':', '-') + f'-{seed}')}", "resume=false",
           f"cache={d / f'cache-{seed}'}", f"engine.k={cfg.offline_k}", *cfg.overrides, *cfg.offline_overrides,
           *arm_overrides(arm)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"offline {arm} seed {seed}: {p.stderr.strip().splitlines()[-1:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return {"offline_mal": res["mean_accepted_length"], "offline_steps": res["steps"],
            "acceptance_per_position": res["acceptance_per_position"]}


def online_job(cfg, arm: str, seed: int) -> dict:
    """The main job with AR rollouts (paired across arms), then the run's drafter against the arm's oracle."""
    import bench_tracking as bt  # this script's folder is on the path
    from drafttrain.drafters import TargetHead, build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import load_policy
    from drafttrain.rl.job import main as run_main

    run_dir = Path(cfg.run_dir) / "online" / f"{arm.replace(':', '-')}-{seed}"
    rc = load_recipe(cfg.recipe, ["engine.speculative=false", "online.measure_every=1", "rl.eval_prompts=0",
                                  "run.tensorboard=false", *cfg.overrides, *arm_overrides(arm), f"run.seed={seed}",
                                  f"rl.prompt_seed={1 + seed}", f"run.out_dir={run_dir}", "run.resume=false"])
    t0 = time.time()
    run_main(rc)
    run_s = time.time() - t0
    recs = read_jsonl(run_dir / "metrics.jsonl")
    k = max_draft_len(rc.engine)
    max_new = cfg.max_new_tokens or rc.sampling.max_new_tokens
    cfg = cfg.copy()
    cfg.max_new_tokens = max_new
    torch.manual_seed(rc.run.seed)  # as the run does: a fresh drafter is its step-0 drafter
    pol0, tok = load_policy(str(resolve_path(rc.policy.path)))
    frozen = build_drafter(rc.drafter, pol0).eval()
    last = run_dir / "ckpt" / (run_dir / "ckpt" / "latest").read_text().strip()
    policy, _ = load_policy(str(last / "policy"))
    tracking = bt.load_tracking(frozen, last)
    ar = build_engine(rc.engine, policy, None)
    p_or, b_or = bt.rollouts(ar, tok, cfg.oracle_rollouts, 10_000 + rc.rl.steps, max_new)
    p_ev, b_ev = bt.rollouts(ar, tok, cfg.eval_rollouts, 20_000 + rc.rl.steps, max_new)
    f_ev, head = bt.features(policy, frozen, p_ev, b_ev.tokens, k), TargetHead.of(policy)
    oracle = bt.train_oracle(frozen, bt.features(policy, frozen, p_or, b_or.tokens, max(k, cfg.oracle_ttt_steps)),
                             rc, cfg, head)
    live, orc = bt.score(tracking, f_ev, k, head), bt.score(oracle, f_ev, k, head)
    q = bt.scored_last_quarter(recs)
    return {"live_mal": statistics.fmean(r["live_tf_mal"] for r in q), "tracking_over_frozen":
            bt.tracking_over_frozen(recs), "tracking_over_oracle": live / orc, "end_tracking_tf_mal": live,
            "end_oracle_tf_mal": orc, "end_frozen_tf_mal": bt.score(frozen, f_ev, k, head),
            "drafter_steps": sum(r.get("drafter_steps") or 0 for r in recs),
            "publishes": sum(bool(r.get("published")) for r in recs), "run_s": round(run_s, 1)}


def run_job(cfg) -> None:
    torch.set_num_threads(1)
    res = (offline_job if cfg.job == "offline" else online_job)(cfg, cfg.arm, int(cfg.seed))
    write_json({"arm": cfg.arm, "seed": int(cfg.seed), **res}, job_file(cfg, cfg.job, cfg.arm, int(cfg.seed)))


def child_argv(cfg) -> list[str]:
    """This run's settings as a job's key=value arguments: lists as JSON, None as null (its str "None" would reach
    the job as the string "None")."""
    def value(v):
        if isinstance(v, ListConfig):
            v = OmegaConf.to_container(v)
        return "null" if v is None else json.dumps(v) if isinstance(v, list) else v
    return [f"{k}={value(v)}" for k, v in cfg.items() if k not in ("job", "arm", "seed")]


def launch(cfg, kind: str, arm: str, seed: int) -> dict:
    """One job in a child process (skipped when its JSON is there); its result."""
    f = job_file(cfg, kind, arm, seed)
    if not f.is_file():
        cmd = [sys.executable, __file__, *child_argv(cfg), f"job={kind}", f"arm={arm}", f"seed={seed}"]
        f.parent.mkdir(parents=True, exist_ok=True)
        print(f"[bench_loss] {kind} {arm} seed {seed}", flush=True)
        with open(f.with_suffix(".log"), "w") as log:
            p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if p.returncode:
            raise RuntimeError(f"bench_loss: {kind} {arm} seed {seed} failed (rc {p.returncode}): see "
                               f"{f.with_suffix('.log')}")
    return json.loads(f.read_text())


# ---- step cost (this process) ---------------------------------------------------------------------------------
def step_cost(cfg) -> dict[str, list[float]]:
    """ms per drafter step per arm, interleaved: each round runs every arm over the same batches."""
    import bench_tracking as bt
    from drafttrain.drafters import TargetHead, build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import load_policy
    from drafttrain.tracking import DrafterTrainer, FeatureBuffer
    from drafttrain.tracking.buffer import collate

    rcs = {a: load_recipe(cfg.recipe, [*cfg.overrides, *arm_overrides(a)]) for a in cfg.arms}
    rc = rcs[cfg.arms[0]]
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    d0 = build_drafter(rc.drafter, policy)
    prompts, b = bt.rollouts(build_engine(rc.engine, policy, None), tok, 128, 7,
                             cfg.max_new_tokens or rc.sampling.max_new_tokens)
    buf = FeatureBuffer(1 << 30, seed=0)
    for f in bt.features(policy, d0, prompts, b.tokens, rc.drafter.ttt_steps):
        buf.add(f)
    batches = [collate(g, buf.steps) for g in buf.sample_groups(rc.train.batch_size, cfg.step_batches)]
    trainers = {}
    for a, c in rcs.items():
        torch.manual_seed(0)
        trainers[a] = DrafterTrainer(build_drafter(c.drafter, policy), c.train, c.drafter,
                                     head=TargetHead.of(policy))
    ms = {a: [] for a in trainers}
    for _ in range(cfg.step_repeats + 1):
        for a, tr in trainers.items():
            t = now()
            for bt_ in batches:
                tr.step(bt_)
            ms[a].append((now() - t) / len(batches) * 1e3)
    return {a: x[1:] for a, x in ms.items()}  # the first round warms up


# ---- summary --------------------------------------------------------------------------------------------------
def mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    return (statistics.fmean(xs) if xs else None), (statistics.stdev(xs) if len(xs) > 1 else None)


def paired_gain(per_seed: dict, key: str, arm: str, ref: str, seeds) -> tuple[float | None, float | None]:
    """Percent gain of arm over ref in `key`, per seed, then mean and sd over seeds."""
    g = [100 * (per_seed[arm, s][key] / per_seed[ref, s][key] - 1) for s in seeds
         if per_seed[arm, s].get(key) and per_seed[ref, s].get(key)]
    return mean_sd(g)


def summarize(cfg, per_seed: dict, steps: dict[str, list[float]]) -> dict:
    ref = cfg.arms[0]
    rows = []
    for a in cfg.arms:
        loss, _, pos = a.partition(":")
        row = {"arm": a, "loss": loss, "positions": pos or "uniform", "seeds": list(cfg.seeds)}
        for m in METRICS[:-1]:
            row[m], row[f"{m}_sd"] = mean_sd([per_seed[a, s].get(SOURCE.get(m, m)) for s in cfg.seeds])
        x = steps.get(a) or []
        row["step_ms"], row["step_ms_sd"] = (statistics.median(x), statistics.stdev(x) if len(x) > 1 else None) \
            if x else (None, None)
        rows.append(row)
    by = {r["arm"]: r for r in rows}
    summary = {"reference": ref}
    for key, name in (("offline_mal", "offline_mal_gain_pct"), ("live_mal", "online_mal_gain_pct")):
        best = max(cfg.arms, key=lambda a: by[a][key] if by[a][key] is not None else float("-inf"))
        if by[best][key] is None:
            continue
        gain, sd = paired_gain(per_seed, key, best, ref, cfg.seeds) if best != ref else (0.0, 0.0)
        summary.update({name: gain, f"{name}_sd": sd, f"{name}_arm": best})
    best_on = summary.get("online_mal_gain_pct_arm")
    if best_on:
        summary["best_tracking_over_oracle"] = by[best_on]["tracking_over_oracle"]
        summary["best_tracking_over_oracle_sd"] = by[best_on]["tracking_over_oracle_sd"]
    cost_arm = best_on or summary.get("offline_mal_gain_pct_arm")
    if cost_arm and by[cost_arm]["step_ms"] and by[ref]["step_ms"]:
        summary["step_cost_ratio"] = by[cost_arm]["step_ms"] / by[ref]["step_ms"]
    return {"recipe": cfg.recipe, "overrides": list(cfg.overrides), "seeds": list(cfg.seeds), "arms": list(cfg.arms),
            "online_arms": [a for a in cfg.arms if by[a]["live_mal"] is not None],
            "offline_arms": [a for a in cfg.arms if by[a]["offline_mal"] is not None],
            "offline_prompts": cfg.offline_prompts, "offline_epochs": cfg.offline_epochs, "offline_k": cfg.offline_k,
            "rows": rows, "summary": summary,
            "per_seed": [{"arm": a, "seed": s, **v} for (a, s), v in per_seed.items()]}


def part_arms(cfg, part: str) -> list[str]:
    """The arms that run `part` (offline | online): its `<part>_arms`, null meaning every arm."""
    arms = list(cfg[f"{part}_arms"]) if cfg[f"{part}_arms"] is not None else list(cfg.arms)
    if cfg.arms[0] not in arms or not set(arms) <= set(cfg.arms):
        raise SystemExit(f"error: {part}_arms: must be arms, the reference {cfg.arms[0]} among them, got {arms}")
    return arms


def main(cfg) -> dict:
    if cfg.job:
        return run_job(cfg)
    for a in cfg.arms:  # a bad arm fails here, in one line naming the key, before any job starts
        load_recipe(cfg.recipe, [*cfg.overrides, *arm_overrides(a)])
    jobs = [(k, a, s) for k in ("offline", "online") if cfg[k] for a in part_arms(cfg, k) for s in cfg.seeds]
    jobs.sort(key=lambda j: (j[0] != "offline", j[1] != cfg.arms[0]))  # each seed's data cache: the first arm's
    with ThreadPoolExecutor(max(1, cfg.parallel)) as pool:
        results = dict(zip(jobs, pool.map(lambda j: launch(cfg, *j), jobs)))
    per_seed = {(a, s): {} for a in cfg.arms for s in cfg.seeds}
    for (_, a, s), r in results.items():
        per_seed[a, s].update({k: v for k, v in r.items() if k not in ("arm", "seed")})
    steps = step_cost(cfg) if cfg.step_cost else {}
    result = summarize(cfg, per_seed, steps)
    print(format_table(result["rows"], ["arm", *(m for m in METRICS), *(f"{m}_sd" for m in METRICS)]))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
