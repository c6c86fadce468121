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
    ttt_loss(aux, next_ids, targets, valid, steps, decay, query_frac=1.0, generator=None, first_ids=None,
             objective=None) -> (loss, [acc per step])  targets: the policy's distributions (drafters/targets.py);
                                                    objective: the loss and where it is taken (ttt.Objective)
    ttt_logits(aux[B, T, X], next_ids[B, T+steps-1], steps, queries=None, first_ids=None) -> steps x [B, T, Vd]
        step i at position t predicts token_{t+2+i}, fed the real tokens (teacher forcing); first_ids [B] = token_0
        (next_ids starts at token_1), for a kind that reads the text from its start (a draft model)
    ttt_hidden(...) -> steps x [B, T, Hd], head_logits(x) -> [.., Vd]: the same split before its LM head (the loss
        and the scorer run the head in chunks of positions); by default the logits and the identity
    draft_ids() -> [Vd] the target token ids its logits cover, ascending
    parameters(), train(), eval()                  (an nn.Module)
The optional members below are declared on the protocols with the default that fits a kind without them: a kind
inherits them (class K(nn.Module, Drafter)) and overrides what it needs; callers call them, never probe for them.
check_compatible(drafter, policy) is the one reader of what a kind may carry beyond the protocol (a config of sizes,
a vocab_size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from drafttrain.quant import quantize_module_int8


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


class Drafter(Protocol):
    kind: str
    follows_policy: bool
    trains: bool
    in_place_update: bool = False  # load_state_dict writes the storage it drafts from: an engine double-buffers it
    trainable: tuple[str, ...] = ()  # an ensemble's members gated and published one by one; (): it is one unit

    @property
    def reads(self) -> Reads: ...

    @property
    def kinds(self) -> list[str]:
        """An ensemble's member kinds, one of which drafts each step as the engine's chooser picks (drafter.kind=auto);
        [] for a single drafter."""
        return []

    def state_dict(self) -> dict: ...

    def load_state_dict(self, weights: dict, strict: bool = True): ...

    def new_state(self, batch: int, max_len: int, prompts=None): ...

    def propose(self, state, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None): ...

    def generation_reads(self) -> Reads:
        """What the policy's forward must return for the next generation (what new_state expects): its reads, or, for a
        drafter that plans which members a generation serves, theirs."""
        return self.reads

    def fuse_for_inference(self, int8: bool):
        """Its inference form (an eval copy the engine owns): by default itself, its linears int8-quantized if int8
        (not a drafter updated in place: its storage is quantized already)."""
        return quantize_module_int8(self) if int8 and not self.in_place_update else self

    def needs_draft_vocab(self) -> bool:
        """Is its draft vocabulary still to be chosen (set_draft_vocab)? A fresh EAGLE-3 drafter over fewer tokens
        than the policy's vocabulary; never a kind that drafts over the whole vocabulary, nor a checkpoint's map."""
        return False

    def set_draft_vocab(self, counts, keep=()):
        """counts [V] (or [n, V], rows in priority order: vocab.draft_vocab) of the policy's rollout tokens: take the
        most frequent, `keep` among them, as its draft vocabulary and return their target ids [Vd]; None where it
        chose none (a kind without a draft vocabulary ignores it)."""
        return None

    def bind_policy(self, policy) -> None:
        """Read `policy`'s own weights (an MTP head's LM head); a drafter that reads none ignores it."""

    def adopt(self, old) -> None:
        """Take over what `old` (the copy it replaces in a hot-swap) learnt outside its weights (a suffix index)."""

    def complete(self, state, texts: list[list[int]]) -> None:
        """The generation ended; texts: every row's whole text (a drafter that indexes text takes the rest)."""


class TrainableDrafter(Drafter, Protocol):
    def ttt_loss(self, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None, objective=None): ...

    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list: ...

    def ttt_hidden(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list:
        """steps x [B, T (or S), Hd]: what its LM head takes at each TTT step. By default the logits themselves (a
        kind that does not split its head off; head_logits is then the identity)."""
        return self.ttt_logits(aux, next_ids, steps, queries, first_ids=first_ids)

    def head_logits(self, x):
        """Its LM head: ttt_hidden's [.., Hd] -> draft logits [.., Vd]."""
        return x

    def draft_ids(self): ...

    def parameters(self): ...

    def freeze_scores(self) -> None:
        """Train with the attention scores held constant (train.score_grad false); a kind without them trains as
        usual."""


def check_compatible(drafter, policy) -> None:
    """A drafter built for another policy fails here, with the mismatching field named: its hidden size where it has
    a config of sizes (EAGLE-3's, MTP's; a self-drafter's is its policy's own; the Drafter protocol does not require
    one), its vocabulary (a config's, or its own vocab_size: the draft model's, the suffix drafter's), and its aux
    layers where it takes them. Both engines call it (vLLM's with the target's config.json)."""
    c, pc = getattr(drafter, "config", None), policy.config
    if hasattr(c, "hidden_size") and c.hidden_size != pc.hidden_size:
        raise ValueError(f"drafter hidden_size {c.hidden_size} != policy hidden_size {pc.hidden_size}")
    V = getattr(drafter, "vocab_size", None) or getattr(c, "vocab_size", None)
    if V is not None and V != pc.vocab_size:
        raise ValueError(f"drafter vocab_size {V} != policy vocab_size {pc.vocab_size}")
    if c is None or not hasattr(c, "hidden_size"):
        return
    aux = drafter.reads.aux_layers
    if not aux:
        return
    if getattr(c, "target_num_layers", pc.num_hidden_layers) != pc.num_hidden_layers or max(
            aux) >= pc.num_hidden_layers:
        raise ValueError(f"drafter aux_layer_ids {list(aux)} do not fit the policy's "
                         f"{pc.num_hidden_layers} layers")
