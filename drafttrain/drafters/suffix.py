"""Suffix drafter (drafter.kind=suffix): drafts text copied from the batch's sibling rows, as they are generated,
and from the last generate() calls' rollouts. Nothing to train and no weights: its update is the index.

In GRPO the G samples of a prompt share most of their text, and the task's scratchpads repeat their phrasing from
one problem to the next; a row whose last n tokens occurred before (in a sibling, in itself, in a recent rollout)
is likely to go on as that occurrence did. Lookup: the longest suffix of the row's text, from drafter.suffix.max_ngram
tokens down to min_ngram, that the index holds; the draft is the k tokens that followed its latest occurrence (a
continuation shorter than k is padded with its last token; no match drafts the row's last token k times).

Drafts are one-hot (draft probs None): rejection sampling accepts draft x with the policy's p(x) and otherwise
samples from p with x removed, so the output distribution stays the policy's whatever the index holds.

The index maps each n-gram (tuple of n token ids) to its latest (text, end position). A generation's rows are
texts (prompt + committed response tokens) from its new_state on; the texts of the last drafter.suffix.history
generations stay, and the index is rebuilt from the kept texts when a generation starts (once per RL step).
A row's newest position enters the index only once the next token is known (it would match itself, with nothing
after it). Pure Python over lists and one dict: about a microsecond per n-gram, far below a verify step.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn as nn

from drafttrain.drafters.contract import Reads


class SuffixDrafter(nn.Module):
    kind = "suffix"
    follows_policy = False  # it reads the text, not the policy
    trains = False  # no weights: its update is the index
    reads = Reads()

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, history: int = 2):
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"drafter.suffix.min_ngram: must be in [1, drafter.suffix.max_ngram = {max_ngram}], "
                             f"got {min_ngram}")
        self.max_ngram, self.min_ngram, self.history = max_ngram, min_ngram, history
        self.texts: deque[list[list[int]]] = deque()  # per generation (oldest first): its rows' texts
        self.index: dict[tuple, tuple[list[int], int]] = {}

    # ---- no weights ---------------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        if state_dict:
            raise ValueError(f"suffix drafter: takes no weights, got {sorted(state_dict)[0]!r} (drafter.kind=suffix "
                             f"has nothing to load)")
        return None

    # ---- the index ------------------------------------------------------------------------------------------------
    def _add(self, text: list[int], lo: int, hi: int) -> None:
        """Index the n-grams ending at positions lo .. hi-1 of text (n = min_ngram .. max_ngram)."""
        index, n0, n1 = self.index, self.min_ngram, self.max_ngram
        for e in range(max(lo, n0 - 1), hi):
            for n in range(n0, min(n1, e + 1) + 1):
                index[tuple(text[e - n + 1:e + 1])] = (text, e)

    def _rebuild(self) -> None:
        """A new generation starts: drop those past the history, index what is kept (positions whose next token
        is known)."""
        while len(self.texts) > self.history:
            self.texts.popleft()
        self.index = {}
        for gen in self.texts:
            for t in gen:
                self._add(t, 0, len(t) - 1)

    def lookup(self, text: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest occurrence of text's longest indexed suffix."""
        for n in range(min(self.max_ngram, len(text)), self.min_ngram - 1, -1):
            hit = self.index.get(tuple(text[-n:]))
            if hit is not None:
                src, e = hit
                cont = src[e + 1:e + 1 + k]
                if cont:
                    return cont + [cont[-1]] * (k - len(cont))
        return [text[-1] if text else 0] * k

    # ---- the engine's calls ---------------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "SuffixState":
        """prompts [B, P] right-padded: each row's text starts with its token 0 (the engine feeds the rest)."""
        self._rebuild()
        first = prompts[:, 0].tolist() if prompts is not None else [0] * batch
        rows = [[t] for t in first]
        self.texts.append(rows)
        return SuffixState(rows)

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Append each row's n_new[b] new tokens (positions start[b]+1 ..) to its text and index them, then look
        up k drafts per row. Returns (drafts [B, k], None: one-hot)."""
        ids, n, s = new_ids.tolist(), n_new.tolist(), start.tolist()
        out = []
        for j, text in enumerate(st.rows):
            at = s[j] + 1
            if at != len(text):  # only a synthetic timing call re-writes positions (measure_costs)
                del text[min(at, len(text)):]
                text.extend([0] * (at - len(text)))
            old = len(text)
            text.extend(ids[j][:n[j]])
            self._add(text, max(old - 1, 0), len(text) - 1)  # the previous newest position's next token is known
            out.append(self.lookup(text, k))
        return torch.tensor(out, dtype=torch.long).view(len(out), k), None


class SuffixState:
    """Per-generation state: the active rows' texts (lists shared with the drafter's index)."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def select_rows(self, idx: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in idx.tolist()]


def from_config(cfg, policy) -> SuffixDrafter:
    """The registry entry: cfg is a DrafterConfig (its suffix section); the policy gives nothing."""
    s = cfg.suffix
    return SuffixDrafter(s.max_ngram, s.min_ngram, s.history)
