"""The main job: GRPO on the tiny policy with speculative rollouts and a drafter that tracks the policy (launched
through drafttrain/online.py).

Writes into run.out_dir: config.yaml (resolved), metrics.jsonl (+ tb/), ckpt/ (every run.checkpoint_every steps,
the newest run.keep_checkpoints kept; resumable after any kill: the latest complete step wins), report.png and a
summary table at the end, eval.json with its table: the policy's held-out accuracy before and after the run
(rl.eval_prompts fixed problems, sampled and greedy), and export/: the final policy with its served drafter, ready
for vLLM (tracking/deliverable.py; the line that serves it printed). Under `accelerate launch` with N processes every
process generates its own rollouts; the policy's gradients are averaged over the processes, and the drafter's by
DDP, or by DeepSpeed ZeRO under a DeepSpeed accelerate config.

A rerun into the same run.out_dir resumes it, if its settings are the checkpoint's (raising rl.steps continues a
run; a finished run is left as it is). One job at a time holds a run folder. SIGTERM/SIGINT stop the job after the
current step, with a checkpoint of it, and the job ends with the process that started it: see rl/runfolder.py.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from drafttrain.checkpoint import CheckpointError, load_checkpoint, shared_sets
from drafttrain.config import ConfigError, resolve_path, sampling_params, save_config
from drafttrain.data import Prompts, stop_ids
from drafttrain.device import load_device_rng_state, now, resolve_device
from drafttrain.drafters import build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy
from drafttrain.report import RunLogger, accuracy_change, eval_table, plot_run, read_jsonl, summary_table, write_json
from drafttrain.rl.grpo import GRPO
from drafttrain.rl.restart import RestartingEngine, rebuild_engine
from drafttrain.rl.runfolder import Checkpointer, RunStopped, Stopper, changed_settings, lock_run_folder
from drafttrain.rl.watch import CollapseWatch, Diverged
from drafttrain.tracking.collective import Collective
from drafttrain.tracking.deliverable import export_run
from drafttrain.tracking.tracker import DraftTracker
from drafttrain.tracking.trainer import make_accelerator
from drafttrain.tracking.vocab import vocab_from_rollouts


def main(cfg) -> list[dict]:
    transformers.utils.logging.disable_progress_bar()
    try:
        device = resolve_device(cfg.run.device)  # auto: this process's GPU (LOCAL_RANK) when there is one
    except ValueError as e:
        raise ConfigError(str(e)) from None
    acc = make_accelerator(device)  # one process, N with DDP, or N with the drafter under DeepSpeed: as launched
    torch.manual_seed(cfg.run.seed + acc.process_index)
    out = Path(cfg.run.out_dir)
    lock = lock_run_folder(out, acc)  # one job per run folder, before anything in it is read
    try:
        with Stopper(acc, out) as stopper, contextlib.ExitStack() as closing:
            return _run(cfg, acc, device, out, stopper, closing)
    finally:
        if lock is not None:
            lock.release()
        Collective(acc).settle()  # the last all-reduce's tensors freed before this process exits


def _resume_state(cfg, last: Path, out: Path, ckpt: Checkpointer) -> dict:
    """The checkpoint's state, if this run may continue it: same recipe, same settings (FREE_ON_RESUME aside)."""
    try:
        state = load_checkpoint(last / "state.pt")
    except CheckpointError as e:
        raise ConfigError(f"run.resume: {e} ({ckpt.resume_hint(last)})") from None
    if state["recipe"] != cfg.recipe:
        raise ConfigError(f"run.resume: {out} holds a checkpoint of recipe {state['recipe']!r}, not "
                          f"{cfg.recipe!r} (choose another run.out_dir or set run.resume=false)")
    changed = changed_settings(state["config"], cfg, state["step"]) if "config" in state else []
    if changed:
        raise ConfigError(f"run.resume: {out} holds a run with other settings: {'; '.join(changed)} (rerun with "
                          f"its settings, raising rl.steps continues it; or choose another run.out_dir, or set "
                          f"run.resume=false to start over)")
    return state


def _run(cfg, acc, device, out: Path, stopper: Stopper, closing: contextlib.ExitStack) -> list[dict]:
    ckpt = Checkpointer(out, acc, cfg.run)
    last = ckpt.latest() if cfg.run.resume else None
    state = _resume_state(cfg, last, out, ckpt) if last else None
    policy, tok = load_policy(str(last / "policy") if last else str(resolve_path(cfg.policy.path)), cfg.engine.kind,
                              device)
    say = (lambda m: tqdm.write(m)) if acc.is_main_process else (lambda m: None)
    # bad data.* or reward.fn: one line, before any heavy set-up
    prompts = Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))
    for note in prompts.notes:
        say(note)
    try:  # a drafter that does not fit the policy is bad input: one line, and nothing written yet
        drafter = build_drafter(cfg.drafter, policy)
        engine = RestartingEngine(build_engine(cfg.engine, policy, drafter),
                                  rebuild_engine(cfg.engine, policy, drafter), lambda: tracker.publisher.served(),
                                  cfg.engine.kind, ckpt.latest, say)  # a dead engine is rebuilt (rl/restart.py)
        closing.callback(engine.close)  # however the run ends, its engine's processes end with it
        if state is None:  # a resumed run's drafter map comes back with its checkpoint
            _choose_draft_vocab(cfg, acc, policy, drafter, engine, prompts, say)
        tracker = DraftTracker(cfg, policy, [engine], drafter, acc, log=say)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grpo = GRPO.from_config(cfg, policy, tok, engine, tracker, acc, rank=acc.process_index, prompts=prompts)
    start = 0
    if state is not None:
        start = _restore(state, last, tracker, grpo, ckpt, say)
        if start >= cfg.rl.steps and ckpt.finished():  # its report and eval are written: rewrite nothing
            say(f"[drafttrain] {out} holds a finished run ({start} of {cfg.rl.steps} steps): nothing to do (raise "
                f"rl.steps to continue it)")
            return read_jsonl(out / "metrics.jsonl")
        say(f"[drafttrain] resumed {out} at step {start}, drafter v{tracker.version}")
    if acc.is_main_process:
        save_config(cfg, out)
    logger = RunLogger(out, cfg.run.tensorboard, resume_step=start, say=say) if acc.is_main_process else None
    before = state.get("eval_before") if state else None  # the step-0 policy's, carried through resumes
    if logger and cfg.rl.eval_prompts and state is None:
        before = grpo.evaluate()
    t_ro = now(device)
    engine.new_step(start)
    ro = grpo.rollout(start) if start < cfg.rl.steps else None
    first_rollout_s = now(device) - t_ro  # each later rollout is timed inside the step before it
    bar = tqdm(range(start, cfg.rl.steps), desc=f"{cfg.recipe}", disable=not acc.is_main_process,
               initial=start, total=cfg.rl.steps)
    stopper.in_loop = True  # from here a SIGTERM/SIGINT waits for the step's checkpoint
    watch = CollapseWatch(cfg, prompts.stop_ids, say)
    for step in bar:
        stopper.step = step
        watch.see(ro)
        if step != start:  # the first step's restarts count its rollout's too
            engine.new_step(step)
        try:
            rec, ro = grpo.run_step(step, ro, last=step == cfg.rl.steps - 1)
        except Diverged as e:
            bar.close()
            raise RunStopped(f"{e}: the last checkpoint ({ckpt.latest() or 'none yet'}) stands; rerun with a lower "
                             f"rl.lr into another run.out_dir (or with run.resume=false)") from None
        rec["restarts"] = engine.restarts  # dead engines rebuilt in this step
        if step == start:  # the RL loop's wall time is the sum of rl_step_s: the first step's rollout belongs to it
            rec["rl_step_s"] += first_rollout_s
        with tracker.outside_rl_step():  # logging and checkpoints earn the drafter's time bank nothing
            if logger:
                logger.log(rec)
                bar.set_postfix(postfix(rec, tracker.version))
            due = ckpt.due(step + 1, cfg.rl.steps)
            if due:
                ckpt.save(step + 1, grpo, tracker, cfg, before)
            stop = stopper.stop_requested()
            if stop and not due:  # a stop between checkpoints saves this step's
                ckpt.save(step + 1, grpo, tracker, cfg, before)
        if stop:
            bar.close()
            if logger:
                logger.close()
            stopper.stop(step + 1, cfg.rl.steps)
    stopper.in_loop, stopper.step = False, None
    if acc.num_processes > 1:  # collectives: every process, before any returns
        _check_agreement(cfg, acc, grpo, tracker, say)
    if logger is None:
        return []
    return _finish(cfg, out, logger, engine, grpo, prompts, before, ckpt)


def _choose_draft_vocab(cfg, acc, policy, drafter, engine, prompts: Prompts, say) -> None:
    """A fresh drafter over fewer tokens than the policy's vocabulary (drafter.eagle3.draft_vocab_size) takes the
    most frequent tokens of one step's worth of the policy's plain rollouts (rl.prompts_per_step x rl.group_size per
    process, prompts no step draws) as its draft vocabulary, before the tracker copies it. The engine, built with the
    placeholder map and not drafted with yet, then serves it as the next drafter version."""
    if not drafter.needs_draft_vocab():
        return
    rl = cfg.rl
    seed = rl.prompt_seed * 1_000_003 - 1 - acc.process_index  # below every step's prompt seed (GRPO.rollout)
    batch = [prompts.encode(r) for r in prompts.rows(rl.prompts_per_step, seed=seed) for _ in range(rl.group_size)]
    params = sampling_params(cfg.sampling, stop_token_ids=prompts.stop_ids, seed=seed)
    note = vocab_from_rollouts(drafter, engine, [batch], params, policy.config.vocab_size, prompts.stop_ids, acc)
    engine.load_drafter(drafter.state_dict(), engine.drafter_version + 1)
    say(f"{note}; the engine serves it as drafter v{engine.drafter_version}")


def _restore(state: dict, last: Path, tracker, grpo, ckpt: Checkpointer, say) -> int:
    """The tracker's, the optimizer's and the RNG's state from the checkpoint at `last` (written on any device); the
    step it resumes at."""
    try:
        tracker.load_state_dict(state["tracker"], last, shared_sets(last, grpo.policy))
    except CheckpointError as e:
        raise ConfigError(f"run.resume: {e} ({ckpt.resume_hint(last)})") from None
    except ValueError as e:  # resumed with another number of processes: bad input, one line
        raise ConfigError(f"run.resume: {e}") from None
    grpo.opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    note = load_device_rng_state(state.get("device_rng"), grpo.device)
    if note:
        say(f"[drafttrain] {note}")
    ckpt.resumed(last)
    return state["step"]


def _check_agreement(cfg, acc, grpo, tracker, say) -> None:
    """Several processes: the averaged gradients kept the policies equal, and the drafters too."""
    pol = Collective(acc).agreement(cfg.rl.steps, grpo.policy)
    if not pol["agree"]:
        raise RuntimeError(f"the {acc.num_processes} processes ended with different policies: weight sums "
                           f"{pol['sums']}")
    agree = tracker.agreement()
    if agree is not None:
        if not agree["agree"]:
            raise RuntimeError(f"the {acc.num_processes} processes ended with different drafters: versions "
                               f"{agree['versions']}, weight sums {agree['sums']}")
        say(f"[drafttrain] {acc.num_processes} processes agree: drafter v{agree['versions'][0]} on each, equal "
            f"weights; equal policies")


def _finish(cfg, out: Path, logger, engine, grpo, prompts, before, ckpt) -> list[dict]:
    """After the last step (main process): the report, the held-out evaluation, the export, then `finished`."""
    logger.close()
    if logger.records:
        png = plot_run(logger.records, out / "report.png", title=cfg.recipe)
        print(summary_table(logger.records))
        print(f"report: {png}  metrics: {logger.path}  config: {out / 'config.yaml'}")
    if cfg.rl.eval_prompts:
        engine.new_step(None)
        after = grpo.evaluate()
        n = prompts.eval_count(cfg.rl.eval_prompts)  # data.path: at most its held-out rows
        write_json({"prompts": n, "seed": cfg.rl.eval_seed, "before": before, "after": after,
                    "change": accuracy_change(before, after, n)}, out / "eval.json")
        print(eval_table(before, after))
    export_run(out, out / "export", log=print)  # before `finished`: a run killed before it is written reruns it
    ckpt.mark_finished()
    return logger.records


def postfix(rec: dict, version: int) -> dict:
    """The progress bar's fields for a step's record: the frozen drafter's MAL only where it was measured (a kind
    that trains nothing has none: 0.00 there read as a drafter gone bad)."""
    out = {"reward": f"{rec['reward_mean']:.2f}", "mal": f"{rec['live_mal']:.2f}"}
    if rec.get("frozen_tf_mal") is not None:
        out["frozen"] = f"{rec['frozen_tf_mal']:.2f}"
    return {**out, "v": version}
