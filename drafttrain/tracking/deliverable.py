"""A run's deliverable: the policy with the drafter that served it, in the folders vLLM loads.

    export_run("runs/eagle3_track", "runs/eagle3_track/export")        # the latest checkpoint, or step=N
    python -m drafttrain.export RUN_DIR [--step N] OUT                 # the same from a shell

OUT/policy is the checkpoint's HF folder (with its tokenizer), OUT/drafter the served drafter (the tracker's last good
weights) in its kind's vLLM form (engines/vllm_forms.py: the form engine.kind=vllm serves), and OUT/serve.json holds
what vllm.LLM(model=..., speculative_config=...) takes, paths relative to OUT. OUT is written whole under a temporary
name and renamed into place (atomic.atomic_dir). A kind plain vLLM cannot serve (auto, suffix) gets the policy and a
serve.json without speculative_config, and the reason in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from drafttrain.atomic import atomic_dir
from drafttrain.checkpoint import load_checkpoint, shared_sets
from drafttrain.config import Config, ConfigError, max_draft_len
from drafttrain.drafters.base import DRAFTERS, build_drafter
from drafttrain.tracking.weightsets import weight_sets


def unservable(kind: str) -> str | None:
    """Why plain vLLM cannot serve this drafter kind, or None when it can."""
    from drafttrain.engines.vllm_forms import form_of  # not at import: the job imports this module, not vLLM's side

    entry = DRAFTERS.get(kind)
    if entry is None or entry.vllm is None:
        return f"drafter.kind={kind} has no vLLM form"
    why = form_of(kind).needs_engine
    return f"drafter.kind={kind}: {why}" if why else None


def write_pair(policy_dir: str | Path, drafter, kind: str, k: int, out: str | Path) -> dict:
    """OUT/policy (a copy of the HF folder policy_dir), OUT/drafter and OUT/serve.json, atomically.
    Returns {"serve": serve.json's dict, "unservable": the reason or None, "out": OUT (absolute)}."""
    policy_dir, out = Path(policy_dir), Path(out).absolute()
    if not (policy_dir / "config.json").is_file():
        raise FileNotFoundError(f"policy: {policy_dir} is not an HF checkpoint folder (no config.json)")
    with atomic_dir(out) as tmp:
        shutil.copytree(policy_dir, tmp / "policy")
        serve, why = {"model": "policy"}, unservable(kind)
        if why is None:
            from drafttrain.engines.vllm_forms import form_of

            form = form_of(kind)
            target = json.loads((tmp / "policy" / "config.json").read_text())
            form.write(drafter, policy_dir, tmp / "drafter", int(k), target)
            serve["speculative_config"] = {"model": "drafter", "method": form.method, "num_speculative_tokens": int(k)}
        (tmp / "serve.json").write_text(json.dumps(serve, indent=2) + "\n")
    return {"serve": serve, "unservable": why, "out": out}


def serve_kwargs(out: str | Path) -> dict:
    """serve.json as vllm.LLM keyword arguments, its relative paths made absolute (vLLM reads them from the cwd)."""
    out = Path(out).absolute()
    s = json.loads((out / "serve.json").read_text())
    kw = {"model": str(out / s["model"])}
    if "speculative_config" in s:
        kw["speculative_config"] = {**s["speculative_config"], "model": str(out / s["speculative_config"]["model"])}
    return kw


def serve_command(out: str | Path) -> str:
    """The one line that serves an export folder here: drafttrain's launcher (python -m drafttrain.serve: vLLM's
    server with the routes and key drafttrain pushes through), the drafter and its k as serve.json says."""
    from drafttrain.serve import serve_line

    kw = serve_kwargs(out)
    spec = kw.get("speculative_config")
    return serve_line(kw["model"], spec["model"] if spec else None, spec["num_speculative_tokens"] if spec else None)


def checkpoint_dir(run_dir: str | Path, step: int | None = None) -> Path:
    """RUN_DIR/ckpt/step-N (the latest complete one when step is None); a missing one is a one-line error."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"RUN_DIR: {run} is not a folder")
    root = run / "ckpt"
    if step is None:
        latest = root / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"RUN_DIR: {run} holds no checkpoint (no ckpt/latest): not a drafttrain run folder")
        d = root / latest.read_text().strip()
    else:
        d = root / f"step-{step}"
    if not (d / "state.pt").is_file() or not (d / "policy" / "config.json").is_file():
        kept = ", ".join(sorted(p.name for p in root.glob("step-*"))) or "none"
        raise FileNotFoundError(f"--step: {run} has no complete checkpoint {d.name} (kept: {kept})")
    return d


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, log=print) -> dict:
    """write_pair for a run folder's checkpoint: its policy and the drafter its tracker served (good_weights),
    rebuilt from the checkpoint's own config. Logs the line that serves it (the launcher), or why there is none."""
    from drafttrain.policy import load_policy

    ckpt = checkpoint_dir(run_dir, step)
    state = load_checkpoint(ckpt / "state.pt")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), state["config"])
    except Exception as e:  # noqa: BLE001  a checkpoint of another drafttrain version
        raise ConfigError(f"RUN_DIR: {ckpt / 'state.pt'} holds a config this version cannot read ({e})") from None
    kind, k = cfg.drafter.kind, max_draft_len(cfg.engine)
    drafter = None
    if unservable(kind) is None:
        policy, _ = load_policy(str(ckpt / "policy"), "vllm")
        drafter = build_drafter(cfg.drafter, policy)
        good = weight_sets(state["tracker"], shared_sets(ckpt, policy))["good_weights"]
        drafter.load_state_dict(good)
    res = write_pair(ckpt / "policy", drafter, kind, k, out)
    if res["unservable"]:
        log(f"[drafttrain] export: {res['unservable']}, so vLLM cannot serve it: wrote the policy only, to "
            f"{res['out']}")
    else:
        log(f"[drafttrain] serve the policy with its drafter: {serve_command(res['out'])}")
    return res
