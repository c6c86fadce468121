"""Hidden-state capture from an ordinary policy forward, and the features the drafter trains on (PolicyCapture: the
tracker's, for every forward between start and stop).

    with HiddenCapture(policy, drafter.aux_layer_ids) as cap:
        h = policy.model(ids, attention_mask=mask).last_hidden_state   # e.g. the RL loss forward: no extra pass
    batch = build_features(ids, mask, cap.features(), h, steps=3, response_start=prompt_lens)
    loss, accs = drafter.ttt_loss(batch["aux"], batch["next_ids"], Targets(batch["hidden"], TargetHead(head_weight)),
                                  batch["valid"], 3, 0.8)

Forward pre-hooks on policy.model.layers[i] record each layer's input, which is HF hidden_states[i] and the aux
layer id convention of LeanLlama and vLLM's EAGLE-3. The hooks only store a detached reference (no copy, no
graph kept). They are removed on exit, also on exceptions.

Simplifies on purpose: features() returns the latest forward's capture (one forward per context is the normal
use; with gradient checkpointing the recompute overwrites it with identical values).
"""
from __future__ import annotations

import contextlib

import torch

from drafttrain.drafters.contract import Reads


class HiddenCapture:
    def __init__(self, policy, layer_ids):
        layers = policy.model.layers
        ids = sorted(int(i) for i in layer_ids)
        if not ids or len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= len(layers):
            raise ValueError(f"HiddenCapture: layer_ids {list(layer_ids)} must be distinct layers in "
                             f"[0, {len(layers) - 1}]")
        self.policy, self.layer_ids = policy, tuple(ids)
        self._layers = [layers[i] for i in ids]
        self._handles: list = []
        self._saved: dict[int, torch.Tensor] = {}

    def _hook(self, i: int):
        def pre_hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._saved[i] = x.detach()  # [B, T, H]

        return pre_hook

    def __enter__(self) -> "HiddenCapture":
        self._saved.clear()
        for i, layer in zip(self.layer_ids, self._layers):
            self._handles.append(layer.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def layer_inputs(self) -> list[torch.Tensor]:
        """The captured layer inputs, [B, T, H] each, detached, in layer-id order."""
        missing = [i for i in self.layer_ids if i not in self._saved]
        if missing:
            raise RuntimeError(f"HiddenCapture: nothing captured for layers {missing} (run the policy forward "
                               f"inside the `with` block)")
        return [self._saved[i] for i in self.layer_ids]

    def features(self) -> torch.Tensor:
        """[B, T, A*H] detached: the captured layer inputs concatenated in layer-id order."""
        return torch.cat(self.layer_inputs(), -1)


@torch.no_grad()
def build_features(ids: torch.Tensor, mask: torch.Tensor, aux: torch.Tensor, hidden: torch.Tensor, steps: int,
                   response_start) -> dict[str, torch.Tensor]:
    """One captured forward -> the tensors ttt_loss needs (rows moved to start at column 0). No distribution is kept:
    the targets are recomputed from `hidden` with the policy's LM head where they are read (drafters/targets.py).

    ids [B, T]; mask: attention mask [B, T] (1 = real token, contiguous per row, left or right padding) or row
    lengths [B]; aux [B, T, X] (what the drafter reads); hidden [B, T, H] the policy's final hidden state (after its
    final norm: logits = its LM head of it); response_start: int or [B], the column (in the given layout) of each
    row's first response token. Returns, with T' = the longest row, in the inputs' dtypes:
        aux [B, T', X], hidden [B, T', H] (0 past a row's end), next_ids [B, T'+steps-1] (next_ids[:, t] =
        token_{t+1}, 0 past the end), valid [B, T'+steps] (position j counts iff the token it predicts, j+1, is a
        response token of that row), lengths [B], start [B] (the first response column), first_ids [B] = token_0
        (a draft model's first input; next_ids starts at token_1).
    """
    B, T = ids.shape
    dev = ids.device
    if mask.dim() == 1:  # lengths, right-padded
        lengths, offset = mask.long().to(dev), torch.zeros(B, dtype=torch.long, device=dev)
    else:
        m = mask.bool()
        lengths = m.sum(1)
        offset = m.long().argmax(1)  # first real column
    rs = torch.as_tensor(response_start, dtype=torch.long, device=dev).expand(B) - offset  # response start, shifted
    Tp = int(lengths.max())
    col = torch.arange(Tp, device=dev).view(1, Tp)
    src = (col + offset.view(B, 1)).clamp_max(T - 1)  # [B, T'] gather index into the given layout
    real = col < lengths.view(B, 1)  # [B, T']
    tok = ids.gather(1, src).masked_fill(~real, 0)
    a, h = (_rows_at(x, src, real, bool(offset.any())) for x in (aux, hidden))
    next_ids = torch.cat([tok[:, 1:], tok.new_zeros(B, steps)], 1)  # [B, T'+steps-1]
    valid = valid_mask(rs, lengths, Tp + steps)
    return {"aux": a, "hidden": h, "next_ids": next_ids, "valid": valid, "lengths": lengths, "start": rs.clamp_min(0),
            "first_ids": tok[:, 0]}


def _rows_at(x: torch.Tensor, src: torch.Tensor, real: torch.Tensor, shifted: bool) -> torch.Tensor:
    """x [B, T, X] -> [B, T', X]: each row's real columns from column 0, zeros past its end."""
    B, Tp = src.shape
    if not shifted:  # right padding (the RL loss forward's): the first T' columns as they are
        return torch.where(real.unsqueeze(-1), x[:, :Tp], 0.0)
    # row-wise indexing copies whole feature vectors: cheaper than a gather with an index expanded over X
    return x[torch.arange(B, device=x.device).view(B, 1), src].masked_fill_(~real.unsqueeze(-1), 0)


def valid_mask(start: torch.Tensor, lengths: torch.Tensor, N: int) -> torch.Tensor:
    """[B, N] bool: position j counts iff the token it predicts, j+1, is a response token (start <= j+1 < length)."""
    j = torch.arange(N, device=lengths.device).view(1, -1)
    return (j + 1 >= start.view(-1, 1)) & (j + 1 < lengths.view(-1, 1))


@torch.no_grad()
def teacher_forced_features(policy, prompts: list[list[int]], responses: list[list[int]], reads,
                            steps: int) -> dict[str, torch.Tensor]:
    """Features of finished rollouts (offline data): one backbone forward over prompt + response, right-padded (the
    LM head is not run: the targets are recomputed from the final hidden state where they are read).
    reads: the drafter's Reads (or its aux layer ids): aux layer inputs, then the final hidden state, as it reads."""
    reads = reads if isinstance(reads, Reads) else Reads(aux_layers=tuple(int(i) for i in reads))
    dev = policy.get_input_embeddings().weight.device
    seqs = [p + r for p, r in zip(prompts, responses)]
    lengths = torch.tensor([len(s) for s in seqs], device=dev)
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long, device="cpu")  # [B, T], filled on the host
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, device="cpu")
    ids = ids.to(dev)
    mask = (torch.arange(ids.shape[1], device=dev).view(1, -1) < lengths.view(-1, 1)).long()
    with contextlib.ExitStack() as stack:
        cap = stack.enter_context(HiddenCapture(policy, reads.aux_layers)) if reads.aux_layers else None
        h = policy.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H], after the final norm
    parts = ([cap.features()] if cap is not None else []) + ([h] if reads.final_hidden else [])
    aux = torch.cat(parts, -1) if parts else h.new_zeros(*ids.shape, 0)
    return build_features(ids, lengths, aux, h, steps, torch.tensor([len(p) for p in prompts], device=dev))


class PolicyCapture:
    """The tracker's capture: from start() to stop(), every policy forward becomes build_features and goes to
    sink(feats, started) (started: clock() when the forward's capture work began, so the sink can charge it).

    It serves the drafter's Reads: aux layer inputs from HiddenCapture's layer pre-hooks, the final hidden state
    (read by a drafter that takes it, and the targets' source for every kind) from a hook on the backbone, token ids
    from a hook on the model itself. The logits are never read (nor needed: a forward that returns none, TRL's fused
    LM head, or only the last n with logits_to_keep, captures the same): capture copies hidden states of the kept
    rows, no vocabulary-sized work. response_start: int or [B] (first response column per row); None = the first
    column whose `labels` is not -100 when the forward gets labels, else 0. grad_only: keep only forwards run with
    autograd on (the loss forward), not no-grad generation or scoring forwards of the same model (TRL). rows: keep
    only some rows of each forward."""

    def __init__(self, policy, reads, steps: int, sink, clock, response_start=None, grad_only: bool = False,
                 rows=None):
        self.policy, self.reads, self.steps, self.sink, self.clock = policy, reads, steps, sink, clock
        self.response_start, self.grad_only = response_start, grad_only
        self.rows = rows  # rows(B) -> the row indices to keep of a forward's B ([0]: none), or None for all
        self.hidden = HiddenCapture(policy, reads.aux_layers) if reads.aux_layers else None
        self._final: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def start(self) -> "PolicyCapture":
        self._handles = [self.policy.register_forward_hook(self._on_forward, with_kwargs=True),
                         self.policy.model.register_forward_hook(self._on_backbone)]
        if self.hidden is not None:
            self.hidden.__enter__()
        return self

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.hidden is not None:
            self.hidden.__exit__(None, None, None)

    def _on_backbone(self, module, args, output) -> None:
        self._final["h"] = (output[0] if isinstance(output, tuple) else output.last_hidden_state).detach()

    def _on_forward(self, module, args, kwargs, output) -> None:
        if self.grad_only and not torch.is_grad_enabled():
            return
        t0 = self.clock()
        ids = kwargs.get("input_ids", args[0] if args else None).detach()
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.detach()
        B, T = ids.shape
        rs = response_columns(self.response_start, kwargs.get("labels"), B, T, ids.device)
        idx = self.rows(B) if self.rows is not None else None
        h = self._final["h"]  # [B, T, H]
        if idx is not None:  # only these rows: build_features' work is per row
            if not idx.numel():
                return
            idx = idx.to(ids.device)
            ids, mask, rs, h = ids[idx], mask[idx], rs[idx], h[idx]
        self.sink(build_features(ids, mask, self._aux(B, T, idx), h, self.steps, rs), t0)

    def _aux(self, B: int, T: int, idx=None) -> torch.Tensor:
        """[B, T, X] (rows idx only, when given): what the drafter reads (Reads), concatenated; X = 0 for none."""
        parts = list(self.hidden.layer_inputs()) if self.hidden is not None else []
        if self.reads.final_hidden:
            parts.append(self._final["h"])
        if idx is not None:  # the kept rows before the concatenation, not after: it copies every row it gets
            parts = [p[idx] for p in parts]
        if parts:
            return torch.cat(parts, -1)
        h = self._final["h"]
        return h.new_zeros(B if idx is None else len(idx), T, 0)


def choose_rows(B: int, holdout_frac: float, capture_frac: float, held_gen, capture_gen):
    """The rows of a captured forward of B to keep: (their indices, None for all; which of them are held out of
    training). Held-out rows (the estimate, the publish gate's and the canary's reference: rollouts the update did
    not train on) are drawn at holdout_frac and always kept; of the rest, capture_frac are kept for training."""
    # host draws (the tracker's resumable CPU generators): the indices move to the rows' device where used
    held = torch.rand(B, generator=held_gen, device="cpu") < holdout_frac
    if capture_frac >= 1:
        return None, held
    keep = held | (torch.rand(B, generator=capture_gen, device="cpu") < capture_frac)
    return keep.nonzero().flatten(), held[keep]


def response_columns(given, labels, B: int, T: int, device) -> torch.Tensor:
    """[B] on device: first response column: as given, else the first column whose label is not -100 (T if none),
    else 0."""
    if given is not None:
        return torch.as_tensor(given, dtype=torch.long, device=device).flatten()[:B].expand(B)
    if labels is None:
        return torch.zeros(B, dtype=torch.long, device=device)
    scored = labels != -100  # [B, T]
    return torch.where(scored.any(1), scored.long().argmax(1), torch.full((B,), T, device=labels.device)).long()
