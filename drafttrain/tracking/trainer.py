"""DrafterTrainer: one drafter update per `step(batch)`, with HF accelerate (1 process, or N under DDP).

    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter, buffer=FeatureBuffer(...))
    out = trainer.step(trainer.buffer.sample(cfg.train.batch_size))   # {loss, acc[steps], grad_norm, nonfinite}
    trainer.save("runs/x/.state/trainer.pt"); trainer.load(...)        # drafter + optimizer + step + buffer + rng

The loss is the drafter's own `ttt_loss` (soft cross-entropy against the policy, unrolled cfg.drafter.ttt_steps
steps, step i weighted ttt_decay**i). Under `accelerate launch` with N processes each process feeds its own shard
and DDP averages the gradients. A non-finite loss or gradient on any process skips the update on every process
(no weight or optimizer change) and reports nonfinite=True. `step` is the single unit of work: time budgets and
background modes wrap it, they do not change it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator

from drafttrain.tracking.runfolder import load_checkpoint


class _TTTLoss(nn.Module):
    """Routes the loss through forward() so a DDP wrapper sees the call and syncs the gradients."""

    def __init__(self, drafter: nn.Module, steps: int, decay: float, query_frac: float = 1.0, seed: int = 0):
        super().__init__()
        self.drafter, self.steps, self.decay, self.query_frac = drafter, steps, decay, query_frac
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, aux, next_ids, target_probs, valid):
        return self.drafter.ttt_loss(aux, next_ids, target_probs, valid, self.steps, self.decay,
                                     query_frac=self.query_frac, generator=self.gen)


class DrafterTrainer:
    def __init__(self, drafter, cfg_train, drafter_cfg, accelerator: Accelerator | None = None, buffer=None):
        self.acc = accelerator or Accelerator(cpu=True)
        self.drafter, self.cfg, self.buffer = drafter, cfg_train, buffer
        self.steps, self.decay = int(drafter_cfg.ttt_steps), float(drafter_cfg.ttt_decay)
        drafter.train()
        params = [p for p in drafter.parameters() if p.requires_grad]  # embed_tokens is frozen
        opt = torch.optim.AdamW(params, lr=cfg_train.lr, weight_decay=cfg_train.weight_decay)
        qf = float(getattr(cfg_train, "query_frac", 1.0))
        if not 0.0 < qf <= 1.0:
            raise ValueError(f"train.query_frac must be in (0, 1], got {qf}")
        # kept unwrapped: its generator (the query positions' draws) is part of the resume state
        self.ttt = _TTTLoss(drafter, self.steps, self.decay, qf, int(getattr(cfg_train, "seed", 0)))
        self.model, self.opt = self.acc.prepare(self.ttt, opt)
        self.params = params
        self.step_count = 0

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self, batch: dict[str, torch.Tensor]) -> dict:
        """One update on a padded feature batch (build_features / FeatureBuffer.sample output)."""
        dev = self.acc.device
        loss, accs = self.model(*(batch[k].to(dev) for k in ("aux", "next_ids", "target_probs", "valid")))
        self.acc.backward(loss)
        gn = self.acc.clip_grad_norm_(self.params, self.cfg.max_grad_norm)  # synced grads: same on every process
        gn = torch.as_tensor(gn, dtype=torch.float32)
        bad = torch.tensor([float(not torch.isfinite(loss.detach())) + float(not torch.isfinite(gn))], device=dev)
        bad = bool(self.acc.reduce(bad, "sum").item() > 0)  # every process takes the same branch
        if not bad:
            self.opt.step()
            self.step_count += 1
        self.opt.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()), "acc": accs, "grad_norm": float(gn), "nonfinite": bad,
                "step": self.step_count}

    def restore(self, weights: dict) -> None:
        """Back to known-good drafter weights after an update that diverged; the optimizer's moments (diverged
        with it) start over."""
        self.drafter.load_state_dict(weights)
        self.opt.state.clear()

    # ---- checkpointing ----------------------------------------------------------------------------------
    def _rank_path(self, path: Path) -> Path:
        r = self.acc.process_index
        return path if r == 0 else path.with_name(f"{path.stem}.rank{r}{path.suffix}")

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Drafter weights + optimizer + step (process 0) and each process's buffer shard and query-position
        generator; atomic per file. `extra`: the caller's own resume state (e.g. a data cursor), per process, returned
        by load() to the process that saved it."""
        path = Path(path)
        state: dict = {"step": self.step_count, "world": self.acc.num_processes, "extra": extra or {},
                       "ttt_gen": self.ttt.gen.get_state()}
        if self.acc.is_main_process:
            state.update(drafter=self.drafter.state_dict(), optimizer=self.opt.state_dict())
        if self.buffer is not None:
            state["buffer"] = self.buffer.state_dict()
        if self.acc.is_main_process or self.buffer is not None:
            out = self._rank_path(path)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            torch.save(state, tmp)
            os.replace(tmp, out)
        self.acc.wait_for_everyone()

    def load(self, path: str | Path) -> dict:
        path = Path(path)
        main = load_checkpoint(path)  # tensors and plain containers only: CheckpointError otherwise
        if main["world"] != self.acc.num_processes:
            raise ValueError(f"trainer state {path}: saved with {main['world']} processes, resumed with "
                             f"{self.acc.num_processes} (the buffer shards would not match)")
        self.drafter.load_state_dict(main["drafter"])
        self.opt.load_state_dict(main["optimizer"])
        self.step_count = int(main["step"])
        own = main  # a process without a buffer writes no file of its own: it takes process 0's generator and extra
        if self.buffer is not None:
            own = main if self.acc.is_main_process else load_checkpoint(self._rank_path(path))
            if "buffer" in own:
                self.buffer.load_state_dict(own["buffer"])
        if "ttt_gen" in own:  # absent from states written before it was saved: the generator stays as it is
            self.ttt.gen.set_state(own["ttt_gen"])
        return own["extra"]
