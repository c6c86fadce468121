"""Draft model (drafter.kind=draft_model): a small separate causal LM of the policy's family and tokenizer, with its
own KV cache, distilled online by forward KL to the policy's distributions (the logits of the policy's loss forward:
no extra policy pass).

A fresh one is the policy cut to its first drafter.draft_model.layers decoder layers (embeddings, those layers, the
final norm and the LM head copied; the embeddings stay frozen, as EAGLE's do): it drafts from the first step and
trains from there. Its weights are the HF model's own (state_dict names "model.layers.0...", "lm_head.weight"),
saved as an HF folder that vLLM's draft_model method also loads (`save` below, with a drafttrain block in
config.json naming the kind).

Its input is the text from token_0 (first_ids, then next_ids = token_1 ..): step i at feature position t predicts
token_{t+2+i}, the model's output at input position t+1+i, so one causal forward gives every TTT step.

The engine runs DraftModelRuntime: the self-drafter's LeanLlama forward (selfquant.py) over the draft model's
weights, fp32 prepacked or torch.ao int8 (engine.drafter_int8), chaining k drafts over its own cache.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from drafttrain.atomic import atomic_dir
from drafttrain.drafters import ttt
from drafttrain.drafters.contract import Reads, TrainableDrafter
from drafttrain.drafters.selfquant import SelfQuantDrafter
from drafttrain.drafters.weights import check_tensors
from drafttrain.device import module_device

KIND = "draft_model"


def _inputs(next_ids: torch.Tensor, T: int, steps: int, first_ids) -> torch.Tensor:
    """[B, T+steps]: token_0 (first_ids), then token_1 .. (next_ids)."""
    if first_ids is None:
        raise ValueError("draft model: features without first_ids (token_0); rebuild them with build_features")
    return torch.cat([first_ids.view(-1, 1).to(next_ids.dtype), next_ids[:, :T + steps - 1]], 1)


def _steps(logits: torch.Tensor, T: int, steps: int, queries) -> list[torch.Tensor]:
    """A causal forward's logits over _inputs -> the TTT steps: step i at t is the output at t+1+i."""
    if queries is None:
        return [logits[:, 1 + i:1 + i + T] for i in range(steps)]
    return [logits[:, queries + 1 + i] for i in range(steps)]


class DraftModelDrafter(nn.Module, TrainableDrafter):
    kind = KIND
    follows_policy = False
    trains = True  # distilled online (forward KL to the policy)
    reads = Reads()  # tokens only: nothing from the policy's forward but its logits (the targets)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.float()
        self.model.get_input_embeddings().weight.requires_grad_(False)

    # ---- weights: the HF model's names -------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        check_tensors(self.model.state_dict(), state_dict, hint="a draft model of another size or vocabulary?")
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.vocab_size, device=self.model.device)

    # ---- training -----------------------------------------------------------------------------------------------
    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list[torch.Tensor]:
        """aux [B, T, 0] (only its T is read); next_ids [B, T+steps-1]; first_ids [B]: steps x [B, T or S, V]."""
        return [self.head_logits(x) for x in self.ttt_hidden(aux, next_ids, steps, queries, first_ids)]

    def ttt_hidden(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list[torch.Tensor]:
        """ttt_logits before the LM head: steps x [B, T or S, H] (one causal forward of the backbone)."""
        T = aux.shape[1]
        h = self.model.model(input_ids=_inputs(next_ids, T, steps, first_ids)).last_hidden_state
        return _steps(h, T, steps, queries)

    def head_logits(self, x):
        return self.model.get_output_embeddings()(x)

    def ttt_loss(self, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None, objective: ttt.Objective = ttt.KL):
        """ttt.ttt_loss against the policy's distributions (objective: kl, tv or both), unrolled `steps` steps."""
        return ttt.ttt_loss(self, aux, next_ids, targets, valid, steps, decay, query_frac, generator,
                            first_ids=first_ids, objective=objective)

    @torch.no_grad()
    def fuse_for_inference(self, int8: bool) -> "DraftModelRuntime":
        return DraftModelRuntime(self.model, "int8" if int8 else "fp32", "ao" if int8 else "ref")


class DraftModelRuntime(SelfQuantDrafter):
    """The engine's form: the draft model's weights in the self-drafter's forward, chain and own KV cache (fp32 or
    int8). Also scored teacher-forced (ttt_logits) as the engine runs it."""
    kind = KIND
    follows_policy = False
    trains = False  # a runtime copy: the trainer trains DraftModelDrafter

    @torch.no_grad()
    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list[torch.Tensor]:
        B, T = aux.shape[:2]
        ids = _inputs(next_ids, T, steps, first_ids)
        self.body.ensure_rope(ids.shape[1])
        pos0 = torch.zeros(B, dtype=torch.long, device=ids.device)
        logits, _ = self.body.forward(ids, pos0, self.body.new_cache(B, ids.shape[1]))
        return _steps(logits, T, steps, queries)

    def ttt_hidden(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list[torch.Tensor]:
        """The runtime forward computes its logits in one piece (its head is fused into it): the logits, whose head
        is the identity (TrainableDrafter's defaults, which this inference form does not inherit)."""
        return self.ttt_logits(aux, next_ids, steps, queries, first_ids)

    def head_logits(self, x):
        return x

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.vocab_size, device=self.body.device)


# ---- registry entries: fresh, load, save ---------------------------------------------------------------------------

def fresh(cfg, policy) -> DraftModelDrafter:
    """The policy's first cfg.draft_model.layers decoder layers, its embeddings, final norm and LM head."""
    n, total = cfg.draft_model.layers, policy.config.num_hidden_layers
    if not 1 <= n <= total:
        raise ValueError(f"drafter.draft_model.layers: must be in [1, the policy's {total} layers], got {n}")
    c = copy.deepcopy(policy.config)
    c.num_hidden_layers = n
    if getattr(c, "layer_types", None):
        c.layer_types = list(c.layer_types)[:n]
    model = type(policy)(c).to(module_device(policy))
    own = model.state_dict()
    with torch.no_grad():
        model.load_state_dict({k: v.detach().clone() for k, v in policy.state_dict().items() if k in own})
    return DraftModelDrafter(model.eval())


def load(cfg, policy) -> DraftModelDrafter:
    """The HF folder at cfg.path (`save`'s); its vocabulary must be the policy's."""
    from transformers import AutoModelForCausalLM

    from drafttrain.paths import resolve_path

    path = resolve_path(cfg.path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    V, PV = model.config.vocab_size, policy.config.vocab_size
    if V != PV:
        raise ValueError(f"drafter.path: {cfg.path} is a draft model over {V} tokens; the policy has {PV} (pretrain "
                         f"one for it with scripts/pretrain_drafter.py drafter.kind=draft_model)")
    return DraftModelDrafter(model.eval())


def save(d: DraftModelDrafter, path, verifier="", k: int = 4, extra: dict | None = None) -> Path:
    """Atomic write of the HF folder (config.json with a drafttrain block, model.safetensors)."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        d.model.save_pretrained(str(tmp))
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["drafttrain"] = {"kind": KIND, "verifier": str(verifier), "k": k, **({"extra": extra} if extra else {})}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


# ---- its config section: drafter.draft_model --------------------------------------------------------------------
@dataclass
class Section:  # drafter.draft_model: a small separate LM (own KV cache), distilled online from the policy
    layers: int = 1  # decoder layers of a fresh draft model: the policy's first ones, copied


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.draft_model, message)."""
    return [(s.layers >= 1, "layers", f"must be >= 1, got {s.layers}")]
