"""DrafterTrainer: one drafter update per `step(batch)`, with HF accelerate (1 process, N under DDP, or N under
DeepSpeed ZeRO-1/2: the launcher's accelerate config decides, see make_accelerator).

    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter, buffer=FeatureBuffer(...), head=TargetHead(W))
    out = trainer.step(trainer.buffer.sample(cfg.train.batch_size))   # {loss, acc[steps], grad_norm, nonfinite}
    trainer.save("runs/x/.state/trainer.pt"); trainer.load(...)        # drafter + optimizer + step + buffer + rng

The loss is the drafter's own `ttt_loss` (train.loss against the policy: soft cross-entropy, total variation or
both, at train.positions; unrolled cfg.drafter.ttt_steps steps, step i weighted ttt_decay**i), its targets the
policy's distributions recomputed from the batch's hidden states with `head` (the policy's LM head: drafters/targets.py). Under `accelerate launch` with N processes each process feeds its own shard
and DDP averages the gradients. A non-finite loss or gradient on any process skips the update on every process
(no weight or optimizer change) and reports nonfinite=True. `step` is the single unit of work: time budgets and
background modes wrap it, they do not change it.

Under DeepSpeed the engine owns the optimizer step: accelerate's backward runs it (clipping at train.max_grad_norm,
skipping on a non-finite gradient on any process), each process keeps its shard of the AdamW state and of the fp32
master weights, and weights set from outside (set_weights) are copied into those masters too. A checkpoint is then a
folder written through accelerate's save_state (the sharded optimizer state) plus each process's own state.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import DistributedType

from drafttrain.checkpoint import load_checkpoint
from drafttrain.config import ConfigError
from drafttrain.device import generator_state, load_generator_state, module_device, to_device
from drafttrain.drafters import ttt
from drafttrain.drafters.targets import Targets
from drafttrain.train_config import check_train


def make_accelerator(device: torch.device | str = "cpu") -> Accelerator:
    """The job's Accelerator on the run's device (run.device), as the launcher's accelerate config says: one
    process; N processes with DDP; or N processes with DeepSpeed, whose engine then trains the drafter (the policy
    is not given to it). Mixed precision is the launcher's (--mixed_precision bf16: the drafter's forward)."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # accelerate places on the current CUDA device
    # accelerate turns DeepSpeed off under cpu=True; without a GPU its engine runs on the CPU anyway
    return Accelerator(cpu=not deepspeed and device.type == "cpu", kwargs_handlers=process_group_kwargs())


def process_group_kwargs(cuda: bool | None = None) -> list:
    """Several processes without a GPU: gloo (accelerate's own choice fails DeepSpeed's batch-size check on CPU);
    with one, accelerate's default (nccl)."""
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return [InitProcessGroupKwargs(backend="gloo")] if multi and not cuda else []


def _configure_deepspeed(acc: Accelerator, cfg_train) -> None:
    """The recipe's batch and clipping into the DeepSpeed config (the recipe wins); one update per step."""
    ds = acc.state.deepspeed_plugin.deepspeed_config
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):  # ZeRO-3 shards the weights themselves: the engines are served whole drafters
        raise ConfigError(f"deepspeed_config.zero_stage: the drafter trains under ZeRO stage 0, 1 or 2, got {stage}")
    accum = ds.get("gradient_accumulation_steps", "auto")
    if accum not in ("auto", 1):
        raise ConfigError(f"deepspeed_config.gradient_accumulation_steps: must be 1 (a drafter step is one update), "
                          f"got {accum}")
    ds["gradient_accumulation_steps"] = 1
    ds["train_micro_batch_size_per_gpu"] = int(cfg_train.batch_size)
    ds["train_batch_size"] = int(cfg_train.batch_size) * acc.num_processes
    clip = float(cfg_train.max_grad_norm)
    ds["gradient_clipping"] = clip if clip != float("inf") else 0.0  # 0: DeepSpeed does not clip


class _TTTLoss(nn.Module):
    """Routes the loss through forward() so a DDP wrapper sees the call and syncs the gradients."""

    def __init__(self, drafter: nn.Module, steps: int, decay: float, query_frac: float = 1.0, seed: int = 0,
                 objective: ttt.Objective = ttt.KL):
        super().__init__()
        self.drafter, self.steps, self.decay, self.query_frac = drafter, steps, decay, query_frac
        self.objective = objective
        self.gen = torch.Generator(device=module_device(drafter)).manual_seed(seed)  # on the draws' device
        self.head = None  # the targets' TargetHead, set per step (a plain attribute: DDP sees only the tensors)

    def forward(self, aux, next_ids, hidden, valid, first_ids=None):
        return self.drafter.ttt_loss(aux, next_ids, Targets(hidden, self.head), valid, self.steps, self.decay,
                                     query_frac=self.query_frac, generator=self.gen, first_ids=first_ids,
                                     objective=self.objective)


class DrafterTrainer:
    def __init__(self, drafter, cfg_train, drafter_cfg, accelerator: Accelerator | None = None, buffer=None,
                 head=None):
        # hooks users: the drafter's device (build_drafter puts it on the policy's)
        self.acc = accelerator or make_accelerator(module_device(drafter))
        self.head = head  # the policy's LM head (TargetHead): the default for step()
        self.buffer_note: str | None = None  # what load() could not keep (buffer, random state), for the caller to say
        self.deepspeed = self.acc.distributed_type == DistributedType.DEEPSPEED
        if self.deepspeed:
            _configure_deepspeed(self.acc, cfg_train)
        self.drafter, self.cfg, self.buffer = drafter, cfg_train, buffer
        self.steps, self.decay = int(drafter_cfg.ttt_steps), float(drafter_cfg.ttt_decay)
        drafter.train()
        # a loaded chain drafter's attention scores held constant (train.score_grad false); a fresh drafter
        # (drafter.path null) always trains them, and kinds without them (draft model, auto) train as usual
        if not getattr(cfg_train, "score_grad", True) and getattr(drafter_cfg, "path", None) is not None:
            drafter.freeze_scores()
        params = [p for p in drafter.parameters() if p.requires_grad]  # embed_tokens is frozen
        # fused: one kernel over all parameters, cheaper than foreach (bench/NOTES.md; DeepSpeed brings its own step)
        opt = torch.optim.AdamW(params, lr=cfg_train.lr, weight_decay=cfg_train.weight_decay,
                                fused=not self.deepspeed)
        check_train(cfg_train)  # also built from sections that skipped config.validate (scripts, probes)
        # kept unwrapped: its generator (the query positions' draws) is part of the resume state
        self.ttt = _TTTLoss(drafter, self.steps, self.decay, float(getattr(cfg_train, "query_frac", 1.0)),
                            int(getattr(cfg_train, "seed", 0)), ttt.Objective.of(cfg_train))
        self.model, self.opt = self.acc.prepare(self.ttt, opt)
        self.params = params
        self.step_count = 0

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self, batch: dict[str, torch.Tensor], head=None) -> dict:
        """One update on a padded feature batch (build_features / FeatureBuffer.sample output); head: the targets'
        TargetHead (default: the trainer's)."""
        dev = self.acc.device
        self.ttt.head = head if head is not None else self.head
        if self.ttt.head is None:
            raise ValueError("DrafterTrainer.step: no LM head for the targets (give head= to the trainer or the step)")
        batch = to_device(dict(batch), dev)  # from pinned host memory: not blocking
        loss, accs = self.model(batch["aux"].float(), batch["next_ids"], batch["hidden"], batch["valid"],
                                first_ids=batch.get("first_ids"))
        if self.deepspeed:
            return self._deepspeed_step(loss, accs)
        self.acc.backward(loss)
        gn = self.acc.clip_grad_norm_(self.params, self.cfg.max_grad_norm)  # synced grads: same on every process
        gn = torch.as_tensor(gn, dtype=torch.float32, device=dev)
        bad = torch.tensor([float(not torch.isfinite(loss.detach())) + float(not torch.isfinite(gn))], device=dev)
        bad = bool(self.acc.reduce(bad, "sum").item() > 0)  # every process takes the same branch
        if not bad:
            self.opt.step()
            self.step_count += 1
        self.opt.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()), "acc": accs, "grad_norm": float(gn), "nonfinite": bad,
                "step": self.step_count}

    def _deepspeed_step(self, loss, accs) -> dict:
        """accelerate's backward is DeepSpeed's backward + step: it clips, and skips the update when the gradient
        is non-finite on any process (its overflow check is a collective), which skipped_steps counts."""
        skipped = self.model.skipped_steps
        self.acc.backward(loss)
        bad = self.model.skipped_steps > skipped
        if not bad:
            self.step_count += 1
        gn = self.acc.clip_grad_norm_(self.params, self.cfg.max_grad_norm)  # the norm before clipping
        return {"loss": float(loss.detach()), "acc": accs, "grad_norm": float("inf") if bad else float(gn),
                "nonfinite": bad, "step": self.step_count}

    def set_weights(self, weights: dict, reset_optimizer: bool = False) -> None:
        """Load drafter weights from outside the optimizer (the gate's reset, a rollback); under DeepSpeed also into
        its fp32 master shards, which the next step would otherwise write back over them."""
        self.drafter.load_state_dict(weights)
        if self.deepspeed:
            self.opt.optimizer.refresh_fp32_params()
        if reset_optimizer:
            self._inner_optimizer().state.clear()

    def restore(self, weights: dict) -> None:
        """Back to known-good drafter weights after an update that diverged; the optimizer's moments (diverged
        with it) start over."""
        self.set_weights(weights, reset_optimizer=True)

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW (under DeepSpeed: over this process's fp32 shard)."""
        opt = self.opt.optimizer
        return opt.optimizer if self.deepspeed else opt

    def optimizer_state_bytes(self) -> int:
        """Bytes this process holds for the optimizer: AdamW's moments, plus DeepSpeed's fp32 master shard."""
        opt = self._inner_optimizer()
        n = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
        if self.deepspeed:
            n += sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
        return n

    # ---- checkpointing ----------------------------------------------------------------------------------
    def _rank_path(self, path: Path) -> Path:
        r = self.acc.process_index
        return path if r == 0 else path.with_name(f"{path.stem}.rank{r}{path.suffix}")

    def save(self, path: str | Path, extra: dict | None = None, weights: bool = True) -> None:
        """Drafter weights + optimizer + step (process 0) and each process's buffer shard and query-position
        generator; atomic per file. `extra`: the caller's own resume state (e.g. a data cursor), per process, returned
        by load() to the process that saved it. weights=False: without the drafter's weights (the caller stores them;
        load() then leaves the drafter as it is). Under DeepSpeed: the folder path.ds instead (see _save_deepspeed),
        whose engine state holds the weights either way."""
        path = Path(path)
        state: dict = {"step": self.step_count, "world": self.acc.num_processes, "extra": extra or {},
                       "ttt_gen": generator_state(self.ttt.gen)}
        if self.buffer is not None:
            state["buffer"] = self.buffer.state_dict()
        if self.deepspeed:
            return self._save_deepspeed(path.with_suffix(".ds"), state)
        if self.acc.is_main_process:
            state["optimizer"] = self.opt.state_dict()
            if weights:
                state["drafter"] = self.drafter.state_dict()
        if self.acc.is_main_process or self.buffer is not None:
            out = self._rank_path(path)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
            torch.save(state, tmp)
            os.replace(tmp, out)
        self.acc.wait_for_everyone()

    def _save_deepspeed(self, folder: Path, state: dict) -> None:
        """accelerate's save_state (the engine's weights and every process's optimizer shard) and each process's
        state.rankN.pt, written into a new folder that then replaces `folder` whole (a kill leaves the old one)."""
        tmp = folder.with_name(f".{folder.name}.tmp")
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp))
        torch.save(state, tmp / f"state.rank{self.acc.process_index}.pt")
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        self.acc.wait_for_everyone()

    def weights_left_out(self) -> dict | None:
        """What save(weights=False) leaves for its caller to store: a copy of the drafter's weights (training goes
        on); None under DeepSpeed, whose engine state holds them."""
        return None if self.deepspeed else {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}

    @staticmethod
    def saved(path: str | Path) -> bool:
        """Is there a trainer state at `path` (save's file, or its DeepSpeed folder path.ds)?"""
        return Path(path).is_file() or Path(path).with_suffix(".ds").is_dir()

    def load(self, path: str | Path, weights: dict | None = None) -> dict:
        """save()'s state back; weights: the drafter's, where save() left them out (loaded last, as set_weights)."""
        path = Path(path)
        folder = path.with_suffix(".ds")
        if self.deepspeed != folder.is_dir() and (path.is_file() or folder.is_dir()):
            raise ValueError(f"trainer state {path}: saved {'with' if folder.is_dir() else 'without'} DeepSpeed, "
                             f"resumed {'with' if self.deepspeed else 'without'} it (launch with the accelerate "
                             f"config that wrote it)")
        extra = self._load_deepspeed(folder) if self.deepspeed else self._load_file(path)
        if weights is not None:
            self.set_weights(weights)
        return extra

    def _load_file(self, path: Path) -> dict:
        main = load_checkpoint(path)  # tensors and plain containers only: CheckpointError otherwise
        self._check_world(path, main)
        if "drafter" in main:  # absent: saved with weights=False
            self.drafter.load_state_dict(main["drafter"])
        self.opt.load_state_dict(main["optimizer"])
        self.step_count = int(main["step"])
        own = main  # a process without a buffer writes no file of its own: it takes process 0's generator and extra
        if self.buffer is not None:
            own = main if self.acc.is_main_process else load_checkpoint(self._rank_path(path))
            if "buffer" in own:
                self.buffer_note = self.buffer.load_state_dict(own["buffer"])
        return self._load_own(own)

    def _load_deepspeed(self, folder: Path) -> dict:
        own = load_checkpoint(folder / f"state.rank{self.acc.process_index}.pt")
        self._check_world(folder, own)
        self.acc.load_state(str(folder))  # the engine's weights and this process's optimizer shard
        self.step_count = int(own["step"])
        if self.buffer is not None and "buffer" in own:
            self.buffer_note = self.buffer.load_state_dict(own["buffer"])
        return self._load_own(own)

    def _check_world(self, path: Path, state: dict) -> None:
        if state["world"] != self.acc.num_processes:
            raise ValueError(f"trainer state {path}: saved with {state['world']} processes, resumed with "
                             f"{self.acc.num_processes} (the buffer shards would not match)")

    def _load_own(self, own: dict) -> dict:
        if "ttt_gen" in own:  # absent from states written before it was saved: the generator stays as it is
            note = load_generator_state(self.ttt.gen, own["ttt_gen"], "train.query_frac's position draws")
            self.buffer_note = "; ".join(filter(None, [self.buffer_note, note])) or None
        return own["extra"]
