"""What a drafter is, as the engines, the tracker and the trainer call it: two narrow protocols and a declaration.

A drafter, as an engine serves it (Drafter):
    kind: str                                       its registry name (base.DRAFTERS)
    follows_policy: bool                            True: rebuilt from the policy's weights at every update (a
                                                    self-drafter: no features, no training); stated, never inferred
    trains: bool                                    True: the tracker trains it on captured features (it is a
                                                    TrainableDrafter); neither (suffix): nothing to update but itself
    reads: Reads                                    what it needs from the policy's forward
    state_dict() / load_state_dict(weights)         one layout, the one exported to vLLM
    new_state(batch, max_len, prompts[B, P]) -> state  per-generation cache (prompts right-padded);
                                                    state.select_rows(idx) drops rows
    propose(state, new_ids[B, m], aux[B, m, X] | None, n_new[B], start[B], k, params, greedy_drafts, generator)
        -> (draft_tokens[B, k], draft_probs[B, k, V] | None)      None: one-hot drafts
A drafter the tracker trains (TrainableDrafter) adds what the trainer and the acceptance scorer call:
    ttt_loss(aux, next_ids, target_probs, valid, steps, decay, query_frac=1.0, generator=None, first_ids=None)
        -> (loss, [acc per step])
    ttt_logits(aux[B, T, X], next_ids[B, T+steps-1], steps, queries=None, first_ids=None) -> steps x [B, T, Vd]
        step i at position t predicts token_{t+2+i}, fed the real tokens (teacher forcing); first_ids [B] = token_0
        (next_ids starts at token_1), for a kind that reads the text from its start (a draft model)
    draft_ids() -> [Vd] the target token ids its logits cover, ascending
    parameters(), train(), eval()                  (an nn.Module)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Reads:
    """What a drafter reads from the policy's forward. Features ("aux" [B, T, X]) are the inputs of decoder layers
    `aux_layers` (HF hidden_states[i]; vLLM's EAGLE-3 convention), then the final hidden state (the backbone's
    output, after its norm) if `final_hidden`, concatenated; X = 0 when it reads neither. The policy's logits are
    always read: they are the training targets."""
    aux_layers: tuple[int, ...] = ()
    final_hidden: bool = False

    @property
    def hidden_states(self) -> bool:
        return bool(self.aux_layers) or self.final_hidden


def generation_reads(drafter) -> Reads:
    """What the policy's forward must return for the drafter's next generation (and so what its new_state expects):
    its reads, or, for a drafter that plans which members a generation serves (drafter.kind=auto), theirs."""
    plan = getattr(drafter, "generation_reads", None)
    return plan() if plan is not None else drafter.reads


class Drafter(Protocol):
    kind: str
    follows_policy: bool
    trains: bool

    @property
    def reads(self) -> Reads: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, weights: dict, strict: bool = True): ...

    def new_state(self, batch: int, max_len: int, prompts=None): ...

    def propose(self, state, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None): ...


class TrainableDrafter(Drafter, Protocol):
    def ttt_loss(self, aux, next_ids, target_probs, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None): ...

    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list: ...

    def draft_ids(self): ...

    def parameters(self): ...
