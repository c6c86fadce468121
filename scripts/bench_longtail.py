"""Long-tail rollouts: where speculative decoding pays, and how the toggle and the draft length follow it.

    python scripts/bench_longtail.py                         # 16 prompts x G=4, all drafters and modes, sweep
    python scripts/bench_longtail.py prompts=4 sweep_batches=[1,8] drafters=[eagle3]
    python scripts/bench_longtail.py drafters=[eagle3,suffix,auto]             # + the chooser's trace in the plot
    python scripts/bench_longtail.py overrides=[engine.max_batch=16]         # recipe overrides

Workload: a GRPO-style batch (prompts x G samples of the shipped task, long-tailed response lengths), with new
problems at each warm-up and repeat, as at each RL step (same_problems=true: the same problems every time, prompts
revisited as in epochs over a dataset, which the suffix drafter drafts from its earlier rollouts of; pool=N: each
batch drawn from a fixed set of N problems, as an RL run over a dataset draws them, give warmup >~ 2 N / prompts
batches so that most are seen once): the active
batch starts large (SD loses: verify costs ~ linearly more tokens on this CPU) and shrinks to the long tail
(SD wins). Modes, for each drafter (EAGLE-3 from checkpoints/eagle3, selfquant int8 and int4):
AR | SD-always at fixed k | SD + toggle (fixed k) | SD + toggle + auto k | SD + toggle + ladder. Each engine
is warmed up on a batch of the workload, then every engine runs `repeats` batches of it, interleaved, each repeat
with its own problems and sampling seed (the same for every engine); the mean wall time counts. Why fresh seeds:
AR and SD draw differently (exact in distribution only), so one draw's longest rows, not the engine, would set
much of the difference.
Sweep: tokens/s at an active batch B for AR, SD-always and SD + toggle: real rollouts of the workload's prompts
(stop token on), counting the decode steps with at least 3/4 of B rows still active, over
max(sweep_min_batches, sweep_rows // B) batches per repeat (a large batch keeps 3/4 of its rows for only a few SD
steps, so one batch per repeat measures noise: bench/NOTES.md, Embedded engine); the median of sweep_repeats
interleaved repeats, and the share of those
steps the toggle ran SD in. toggle_over_best is the median over repeats of each repeat's toggle / max(AR, SD-always)
(paired within the repeat); toggle_over_best_of_medians, the ratio of the medians, is kept beside it. The stop
token is on: past its end of text the policy writes junk that no drafter predicts, which would misstate SD at every
batch.
Ceiling: the AR runs re-priced step by step at the sweep's best of AR and SD-always at each step's active batch
(ceiling_wall): about what a perfect toggle at k = `k` would take on this machine, next to the toggle's own time.
Prints tables; writes bench/longtail.json and bench/longtail_trace.png (active batch, SD on/off and k per step).
"""
from __future__ import annotations

import copy
import math
import random
import statistics
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from drafttrain.config import load_recipe, resolve_path, script_config
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import format_table, write_json
from drafttrain.spec import SamplingParams

DEFAULTS = dict(recipe="eagle3_track", overrides=[], prompts=16, group=4, max_new_tokens=256, k=5, seed=4321,
                drafters=["eagle3", "selfquant_int8", "selfquant_int4"], sweep_batches=[1, 2, 4, 8, 16, 32, 64],
                repeats=15, sweep_tokens=256, sweep_rows=32, sweep_min_batches=8, sweep_repeats=7,
                same_problems=False, pool=0, out="bench/longtail.json", threads=2)

MODES = {  # name -> engine overrides (None = AR)
    "ar": None,
    "sd_always": dict(toggle=False),
    "sd_toggle": dict(toggle=True),
    "sd_toggle_auto": dict(toggle=True, k="auto"),
    "sd_toggle_ladder": dict(toggle=True, k="ladder"),
}


def make_drafter(name: str, rc, policy):
    dc = copy.deepcopy(rc.drafter)
    if name.startswith("selfquant"):
        dc.kind, dc.path, dc.selfquant.quant, dc.selfquant.backend = "selfquant", None, name.split("_")[1], "ao"
    elif name != rc.drafter.kind:  # another kind at its defaults (suffix: nothing to load)
        dc.kind, dc.path = name, None
    return build_drafter(dc, policy)


def engine_for(rc, policy, drafter, k, **over):
    ec = copy.deepcopy(rc.engine)
    ec.k, ec.toggle = k, False
    for key, v in over.items():
        setattr(ec, key, v)
    return build_engine(ec, policy, drafter)


def interleaved(engines: dict, prompts, params, repeats: int, shift: int = 0) -> dict:
    """engines: key -> (engine, speculative). Every engine runs the repeat's prompts (`prompts`, or prompts(rep) if it
    is a function) once per repeat (params(rep)), the engines taking turns, so a slow spell of the machine hits them
    all alike, in the order run_order(rep + shift). Returns key -> [RolloutBatch]."""
    runs = {key: [] for key in engines}
    for rep in range(repeats):
        batch = prompts(rep) if callable(prompts) else prompts
        for key in run_order(list(engines), rep + shift):
            eng, spec = engines[key]
            runs[key].append(eng.generate(batch, params(rep), speculative=spec))
    return runs


def workload(tok, n: int, group: int, seed0: int, same: bool, pool: int = 0):
    """-> batch(seed): a GRPO batch of n problems x `group` samples, the problems drawn at `seed` (each RL step draws
    new ones), or with same=True always those drawn at seed0 (problems revisited, as in epochs over a dataset: what
    the suffix drafter, which drafts from earlier rollouts, thrives on). New problems by default because an RL run
    draws them: on revisited problems the suffix drafter's index holds earlier rollouts of the very problems it
    drafts, which it accepts far more of (bench/NOTES.md, Suffix).
    pool > 0: n of a fixed set of `pool` problems (drawn at seed0), sampled at `seed` without replacement, as an RL
    run over a dataset draws its steps' prompts (drafttrain/data.py): each comes back every ~pool/n batches."""
    fixed = make_prompts(pool, seed=seed0) if pool else None

    def batch(seed: int) -> list[list[int]]:
        if fixed is not None and not same:
            probs = random.Random(seed).sample(fixed, n)
        else:
            probs = make_prompts(n, seed=seed0 if same else seed)
        return [encode_prompt(tok, p.prompt) for p in probs for _ in range(group)]

    return batch


def run_order(keys: list, rep: int) -> list:
    """The engines' order in repeat `rep`: a permutation drawn from a generator seeded by rep, so that over the
    repeats each engine runs first, last and right after every other one about equally often. An order rotated by
    one per repeat keeps each engine's predecessor, and an engine's time moved with what ran before it
    (bench/NOTES.md, Embedded engine)."""
    keys = list(keys)
    random.Random(rep).shuffle(keys)
    return keys


def main(cfg) -> dict:
    torch.set_num_threads(cfg.threads)
    rc = load_recipe(cfg.recipe, list(cfg.overrides))
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    problems = workload(tok, cfg.prompts, cfg.group, cfg.seed, cfg.same_problems, cfg.pool)
    prompts = problems(cfg.seed)  # the sweep's pool
    params = SamplingParams(temperature=rc.sampling.temperature, max_new_tokens=cfg.max_new_tokens,
                            stop_token_ids=(tok.eos_token_id,), seed=cfg.seed)
    rows, traces, result = [], {}, {}
    engines = {}  # (drafter name or "-", mode) -> (engine, speculative)
    for dname in cfg.drafters:
        drafter = make_drafter(dname, rc, policy)
        for mode, over in MODES.items():
            if over is None and engines:
                continue  # AR does not depend on the drafter
            over = dict(over or {})
            eng = engine_for(rc, policy, drafter if over else None, over.pop("k", cfg.k), **over)
            # warm-up: a batch of the workload, as the previous RL step's rollouts would be (the controller's
            # acceptance estimates and measured step times carry over, as in a running job)
            eng.generate(problems(cfg.seed + 1), replace(params, seed=cfg.seed + 1), speculative=over is not None)
            engines[(dname if over else "-", mode)] = (eng, over is not None)
    # a seed per repeat, the same for every engine: SD is exact in distribution, not sample for sample, so with one
    # seed AR and SD would each time the same single draw of the batch, whose longest rows set the wall time
    all_runs = interleaved(engines, lambda rep: problems(cfg.seed + 1000 * rep),
                           lambda rep: replace(params, seed=cfg.seed + 1000 * rep), cfg.repeats)
    for (dname, mode), runs in all_runs.items():
        walls = [r.wall_s for r in runs]
        wall = statistics.fmean(walls)  # the expected rollout time of a batch
        lens = sorted(len(t) for r in runs for t in r.tokens)
        stats = runs[0].stats
        for r in runs[1:]:
            stats = stats.merge(r.stats)
        rows.append({"drafter": dname, "mode": mode, "wall_s": wall, "wall_s_median": statistics.median(walls),
                     "wall_s_runs": walls, "tokens_per_s": sum(r.num_tokens for r in runs) / sum(walls),
                     "mal": stats.mean_accepted_length,
                     "sd_steps": sum(t["on"] for r in runs for t in r.timeline.schedule) / len(runs),
                     "steps": sum(len(r.timeline.ends) for r in runs) / len(runs),
                     "len_p50": lens[len(lens) // 2], "len_max": lens[-1]})
        traces[(dname, mode)] = runs[-1].timeline.schedule
    ar = next(r for r in rows if r["mode"] == "ar")
    for r in rows:
        r["vs_ar"] = ar["wall_s"] / r["wall_s"]
    # the best drafter is the one SD does best with (SD-always wall time): picking by the toggle's own time would
    # pick, within noise, a drafter the toggle never uses (a self-drafter that never pays here) and test nothing
    fastest = min((r for r in rows if r["mode"] == "sd_always"), key=lambda r: r["wall_s"])["drafter"]
    best = next(r for r in rows if r["mode"] == "sd_toggle_auto" and r["drafter"] == fastest)
    ladder = next(r for r in rows if r["mode"] == "sd_toggle_ladder" and r["drafter"] == best["drafter"])

    # sweep: throughput at an active batch, best drafter. Real rollouts (stop token on: past its end of text the
    # policy writes junk no drafter predicts, which would misstate SD), so the batch shrinks as rows finish:
    # each B counts only the decode steps with at least 3/4 of B rows active (timeline.batch / timeline.tokens), over
    # max(sweep_min_batches, sweep_rows // B) batches of B prompts per repeat
    sweep = []
    drafter = make_drafter(best["drafter"], rc, policy)
    engines = {"ar": (engine_for(rc, policy, None, cfg.k), False), "sd": (engine_for(rc, policy, drafter, cfg.k), True),
               "toggle": (engine_for(rc, policy, drafter, cfg.k, toggle=True), True)}
    sp = replace(params, max_new_tokens=cfg.sweep_tokens)
    for B in cfg.sweep_batches:
        n_chunks = max(cfg.sweep_min_batches, cfg.sweep_rows // B)
        pool = prompts * ((n_chunks * B) // len(prompts) + 1)
        chunks = [pool[i * B:(i + 1) * B] for i in range(n_chunks)]
        interleaved(engines, chunks[0], lambda rep: replace(sp, max_new_tokens=16, seed=cfg.seed + 1), 1)  # warm-up
        tps = {name: [] for name in engines}
        on = []
        for rep in range(cfg.sweep_repeats):
            tot = {name: [0, 0.0] for name in engines}
            for c, chunk in enumerate(chunks):
                runs = interleaved(engines, chunk, lambda r: replace(sp, seed=cfg.seed + 2 + 97 * rep + c), 1,
                                   shift=rep * len(chunks) + c)
                for name, (b,) in runs.items():
                    n, t = at_batch(b, B)
                    tot[name][0] += n
                    tot[name][1] += t
                    if name == "toggle":  # the very steps at_batch times (the first, a probe, is not one)
                        on += [b.timeline.schedule[i]["on"] for i in counted_steps(b, B)]
            for name, (n, t) in tot.items():
                tps[name].append(n / max(t, 1e-9))
        row = {"batch": B, **{f"{name}_tps": statistics.median(v) for name, v in tps.items()}}
        # paired: each repeat's engines ran the same chunks in turns, so the ratio within a repeat leaves out the
        # machine's drift between repeats (with fixed k and SD on in every step, toggle and SD-always decode the
        # very same tokens, and the ratio of the medians still moved 0.95-1.03 at B = 4-8 from run to run)
        row["toggle_over_best"] = statistics.median(
            t / max(a, s) for t, a, s in zip(tps["toggle"], tps["ar"], tps["sd"]))
        row["toggle_over_best_of_medians"] = row["toggle_tps"] / max(row["ar_tps"], row["sd_tps"])
        row["toggle_sd_steps_pct"] = 100 * sum(on) / max(len(on), 1)  # decode steps the toggle ran SD in
        sweep.append(row)
        print(format_table([row], list(row)))

    ceil = statistics.fmean(ceiling_wall(b, sweep) for b in all_runs[("-", "ar")])
    result = {"ar_wall_s": ar["wall_s"], "toggle_auto_wall_s": best["wall_s"], "ladder_wall_s": ladder["wall_s"],
              "best_drafter": best["drafter"], "toggle_auto_vs_ar_pct": 100 * (1 - best["wall_s"] / ar["wall_s"]),
              "ceiling_wall_s": ceil, "ceiling_vs_ar_pct": 100 * (1 - ceil / ar["wall_s"]),
              "rows": rows, "sweep": sweep, "config": OmegaConf.to_container(cfg),
              "trace": traces[(best["drafter"], "sd_toggle_auto")]}
    if "auto" in cfg.drafters:  # the chooser's decisions (drafter.kind=auto): the kind each step drafted with
        result["auto_trace"] = traces[("auto", "sd_toggle_auto")]
    print(format_table(rows, ["drafter", "mode", "wall_s", "vs_ar", "tokens_per_s", "mal", "sd_steps", "steps"]))
    print(format_table(sweep, ["batch", "ar_tps", "sd_tps", "toggle_tps", "toggle_over_best"]))
    print(f"toggle + auto k ({best['drafter']}): {result['toggle_auto_vs_ar_pct']:.1f}% below AR wall time; "
          f"ladder {ladder['wall_s']:.2f}s vs auto {best['wall_s']:.2f}s; ceiling at the sweep's speeds "
          f"{result['ceiling_vs_ar_pct']:.1f}% below AR")
    png = plot_trace(result.get("auto_trace", result["trace"]), str(cfg.out).replace(".json", "_trace.png"))
    print(f"wrote {write_json(result, cfg.out)} and {png}")
    return result


def ceiling_wall(ar_run, sweep: list[dict]) -> float:
    """What a perfect toggle at the sweep's k would take for AR rollout `ar_run`: its prefill and first step as they
    were, every later decode step at the best of AR and SD-always at its active batch (the sweep's batch nearest in
    log scale), i.e. divided by max(1, sd_tps / ar_tps) there. Not a bound over k, nor over noise: a yardstick for
    the toggle's own time."""
    gain = {r["batch"]: max(1.0, r["sd_tps"] / r["ar_tps"]) for r in sweep}

    def at(B: int) -> float:
        return gain[min(gain, key=lambda s: abs(math.log(s) - math.log(B)))]

    e = ar_run.timeline.ends
    steps = [(ar_run.timeline.batch[i], e[i] - e[i - 1]) for i in range(1, len(e))]
    return ar_run.wall_s - sum(dt for _, dt in steps) + sum(dt / at(B) for B, dt in steps)


def counted_steps(b, B: int) -> list[int]:
    """Indices of rollout b's decode steps that ran at least 3/4 of B rows, the first step left out: a step's time
    is from the end of the one before, and the first follows the prefill."""
    return [i for i in range(1, len(b.timeline.ends)) if 4 * b.timeline.batch[i] >= 3 * B]


def at_batch(b, B: int) -> tuple[int, float]:
    """(tokens, seconds) of rollout b's counted_steps."""
    steps = counted_steps(b, B)
    return sum(b.timeline.tokens[i] for i in steps), sum(b.timeline.ends[i] - b.timeline.ends[i - 1] for i in steps)


def plot_trace(trace: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(len(trace)))
    kinds = sorted({t["kind"] for t in trace if "kind" in t})  # drafter.kind=auto: the chooser's pick per step
    fig, ax = plt.subplots(3 + bool(kinds), 1, figsize=(10, 6 + 2 * bool(kinds)), sharex=True)
    ax[0].plot(steps, [t["batch"] for t in trace])
    ax[0].set(ylabel="active batch", title="SD decision trace (toggle + auto k)")
    ax[1].step(steps, [int(t["on"]) for t in trace], where="post")
    ax[1].set(ylabel="SD on")
    ax[2].step(steps, [t["k"] for t in trace], where="post")
    ax[2].set(ylabel="k", xlabel="" if kinds else "decode step")
    if kinds:
        ax[3].scatter(steps, [kinds.index(t["kind"]) for t in trace], s=8)
        ax[3].set(yticks=range(len(kinds)), yticklabels=kinds, ylabel="chooser", xlabel="decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main(script_config(DEFAULTS))
