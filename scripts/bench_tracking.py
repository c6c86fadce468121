"""Does the tracking drafter keep up with a drifting policy? Tracking vs frozen vs an oracle, over seeds, plus costs.

    python scripts/bench_tracking.py                                   # the default recipe, seeds 0-2 (~3 runs)
    python scripts/bench_tracking.py seeds=[0,1] overrides=[rl.steps=8] oracle_steps=50   # quick look

Runs the recipe (default eagle3_track) as it is shipped: no learning-rate or budget overrides unless given in
`overrides` (recorded in the JSON), but for online.measure_every=1 (the live/frozen scoring at every step). Per seed
s (run.seed=s, rl.prompt_seed=1+s: seed 0 is the default run):
1. The run, resumed in its own folder up to each oracle checkpoint (oracle_points steps in the last quarter, the
   last one the run's end). Its own per-step record gives the live and the frozen step-0 drafter's teacher-forced
   MAL on the same rollouts: tracking_over_frozen is their ratio over the last quarter of steps.
2. At each checkpoint: fresh rollouts of the current policy (held out) score the run's drafter, the frozen one and
   an oracle (the step-0 drafter trained to convergence on other fresh rollouts of the current policy):
   tracking_over_oracle, the mean over those checkpoints.
3. frozen_decay_pct: the frozen drafter's MAL on the final policy's rollouts below its MAL on the step-0 policy's,
   on one fixed held-out prompt set (decay_prompts, sampled).
4. heldout_accuracy_gain_pts: the run's eval.json, sampled accuracy after minus before, in points.
5. rollout_speedup_over_frozen: rollout tokens/s at the last checkpoint with the run's drafter over the frozen one,
   same prompts and seeds, generated back to back in the order tracking, frozen, frozen, tracking (drift cancels).
6. Overhead: online training's time (capture hooks, drafter steps, the acceptance estimate, publishing) as a % of
   the RL steps' own time (sync mode; rollout and policy update), over every seed's steps (overhead_pct), and per
   step. The per-step live/frozen scoring the run records is reporting, given apart (measure_pct).
7. Swap stall (first seed, last checkpoint): generation runs while another thread hot-swaps drafters; the decode
   steps in which a swap was staged or landed are compared with the steps around them, in decode steps.
Means over seeds carry their sd over seeds (`_sd`), the accuracy gain its standard error (`_se`). Writes
bench/tracking.json (those keys, `per_seed`, `checkpoints`, a `series` of per-step records for each seed) and
report.png beside the first seed's run (with the oracle's points), and prints tables.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from drafttrain.config import load_recipe, max_draft_len, resolve_path, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import (accuracy_change, format_table, last_quarter, overhead, plot_run, read_jsonl,
                               write_json)
from drafttrain.rl.job import main as run_main
from drafttrain.spec import SamplingParams, SpecStats
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.buffer import FeatureBuffer
from drafttrain.tracking.weightsets import checkpoint_sets
from drafttrain.tracking.capture import teacher_forced_features
from drafttrain.tracking.trainer import DrafterTrainer

DEFAULTS = dict(recipe="eagle3_track", seeds=[0, 1, 2], overrides=[], oracle_points=2, run_dir="runs/bench_tracking",
                fresh=True, oracle_rollouts=96, oracle_steps=300, oracle_lr=3e-4, oracle_batch=16,
                oracle_ttt_steps=3, eval_rollouts=48, decay_prompts=256,
                max_new_tokens=None, out="bench/tracking.json")  # max_new_tokens None: the recipe's
DECAY_SEED = 555_555  # the fixed held-out prompt set of frozen_decay_pct (no run trains or evaluates on it)


def rollouts(engine, tok, n, seed, max_new, speculative=False):
    probs = make_prompts(n, seed=seed)
    prompts = [encode_prompt(tok, p.prompt) for p in probs]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=(tok.eos_token_id,), seed=seed)
    b = engine.generate(prompts, params, speculative=speculative)
    return prompts, b


def features(policy, drafter, prompts, responses, k):
    out = []
    for i in range(0, len(prompts), 16):
        out.append(teacher_forced_features(policy, prompts[i:i + 16], responses[i:i + 16], drafter.aux_layer_ids, k))
    return out


def score(drafter, feats, k, head) -> float:
    """MAL of `drafter` on feats, against the distributions of the policy whose LM head is `head`."""
    st = SpecStats()
    for f in feats:  # pooled as the engine pools rows
        st = st.merge(teacher_forced_acceptance(drafter, f, k, head)["stats"])
    return st.mean_accepted_length


def train_oracle(base, feats, rc, cfg, head):
    """The upper bound: the step-0 drafter trained to convergence on the current policy's rollouts, with its own
    fixed settings (every position, the full gradient, cfg.oracle_lr, cfg.oracle_batch, cfg.oracle_ttt_steps),
    whatever the recipe's online steps use."""
    oracle = copy.deepcopy(base)
    buf = FeatureBuffer(1 << 30, dtype=torch.float32)
    for f in feats:
        buf.add(f)
    tc = copy.deepcopy(rc.train)
    tc.query_frac, tc.lr, tc.batch_size, tc.score_grad = 1.0, cfg.oracle_lr, cfg.oracle_batch, True
    dc = copy.deepcopy(rc.drafter)
    dc.ttt_steps = cfg.oracle_ttt_steps
    tr = DrafterTrainer(oracle, tc, dc, buffer=buf, head=head)
    for _ in range(cfg.oracle_steps):
        tr.step(buf.sample(tc.batch_size))
    return oracle.eval()


def stall_steps(ends: list[float], landed: list[tuple[float, float]], around: int = 4) -> list[float]:
    """Per swap (landing time, staging seconds): the extra time of the decode steps that overlapped its staging or
    its landing, in decode steps, against the `around` steps on either side of them (a local baseline: the steps
    of a generation shrink with its active batch, and against the whole run's median the early, larger-batch steps
    a swap lands in read as a stall of ~1 step where there was none)."""
    durs = [b - a for a, b in zip(ends, ends[1:])]
    out = []
    for t_land, swap_s in landed:
        hit = [i for i, (a, b) in enumerate(zip(ends, ends[1:])) if b >= t_land - swap_s and a <= t_land]
        if not hit:
            continue
        near = durs[max(0, hit[0] - around):hit[0]] + durs[hit[-1] + 1:hit[-1] + 1 + around]
        base = statistics.median(near) if near else statistics.median(durs)
        out.append(sum(durs[i] - base for i in hit) / base)
    return out


def swap_stall(engine, weights, tok, n_swaps=4) -> dict:
    """Generate while another thread swaps drafters; the stall of each swap in decode steps (stall_steps).
    No stop token: every row runs to max_new_tokens, so the generation outlasts every swap (with stops it ended
    after the first one or two)."""
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(16, seed=777)]
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=777)
    result, landed = {}, []

    def gen():
        result["b"] = engine.generate(prompts, params)

    t = threading.Thread(target=gen)
    t.start()
    time.sleep(0.3)
    for _ in range(n_swaps):
        engine.load_drafter(weights, engine.drafter_version + 1)
        landed.append((now(), engine.last_swap_s, engine.last_swap_critical_s))
        time.sleep(0.2)
    t.join()
    ends = result["b"].timeline.ends
    stalls = stall_steps(ends, [(t_land, swap_s) for t_land, swap_s, _ in landed])
    return {"median_decode_step_ms": statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3,
            "swap_s": [x[1] for x in landed], "swap_critical_ms": [x[2] * 1e3 for x in landed],
            "stall_per_swap": stalls,
            "stall_decode_steps": max(0.0, statistics.fmean(stalls)) if stalls else 0.0}


def oracle_checkpoints(steps: int, n: int) -> list[int]:
    """n checkpoint steps spread over the last quarter of a run of `steps` (the last one its end), ascending."""
    q0 = steps - max(1, steps // 4)
    return sorted({min(steps, max(1, q0 + round((i + 1) * (steps - q0) / n))) for i in range(n)})


def scored_last_quarter(records: list[dict]) -> list[dict]:
    """The records of the last quarter of a run's steps that scored both drafters (at least one)."""
    return last_quarter([r for r in records if r.get("live_tf_mal") is not None and r.get("frozen_tf_mal") is not None])


def tracking_over_frozen(records: list[dict]) -> float | None:
    """Live over frozen step-0 drafter's teacher-forced MAL on the same rollouts, each the mean over the run's last
    quarter of steps."""
    q = scored_last_quarter(records)
    return statistics.fmean(r["live_tf_mal"] for r in q) / statistics.fmean(r["frozen_tf_mal"] for r in q) \
        if q else None


def over_seeds(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, sd over seeds) of the values there are; sd None under 2 values."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None


def accuracy_gain(ev: dict | None) -> tuple[float | None, float | None]:
    """(gain in points, its standard error) of eval.json's sampled accuracy, after minus before on the same
    problems (report.accuracy_change)."""
    if not ev or not ev.get("before") or not ev.get("after"):
        return None, None
    ch = accuracy_change(ev["before"], ev["after"], ev["prompts"]).get("eval_sampled_acc")
    return (ch["change_pts"], ch["se_pts"]) if ch else (None, None)


def load_tracking(frozen, ckpt: Path):
    """The drafter the run serves at a checkpoint: the version published last, also while its canary has not judged
    it yet (else the last good weights); the trainer's may be newer: updates the publish gate has not passed."""
    sets = checkpoint_sets(ckpt)
    tracking = copy.deepcopy(frozen)
    tracking.load_state_dict(sets["pending"] if sets["pending"] is not None else sets["good_weights"])
    return tracking.eval()


def rollout_speed(eng, tok, drafters: dict, cfg) -> dict:
    """Per drafter: SD rollout wall time, tokens and MAL on the same prompts, generated back to back in the order
    a, b, b, a (a drift of the machine's speed cancels); then AR on the same prompts."""
    names = list(drafters)
    wall = {f"sd_{n}": {"wall_s": 0.0, "tokens": 0, "mal": []} for n in names}
    for n in names + names[::-1]:
        eng.load_drafter(drafters[n].state_dict(), eng.drafter_version + 1)
        _, b = rollouts(eng, tok, cfg.eval_rollouts, 30_000, cfg.max_new_tokens, True)
        w = wall[f"sd_{n}"]
        w["wall_s"] += b.wall_s
        w["tokens"] += b.num_tokens
        w["mal"].append(b.stats.mean_accepted_length)
    _, b = rollouts(eng, tok, cfg.eval_rollouts, 30_000, cfg.max_new_tokens, False)
    wall["ar"] = {"wall_s": b.wall_s, "tokens": b.num_tokens, "mal": [b.stats.mean_accepted_length]}
    for w in wall.values():
        w["mal"] = statistics.fmean(w["mal"])
        w["tokens_per_s"] = w["tokens"] / w["wall_s"]
    return wall


def run_seed(cfg, seed: int) -> dict:
    """One seed's run, its checkpoints' oracle comparison, frozen decay and rollout speeds (steps 1-5)."""
    run_dir = Path(cfg.run_dir) / f"seed-{seed}"
    if cfg.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    # the per-step live/frozen series (step 1's tracking_over_frozen) needs the scoring at every step
    base_over = ["online.measure_every=1", *cfg.overrides, f"run.seed={seed}", f"rl.prompt_seed={1 + seed}",
                 f"run.out_dir={run_dir}", "run.resume=true"]
    rc = load_recipe(cfg.recipe, base_over)
    k = max_draft_len(rc.engine)
    cfg = cfg.copy()
    cfg.max_new_tokens = cfg.max_new_tokens or rc.sampling.max_new_tokens
    torch.manual_seed(rc.run.seed)  # as the run does, so a fresh (path=null) drafter is the run's step-0 drafter
    pol0, tok = load_policy(str(resolve_path(rc.policy.path)))
    frozen = build_drafter(rc.drafter, pol0).eval()
    points = []
    for c in oracle_checkpoints(rc.rl.steps, cfg.oracle_points):
        run_main(load_recipe(cfg.recipe, [*base_over, f"rl.steps={c}"]))
        last = run_dir / "ckpt" / (run_dir / "ckpt" / "latest").read_text().strip()
        policy, _ = load_policy(str(last / "policy"))
        tracking = load_tracking(frozen, last)
        ar = build_engine(rc.engine, policy, None)
        p_or, b_or = rollouts(ar, tok, cfg.oracle_rollouts, 10_000 + c, cfg.max_new_tokens)
        p_ev, b_ev = rollouts(ar, tok, cfg.eval_rollouts, 20_000 + c, cfg.max_new_tokens)
        f_ev, head = features(policy, frozen, p_ev, b_ev.tokens, k), TargetHead.of(policy)
        oracle = train_oracle(frozen, features(policy, frozen, p_or, b_or.tokens, max(k, cfg.oracle_ttt_steps)), rc,
                              cfg, head)
        pt = {"seed": seed, "step": c, "tracking_tf_mal": score(tracking, f_ev, k, head),
              "frozen_tf_mal": score(frozen, f_ev, k, head), "oracle_tf_mal": score(oracle, f_ev, k, head)}
        pt["tracking_over_frozen"] = pt["tracking_tf_mal"] / pt["frozen_tf_mal"]
        pt["tracking_over_oracle"] = pt["tracking_tf_mal"] / pt["oracle_tf_mal"]
        points.append(pt)
        print(format_table([pt], list(pt)))
    # the frozen drafter on one fixed held-out prompt set: the step-0 policy's rollouts, then the final policy's
    mal = {}
    for name, pol in (("step0", pol0), ("final", policy)):
        p_d, b_d = rollouts(build_engine(rc.engine, pol, None), tok, cfg.decay_prompts, DECAY_SEED, cfg.max_new_tokens)
        mal[name] = score(frozen, features(pol, frozen, p_d, b_d.tokens, k), k, TargetHead.of(pol))
    eng = build_engine(rc.engine, policy, tracking)
    wall = rollout_speed(eng, tok, {"tracking": tracking, "frozen": frozen}, cfg)
    recs = read_jsonl(run_dir / "metrics.jsonl")
    ev = run_dir / "eval.json"
    gain, gain_se = accuracy_gain(json.loads(ev.read_text()) if ev.is_file() else None)
    return {"seed": seed, "recs": recs, "points": points, "wall": wall, "engine": eng, "tracking": tracking, "k": k,
            "tok": tok, "rl_lr": rc.rl.lr, "steps": rc.rl.steps, "run_dir": run_dir,
            "summary": {"seed": seed, "tracking_over_frozen": tracking_over_frozen(recs),
                        "tracking_over_oracle": statistics.fmean(p["tracking_over_oracle"] for p in points),
                        "frozen_step0_mal": mal["step0"], "frozen_final_mal": mal["final"],
                        "frozen_decay_pct": 100 * (1 - mal["final"] / mal["step0"]),
                        "heldout_accuracy_gain_pts": gain, "heldout_accuracy_gain_pts_se": gain_se,
                        "rollout_speedup_over_frozen": wall["sd_tracking"]["tokens_per_s"]
                        / wall["sd_frozen"]["tokens_per_s"], **overhead(recs)}}


def main(cfg) -> dict:
    if len(cfg.seeds) < 1:
        raise SystemExit("error: seeds: give at least one seed")
    if cfg.oracle_ttt_steps < 1:
        raise SystemExit(f"error: oracle_ttt_steps: must be >= 1, got {cfg.oracle_ttt_steps}")
    runs = [run_seed(cfg, s) for s in cfg.seeds]
    first = runs[0]
    stall = swap_stall(first["engine"], first["tracking"].state_dict(), first["tok"])
    per_seed = [r["summary"] for r in runs]
    result = {"recipe": cfg.recipe, "overrides": list(cfg.overrides), "seeds": list(cfg.seeds),
              "steps": first["steps"], "k": first["k"], "rl_lr": first["rl_lr"]}
    for key in ("tracking_over_frozen", "tracking_over_oracle", "frozen_decay_pct", "rollout_speedup_over_frozen"):
        result[key], result[f"{key}_sd"] = over_seeds([p[key] for p in per_seed])
    gain, sd = over_seeds([p["heldout_accuracy_gain_pts"] for p in per_seed])
    n_gain = sum(p["heldout_accuracy_gain_pts"] is not None for p in per_seed)
    # the mean's standard error: from the seeds' spread (run-to-run and evaluation noise); one seed: its binomial
    se = sd / math.sqrt(n_gain) if sd is not None else per_seed[0]["heldout_accuracy_gain_pts_se"]
    result.update(heldout_accuracy_gain_pts=gain, heldout_accuracy_gain_pts_se=se)
    result.update(overhead([r for run in runs for r in run["recs"]]))
    wall = {m: {"wall_s": sum(r["wall"][m]["wall_s"] for r in runs),
                "tokens": sum(r["wall"][m]["tokens"] for r in runs),
                "mal": statistics.fmean(r["wall"][m]["mal"] for r in runs)} for m in first["wall"]}
    result.update(swap_stall_decode_steps=stall["stall_decode_steps"], swap=stall, rollout_wall=wall,
                  per_seed=per_seed, checkpoints=[p for r in runs for p in r["points"]],
                  series={str(r["seed"]): r["recs"] for r in runs})
    # the oracle's points on the first seed's report: checkpoint c's policy generated step c's rollouts
    oracle_at = {p["step"]: p["oracle_tf_mal"] for p in first["points"]}
    recs = [{**r, "oracle_tf_mal": oracle_at.get(r["step"])} for r in first["recs"]]
    recs += [{"step": c, "oracle_tf_mal": v} for c, v in oracle_at.items() if c >= len(recs)]
    png = plot_run(recs, first["run_dir"] / "report.png", title=f"{cfg.recipe}, seed {first['seed']}")
    print(format_table(result["checkpoints"], ["seed", "step", "tracking_tf_mal", "frozen_tf_mal", "oracle_tf_mal",
                                               "tracking_over_frozen", "tracking_over_oracle"]))
    print(format_table(per_seed, ["seed", "tracking_over_frozen", "tracking_over_oracle", "frozen_decay_pct",
                                  "heldout_accuracy_gain_pts", "rollout_speedup_over_frozen", "overhead_pct"]))
    print(format_table([{"mode": m, **v, "tok_per_s": v["tokens"] / v["wall_s"]} for m, v in wall.items()],
                       ["mode", "wall_s", "tokens", "tok_per_s", "mal"]))
    print(f"overhead {result['overhead_pct']:.1f}% of the RL step (measurement {result['measure_pct']:.1f}% more)  |  "
          f"swap stall {stall['stall_decode_steps']:.2f} decode steps (median step {stall['median_decode_step_ms']:.1f}"
          f" ms)  |  report: {png}")
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
