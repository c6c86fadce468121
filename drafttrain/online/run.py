"""The main job: GRPO on the tiny policy with speculative rollouts and a drafter that tracks the policy.

    accelerate launch drafttrain/online.py recipe=eagle3_track [key=value ...]
    python -m drafttrain.online recipe=eagle3_track rl.steps=5

Writes into run.out_dir: config.yaml (resolved), metrics.jsonl (+ tb/), ckpt/ (resumable after any kill: the
latest complete step wins), report.png and a summary table at the end, and eval.json with its table: the policy's
held-out accuracy before and after the run (rl.eval_prompts fixed problems, sampled and greedy). Under
`accelerate launch` with N processes every process generates its own rollouts and DDP syncs both the policy's and
the drafter's gradients.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from drafttrain.config import ConfigError, load_recipe, resolve_path, save_config
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy, save_policy
from drafttrain.report import RunLogger, eval_table, plot_run, summary_table, write_json
from drafttrain.rl.grpo import GRPO
from drafttrain.rl.hooks import DraftTracker


class Checkpointer:
    """out/ckpt/step-N/ (policy, state.pt, trainer state); `latest` names the last complete one."""

    def __init__(self, out: Path, acc):
        self.root, self.acc = out / "ckpt", acc

    def latest(self) -> Path | None:
        f = self.root / "latest"
        if not f.is_file():
            return None
        p = self.root / f.read_text().strip()
        return p if (p / "state.pt").is_file() else None

    def save(self, step: int, grpo: GRPO, tracker: DraftTracker, recipe: str, eval_before: dict | None) -> None:
        d = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}"
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        if tracker.trainer is not None:  # self-drafters have no training state
            tracker.trainer.save(tmp / "trainer.pt")  # every process: its buffer shard
        if self.acc.is_main_process:
            save_policy(grpo.policy, grpo.tok, str(tmp / "policy"))
            torch.save({"step": step, "recipe": recipe, "opt": grpo.opt.state_dict(),
                        "tracker": tracker.state_dict(), "rng": torch.get_rng_state(), "eval_before": eval_before},
                       tmp / "state.pt")
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)
            (self.root / ".latest.tmp").write_text(d.name)
            os.replace(self.root / ".latest.tmp", self.root / "latest")
            for old in self.root.glob("step-*"):
                if old != d:
                    shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()


def main(cfg) -> list[dict]:
    from accelerate import Accelerator, InitProcessGroupKwargs

    transformers.utils.logging.disable_progress_bar()
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1  # launched with N processes: gloo (ENVIRONMENT.md)
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if multi else [])
    torch.manual_seed(cfg.run.seed + acc.process_index)
    out = Path(cfg.run.out_dir)
    ckpt = Checkpointer(out, acc)
    last = ckpt.latest() if cfg.run.resume else None
    state = torch.load(last / "state.pt", weights_only=False) if last else None
    if state is not None and state["recipe"] != cfg.recipe:
        raise ConfigError(f"run.resume: {out} holds a checkpoint of recipe {state['recipe']!r}, not "
                          f"{cfg.recipe!r} (choose another run.out_dir or set run.resume=false)")
    policy, tok = load_policy(str(last / "policy") if last else str(resolve_path(cfg.policy.path)))
    say = (lambda m: tqdm.write(m)) if acc.is_main_process else (lambda m: None)
    try:  # a drafter that does not fit the policy is bad input: one line, and nothing written yet
        drafter = build_drafter(cfg.drafter, policy)
        engine = build_engine(cfg.engine, policy, drafter)
        tracker = DraftTracker(cfg, policy, [engine], drafter, acc, log=say)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grpo = GRPO(cfg, policy, tok, engine, tracker, acc, rank=acc.process_index)
    start = 0
    if state is not None:
        if tracker.trainer is not None:
            try:
                tracker.trainer.load(last / "trainer.pt")
            except ValueError as e:  # resumed with another number of processes: bad input, one line
                raise ConfigError(f"run.resume: {e}") from None
        tracker.load_state_dict(state["tracker"])
        grpo.opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        say(f"[drafttrain] resumed {out} at step {start}, drafter v{tracker.version}")
    if acc.is_main_process:
        save_config(cfg, out)
    logger = RunLogger(out, cfg.run.tensorboard, resume_step=start) if acc.is_main_process else None
    before = state.get("eval_before") if state else None  # the step-0 policy's, carried through resumes
    if logger and cfg.rl.eval_prompts and state is None:
        before = grpo.evaluate()
    t_ro = time.perf_counter()
    ro = grpo.rollout(start) if start < cfg.rl.steps else None
    first_rollout_s = time.perf_counter() - t_ro  # each later rollout is timed inside the step before it
    bar = tqdm(range(start, cfg.rl.steps), desc=f"{cfg.recipe}", disable=not acc.is_main_process,
               initial=start, total=cfg.rl.steps)
    for step in bar:
        rec, ro = grpo.run_step(step, ro, last=step == cfg.rl.steps - 1)
        if step == start:  # the RL loop's wall time is the sum of rl_step_s: the first step's rollout belongs to it
            rec["rl_step_s"] += first_rollout_s
        with tracker.outside_rl_step():  # logging and checkpoints earn the drafter's time bank nothing
            if logger:
                logger.log(rec)
                bar.set_postfix(reward=f"{rec['reward_mean']:.2f}", mal=f"{rec['live_mal']:.2f}",
                                frozen=f"{rec.get('frozen_tf_mal') or 0:.2f}", v=tracker.version)
            ckpt.save(step + 1, grpo, tracker, cfg.recipe, before)
    if logger is None:
        return []
    logger.close()
    if logger.records:
        png = plot_run(logger.records, out / "report.png", title=cfg.recipe)
        print(summary_table(logger.records))
        print(f"report: {png}  metrics: {logger.path}  config: {out / 'config.yaml'}")
    if cfg.rl.eval_prompts:
        after = grpo.evaluate()
        write_json({"prompts": cfg.rl.eval_prompts, "seed": cfg.rl.eval_seed, "before": before, "after": after},
                   out / "eval.json")
        print(eval_table(before, after))
    return logger.records


def cli(argv: list[str] | None = None) -> None:
    from drafttrain.config import check_out_dir, usage

    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(usage())
        return
    recipe = [a.split("=", 1)[1] for a in args if a.startswith("recipe=")]
    overrides = [a for a in args if not a.startswith("recipe=")]
    try:
        cfg = load_recipe(recipe[-1] if recipe else "eagle3_track", overrides)
        check_out_dir(cfg.run.out_dir)
        main(cfg)
    except (ConfigError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli()
