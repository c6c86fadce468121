"""Does my drafter go stale? Score one drafter on rollouts of each policy checkpoint of an RL run (any RL stack).

    python -m drafttrain.staleness --drafter checkpoints/eagle3 runs/eagle3_track --out staleness
    python -m drafttrain.staleness --drafter DRAFTER ckpt_a ckpt_b ... [--data prompts.jsonl] [--catch-up 60]

CHECKPOINT: Hugging Face policy folders, or a drafttrain run folder (its step-0 policy, then each ckpt/step-N/policy).
For each, fresh rollouts of that policy (temperature 1, the same prompts: data.path's, or the shipped task's) and the
drafter's teacher-forced acceptance per position and MAL on them (tracking/acceptance.py: what the engine's SD would
count, in expectation). --catch-up S also trains a copy of the drafter S seconds on that policy's other rollouts and
scores it again: what a short retraining recovers. Writes OUT.json, OUT.png (MAL against checkpoint) and prints a
table. Uses no RL code: only the policy folders are read.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from drafttrain.config import Config, ConfigError, resolve_path
from drafttrain.data import Prompts, stop_ids
from drafttrain.drafters.base import build_drafter, check_compatible
from drafttrain.drafters.targets import TargetHead
from drafttrain.engines import build_engine
from drafttrain.export import read_speculators_config
from drafttrain.policy import load_policy
from drafttrain.spec import SamplingParams, SpecStats
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.buffer import FeatureBuffer, collate
from drafttrain.tracking.capture import teacher_forced_features
from drafttrain.tracking.trainer import DrafterTrainer

CHUNK = 16  # rollouts per feature batch


def checkpoints(paths: list[str]) -> list[tuple[str, Path]]:
    """(label, HF folder) per checkpoint; a run folder gives its step-0 policy and each ckpt/step-N/policy."""
    if not paths:
        raise ValueError("CHECKPOINT: give at least one policy folder or run folder")
    out = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            out.append((p.name, p))
        elif (p / "ckpt").is_dir() and (p / "config.yaml").is_file():
            first = resolve_path(OmegaConf.load(p / "config.yaml").policy.path)
            steps = sorted(p.glob("ckpt/step-*/policy"), key=lambda q: int(q.parent.name.split("-")[1]))
            out += [("step-0", first)] + [(q.parent.name, q) for q in steps]
        else:
            raise FileNotFoundError(f"CHECKPOINT: {p} is neither a policy folder (config.json) nor a run folder "
                                    f"(config.yaml, ckpt/)")
    return out


def load_drafter_for(path: Path, policy):
    """The drafter at path, through the registry (its kind from its config.json)."""
    c = read_speculators_config(path)
    kind = (c.get("drafttrain") or {}).get("kind") or c.get("speculators_model_type")
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = kind, str(Path(path).absolute())
    d = build_drafter(cfg, policy)
    if not d.trains:
        raise ValueError(f"--drafter: {path} holds a {kind} drafter, which teacher-forced scoring cannot score")
    return d.eval()


def rollouts(policy, prompts, params, seed: int) -> list[list[int]]:
    ecfg = OmegaConf.structured(Config).engine
    ecfg.kind, ecfg.max_batch, ecfg.seed = "torch", max(1, len(prompts)), seed
    return build_engine(ecfg, policy, None).generate(prompts, params, speculative=False).tokens


def features(policy, drafter, prompts, responses, k: int) -> list[dict]:
    return [teacher_forced_features(policy, prompts[i:i + CHUNK], responses[i:i + CHUNK], drafter.reads, k)
            for i in range(0, len(prompts), CHUNK)]


def score(drafter, feats: list[dict], k: int, head) -> dict:
    st = SpecStats()
    for f in feats:
        st = st.merge(teacher_forced_acceptance(drafter, f, k, head)["stats"])
    return {"mal": round(st.mean_accepted_length, 4),
            "acceptance_per_position": [round(a, 4) for a in st.acceptance_per_position]}


def catch_up(drafter, feats: list[dict], seconds: float, seed: int, head):
    """A copy of the drafter after `seconds` of drafter steps (the online trainer's, the default train.* settings)
    on feats."""
    cfg = OmegaConf.structured(Config)
    d = copy.deepcopy(drafter).train()
    buf = FeatureBuffer(1 << 30, seed=seed)
    for f in feats:
        buf.add(f)
    tr, spent = DrafterTrainer(d, cfg.train, cfg.drafter, buffer=buf, head=head), 0.0
    while spent < seconds:
        batch = collate(buf.sample_groups(cfg.train.batch_size, 1)[0], buf.steps)
        t0 = time.perf_counter()
        tr.step(batch)
        spent += time.perf_counter() - t0
    return d.eval()


def measure(args) -> dict:
    points = checkpoints(args.checkpoints)
    if not Path(args.drafter).is_dir():
        raise FileNotFoundError(f"--drafter: {args.drafter} is not a folder")
    base, tok = load_policy(str(points[0][1]))
    drafter = load_drafter_for(Path(args.drafter), base)
    cfg = OmegaConf.structured(Config)
    cfg.data.path = args.data
    rows = []
    for label, path in points:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"CHECKPOINT: {path} ({label}) is not a policy folder")
        policy, tok = load_policy(str(path))
        try:
            check_compatible(drafter, policy)
        except ValueError as e:
            raise ValueError(f"CHECKPOINT: {path} does not fit the drafter: {e}") from None
        prompts = Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))
        ids = [prompts.encode(r) for r in prompts.rows(args.prompts, args.seed)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                stop_token_ids=prompts.stop_ids, seed=args.seed)
        torch.manual_seed(args.seed)
        feats = features(policy, drafter, ids, rollouts(policy, ids, params, args.seed), args.k)
        head = TargetHead.of(policy)
        row = {"checkpoint": label, "path": str(path), **score(drafter, feats, args.k, head)}
        if args.catch_up:
            train = [prompts.encode(r) for r in prompts.rows(args.prompts, args.seed + 1)]
            tf = features(policy, drafter, train, rollouts(policy, train, params, args.seed + 1), args.k)
            row["catch_up_mal"] = score(catch_up(drafter, tf, args.catch_up, args.seed, head), feats, args.k,
                                        head)["mal"]
        rows.append(row)
        print(f"[staleness] {label}: MAL {row['mal']:.3f}", flush=True)
    return {"drafter": str(args.drafter), "k": args.k, "prompts": args.prompts, "catch_up_s": args.catch_up,
            "checkpoints": rows, "mal_drop": round(rows[0]["mal"] - rows[-1]["mal"], 4)}


def table(res: dict) -> str:
    k, cu = res["k"], res["catch_up_s"] is not None
    head = ["checkpoint", "MAL"] + [f"acc@{i + 1}" for i in range(k)] + (["catch-up MAL"] if cu else [])
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in res["checkpoints"]:
        cells = [r["checkpoint"], f"{r['mal']:.3f}"] + [f"{a:.3f}" for a in r["acceptance_per_position"]]
        lines.append(" | ".join(cells + ([f"{r['catch_up_mal']:.3f}"] if cu else [])))
    lines.append(f"MAL drop, first to last checkpoint: {res['mal_drop']:.3f}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["checkpoints"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rows)), [r["mal"] for r in rows], "o-", label="drafter as given")
    if res["catch_up_s"] is not None:
        ax.plot(range(len(rows)), [r["catch_up_mal"] for r in rows], "s--", label=f"after {res['catch_up_s']:g} s")
    ax.set_xticks(range(len(rows)), [r["checkpoint"] for r in rows], rotation=30)
    ax.set_ylabel(f"MAL (k={res['k']}, teacher-forced)")
    ax.set_title("drafter staleness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafttrain.staleness", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="*", metavar="CHECKPOINT", help="policy folders or a run folder")
    ap.add_argument("--drafter", required=True, help="the drafter folder (speculators EAGLE-3, MTP, draft model)")
    ap.add_argument("--data", default=None, help="prompts as data.path takes them (default: the shipped task)")
    ap.add_argument("--prompts", type=int, default=64, help="rollouts per checkpoint")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5, help="draft length scored")
    ap.add_argument("--catch-up", type=float, default=None, metavar="SECONDS", help="retrain a copy this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="staleness", help="writes OUT.json and OUT.png")
    args = ap.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "k"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        res = measure(args)
    except (ValueError, FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(f"plot: {plot(res, out.with_suffix('.png'))}  json: {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
