"""Verified positions a drafter has not consumed yet (the engine's hand-off to the drafter between its turns)."""
from __future__ import annotations

import torch


class Pending:
    """Verified positions the drafter has not consumed yet, per row: token ids [B, cap], aux states [B, cap, X] (or
    None: a drafter without aux inputs), count n[B] and first position start[B]. Appends write the new entries in
    place (growing the buffers by doubling, rarely), so a long run of AR steps (the toggle off) costs O(new entries)
    per step, not a copy of everything pending."""

    def __init__(self, ids: torch.Tensor, aux: torch.Tensor | None, n: torch.Tensor, start: torch.Tensor):
        self.ids, self.aux, self.n, self.start = ids, aux, n, start
        self._max = int(n.max())

    def width(self) -> int:
        return self._max

    def view(self):
        """(ids [B, w], aux [B, w, X] or None, n [B], start [B]) with w = the longest row's count."""
        w = self._max
        return self.ids[:, :w], None if self.aux is None else self.aux[:, :w], self.n, self.start

    def consumed(self) -> None:
        self.n = torch.zeros_like(self.n)
        self._max = 0

    def append(self, ids: torch.Tensor, aux: torch.Tensor | None, n: torch.Tensor, start: torch.Tensor) -> None:
        """Each row's first n[b] of ids [B, m] (aux [B, m, X]); a row with none pending restarts at start[b]."""
        B, m = ids.shape
        if B == 1:  # one row (batch 1, the long tail): slices, no index tensors
            c = self._max
            need = c + int(n[0])
            if need > self.ids.shape[1]:
                self._grow(max(need, 2 * self.ids.shape[1]))
            self.ids[0, c:need] = ids[0, :need - c]
            if self.aux is not None:
                self.aux[0, c:need] = aux[0, :need - c]
            self.start, self.n, self._max = (start if c == 0 else self.start), self.n + n, need
            return
        need = self._max + m if m == 1 else int((self.n + n).max())
        if need > self.ids.shape[1]:
            self._grow(max(need, 2 * self.ids.shape[1]))
        dev = ids.device
        if m == 1:  # an AR step: one entry per row, at each row's count
            rows, cols, src_ids = torch.arange(B, device=dev), self.n, ids[:, 0]
            src_aux = None if aux is None else aux[:, 0]
        else:
            j = torch.arange(m, device=dev).view(1, m)
            cols = self.n.view(B, 1) + j  # [B, m] destination columns
            ok = j < n.view(B, 1)
            rows, cols = torch.arange(B, device=dev).view(B, 1).expand(B, m)[ok], cols[ok]
            src_ids, src_aux = ids[ok], None if aux is None else aux[ok]
        self.ids[rows, cols] = src_ids
        if self.aux is not None:
            self.aux[rows, cols] = src_aux
        self.start = torch.where(self.n > 0, self.start, start)
        self.n = self.n + n
        self._max = need

    def _grow(self, cap: int) -> None:
        B, w = self.ids.shape
        ids = self.ids.new_zeros(B, cap)
        ids[:, :w] = self.ids
        self.ids = ids
        if self.aux is not None:
            aux = self.aux.new_zeros(B, cap, self.aux.shape[-1])
            aux[:, :w] = self.aux
            self.aux = aux

    def select_rows(self, keep: torch.Tensor) -> None:
        self.ids, self.n, self.start = self.ids[keep], self.n[keep], self.start[keep]
        self.aux = None if self.aux is None else self.aux[keep]
        self._max = int(self.n.max()) if len(keep) else 0
