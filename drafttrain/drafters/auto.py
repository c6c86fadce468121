"""Several drafters at once (drafter.kind=auto): the engine's chooser (engines/chooser.py) picks, per decode step, the
member that drafts, or none.

Every member sees every verified position: the engine hands this drafter each step's new positions, each member
keeps its own backlog of the positions it has not consumed (Pending), and the member that drafts catches up on its
whole backlog in that one call, as a drafter does after AR steps. What the members read from the policy's forward is
the union of their Reads (aux layer inputs in ascending order, then the final hidden state); each gets its own
columns.

Members are served as loaded (drafter.auto.kinds, each from drafter.auto.paths: a checkpoint, or null for a fresh
one): the tracker does not train them in this mode yet. Weights are the members' own, under "<kind>." prefixes, so
a hot-swap with that layout loads every member, each validated by its own load_state_dict.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from drafttrain.drafters.contract import Reads
from drafttrain.drafters.pending import Pending
from drafttrain.drafters.weights import check_tensors


def union_reads(members) -> tuple[Reads, dict[str, torch.Tensor | None]]:
    """The union of the members' Reads, and each member's aux columns in it (None: it reads none)."""
    layers = sorted({i for m in members.values() for i in m.reads.aux_layers})
    final = any(m.reads.final_hidden for m in members.values())
    cols = {}
    for kind, m in members.items():
        blocks = [layers.index(i) for i in m.reads.aux_layers] + ([len(layers)] if m.reads.final_hidden else [])
        cols[kind] = torch.tensor(blocks) if blocks else None  # block indices: times H at first use
    return Reads(aux_layers=tuple(layers), final_hidden=final), cols


class AutoDrafter(nn.Module):
    kind = "auto"
    follows_policy = False
    trains = False  # members are served as loaded: the tracker does not train them in this mode

    def __init__(self, members: dict[str, nn.Module], runtime_copy):
        super().__init__()
        if not members:
            raise ValueError("drafter.auto.kinds: give at least one drafter kind")
        self.members = nn.ModuleDict(members)
        self._runtime_copy = runtime_copy  # drafters/base.py's (handed in: the registry imports this module)
        self._reads, self._blocks = union_reads(members)
        self._cols: dict[tuple[str, int], torch.Tensor | None] = {}  # (member, hidden size) -> its aux columns
        self.current = next(iter(members))  # the member the next propose drafts with (the chooser sets it)

    @property
    def reads(self) -> Reads:
        return self._reads

    @property
    def kinds(self) -> list[str]:
        return list(self.members)

    def use(self, kind: str) -> None:
        self.current = kind

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
            if hasattr(m, "bind_policy"):
                m.bind_policy(policy)

    # ---- the engine's calls -------------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "AutoState":
        return AutoState({k: m.new_state(batch, max_len, prompts) for k, m in self.members.items()})

    def _aux(self, kind: str, aux):
        b = self._blocks[kind]
        if b is None or aux is None:
            return None
        H = aux.shape[-1] // (len(self._reads.aux_layers) + self._reads.final_hidden)
        if (kind, H) not in self._cols:  # once per member: propose runs at every decode step
            cols = (b.view(-1, 1) * H + torch.arange(H).view(1, -1)).flatten()
            self._cols[(kind, H)] = None if torch.equal(cols, torch.arange(aux.shape[-1])) else cols  # None: all
        cols = self._cols[(kind, H)]
        return aux if cols is None else aux[..., cols]

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Every member's backlog takes the new positions; the current member drafts after consuming its own."""
        for kind in self.kinds:
            st.add(kind, new_ids, self._aux(kind, aux), n_new, start)
        kind = self.current
        d, q = self.members[kind].propose(st.states[kind], *st.backlog[kind].view(), k, params, greedy_drafts,
                                          generator)
        st.backlog[kind].consumed()
        return d, q


class AutoState:
    """Each member's generation state and its backlog of verified positions it has not consumed."""

    def __init__(self, states: dict):
        self.states = states
        self.backlog: dict[str, Pending] = {}

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
