"""Pretrain a drafter on the policy's own rollouts: EAGLE-3 (the shipped one, speculators format), an MTP head
(a vLLM EAGLE-1 folder) or a draft model (an HF folder); drafter.kind picks it, out defaults to checkpoints/<kind>.

    python scripts/pretrain_drafter.py threads=2                         # -> checkpoints/eagle3/ (as shipped)
    python scripts/pretrain_drafter.py drafter.kind=mtp threads=2        # -> checkpoints/mtp/
    python scripts/pretrain_drafter.py drafter.kind=draft_model threads=2   # -> checkpoints/draft_model/
    python scripts/pretrain_drafter.py prompts=256 epochs=2 out=/tmp/e3 train.lr=1e-3 drafter.ttt_steps=4
    python scripts/pretrain_drafter.py train.loss=kl_tv train.positions=rejected out=/tmp/e3tv   # the loss: ttt.py
    accelerate launch --config_file recipes/accelerate/ddp2.yaml scripts/pretrain_drafter.py threads=1
    accelerate launch --config_file recipes/accelerate/zero2.yaml scripts/pretrain_drafter.py threads=1   # ZeRO-2

Keys: this script's (PretrainConfig below) plus any recipe key (`recipe=eagle3_track`, then e.g. `train.lr=`).
Data is regenerated in chunks, each process its own shard: the policy samples responses to fresh prompts (the
task's, or your own: policy.path, data.path and the other data.* keys, as in the main job) through the embedded
engine (AR, the recipe's sampling); one teacher-forced policy forward per `fwd_batch` rollouts (grouped by length)
yields what the drafter reads (aux layer inputs, the final hidden state, or only the tokens) and the policy's
distributions, which enter a FeatureBuffer (with cache=DIR also DIR, per chunk: a rerun on the same data loads
them). The drafter, always a fresh one (DrafterTrainer, ttt_loss), trains after each chunk until each rollout so far
has been drawn `epochs` times on average (warmup, then cosine lr). A drafter over fewer tokens than the policy's
vocabulary (EAGLE-3's drafter.eagle3.draft_vocab_size: 32000 by default on a larger vocabulary) first takes the most
frequent tokens of `vocab_rollouts` plain rollouts as its draft vocabulary (tracking/vocab.py).
Training state (drafter, optimizer, step, buffer, data cursor, batches drawn ahead) is checkpointed to
`<out>.state/` every `save_every` steps and at `max_steps`; a rerun with resume=true and the same settings continues
there exactly (other settings: a one-line error). At the end the drafter is
scored on fresh rollouts (speculative, the recipe's engine and k) and the mean accepted length is printed and
stored under drafttrain.extra in the saved config.json.

Shipped checkpoints/eagle3 is this script at its defaults with `threads=2` (8192 rollouts, 3 epochs, 1536 steps of
a 5-step training-time test); its time and its mean accepted length: bench/NOTES.md, EAGLE-3.

Simplifies on purpose: no validation split (the acceptance measurement on fresh prompts is the validation).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

from drafttrain.config import ConfigError, load_recipe, resolve_path, sampling_params
from drafttrain.data import Prompts, stop_ids
from drafttrain.device import resolve_device
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.drafters.base import save_drafter
from drafttrain.engines import build_engine
from drafttrain.tracking import DrafterTrainer, FeatureBuffer, teacher_forced_features
from drafttrain.tracking.buffer import FORMAT as FEATURE_FORMAT
from drafttrain.tracking.buffer import collate
from drafttrain.tracking.trainer import make_accelerator
from drafttrain.tracking.vocab import vocab_from_rollouts
from drafttrain.policy import load_policy
from drafttrain.spec import SpecStats


# the shipped drafter's pretraining settings of recipe keys; CLI keys come after them and win
RECIPE_DEFAULTS = ("train.lr=3e-3", "drafter.ttt_steps=5", "train.query_frac=1.0", "train.score_grad=true")


@dataclass
class PretrainConfig:
    recipe: str = "eagle3_track"
    overrides: list[str] = field(default_factory=list)  # recipe key=value (the CLI routes them here)
    out: str = ""  # the drafter's folder; "" = checkpoints/<drafter.kind>
    prompts: int = 8192  # rollouts to train on, all processes together
    chunk: int = 64  # rollouts per generation round, per process
    fwd_batch: int = 16  # rollouts per teacher-forced policy forward (sorted by length: little padding)
    epochs: float = 3.0  # mean number of times each rollout is drawn
    bucket: int = 8  # batches drawn at once and grouped by length (less padding); 1 = plain random batches
    warmup: int = 20  # lr warmup steps, then cosine to 10%
    buffer_mb: int = 4096  # per process; the oldest chunks are evicted beyond it
    save_every: int = 100
    max_steps: int = 0  # stop (state saved, drafter exported) after this step; 0 = run the whole schedule
    resume: bool = True
    keep_state: bool = False  # keep <out>.state/ after a completed run
    eval_prompts: int = 128
    seed: int = 0
    threads: int = 0  # torch threads per process; 0 = torch's default
    cache: str = ""  # folder for the regenerated features, per chunk: a rerun with the same data loads them; "" = off
    vocab_rollouts: int = 512  # rollouts (all processes) whose token counts choose a draft vocabulary, if it has one


def main(pc: PretrainConfig) -> dict:
    if pc.threads:
        torch.set_num_threads(pc.threads)
    cfg = load_recipe(pc.recipe, [*RECIPE_DEFAULTS, *pc.overrides, "drafter.path=null"])
    try:
        device = resolve_device(cfg.run.device, "overrides: run.device")  # the recipe's run.device (auto: a GPU)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    acc = make_accelerator(device)  # as launched: one process, DDP, or DeepSpeed ZeRO (accelerate config)
    rank, world, main_proc = acc.process_index, acc.num_processes, acc.is_main_process
    policy, tok = load_policy(str(resolve_path(cfg.policy.path)), cfg.engine.kind, device)
    prompts = Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))  # the task's, or data.path's
    torch.manual_seed(pc.seed)
    drafter = build_drafter(cfg.drafter, policy)
    if not drafter.trains:
        raise ConfigError(f"drafter.kind: {cfg.drafter.kind} trains nothing: there is nothing to pretrain")
    pc.out = pc.out or f"checkpoints/{cfg.drafter.kind}"
    buffer = FeatureBuffer(pc.buffer_mb << 20, torch.bfloat16, seed=pc.seed * 7919 + rank, name="buffer_mb")
    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter, acc, buffer, head=TargetHead.of(policy))
    out, state = Path(pc.out), Path(f"{pc.out}.state") / "trainer.pt"
    chunks_done, run_key, queue = 0, resume_key(pc, cfg, world), []
    resumed = pc.resume and DrafterTrainer.saved(state)
    if resumed:
        try:
            saved = trainer.load(state)
        except ValueError as e:  # resumed with another number of processes: bad input, one line
            raise ConfigError(f"resume: {e}") from None
        if saved.get("run_key") != run_key:
            raise ConfigError(f"resume: {state} was written by a run with other settings ({saved.get('run_key')}); "
                              f"rerun with those, or with resume=false to start over")
        chunks_done, queue = saved["chunks_done"], saved.get("queue", [])
        if main_proc:
            print(f"resumed from {state} at step {trainer.step_count}, chunk {chunks_done}")
    n_chunks = math.ceil(pc.prompts / (pc.chunk * world))
    total = math.ceil(pc.epochs * n_chunks * pc.chunk / cfg.train.batch_size)  # steps; each takes one batch
    gen_engine = build_engine(cfg.engine, policy)  # AR for data: no drafter
    if not resumed:  # before the first step; the trainer trains this very module (a resumed one's map: its state)
        choose_draft_vocab(pc, cfg, policy, prompts, gen_engine, drafter, acc)
    t0, last, bad = time.time(), {}, 0
    bar = tqdm(total=total, initial=trainer.step_count, desc="drafter", disable=not main_proc)
    stop = pc.max_steps or total
    while trainer.step_count < stop:
        if trainer.step_count >= -(-total * chunks_done // n_chunks):  # trained enough on the data so far
            add_chunk(pc, cfg, policy, prompts, gen_engine, buffer, drafter.reads, chunks_done, rank, world)
            chunks_done += 1
            continue
        s = trainer.step_count
        trainer.set_lr(cfg.train.lr * lr_factor(s, total, pc.warmup))
        # record groups drawn ahead: the buffer's generator is already past them, so they are saved with the state
        queue = queue or buffer.sample_groups(cfg.train.batch_size, pc.bucket)
        last = trainer.step(collate(queue.pop(), buffer.steps))
        bad = bad + 1 if last["nonfinite"] else 0
        if bad >= 10:
            raise FloatingPointError(f"pretrain_drafter: {bad} non-finite drafter steps in a row at step {s}")
        bar.update(trainer.step_count - s)
        bar.set_postfix(loss=f"{last['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in last["acc"]), chunk=chunks_done)
        if trainer.step_count % pc.save_every == 0 or trainer.step_count == stop:
            trainer.save(state, extra={"chunks_done": chunks_done, "run_key": run_key, "queue": queue})
    bar.close()
    done = trainer.step_count >= total
    train_s = time.time() - t0
    extra = {"pretrain": {**asdict(pc), "steps": trainer.step_count, "total_steps": total, "world": world,
                          "rollouts": min(chunks_done, n_chunks) * pc.chunk * world,
                          "wall_s": round(train_s, 1), "last": last,
                          "optimizer_state_mb": optimizer_state_mb(acc, trainer)},
             "recipe_config": OmegaConf.to_container(cfg)}
    if done:
        acc.wait_for_everyone()
        extra["eval"] = evaluate(cfg, policy, prompts, drafter, pc) if main_proc else {}
    if main_proc:
        save_drafter(cfg.drafter.kind, drafter.eval(), out, verifier=cfg.policy.path, k=cfg.engine.k, extra=extra)
        print(json.dumps({"out": str(out), "steps": trainer.step_count, "done": done, **extra.get("eval", {})}))
        if done and not pc.keep_state:
            shutil.rmtree(state.parent, ignore_errors=True)
    acc.wait_for_everyone()
    return extra


def optimizer_state_mb(acc, trainer) -> list[float]:
    """Each process's optimizer state in MB (AdamW moments; under ZeRO also its fp32 master shard)."""
    mine = torch.tensor([trainer.optimizer_state_bytes() / 2**20], dtype=torch.float64)
    return [round(x, 3) for x in acc.gather(mine.to(acc.device)).cpu().tolist()]


def resume_key(pc: PretrainConfig, cfg, world: int) -> str:
    """The settings a resumed run must share with the run that wrote the state."""
    return (f"drafter.kind={cfg.drafter.kind} prompts={pc.prompts} chunk={pc.chunk} epochs={pc.epochs} "
            f"seed={pc.seed} world={world} "
            f"drafter.ttt_steps={cfg.drafter.ttt_steps} train.batch_size={cfg.train.batch_size} "
            f"train.lr={cfg.train.lr} train.loss={cfg.train.loss} train.tv_weight={cfg.train.tv_weight} "
            f"train.positions={cfg.train.positions} policy.path={cfg.policy.path} data.path={cfg.data.path}")


def choose_draft_vocab(pc, cfg, policy, source: Prompts, engine, drafter, acc) -> None:
    """A fresh drafter over fewer tokens than the vocabulary takes the most frequent of pc.vocab_rollouts plain
    rollouts (each process its share, in chunks; prompts no chunk draws) as its draft vocabulary."""
    if not drafter.needs_draft_vocab():
        return
    rank, world = acc.process_index, acc.num_processes
    n = math.ceil(pc.vocab_rollouts / world)
    seeds = [(pc.seed * 100_003 - 1 - c) * world + rank for c in range(math.ceil(n / pc.chunk))]  # add_chunk's: c >= 0
    batches = [[source.encode(r) for r in source.rows(min(pc.chunk, n - i * pc.chunk), seed=s)]
               for i, s in enumerate(seeds)]
    params = sampling_params(cfg.sampling, stop_token_ids=source.stop_ids, seed=pc.seed)
    note = vocab_from_rollouts(drafter, engine, batches, params, policy.config.vocab_size, source.stop_ids, acc)
    if note and acc.is_main_process:
        print(note)


def add_chunk(pc, cfg, policy, source: Prompts, engine, buffer, reads, c: int, rank: int, world: int) -> None:
    """Chunk c of this process's shard: AR rollouts on fresh prompts, then their features into the buffer. With
    `cache`, the features are saved per chunk (and process), and a later run with the same settings loads them."""
    seed = (pc.seed * 100_003 + c) * world + rank
    cached = Path(pc.cache) / f"chunk-{c}-of-{world}-{rank}.pt" if pc.cache else None
    if cached is not None and cached.is_file():
        saved = torch.load(cached, weights_only=True)
        if saved["key"] == cache_key(pc, cfg, reads):
            for feats in saved["feats"]:
                buffer.add(feats)
            return
    prompts = [source.encode(r) for r in source.rows(pc.chunk, seed=seed)]
    params = sampling_params(cfg.sampling, stop_token_ids=source.stop_ids, seed=seed)
    resp = engine.generate(prompts, params, speculative=False).tokens
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(resp[i]))  # little padding
    feats = []
    for g in range(0, len(order), pc.fwd_batch):
        idx = order[g:g + pc.fwd_batch]
        feats.append(teacher_forced_features(policy, [prompts[i] for i in idx], [resp[i] for i in idx], reads,
                                             cfg.drafter.ttt_steps))
        buffer.add(feats[-1])
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        torch.save({"key": cache_key(pc, cfg, reads), "feats": feats}, tmp)
        tmp.replace(cached)  # a reader never sees half a file


def cache_key(pc: PretrainConfig, cfg, reads) -> str:
    """What a chunk's cached features depend on: the data (policy, prompts, sampling, seed) and the features' form."""
    return (f"policy.path={cfg.policy.path} data={cfg.data.path}:{cfg.data.split}:{cfg.data.prompt_field} "
            f"eval_size={cfg.data.eval_size} chat={cfg.data.chat_template} seed={pc.seed} chunk={pc.chunk} "
            f"fwd_batch={pc.fwd_batch} "
            f"sampling={dict(cfg.sampling)} drafter.ttt_steps={cfg.drafter.ttt_steps} "
            f"reads={reads} format={FEATURE_FORMAT}")


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def evaluate(cfg, policy, source: Prompts, drafter, pc: PretrainConfig) -> dict:
    """Speculative rollouts on fresh prompts (user data: its held-out rows) with the recipe's engine (k, int8, draft
    sampling) and sampling."""
    engine = build_engine(cfg.engine, policy, drafter)
    problems = source.eval_rows(pc.eval_prompts, seed=10**9 + pc.seed)
    params = sampling_params(cfg.sampling, stop_token_ids=source.stop_ids, seed=pc.seed)
    stats, t0 = SpecStats(), time.time()
    for i in range(0, len(problems), cfg.engine.max_batch):
        prompts = [source.encode(p) for p in problems[i:i + cfg.engine.max_batch]]
        stats = stats.merge(engine.generate(prompts, params, speculative=True).stats)
    return {"k": cfg.engine.k, "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "acceptance_per_position": [round(a, 4) for a in stats.acceptance_per_position],
            "eval_prompts": len(problems), "temperature": cfg.sampling.temperature,
            "drafter_int8": cfg.engine.drafter_int8, "draft_sampling": cfg.engine.draft_sampling,
            "eval_wall_s": round(time.time() - t0, 1)}


def parse(argv: list[str]) -> PretrainConfig:
    mine = {f.name for f in fields(PretrainConfig)} - {"overrides"}
    own = [a for a in argv if a.split("=", 1)[0] in mine]
    try:
        pc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PretrainConfig), OmegaConf.from_dotlist(own)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from None
    pc.overrides = [a for a in argv if a not in own]
    return pc


if __name__ == "__main__":
    try:
        main(parse(sys.argv[1:]))
    except (FileNotFoundError, ConfigError) as e:
        sys.exit(f"pretrain_drafter: {e}")
