"""Project drafttrain to 8B / 70B / 235B-A22B on H100 / H200 / B200 with a roofline simulator, and reproduce the
papers' headline numbers with it (drafttrain/simulate.py holds the cost model).

    python scripts/simulate.py                                    # bench/simulate.json + bench/simulate.png
    python scripts/simulate.py gpus=[H100,B200] live_acceptance=[0.8,0.7,0.6] frozen_acceptance=[0.6,0.5,0.4]

Inputs: measured traces from bench/ (tracking: per-position teacher-forced acceptance of the live and the frozen
EAGLE-3 drafter at each RL step, and response lengths (mean, p90) -> the lognormal sigma of the long tail;
longtail: p50 / max lengths if the tracking file has none; selfquant: the int8 / int4 self-drafters' acceptance;
drafters: the MTP head's and the draft model's live and frozen acceptance per position at the end of their default
runs, the suffix drafter's MAL as a flat curve).
Any curve can be given instead (a list per position; the last value repeats past its end).
Projection, per model and GPU (the model's acceptance taken as the tiny policy's, position by position): AR;
EAGLE-3 frozen and tracking (fixed k; tracking pays the drafter budget); tracking + toggle + auto k; the int8 / int4
self-drafters with toggle + auto k (requantized every step); the MTP head and the draft model frozen (fixed k) and
tracking with toggle + auto k (their end-of-run acceptance at every step: no per-step trace), the suffix drafter with
toggle + auto k; the chooser (fastest drafter per stretch of active batch, every drafter it holds in HBM) over the
light drafters (EAGLE-3, MTP, draft model, suffix), and over them and the self-drafters (chooser_with_self). Each is
averaged over the tracking run's steps (the drift), with sync and async steps; a setting whose weights leave no room
for a KV cache is listed with fits=false.
Reproduction: NeMo-RL at 8B (sync rollout throughput, EAGLE-3) and at 235B (end to end, async SD against sync AR);
EfficientRollout (W4 self-drafter, toggle, ladder). The settings (NEMO, EFFICIENTROLLOUT, SHARED below; `assumptions`
in the JSON) take what the papers and EfficientRollout's code release state, and assume the rest: for NeMo-RL the
DAPO batch, mean response 4096 of max 20480, 2048 GPUs at tp 8 for 235B, a flat acceptance giving its length 2.47
at k=3; for EfficientRollout prompt 256 and mean response 1024 tokens; for both, a lognormal long tail of sigma 0.53
(paper_length_sigma=; null takes the sigma measured here) and NeMo-RL's measured 8B rollout share (100 s of a
151.2 s step) for the time outside the rollout.
Writes bench/simulate.json (the PNG's path in `plot`) and bench/simulate.png (git-ignored), prints both tables.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import fields
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from drafttrain.config import ConfigError, resolve_path, script_config
from drafttrain.report import format_table, write_json
from drafttrain.simulate import GPUS, MODELS, Mode, Replica, Workload, rl_step, sigma_from_mean_p90, uniform_curve

DEFAULTS = dict(
    tracking="bench/tracking.json", longtail="bench/longtail.json", selfquant="bench/selfquant.json",
    drafters="bench/drafters.json",
    live_acceptance=None, frozen_acceptance=None, int8_acceptance=None, int4_acceptance=None, length_sigma=None,
    # the papers' long tail: a stated lognormal sigma (0.53, this repository's tail at 20637e5), fixed so the paper rows
    # do not move with the tiny world's traces; null = the measured sigma, as the projection uses
    paper_length_sigma=0.53,
    gpus=["H100", "H200", "B200"], k=5, k_max=8, drafter_budget=0.05, train_mfu=0.35,
    # projection workload (shared by every model): prompts x group rows, lengths, GPUs and tensor parallelism per model
    prompts=512, group=16, prompt_len=256, mean_len=4096, max_len=20480,
    cluster={"8b": [64, 1], "70b": [256, 4], "235b_a22b": [1024, 8]},
    out="bench/simulate.json", plot="bench/simulate.png", tolerance=0.25)


def _read(path: str, what: str) -> dict:
    """A bench JSON object; {} when the file is absent (the caller says what it then lacks)."""
    p = resolve_path(path)
    if not Path(p).exists():
        return {}
    try:
        obj = json.loads(Path(p).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}={path}: unreadable JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{what}={path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _is_curve(values) -> bool:
    return isinstance(values, list) and bool(values) and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1 for a in values)


def _curve(values, name: str, k_max: int) -> list[float]:
    values = OmegaConf.to_container(values) if isinstance(values, ListConfig) else values
    if not _is_curve(values):
        raise ConfigError(f"{name}: expected a list of acceptance rates in [0, 1], got {values!r}")
    return [float(a) for a in values] + [float(values[-1])] * max(0, k_max - len(values))


def load_inputs(cfg) -> dict:
    """The acceptance curves per RL step (live, frozen), the self-drafters' curves and the length sigma."""
    km, used = cfg.k_max, []
    tr = _read(cfg.tracking, "tracking")
    series = tr.get("series") or []
    if isinstance(series, dict):  # bench_tracking writes one series per seed: {seed: [records]}
        series = [rec for recs in series.values() if isinstance(recs, list) for rec in recs]
    series = [s for s in series if isinstance(s, dict)]
    ok = [s for s in series if _is_curve(s.get("live_tf_acc_pos")) and _is_curve(s.get("frozen_tf_acc_pos"))]
    live, frozen = [s["live_tf_acc_pos"] for s in ok], [s["frozen_tf_acc_pos"] for s in ok]
    if cfg.live_acceptance is not None or cfg.frozen_acceptance is not None:
        if cfg.live_acceptance is None or cfg.frozen_acceptance is None:
            raise ConfigError("live_acceptance / frozen_acceptance: give both curves, or neither")
        live, frozen = [cfg.live_acceptance], [cfg.frozen_acceptance]
    elif live:
        used.append(cfg.tracking)
    else:
        raise ConfigError(f"tracking={cfg.tracking}: missing, or no series with live_tf_acc_pos and frozen_tf_acc_pos "
                          "(run scripts/bench_tracking.py, or give live_acceptance= and frozen_acceptance=)")
    steps = [(_curve(a, "live_acceptance", km), _curve(b, "frozen_acceptance", km)) for a, b in zip(live, frozen)]
    self_acc = {}
    sq = _read(cfg.selfquant, "selfquant")
    for kind in ("int8", "int4"):
        given = cfg.get(f"{kind}_acceptance")
        rows = [r.get("acceptance_per_position") for r in sq.get("mal") or [] if isinstance(r, dict)
                and str(r.get("variant", "")).startswith(kind + "/") and _is_curve(r.get("acceptance_per_position"))]
        if given is not None:
            self_acc[kind] = _curve(given, f"{kind}_acceptance", km)
        elif rows:
            self_acc[kind] = _curve(rows[0], f"{cfg.selfquant} {kind}", km)
    if self_acc and cfg.int8_acceptance is None and cfg.int4_acceptance is None:
        used.append(cfg.selfquant)
    kinds = drafter_kinds(_read(cfg.drafters, "drafters"), km)
    if kinds:
        used.append(cfg.drafters)
    sigma = cfg.length_sigma
    if sigma is None:
        pairs = [(s["resp_len_mean"], s["resp_len_p90"]) for s in series
                 if _positive(s.get("resp_len_mean")) and _positive(s.get("resp_len_p90"))]
        lt = _read(cfg.longtail, "longtail")
        ar = [r for r in lt.get("rows") or [] if isinstance(r, dict) and r.get("mode") == "ar"
              and _positive(r.get("len_p50")) and _positive(r.get("len_max"))]
        if pairs:
            sigma = statistics.median(sigma_from_mean_p90(m, p) for m, p in pairs)
            used.append(cfg.tracking)
        elif ar:  # the longest of n rows sits near the 1 - 1/(2n) quantile
            n = (lt.get("config") or {}).get("prompts", 16) * (lt.get("config") or {}).get("group", 4)
            sigma = math.log(ar[0]["len_max"] / ar[0]["len_p50"]) / statistics.NormalDist().inv_cdf(1 - 0.5 / n)
            used.append(cfg.longtail)
        else:
            raise ConfigError(f"tracking={cfg.tracking} / longtail={cfg.longtail}: no response lengths "
                              "(give length_sigma=)")
    return {"steps": steps, "self": self_acc, "kinds": kinds, "sigma": float(sigma), "read": sorted(set(used))}


def drafter_kinds(dr: dict, km: int) -> dict[str, tuple[list[float], list[float]]]:
    """{kind: (live curve, frozen curve)} of the MTP head and the draft model (their tracking runs' live and frozen
    teacher-forced acceptance per position over the default run's last quarter; or, where only the mean lengths
    are given, the flat curves giving them at the run's k), and of the suffix drafter (the flat curve of its MAL at
    k=4 on fresh rollouts; nothing to freeze: both curves the same)."""
    from drafttrain.config import load_recipe

    out = {}
    for t in dr.get("tracking") or []:
        kind = t.get("kind") if isinstance(t, dict) else None
        if kind not in ("mtp", "draft_model"):
            continue
        if _is_curve(t.get("live_tf_acc_pos")) and _is_curve(t.get("frozen_tf_acc_pos")):  # measured per position
            out[kind] = (_curve(t["live_tf_acc_pos"], kind, km), _curve(t["frozen_tf_acc_pos"], kind, km))
        elif _positive(t.get("live_tf_mal")) and _positive(t.get("frozen_tf_mal")):
            k = t.get("k") or load_recipe(f"{kind}_track").engine.k
            out[kind] = (uniform_curve(t["live_tf_mal"], k, km), uniform_curve(t["frozen_tf_mal"], k, km))
    for r in dr.get("kinds") or []:
        if isinstance(r, dict) and r.get("kind") == "suffix" and _positive(r.get("mal_k4")):
            c = uniform_curve(r["mal_k4"], 4, km)
            out["suffix"] = (c, c)
    return out


# Where the papers say too little, these are assumed; each is stated once and shared by the rows it applies to.
SHARED = dict(rollout_share_of_sync_step=100.0 / 151.2, note=(
    "the non-rollout part of a sync AR step (log-probs, training, sync) is NeMo-RL's measured 8B share, generation "
    "100 s of 151.2 s, for every paper row (the roofline prices rollouts only); response lengths are lognormal with "
    "a stated sigma (paper_length_sigma: 0.53, this repository's measured tail at 20637e5)"))
NEMO = dict(gpu="GB200", prompts=512, group=16, prompt_len=256, mean_len=4096, max_len=20480, k=3,
            acceptance_length=2.47, note=(
                "GB200 as reported (32 GPUs at 8B, 2048 at 235B with tp 8 assumed); the DAPO batch (512 prompts x 16, "
                "max response 20480) with mean response 4096 assumed; EAGLE-3 at k=3 (its stable draft length) with "
                "a flat acceptance giving length 2.47, the higher of the two it reports, taken for RL-Zero (the 1.8x "
                "workload) and kept at 235B"))
EFFICIENTROLLOUT = dict(
    gpu="A100", n_gpus=8, prompts=128, group=8, prompt_len=256, mean_len=1024, max_len=8192, mem_util=0.6,
    ladder=[5, 7, 9, 11], threshold=1.05, acceptance_length=6.7, acceptance_k=7,
    replica=dict(mbu=1.566 / 2.039, mfu=233.5 / 312, overhead_s=0.0, sd_overhead_s=0.0,
                 row_s=[74e-6, 86.1e-6, 214.2e-6]),
    note=("its code release: 8 x A100-80GB, tp 1, 128 prompts x 8, max response 8192, vLLM memory share 0.6, RTN W4 "
          "self-drafter sharing the policy's KV cache, toggle at 1.05, k ladder 5/7/9/11, and its A100 calibration "
          "for Llama-3.1-8B (77% of peak bandwidth, 75% of peak FLOPs, 74 / 86 / 214 us per row for decode / draft "
          "/ verify, no fixed cost); assumed: prompt 256 and mean response 1024 tokens, and a flat acceptance giving "
          "the length 6.7 at k=7 its release quotes"))


def reproduce(inp: dict, cfg) -> tuple[list[dict], dict]:
    """The four paper numbers, each from its stated setting (NEMO, EFFICIENTROLLOUT, SHARED)."""
    sigma, km = inp["sigma"] if cfg.paper_length_sigma is None else float(cfg.paper_length_sigma), max(cfg.k_max, 12)

    def run(rep: Replica, wl: Workload, mode: Mode, requant=()) -> tuple[dict, dict]:
        ar, sd = rl_step(rep, wl, Mode({}), sigma), rl_step(rep, wl, mode, sigma, requant=requant)
        rest = ar["rollout_s"] * (1 / SHARED["rollout_share_of_sync_step"] - 1)  # non-rollout time, measured share
        extra = sd["sync_s"] - ar["sync_s"]  # a self-drafter's requantize
        return ({"rollout": ar["rollout_s"], "sync": ar["rollout_s"] + rest, "concurrency": ar["concurrency"]},
                {"rollout": sd["rollout_s"], "sync": sd["rollout_s"] + rest + extra,
                 "async": max(sd["rollout_s"], rest) + extra, "concurrency": sd["concurrency"]})

    n = NEMO
    eagle = Mode({"eagle3": uniform_curve(n["acceptance_length"], n["k"], km)}, k=n["k"], k_max=km)
    nemo = {}
    for name, n_gpus, tp in (("8b", 32, 1), ("235b_a22b", 2048, 8)):
        wl = Workload(n_gpus, n["prompts"], n["group"], n["prompt_len"], n["mean_len"], n["max_len"])
        nemo[name] = run(Replica(MODELS[name], GPUS[n["gpu"]], tp=tp), wl, eagle)
    e = EFFICIENTROLLOUT
    rep = Replica(MODELS["8b"], GPUS[e["gpu"]], **{**e["replica"], "row_s": tuple(e["replica"]["row_s"])})
    wl = Workload(e["n_gpus"], e["prompts"], e["group"], e["prompt_len"], e["mean_len"], e["max_len"],
                  mem_util=e["mem_util"])
    w4 = Mode({"int4": uniform_curve(e["acceptance_length"], e["acceptance_k"], km)}, k="ladder", toggle=True,
              k_max=km, threshold=e["threshold"], shared_kv=True, ladder=tuple(e["ladder"]))
    ar_e, sd_e = run(rep, wl, w4, requant=("int4",))
    (ar8, sd8), (ar235, sd235) = nemo["8b"], nemo["235b_a22b"]
    rows = [("NeMo-RL", "rollout throughput, 8B, sync (x)", 1.8, ar8["rollout"] / sd8["rollout"]),
            ("NeMo-RL", "end to end, 235B, async SD vs sync AR (x)", 2.5, ar235["sync"] / sd235["async"]),
            ("EfficientRollout", "rollout latency reduction (%)", 19.6, 100 * (1 - sd_e["rollout"] / ar_e["rollout"])),
            ("EfficientRollout", "end-to-end latency reduction (%)", 12.7, 100 * (1 - sd_e["sync"] / ar_e["sync"]))]
    checks = {"nemo_rl_8b AR generation s (paper: 100.0)": round(ar8["rollout"], 1),
              "rows at once (AR / SD): nemo_rl_8b, nemo_rl_235b, efficientrollout":
              [[ar8["concurrency"], sd8["concurrency"]], [ar235["concurrency"], sd235["concurrency"]],
               [ar_e["concurrency"], sd_e["concurrency"]]]}
    assumptions = {"shared": SHARED, "nemo_rl": NEMO, "efficientrollout": EFFICIENTROLLOUT, "length_sigma": sigma,
                   "replica (NeMo-RL rows and projection)": {f.name: f.default for f in fields(Replica)
                                                             if f.name not in ("model", "gpu", "tp")},
                   "checks": checks}
    return [{"paper": p_, "metric": m, "paper_value": v, "simulated": round(s_, 3),
             "within_25pct": abs(s_ - v) <= cfg.tolerance * v} for p_, m, v, s_ in rows], assumptions


def settings(inp: dict, cfg, live: list[float], frozen: list[float]):
    """(name, mode, drafter budget, self-drafters requantized every step) of each projected setting."""
    auto = dict(k="auto", toggle=True, k_max=cfg.k_max)
    yield "ar", Mode({}), 0.0, ()
    yield "eagle3_frozen", Mode({"eagle3": frozen}, k=cfg.k), 0.0, ()
    yield "eagle3_tracking", Mode({"eagle3": live}, k=cfg.k), cfg.drafter_budget, ()
    yield "eagle3_tracking_toggle", Mode({"eagle3": live}, **auto), cfg.drafter_budget, ()
    for kind, acc in inp["self"].items():
        yield f"selfquant_{kind}_toggle", Mode({kind: acc}, **auto), 0.0, (kind,)
    for kind, (live_k, frozen_k) in inp["kinds"].items():
        if kind == "suffix":
            yield "suffix_toggle", Mode({kind: live_k}, **auto), 0.0, ()
            continue
        yield f"{kind}_frozen", Mode({kind: frozen_k}, k=cfg.k), 0.0, ()
        yield f"{kind}_tracking_toggle", Mode({kind: live_k}, **auto), cfg.drafter_budget, ()
    light = {"eagle3": live, **{kind: c[0] for kind, c in inp["kinds"].items()}}  # a layer or two each, or nothing
    yield "chooser", Mode(light, **auto), cfg.drafter_budget, ()
    if inp["self"]:  # the self-drafters too: each a policy copy and a KV cache of its own in HBM
        yield "chooser_with_self", Mode({**light, **inp["self"]}, **auto), cfg.drafter_budget, tuple(inp["self"])


def project(inp: dict, cfg) -> list[dict]:
    """One row per model, GPU and setting, averaged over the tracking run's steps (each step's acceptance). A setting
    whose weights leave no room for a KV cache on its replica is a row with `fits` false and no times."""
    rows = []
    for gpu in cfg.gpus:
        if gpu not in GPUS:
            raise ConfigError(f"gpus: unknown GPU {gpu!r} (one of {sorted(GPUS)})")
        for name, model in MODELS.items():
            if name not in cfg.cluster:
                raise ConfigError(f"cluster: no [n_gpus, tp] for model {name!r}")
            n_gpus, tp = cfg.cluster[name]
            rep = Replica(model, GPUS[gpu], tp=tp)
            wl = Workload(n_gpus, cfg.prompts, cfg.group, cfg.prompt_len, cfg.mean_len, cfg.max_len,
                          train_mfu=cfg.train_mfu)
            acc = {}
            for live, frozen in inp["steps"]:
                for setting, mode, budget, rq in settings(inp, cfg, live, frozen):
                    try:
                        r = rl_step(rep, wl, mode, inp["sigma"], drafter_budget=budget, requant=rq)
                    except ValueError:
                        r = None
                    acc.setdefault(setting, []).append(r)
            mean = {st: None if None in rs else {key: statistics.fmean(r[key] for r in rs) for key in rs[0]}
                    for st, rs in acc.items()}
            base = mean["ar"]
            for setting, m in mean.items():
                row = {"model": name, "gpu": gpu, "n_gpus": n_gpus, "tp": tp, "setting": setting,
                       "rows_per_replica": wl.rows_per_replica(tp), "fits": m is not None}
                if m is not None and base is not None:
                    row.update({key: m[key] for key in ("concurrency", "rollout_s", "sd_share", "train_s",
                                                        "step_sync_s", "step_async_s")})
                    row.update({"rollout_speedup": base["rollout_s"] / m["rollout_s"],
                                "e2e_sync_speedup": base["step_sync_s"] / m["step_sync_s"],
                                "e2e_async_speedup": base["step_async_s"] / m["step_async_s"]})
                rows.append(row)
    return rows


def plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    fig, axes = plt.subplots(1, len(gpus), figsize=(6 * len(gpus), 4.5), squeeze=False)
    for ax, gpu in zip(axes[0], gpus):
        sub = [r for r in rows if r["gpu"] == gpu and r["setting"] != "ar"]
        models = list(dict.fromkeys(r["model"] for r in sub))
        settings = list(dict.fromkeys(r["setting"] for r in sub))
        w = 0.8 / len(settings)
        for j, s in enumerate(settings):
            ys = [next(r.get("e2e_sync_speedup") or 0.0 for r in sub if r["model"] == m and r["setting"] == s)
                  for m in models]
            ax.bar([i + j * w for i in range(len(models))], ys, w, label=s)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(models))], models)
        ax.set_ylabel("end-to-end speed-up over AR (sync)")
        ax.set_title(f"drafttrain projected on {gpu}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(resolve_path(path), dpi=110)
    plt.close(fig)
    return path


def main(cfg) -> dict:
    inp = load_inputs(cfg)
    repro, assumptions = reproduce(inp, cfg)
    proj = project(inp, cfg)
    assumptions["projection"] = {"workload": {k: cfg[k] for k in ("prompts", "group", "prompt_len", "mean_len",
                                                                   "max_len", "k", "k_max", "drafter_budget",
                                                                   "train_mfu")},
                                 "cluster [n_gpus, tp]": OmegaConf.to_container(cfg.cluster),
                                 "acceptance": "the tiny policy's measured curves, per position, at every size"}
    out = {"reproduction": repro, "projection": proj, "assumptions": assumptions,
           "inputs": {"read": inp["read"], "length_sigma": inp["sigma"], "rl_steps": len(inp["steps"])},
           "plot": plot(proj, cfg.plot) if cfg.plot else None}
    print(format_table(repro, ["paper", "metric", "paper_value", "simulated", "within_25pct"]))
    print()
    print(format_table(proj, ["model", "gpu", "setting", "concurrency", "rollout_s", "sd_share", "rollout_speedup",
                              "step_sync_s", "e2e_sync_speedup", "step_async_s", "e2e_async_speedup"]))
    write_json(out, resolve_path(cfg.out))
    return out


if __name__ == "__main__":
    try:
        main(script_config(DEFAULTS))
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
