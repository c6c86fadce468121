"""Train the shipped tiny policy: SFT a small Llama on the task (drafttrain/policy/task.py).

    python scripts/make_policy.py                      # one stage, in the task's world (CHECK_P of responses check)
    python scripts/make_policy.py out=/tmp/p steps=50 eval_n=64
    python scripts/make_policy.py init=checkpoints/policy out=/tmp/p2 steps=800 lr=1e-3   # a second SFT stage

Builds the char tokenizer and a fresh fp32 Llama (sizes: drafttrain.policy.model.PolicyConfig),
trains it with AdamW (warmup + cosine) on length-bucketed batches with the loss on the
response only (each step by the task's right or wrong rule at random, as its SFT teacher writes), then samples
`eval_n` held-out problems at temperature 1.0 and writes `task_eval.json` (accuracy,
response-length stats) beside the weights. The step count is chosen so training ends "decent
but imperfect", leaving RL room to improve. Deterministic in `seed` for a fixed thread count.

The shipped checkpoint is three stages (2 threads each): the chain alone first, as a fresh policy trained with the
long checks from the start loses the countdown (sampled accuracy 0.0-0.035), then two stages with the checks:

    python scripts/make_policy.py check_p=0 out=/tmp/p0
    python scripts/make_policy.py init=/tmp/p0 out=/tmp/p1 steps=800 lr=1e-3 warmup=10 seed=1
    python scripts/make_policy.py init=/tmp/p1 steps=2000 lr=1e-3 warmup=10 seed=2     # -> checkpoints/policy

Each rule is computed right at almost every step and the wrong one chosen at most of them, as the SFT teacher did;
its training time and accuracy: bench/NOTES.md, World.

Simplifies on purpose: one process, no packing, no validation loss, no checkpoint resume.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from drafttrain.policy.model import PolicyConfig, build_policy, load_policy, save_policy
from drafttrain.policy.sft import sample_eval, sft_batches
from drafttrain.policy.task import make_problems
from drafttrain.policy.tokenizer import build_tokenizer


@dataclass
class MakePolicyConfig:
    out: str = "checkpoints/policy"
    init: str | None = None  # a saved policy to go on training (a second SFT stage), else a fresh one
    check_p: float | None = None  # share of SFT responses that check after the answer; None: the task's CHECK_P
    seed: int = 0
    threads: int = 2
    model: PolicyConfig = field(default_factory=PolicyConfig)
    steps: int = 2000
    tokens_per_batch: int = 512  # small batches, many steps
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_n: int = 256
    eval_seed: int = 1_000_003  # held out: training draws from `seed`
    eval_temperature: float = 1.0
    save_dtype: str = "float32"  # "float32" or "bfloat16"; the eval runs on the stored (rounded) weights


def lr_at(cfg: MakePolicyConfig, step: int) -> float:
    """Linear warmup times cosine decay (over all steps) to `min_lr_ratio * lr`."""
    warm = min(1.0, (step + 1) / cfg.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def main(cfg: MakePolicyConfig) -> dict:
    if cfg.save_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"save_dtype must be float32 or bfloat16, got {cfg.save_dtype}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if cfg.init:
        model, tok = load_policy(cfg.init)
        model.train()
    else:
        tok = build_tokenizer()
        model = build_policy(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"policy: {n_params / 1e6:.1f}M params, {OmegaConf.to_yaml(OmegaConf.structured(cfg.model))}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    batches = sft_batches(tok, cfg.seed, cfg.tokens_per_batch, check_p=cfg.check_p)

    model.train()
    t0, n_tok, losses = time.time(), 0, []
    bar = tqdm(range(cfg.steps), desc="sft")
    for step in bar:
        batch = next(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_tok += batch["input_ids"].numel()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.4f}", tok_s=f"{n_tok / (time.time() - t0):.0f}")
    train_s = time.time() - t0

    save_dtype = getattr(torch, cfg.save_dtype)
    with torch.no_grad():  # evaluate exactly what load_policy will return
        for p in model.parameters():
            p.copy_(p.to(save_dtype).float())
    t1 = time.time()
    ev = sample_eval(model, tok, make_problems(cfg.eval_n, cfg.eval_seed), temperature=cfg.eval_temperature,
                     seed=cfg.seed)
    ev.update(params=n_params, train_steps=cfg.steps, train_tokens=n_tok, train_seconds=round(train_s, 1),
              train_tok_per_s=round(n_tok / train_s), final_loss=round(sum(losses[-20:]) / len(losses[-20:]), 4),
              eval_seconds=round(time.time() - t1, 1))
    print(json.dumps(ev, indent=1))
    extra = {"task_eval.json": json.dumps(ev, indent=1) + "\n",
             "make_policy_config.yaml": OmegaConf.to_yaml(OmegaConf.structured(cfg))}
    save_policy(model, tok, cfg.out, extra=extra, save_dtype=save_dtype)
    print(f"wrote {os.path.abspath(cfg.out)}")
    return ev


if __name__ == "__main__":
    schema = OmegaConf.structured(MakePolicyConfig)
    cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(sys.argv[1:]))
    main(OmegaConf.to_object(cfg))
