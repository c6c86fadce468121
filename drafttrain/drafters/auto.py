"""Several drafters at once (drafter.kind=auto): the engine's chooser (engines/chooser.py) picks, per decode step, the
member that drafts, or none.

Each generation serves the members the chooser planned for it (plan(); all of them until it has tried each): only
those get a state and a backlog, and the policy's forward returns only what they read (generation_reads), so a
member the chooser has set aside costs nothing while it is (its KV cache, its backlog copies, an EAGLE-3's aux layers;
measured: bench/NOTES.md, Auto). Every planned member sees every verified
position: the engine hands this drafter each step's new positions, each planned member keeps its own backlog of the
positions it has not consumed (Pending), and the member that drafts catches up on its whole backlog in that one
call, as a drafter does after AR steps. What they read from the policy's forward is the union of their Reads (aux
layer inputs in ascending order, then the final hidden state); each gets its own columns. `reads` is every
member's union: what the policy must be able to give (check_compatible).

Members start as loaded (drafter.auto.kinds, each from drafter.auto.paths: a checkpoint, or null for a fresh one).
The tracker trains the trainable ones together, as one drafter: the loss of a training step is the sum of theirs
(each member's own loss, on its own columns of the captured union) and one optimizer steps them all. Each trainable
member is gated and canaried on its own (tracking/gate.py, hotswap.py): an update publishes the members that beat their
serving weights, and a member that fails its canary (on the steps it drafted) is rolled back alone. ttt_logits /
draft_ids are the `scored` member's: the first trainable one in drafter.auto.kinds (the report's live/frozen MAL), or
the one scoring() names. Weights are the members' own, under "<kind>." prefixes, so a hot-swap with that layout loads
every member, each validated by its own load_state_dict.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from drafttrain.drafters import ttt
from drafttrain.drafters.contract import Reads, TrainableDrafter
from drafttrain.drafters.pending import Pending
from drafttrain.drafters.weights import check_tensors


def union_reads(members) -> tuple[Reads, dict[str, torch.Tensor | None]]:
    """The union of the members' Reads, and each member's aux columns in it (None: it reads none)."""
    layers = sorted({i for m in members.values() for i in m.reads.aux_layers})
    final = any(m.reads.final_hidden for m in members.values())
    cols = {}
    for kind, m in members.items():
        blocks = [layers.index(i) for i in m.reads.aux_layers] + ([len(layers)] if m.reads.final_hidden else [])
        cols[kind] = torch.tensor(blocks, device="cpu") if blocks else None  # block indices (host): times H at use
    return Reads(aux_layers=tuple(layers), final_hidden=final), cols


def member_columns(blocks: torch.Tensor, per: int, H: int, device=None) -> slice | torch.Tensor | None:
    """A member's columns of a union's features [..., per * H], from its block indices in the union (union_reads):
    None where it reads them all, a slice where its blocks are adjacent (a view), else an index on `device` (the
    features')."""
    b = blocks.tolist()
    if b == list(range(b[0], b[0] + len(b))):
        return None if len(b) == per else slice(b[0] * H, (b[-1] + 1) * H)
    return (blocks.view(-1, 1) * H + torch.arange(H, device="cpu").view(1, -1)).flatten().to(device)


class AutoDrafter(nn.Module, TrainableDrafter):
    kind = "auto"
    follows_policy = False

    def __init__(self, members: dict[str, nn.Module], runtime_copy):
        super().__init__()
        if not members:
            raise ValueError("drafter.auto.kinds: give at least one drafter kind")
        self.members = nn.ModuleDict(members)
        self._runtime_copy = runtime_copy  # drafters/base.py's (handed in: the registry imports this module)
        self._reads, self._train_blocks = union_reads(members)  # features are captured for the full union
        self.planned = list(members)  # the members the next generation serves (plan())
        trainable = [k for k, m in members.items() if m.trains]
        self.trains = bool(trainable)  # the tracker trains the trainable members (none: served as loaded)
        self.trainable = trainable  # in member order
        self.scored = trainable[0] if trainable else None  # the member the gate and the report score
        self.current = next(iter(members))  # the member the next propose drafts with (the chooser sets it)

    @property
    def reads(self) -> Reads:
        return self._reads

    @property
    def kinds(self) -> list[str]:
        return list(self.members)

    def use(self, kind: str) -> None:
        self.current = kind

    def plan(self, kinds) -> None:
        """The members the next generation serves (in member order); the others sit it out."""
        planned = [k for k in self.kinds if k in kinds]
        if not planned:
            raise ValueError(f"auto drafter: plan names no member (members {self.kinds}, got {list(kinds)})")
        self.planned = planned

    def generation_reads(self) -> Reads:
        """What the policy's forward returns in the next generation: the planned members' union."""
        return union_reads({k: self.members[k] for k in self.planned})[0]

    # ---- weights: the members', prefixed ----------------------------------------------------------------------
    def state_dict(self, *args, **kwargs) -> dict:
        return {f"{kind}.{k}": v for kind, m in self.members.items() for k, v in m.state_dict().items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        check_tensors(self.state_dict(), state_dict, hint="a member of another size?")  # the prefixed names
        for kind, m in self.members.items():
            m.load_state_dict({k[len(kind) + 1:]: v for k, v in state_dict.items() if k.startswith(kind + ".")})
        return None

    def fuse_for_inference(self, int8: bool) -> "AutoDrafter":
        """Each member in its own runtime form."""
        for kind in self.kinds:
            self.members[kind] = self._runtime_copy(self.members[kind], int8, owned=True)
        return self

    def bind_policy(self, policy) -> None:
        """Members that read the policy's weights (an MTP head's LM head) read `policy`'s."""
        for m in self.members.values():
            m.bind_policy(policy)

    def needs_draft_vocab(self) -> bool:
        return any(m.needs_draft_vocab() for m in self.members.values())

    def set_draft_vocab(self, counts, keep=()):
        """Each member still choosing a draft vocabulary takes it from counts; the first one's ids (one kind, at
        most: only EAGLE-3 has one), None where none chose."""
        chosen = [m.set_draft_vocab(counts, keep) for m in self.members.values()]
        return next((ids for ids in chosen if ids is not None), None)

    # ---- training: the trainable members together, scored on one --------------------------------------------------
    def _train_aux(self, kind: str, aux):
        """The member's columns of captured features (the full union's)."""
        b = self._train_blocks[kind]
        if b is None:
            return aux[..., :0]
        per = len(self._reads.aux_layers) + self._reads.final_hidden
        cols = member_columns(b, per, aux.shape[-1] // per, aux.device)
        return aux if cols is None else aux[..., cols]

    def ttt_loss(self, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None, objective=ttt.KL):
        """The sum of the trainable members' losses; the per-step accuracy is the scored member's."""
        total, accs = 0.0, []
        for kind, m in self.members.items():
            if m.trains:
                loss, a = m.ttt_loss(self._train_aux(kind, aux), next_ids, targets, valid, steps, decay,
                                     query_frac, generator, first_ids=first_ids, objective=objective)
                total = total + loss
                accs = a if kind == self.scored else accs
        return total, accs

    @contextlib.contextmanager
    def scoring(self, kind: str):
        """ttt_logits / draft_ids are member `kind`'s inside the block (per-member gates and canaries)."""
        if kind not in self.trainable:
            raise ValueError(f"auto drafter: {kind!r} is not a trainable member (trainable: {self.trainable})")
        before, self.scored = self.scored, kind
        try:
            yield self
        finally:
            self.scored = before

    def _scored(self):
        if self.scored is None:
            raise ValueError(f"auto drafter: no member trains (members {self.kinds}): nothing to score")
        return self.members[self.scored]

    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list:
        return self._scored().ttt_logits(self._train_aux(self.scored, aux), next_ids, steps, queries,
                                         first_ids=first_ids)

    def ttt_hidden(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list:
        return self._scored().ttt_hidden(self._train_aux(self.scored, aux), next_ids, steps, queries,
                                         first_ids=first_ids)

    def head_logits(self, x):
        return self._scored().head_logits(x)

    def draft_ids(self):
        return self._scored().draft_ids()

    # ---- the engine's calls -------------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "AutoState":
        """The planned members' states; the aux the engine hands propose is their union's (generation_reads)."""
        planned = {k: self.members[k] for k in self.planned}
        reads, blocks = union_reads(planned)
        return AutoState({k: m.new_state(batch, max_len, prompts) for k, m in planned.items()}, reads, blocks)

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Every served member's backlog takes the new positions; the current member drafts after consuming its own.
        The state names the members (a hot-swapped copy drafts on with the state its predecessor made)."""
        kind = self.current
        if kind not in st.states:
            raise ValueError(f"auto drafter: {kind!r} is not served in this generation (planned: {list(st.states)})")
        if len(st.states) == 1:  # the engine's pending positions are exactly this member's: no copy of its own
            return self.members[kind].propose(st.states[kind], new_ids, st.aux_of(kind, aux), n_new, start, k, params,
                                              greedy_drafts, generator)
        for m in st.states:
            st.add(m, new_ids, st.aux_of(m, aux), n_new, start)
        d, q = self.members[kind].propose(st.states[kind], *st.backlog[kind].view(), k, params, greedy_drafts,
                                          generator)
        st.backlog[kind].consumed()
        return d, q

    def adopt(self, old: "AutoDrafter") -> None:
        """Members that keep what they learnt outside their weights (the suffix drafter's index) take over `old`'s
        (a hot-swap builds the members afresh from the template)."""
        for kind, m in self.members.items():
            if kind in old.members:
                m.adopt(old.members[kind])

    def complete(self, st, texts) -> None:
        """The generation ended (texts: every row's whole text): served members that index text take the rest."""
        for kind, state in st.states.items():
            self.members[kind].complete(state, texts)


class AutoState:
    """Each served member's generation state and its backlog of verified positions it has not consumed; reads and
    blocks: the union the engine's aux follows, and each member's blocks in it (union_reads)."""

    def __init__(self, states: dict, reads: Reads, blocks: dict[str, torch.Tensor | None]):
        self.states = states
        self.backlog: dict[str, Pending] = {}
        self._per = len(reads.aux_layers) + reads.final_hidden  # blocks in the aux the engine hands in
        self._blocks = blocks
        self._cols: dict[str, slice | torch.Tensor | None] = {}  # member -> its aux columns (None: all of them)

    def aux_of(self, kind: str, aux):
        """The member's columns of the engine's aux (member_columns)."""
        b = self._blocks[kind]
        if b is None or aux is None:
            return None
        if kind not in self._cols:  # once per member and generation: propose runs at every decode step
            self._cols[kind] = member_columns(b, self._per, aux.shape[-1] // self._per, aux.device)
        cols = self._cols[kind]
        return aux if cols is None else aux[..., cols]

    def add(self, kind: str, ids, aux, n, start) -> None:
        if kind not in self.backlog:
            self.backlog[kind] = Pending(ids.clone(), None if aux is None else aux.clone(), n.clone(), start.clone())
        else:
            self.backlog[kind].append(ids, aux, n, start)

    def select_rows(self, idx: torch.Tensor) -> None:
        for s in self.states.values():
            s.select_rows(idx)
        for b in self.backlog.values():
            b.select_rows(idx)


# ---- its config section: drafter.auto ---------------------------------------------------------------------------
@dataclass
class Section:  # drafter.auto: several drafters at once; the engine picks one (or none) per active-batch bucket
    kinds: list[str] = field(default_factory=lambda: ["eagle3", "suffix"])  # member kinds (not selfquant, not auto)
    paths: list[Optional[str]] = field(default_factory=lambda: ["checkpoints/eagle3", None])  # each member's checkpoint


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.auto, message)."""
    return [(len(s.kinds) == len(s.paths), "paths",
             f"must give one path (or null) per drafter.auto.kinds entry: {len(s.kinds)} kinds, {len(s.paths)} paths"),
            (len(set(s.kinds)) == len(s.kinds) and not {"auto", "selfquant"} & set(s.kinds), "kinds",
             f"must be distinct kinds other than auto and selfquant, got {list(s.kinds)}")]
