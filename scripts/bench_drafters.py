"""Every drafter kind on the shipped policy, side by side; and the chooser (drafter.kind=auto) on the long-tail batch.

    python scripts/bench_drafters.py                                   # every kind, every measurement
    python scripts/bench_drafters.py kinds=[mtp,suffix] repeats=3 track_steps=20           # shorter tracking runs

Per kind (eagle3, mtp and draft_model from their shipped checkpoints in checkpoints/, selfquant int8, suffix):
- mal_k4 / mal_auto: mean accepted length on fresh rollouts of a GRPO batch (`prompts` x `group` samples, stop token
  on) at fixed k=4 and at k=auto, after a warm-up batch of other problems (same_problems=true: of the same ones);
- draft_cost: the drafter's time per drafted token over one decode step's, at batch 1, 8 and 64 (measure_costs);
- tokens_per_s at batch 1, 8, 64: rollouts of that many rows (distinct prompts) at k=auto, and AR's beside them;
- train_ms_per_rl_step (trainable kinds): online.steps_per_update drafter steps on the recipe's batch, from features
  of fresh rollouts, per RL step.
Long tail: the GRPO batch's wall time with SD + toggle + auto k for each kind and for drafter.kind=auto over every
member kind, and AR's, interleaved over `repeats` batches, each with its own problems and sampling seed
(bench_longtail's method and workload; same_problems=true: the same problems in every batch, as prompts revisited
over a dataset's epochs; pool=N: drawn from a fixed set of N problems, as over a dataset), after `warmup` batches
each (a running job's engine has seen the earlier steps' batches: the schedule and the chooser have learnt);
auto_over_best = auto's mean wall time over the best single kind's (wall_s_sd: each one's spread over the seeds; a
batch's wall time varies from seed to seed, hence 20 seeds: bench/NOTES.md, Auto); suffix_speedup_over_ar = AR's over
the suffix drafter's.
Tracking (tracking=true): the main job's default run for each trainable kind (its recipe, `track_steps` RL steps;
null = the recipe's; track_overrides: more recipe keys), and live over frozen teacher-forced MAL over the run's last
quarter; track_ceiling=true (default) also runs it with no time budget (online.budget_frac=0): ceiling_live_over_frozen,
and live_over_ceiling, the default run's ratio over that one's (1.0: the budget holds nothing back).
Prints tables; writes bench/drafters.json.
"""
from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from drafttrain.config import PROJECT_ROOT, load_recipe, resolve_path, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.engines import build_engine
from drafttrain.engines.schedule import measure_costs
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import format_table, write_json
from drafttrain.spec import SamplingParams
from drafttrain.tracking import DrafterTrainer, FeatureBuffer, teacher_forced_features

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_longtail import interleaved, workload  # noqa: E402  (the benchmarks' one interleaving and workload)

DEFAULTS = dict(recipe="eagle3_track", kinds=["eagle3", "mtp", "draft_model", "selfquant", "suffix"], prompts=8,
                group=8, max_new_tokens=256, repeats=20, warmup=3, batches=[1, 8, 64], seed=4321, tracking=True,
                track_steps=None, track_overrides=[], track_ceiling=True, same_problems=False, pool=0,
                out="bench/drafters.json", threads=2)
TRAINABLE = ("eagle3", "mtp", "draft_model")


def drafter_cfg(rc, kind: str, kinds: list[str]):
    dc = copy.deepcopy(rc.drafter)
    dc.kind = kind
    dc.path = f"checkpoints/{kind}" if kind in TRAINABLE else None
    if kind == "auto":
        dc.auto.kinds = [k for k in kinds if k != "selfquant"]
        dc.auto.paths = [f"checkpoints/{k}" if k in TRAINABLE else None for k in dc.auto.kinds]
    return dc


def engine(rc, policy, drafter, **over):
    ec = copy.deepcopy(rc.engine)
    for key, v in over.items():
        setattr(ec, key, v)
    return build_engine(ec, policy, drafter)


def per_kind(cfg, rc, policy, kind: str, prompts, params, problems, tok) -> dict:
    """prompts: the measured batch; problems: seed -> a batch of the workload (the warm-ups)."""
    dc = drafter_cfg(rc, kind, cfg.kinds)
    d = build_drafter(dc, policy)
    row = {"kind": kind}
    for name, k in (("mal_k4", 4), ("mal_auto", "auto")):
        eng = engine(rc, policy, d, k=k, toggle=False)
        eng.generate(problems(cfg.seed + 1), replace(params, seed=cfg.seed + 1))  # warm-up: auto k's estimates
        row[name] = eng.generate(prompts, params).stats.mean_accepted_length
    eng = engine(rc, policy, d, k="auto", toggle=False)
    for b in cfg.batches:
        c = measure_costs(eng, b, [1], 4, repeats=10)
        row[f"draft_cost_b{b}"] = c["draft_ms_per_token"] / c["target_ms"][1]
        rows, warm = (workload(tok, b, 1, cfg.seed + 7, cfg.same_problems, cfg.pool)(s)
                      for s in (cfg.seed + 7, cfg.seed + 8))
        tps = {}
        for label, spec in (("sd", True), ("ar", False)):
            eng.generate(warm, replace(params, seed=cfg.seed + 2), speculative=spec)
            t0 = now()
            out = eng.generate(rows, replace(params, seed=cfg.seed + 3), speculative=spec)
            tps[label] = out.num_tokens / (now() - t0)
        row[f"tokens_per_s_b{b}"], row[f"ar_tokens_per_s_b{b}"] = tps["sd"], tps["ar"]
    if kind in TRAINABLE:
        row["train_ms_per_rl_step"] = train_ms(rc, policy, d, prompts, params, eng)
    return row


def train_ms(rc, policy, d, prompts, params, eng) -> float:
    """online.steps_per_update drafter steps of train.batch_size records (the recipe's query_frac), timed."""
    resp = eng.generate(prompts, params, speculative=False).tokens
    steps = max(rc.drafter.ttt_steps, 5)
    buf = FeatureBuffer(1 << 30, seed=0)
    for i in range(0, len(prompts), 16):
        buf.add(teacher_forced_features(policy, prompts[i:i + 16], resp[i:i + 16], d.reads, steps))
    tr = DrafterTrainer(copy.deepcopy(d), rc.train, rc.drafter, buffer=buf, head=TargetHead.of(policy))
    tr.step(buf.sample(rc.train.batch_size))  # warm-up
    n = rc.online.steps_per_update
    t0 = now()
    for _ in range(n):
        tr.step(buf.sample(rc.train.batch_size))
    return (now() - t0) * 1e3


def long_tail(cfg, rc, policy, prompts, params) -> dict:
    """SD + toggle + auto k per kind and for auto, interleaved over seeds: mean wall time per kind. prompts: a batch
    (every warm-up and repeat runs it), or seed -> a batch (workload)."""
    problems = prompts if callable(prompts) else (lambda seed: prompts)
    kinds = [k for k in cfg.kinds if k != "selfquant"] + ["auto"]
    engines = {"ar": (engine(rc, policy, None, k=4, toggle=False), False)}
    for kind in kinds:
        d = build_drafter(drafter_cfg(rc, kind, cfg.kinds), policy)
        eng = engine(rc, policy, d, k="auto", toggle=True)
        # warm-up, as the previous RL steps' rollouts: the schedule and the chooser learn as in a running job
        for w in range(cfg.warmup):
            eng.generate(problems(cfg.seed + 1 + w), replace(params, seed=cfg.seed + 1 + w))
        engines[kind] = (eng, True)
    runs = interleaved(engines, lambda rep: problems(cfg.seed + 1000 * rep),
                       lambda rep: replace(params, seed=cfg.seed + 1000 * rep), cfg.repeats)
    wall = {key: statistics.fmean(r.wall_s for r in rs) for key, rs in runs.items()}
    sd = {key: statistics.stdev(r.wall_s for r in rs) if len(rs) > 1 else 0.0 for key, rs in runs.items()}
    best = min((k for k in kinds if k != "auto"), key=wall.get)
    trace = runs["auto"][-1].timeline.schedule
    return {"wall_s": wall, "wall_s_sd": sd, "wall_s_runs": {key: [r.wall_s for r in rs] for key, rs in runs.items()},
            "best_single": best, "auto_over_best": wall["auto"] / wall[best],
            "auto_kinds_steps": {k: sum(t.get("kind") == k for t in trace) for k in [*kinds, "ar"]},
            "auto_trace": trace}


def tracking_run(cfg, kind: str, extra=()) -> dict:
    """One main job of kind's recipe: live and frozen teacher-forced MAL over its last quarter (and per position)."""
    out = Path(tempfile.mkdtemp(prefix=f"bench_drafters_{kind}_"))
    cmd = [sys.executable, "-m", "drafttrain.online", f"recipe={kind}_track", f"run.out_dir={out}",
           "run.tensorboard=false", "online.measure_every=1",
           *([f"rl.steps={cfg.track_steps}"] if cfg.track_steps else []),
           *cfg.track_overrides, *extra]
    if kind != "eagle3":
        cmd.append(f"drafter.path=checkpoints/{kind}")  # the shipped pretrained drafter, as the frozen baseline
    r = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench_drafters: the {kind} run failed: {(r.stdout + r.stderr)[-2000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [x for x in recs if x.get("live_tf_mal") is not None]
    q = recs[-max(1, len(recs) // 4):]
    live, frozen = statistics.fmean(x["live_tf_mal"] for x in q), statistics.fmean(x["frozen_tf_mal"] for x in q)
    curves = {key: [statistics.fmean(a) for a in zip(*(x[key] for x in q))]  # per position, over the last quarter
              for key in ("live_tf_acc_pos", "frozen_tf_acc_pos") if all(x.get(key) for x in q)}
    return {"steps": len(recs), "live_tf_mal": live, "frozen_tf_mal": frozen, "live_over_frozen": live / frozen,
            "k": len(q[-1].get("live_tf_acc_pos") or []) or None, **curves, "run": str(out)}


def tracking(cfg, kind: str) -> dict:
    """The main job's default run of kind's recipe: live over frozen teacher-forced MAL over its last quarter. With
    track_ceiling, the same run again with no time budget (online.budget_frac=0: the drafter trains after every RL
    step, as much as online.steps_per_update allows): what the kind can track at all, so live_over_ceiling (the
    default run's live/frozen over the unbounded run's) says whether the 5% budget or the drafter holds it back."""
    row = {"kind": kind, **tracking_run(cfg, kind)}
    if cfg.track_ceiling:
        top = tracking_run(cfg, kind, ["online.budget_frac=0"])
        row.update(ceiling_live_tf_mal=top["live_tf_mal"], ceiling_frozen_tf_mal=top["frozen_tf_mal"],
                   ceiling_live_over_frozen=top["live_over_frozen"],
                   live_over_ceiling=row["live_over_frozen"] / top["live_over_frozen"], ceiling_run=top["run"])
    return row


def setup(cfg):
    """(recipe, policy, tokenizer, the GRPO batch's problems and prompt ids, its sampling params)."""
    torch.set_num_threads(cfg.threads)
    rc = load_recipe(cfg.recipe)
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    probs = make_prompts(cfg.prompts, seed=cfg.seed)
    prompts = [encode_prompt(tok, p.prompt) for p in probs for _ in range(cfg.group)]
    params = SamplingParams(temperature=rc.sampling.temperature, max_new_tokens=cfg.max_new_tokens,
                            stop_token_ids=(tok.eos_token_id,), seed=cfg.seed)
    return rc, policy, tok, probs, prompts, params


def main(cfg) -> dict:
    rc, policy, tok, probs, prompts, params = setup(cfg)
    problems = workload(tok, cfg.prompts, cfg.group, cfg.seed, cfg.same_problems, cfg.pool)
    rows = [per_kind(cfg, rc, policy, kind, prompts, params, problems, tok) for kind in cfg.kinds]
    lt = long_tail(cfg, rc, policy, problems, params)
    result = {"kinds": rows, "long_tail": lt, "auto_over_best": lt["auto_over_best"],
              **({"suffix_speedup_over_ar": lt["wall_s"]["ar"] / lt["wall_s"]["suffix"]} if "suffix" in cfg.kinds
                 else {}), "config": OmegaConf.to_container(cfg)}
    if cfg.tracking:
        result["tracking"] = [tracking(cfg, k) for k in cfg.kinds if k in TRAINABLE]
    cols = ["kind", "mal_k4", "mal_auto", *[f"{m}_b{b}" for m in ("draft_cost", "tokens_per_s", "ar_tokens_per_s")
                                             for b in cfg.batches], "train_ms_per_rl_step"]
    print(format_table(rows, cols))
    print(format_table([{"engine": k, "wall_s": v} for k, v in lt["wall_s"].items()], ["engine", "wall_s"]))
    print(f"long tail: auto {lt['wall_s']['auto']:.3f}s, best single kind ({lt['best_single']}) "
          f"{lt['wall_s'][lt['best_single']]:.3f}s: auto_over_best {lt['auto_over_best']:.3f}")
    if cfg.tracking:
        print(format_table(result["tracking"], ["kind", "steps", "live_tf_mal", "frozen_tf_mal", "live_over_frozen",
                                                 *(["ceiling_live_over_frozen", "live_over_ceiling"]
                                                   if cfg.track_ceiling else [])]))
    write_json(result, cfg.out)
    print(f"wrote {cfg.out}")
    return result


if __name__ == "__main__":
    main(script_config(DEFAULTS))
