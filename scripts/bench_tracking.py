"""Does the tracking drafter keep up with a drifting policy? Tracking vs frozen vs an oracle, plus the overheads.

    python scripts/bench_tracking.py                          # 12 RL steps at rl_lr=1e-3, oracle at steps 6, 12
    python scripts/bench_tracking.py checkpoints=[4] rl_lr=1e-4 oracle_steps=50   # quick look

Why rl_lr=1e-3: at the main job's 4e-5, and at 1e-4 and 3e-4, the step-0 drafter does not go stale (its
teacher-forced MAL stays within 2% of the tracking drafter's over 16-24 steps): EAGLE-3 reads the policy's own
hidden states, so a drafter follows a policy that changes gently by itself. At 1e-3 the policy does move (and
collapses: held-out accuracy 27% -> 2% in 12 steps), and the frozen drafter falls to ~0.64 of the oracle.

1. Runs the recipe (default eagle3_track, sync) with an RL learning rate that really moves the policy, resuming
   the same run folder up to each checkpoint step.
2. At each checkpoint: fresh rollouts of the current policy (held out) score three drafters by teacher-forced
   mean accepted length (k = engine.k): the tracking drafter of the run, the frozen step-0 drafter, and an oracle
   (the step-0 drafter trained to convergence on other fresh rollouts of the current policy).
3. At the last checkpoint: rollout wall time on the same prompts with SD tracking, SD frozen, and AR.
4. Overhead: online training's time (capture hooks, drafter steps, the acceptance estimate, publishing) as a % of
   the RL steps' own time (sync mode; rollout and policy update): over the whole run (overhead_pct), and per step.
   The per-step live/frozen scoring the run records is reporting, given apart (measure_pct).
5. Swap stall: generation runs while another thread hot-swaps drafters; the decode steps in which a swap was
   staged or landed are compared with the steps around them (stall_steps), in decode steps.
Writes bench/tracking.json (tracking_over_frozen, tracking_over_oracle, overhead_pct, swap_stall_decode_steps,
per-step series) and prints a table.
"""
from __future__ import annotations

import copy
import statistics
import threading
import time
from pathlib import Path

import torch

from drafttrain.config import load_recipe, max_draft_len, resolve_path, script_config
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.online.acceptance import teacher_forced_acceptance
from drafttrain.online.buffer import FeatureBuffer
from drafttrain.online.capture import teacher_forced_features
from drafttrain.online.run import main as run_main
from drafttrain.online.runfolder import load_checkpoint
from drafttrain.online.trainer import DrafterTrainer
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import format_table, read_jsonl, write_json
from drafttrain.spec import SamplingParams, SpecStats

DEFAULTS = dict(recipe="eagle3_track", checkpoints=[6, 12], rl_lr=1e-3, run_dir="runs/bench_tracking", fresh=True,
                oracle_rollouts=96, oracle_steps=300, oracle_lr=3e-4, oracle_batch=16, eval_rollouts=48,
                max_new_tokens=256, out="bench/tracking.json", overrides=[])


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


def score(drafter, feats, k) -> float:
    st = SpecStats()
    for f in feats:  # pooled as the engine pools rows
        st = st.merge(teacher_forced_acceptance(drafter, f, k)["stats"])
    return st.mean_accepted_length


def train_oracle(base, feats, rc, cfg):
    """The upper bound: the step-0 drafter trained to convergence on the current policy's rollouts, with its own
    fixed settings (every position, cfg.oracle_lr, cfg.oracle_batch), whatever the recipe's online steps use."""
    oracle = copy.deepcopy(base)
    buf = FeatureBuffer(1 << 30, dtype=torch.float32)
    for f in feats:
        buf.add(f)
    tc = copy.deepcopy(rc.train)
    tc.query_frac, tc.lr, tc.batch_size = 1.0, cfg.oracle_lr, cfg.oracle_batch
    tr = DrafterTrainer(oracle, tc, rc.drafter, buffer=buf)
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
        landed.append((time.perf_counter(), engine.last_swap_s, engine.last_swap_critical_s))
        time.sleep(0.2)
    t.join()
    ends = result["b"].step_ends
    stalls = stall_steps(ends, [(t_land, swap_s) for t_land, swap_s, _ in landed])
    return {"median_decode_step_ms": statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3,
            "swap_s": [x[1] for x in landed], "swap_critical_ms": [x[2] * 1e3 for x in landed],
            "stall_per_swap": stalls,
            "stall_decode_steps": max(0.0, statistics.fmean(stalls)) if stalls else 0.0}


def main(cfg) -> dict:
    run_dir = Path(cfg.run_dir)
    if cfg.fresh and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    base_over = [f"rl.lr={cfg.rl_lr}", f"run.out_dir={run_dir}", "run.resume=true", *cfg.overrides]
    rc = load_recipe(cfg.recipe, base_over)
    k = max_draft_len(rc.engine)
    torch.manual_seed(rc.run.seed)  # as the run does, so a fresh (path=null) drafter is the run's step-0 drafter
    pol0, tok = load_policy(str(resolve_path(rc.policy.path)))
    frozen = build_drafter(rc.drafter, pol0).eval()
    points = []
    for c in cfg.checkpoints:
        run_main(load_recipe(cfg.recipe, [*base_over, f"rl.steps={c}"]))
        last = run_dir / "ckpt" / (run_dir / "ckpt" / "latest").read_text().strip()
        policy, _ = load_policy(str(last / "policy"))
        tracking = copy.deepcopy(frozen)
        tracking.load_state_dict(load_checkpoint(last / "trainer.pt")["drafter"])
        tracking.eval()
        ar = build_engine(rc.engine, policy, None)
        p_or, b_or = rollouts(ar, tok, cfg.oracle_rollouts, 10_000 + c, cfg.max_new_tokens)
        p_ev, b_ev = rollouts(ar, tok, cfg.eval_rollouts, 20_000 + c, cfg.max_new_tokens)
        f_ev = features(policy, frozen, p_ev, b_ev.tokens, k)
        oracle = train_oracle(frozen, features(policy, frozen, p_or, b_or.tokens, k), rc, cfg)
        pt = {"step": c, "tracking_tf_mal": score(tracking, f_ev, k), "frozen_tf_mal": score(frozen, f_ev, k),
              "oracle_tf_mal": score(oracle, f_ev, k)}
        pt["tracking_over_frozen"] = pt["tracking_tf_mal"] / pt["frozen_tf_mal"]
        pt["tracking_over_oracle"] = pt["tracking_tf_mal"] / pt["oracle_tf_mal"]
        points.append(pt)
        print(format_table([pt], list(pt)))

    # rollout wall time at the last checkpoint, same prompts
    eng = build_engine(rc.engine, policy, tracking)
    wall = {}
    for name, spec in [("ar", False), ("sd_tracking", True)]:
        _, b = rollouts(eng, tok, cfg.eval_rollouts, 30_000, cfg.max_new_tokens, spec)
        wall[name] = {"wall_s": b.wall_s, "tokens": b.num_tokens, "mal": b.stats.mean_accepted_length}
    eng.load_drafter(frozen.state_dict(), eng.drafter_version + 1)
    _, b = rollouts(eng, tok, cfg.eval_rollouts, 30_000, cfg.max_new_tokens, True)
    wall["sd_frozen"] = {"wall_s": b.wall_s, "tokens": b.num_tokens, "mal": b.stats.mean_accepted_length}
    stall = swap_stall(eng, tracking.state_dict(), tok)

    recs = read_jsonl(run_dir / "metrics.jsonl")
    # online training's time per RL step: capture hooks in the loss forward, drafter steps, estimate, publish; over
    # the RL step's own time (rollout + policy update): rl_step_s less that work and less measure_s (the per-step
    # live/frozen scoring, reported on its own as measure_pct)
    work = [(r["drafter_train_s"] + (r.get("publish_s") or 0) + (r.get("capture_s") or 0), r["rl_step_s"],
             r.get("measure_s") or 0.0) for r in recs if r.get("drafter_train_s") is not None]
    ov = [100 * w / max(t - w - m, 1e-9) for w, t, m in work]
    own = sum(t - w - m for w, t, m in work)
    ov_total = 100 * sum(w for w, _, _ in work) / max(own, 1e-9) if work else None
    measure_pct = 100 * sum(m for _, _, m in work) / max(own, 1e-9) if work else None
    last = points[-1]
    result = {"tracking_over_frozen": last["tracking_over_frozen"],
              "tracking_over_oracle": last["tracking_over_oracle"],
              "overhead_pct": ov_total, "overhead_pct_mean_of_steps": statistics.fmean(ov) if ov else None,
              "overhead_pct_per_step": ov, "measure_pct": measure_pct,
              "swap_stall_decode_steps": stall["stall_decode_steps"], "swap": stall, "checkpoints": points,
              "rollout_wall": wall, "series": recs, "k": k, "rl_lr": cfg.rl_lr}
    print(format_table(points, ["step", "tracking_tf_mal", "frozen_tf_mal", "oracle_tf_mal", "tracking_over_frozen",
                                "tracking_over_oracle"]))
    print(format_table([{"mode": m, **v, "tok_per_s": v["tokens"] / v["wall_s"]} for m, v in wall.items()],
                       ["mode", "wall_s", "tokens", "tok_per_s", "mal"]))
    print(f"overhead {result['overhead_pct']:.1f}% of the RL step (measurement {measure_pct:.1f}% more)  |  swap stall "
          f"{stall['stall_decode_steps']:.2f} decode steps (median step {stall['median_decode_step_ms']:.1f} ms)")
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
