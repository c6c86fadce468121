"""What shape of RL step makes rollouts dominate on this CPU, and what SD can then buy end to end (issue 46)?

1. Measures, on the shipped policy and drafter: the embedded engine's decode step (AR, and SD at the recipe's k) by
   active batch, from the timeline of rows that never stop; and the policy update's cost per token (GRPO.train_step
   on a recipe-sized batch, every row with an advantage, and as the rewards of the SFT policy leave it).
2. Projects candidate response-length shapes through those costs, per seed (a fresh draw of a batch's lengths):
   the AR rollout wall (one decode step per token, the active batch shrinking as rows end), the share of it spent
   while only the longest-running 10% of rows run (tail10), the AR step's rollout share, and the end-to-end ratio
   of a step whose SD rollouts run at MAL tokens per SD step where the batch is at most `sd_below` rows (the toggle)
   and at AR elsewhere, with the drafter's work at 5% of the step.
A shape is `grouped` when its length is drawn per prompt (a GRPO group of G samples shares it) and per sample
otherwise. Rough by design: step times at a batch are interpolated; prefill and sampling extras are ignored.

    python bench/probes/step_shape.py [seeds=5] [measure=true] [mal=4.5] [sd_below=16] [train_ms=null]
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from drafttrain.config import load_recipe, sampling_params, script_config
from drafttrain.data import Prompts, stop_ids
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy
from drafttrain.rl.grpo import GRPO

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def measure(threads: int = 2) -> tuple[dict, dict, float, float]:
    """(AR ms per step by batch, SD ms per step by batch, train ms per token all rows, as the SFT policy's rewards)."""
    torch.set_num_threads(threads)
    cfg = load_recipe("eagle3_track", ["rl.eval_prompts=0"])
    policy, tok = load_policy("checkpoints/policy", "torch")
    engine = build_engine(cfg.engine, policy, build_drafter(cfg.drafter, policy))
    prompts = Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))
    out = {}
    for spec in (False, True):
        for b in BATCHES:
            rows = [prompts.encode(r) for r in prompts.rows(b, seed=7)]
            params = sampling_params(cfg.sampling, stop_token_ids=(), seed=1, max_new_tokens=48)
            engine.generate(rows, params, speculative=spec)  # warm-up
            best = []
            for _ in range(3):
                e = engine.generate(rows, params, speculative=spec).timeline.ends
                best.append((e[-1] - e[0]) / (len(e) - 1) * 1e3)
            out[(spec, b)] = min(best)
    grpo = GRPO.from_config(cfg, policy, tok, engine, None)
    ro = grpo.rollout(0)
    ntok = sum(len(p) + len(r) for p, r in zip(ro.prompts, ro.responses))
    natural = _timed(grpo, ro) / ntok * 1e3
    ro.rewards = [float(i % 2) for i in range(len(ro.rewards))]  # every row with an advantage
    full = _timed(grpo, ro) / ntok * 1e3
    return ({b: out[(False, b)] for b in BATCHES}, {b: out[(True, b)] for b in BATCHES}, full, natural)


def _timed(grpo, ro, repeats: int = 2) -> float:
    grpo.opt.step = lambda: None  # the cost, not the update
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        grpo.train_step(ro)
        best = min(best, time.perf_counter() - t)
    return best


def interp(costs: dict, b: float) -> float:
    ks = sorted(costs)
    if b <= ks[0]:
        return costs[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if b <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (b - lo) / (hi - lo)
    return costs[ks[-1]] * b / ks[-1]


def rollout(lens: list[int], ar: dict, sd: dict | None = None, mal: float = 1.0, sd_below: int = 0):
    """(wall ms, tail10 ms) of a batch whose rows end at `lens` tokens."""
    lens, n = sorted(lens), len(lens)
    t90 = lens[int(0.9 * n) - 1]
    wall = tail = pos = 0.0
    i = 0
    while i < n:
        b = n - i
        on = sd is not None and b <= sd_below
        c = interp(sd if on else ar, b)
        wall, pos = wall + c, pos + (mal if on else 1.0)
        tail += c if pos > t90 else 0.0
        while i < n and lens[i] <= pos:
            i += 1
    return wall, tail


def geometric(p: float, cap: int):
    def draw(rng):
        n = 1
        while n < cap and rng.random() < p:
            n += 1
        return n
    return draw


def shapes() -> dict:
    """name -> (draw lengths of one batch: rng -> list[int]). Tokens per step 5 (the shipped format) or 6."""
    def grouped(nd, per=5, P=16, G=8):
        return lambda rng: [per * n + 5 for n in (nd(rng) for _ in range(P)) for _ in range(G)]

    def per_sample(nd, per=5, rows=128):
        return lambda rng: [per * nd(rng) + 5 for _ in range(rows)]

    def mixture(p_long, lo, hi):
        short = geometric(0.7, 16)
        return lambda rng: rng.randint(lo, hi) if rng.random() < p_long else short(rng)

    def pareto(alpha, cap):
        return lambda rng: min(cap, int(rng.paretovariate(alpha)))

    def passes(c, pmax, per=5):  # a group's n, each sample re-derives the chain a geometric number of times
        n_d = geometric(0.7, 16)

        def draw(rng):
            out = []
            for _ in range(16):
                n = n_d(rng)
                for _ in range(8):
                    k = 1
                    while k < pmax and rng.random() < c:
                        k += 1
                    out.append(k * (per * n + 1) + 4)
            return out
        return draw

    return {
        "shipped: n ~ 1+Geo(0.7) <= 16, grouped": grouped(geometric(0.7, 16)),
        "grouped: 1/16 of prompts n ~ U[40,99], 6 tok/step": grouped(mixture(1 / 16, 40, 99), per=6),
        "grouped: G=4 x 32 prompts, 1/16 long": grouped(mixture(1 / 16, 40, 99), per=6, P=32, G=4),
        "grouped: re-derivation passes ~ Geo(0.6) <= 10": passes(0.6, 10),
        "per sample: 3% n ~ U[60,99], 6 tok/step": per_sample(mixture(0.03, 60, 99), per=6),
        "per sample: n ~ Pareto(1.2) <= 99, 6 tok/step": per_sample(pareto(1.2, 99), per=6),
        "per sample, 64 rows: 3% n ~ U[60,99]": per_sample(mixture(0.03, 60, 99), per=6, rows=64),
    }


def main(cfg) -> None:
    if cfg.measure:
        ar, sd, full, natural = measure()
        print("AR ms/step by batch:", {b: round(v, 2) for b, v in ar.items()})
        print("SD ms/step by batch (k=5):", {b: round(v, 2) for b, v in sd.items()})
        print(f"policy update ms/token: every row with an advantage {full:.3f}, the SFT policy's rewards {natural:.3f}")
    else:  # a 2-core AMD EPYC (AVX-512), session 33
        ar = {1: 2.12, 2: 2.6, 4: 2.76, 8: 3.28, 16: 4.18, 32: 8.56, 64: 9.01, 128: 15.29}
        sd = {1: 5.0, 2: 6.48, 4: 7.66, 8: 10.1, 16: 12.69, 32: 17.63, 64: 29.33, 128: 49.5}
        full, natural = 0.290, 0.156
    train_ms = cfg.train_ms or (full + natural) / 2
    print(f"projection: train {train_ms:.3f} ms/token, SD at MAL {cfg.mal} where the batch is <= {cfg.sd_below}")
    print(f"{'shape':52s} {'rollout share':>14s} {'tail10':>7s} {'SD rollout':>11s} {'e2e (sd)':>12s}")
    for name, draw in shapes().items():
        rows = []
        for s in range(cfg.seeds):
            lens = draw(random.Random(s))
            wall, tail = rollout(lens, ar)
            wall_sd, _ = rollout(lens, ar, sd, cfg.mal, cfg.sd_below)
            train = train_ms * sum(n + 9 for n in lens)
            rows.append((wall / (wall + train), tail / wall, wall / wall_sd, (wall + train) / (wall_sd + 1.05 * train)))
        m = [statistics.fmean(r[i] for r in rows) for i in range(4)]
        e2e_sd = statistics.stdev(r[3] for r in rows) if len(rows) > 1 else 0.0
        print(f"{name:52s} {m[0]:14.2f} {m[1]:7.2f} {m[2]:10.2f}x {m[3]:7.2f}x ({e2e_sd:.2f})")


if __name__ == "__main__":
    main(script_config(dict(seeds=5, measure=True, mal=4.5, sd_below=16, train_ms=None)))
