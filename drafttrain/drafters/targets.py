"""The policy's next-token distributions a drafter trains on and is scored against, recomputed from the policy's final
hidden state with its LM head: features store hidden states, never distributions (a [T, V] row of probabilities is
608 KiB a token at a 152k vocabulary, the hidden state a few KiB).

    head = TargetHead(policy.get_output_embeddings().weight)   # a snapshot (the tracker refreshes it per policy update)
    t = Targets(batch["hidden"], head)                         # hidden [B, N, H]: the policy's state at each position
    t.draft_probs(at, ids)    # [B, S, Vd] softmax over the draft vocabulary `ids` alone (= the full softmax there,
                              #   renormalized): all the default loss needs, and no full-vocabulary work
    t.probs(at, ids)          # [B, S, Vd] the full-vocabulary p on `ids`, not renormalized (TV, acceptance)
    t.token_probs(at, x)      # [B, S] p(x) of one target token per position (teacher-forced acceptance)

p_j = softmax(W h_j) at temperature 1 (what the old features stored). The full normalizer logsumexp(W h_j) costs a
V x H product per position: it is computed only where it is read, once per position (row_lse, or on the first read),
in chunks of positions (CHUNK elements at most).
"""
from __future__ import annotations

import hashlib

import torch

from drafttrain.spec.sampling import CHUNK  # elements of one [rows, positions, V] block of logits: 64 MB in fp32


def position_chunk(rows: int, width: int) -> int:
    """Positions per chunk so that rows x chunk x width elements stay within CHUNK (at least 1)."""
    return max(1, CHUNK // max(1, rows * width))


class TargetHead:
    """A snapshot of the policy's LM head weight [V, H] (detached; cloned unless told otherwise) and, cached once per
    draft vocabulary and device, its rows for that vocabulary [Vd, H] (a drafter step must not gather 32k rows).
    tag: which policy it was taken from (the tracker's policy version), for scores cached against it."""

    def __init__(self, weight: torch.Tensor, clone: bool = True, tag=None):
        w = weight.detach()
        self.weight = w.clone() if clone else w  # [V, H]
        self.tag = tag
        self._rows: dict = {}

    @classmethod
    def of(cls, policy, tag=None, held: "TargetHead | None" = None) -> "TargetHead":
        """A snapshot of `policy`'s LM head (an HF causal LM's output embeddings); `held` itself where its weights are
        still the policy's (what was cached against it stays valid)."""
        w = policy.get_output_embeddings().weight
        if held is not None and held.weight.shape == w.shape and torch.equal(held.weight, w):
            return held
        return cls(w, tag=tag)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def rows(self, ids: torch.Tensor | None, device) -> torch.Tensor:
        """[Vd, H] in the head's dtype, on `device`: the rows of `ids` (None or the whole vocabulary in order: every
        row, no copy where the head is there already)."""
        full = ids is None or (len(ids) == self.vocab_size and bool((ids == torch.arange(
            len(ids), device=ids.device)).all()))
        key = (None if full else hashlib.sha1(ids.cpu().numpy().tobytes()).hexdigest(), str(device))
        if key not in self._rows:
            w = self.weight if full else self.weight[ids.to(self.weight.device)]
            self._rows[key] = w.to(device)
        return self._rows[key]


def row_lse(hidden: torch.Tensor, lengths: torch.Tensor, head: TargetHead) -> torch.Tensor:
    """[B, N] logsumexp of the full-vocabulary logits at each row's first lengths[b] positions (0 past them: no work
    spent on padding), a row at a time in chunks of positions."""
    w = head.rows(None, hidden.device)  # [V, H]
    out = torch.zeros(hidden.shape[:2], device=hidden.device)
    n = position_chunk(1, w.shape[0])
    for b, L in enumerate(lengths.tolist()):
        for i in range(0, min(L, hidden.shape[1]), n):
            out[b, i:min(i + n, L)] = Targets.matmul(hidden[b, i:min(i + n, L)], w).logsumexp(-1)
    return out


class Targets:
    """The policy's distributions at the feature positions of a batch: hidden [B, N, H] (float; positions past a row's
    end are never read unmasked), head: its TargetHead, lse: [B, N] full normalizers if known (row_lse; else
    computed on the first read, for every position at once). `at` indexes positions (a slice or an index tensor)."""

    def __init__(self, hidden: torch.Tensor, head: TargetHead, lse: torch.Tensor | None = None):
        self.hidden, self.head, self._lse = hidden, head, lse

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    @property
    def device(self):
        return self.hidden.device

    def _h(self, at) -> torch.Tensor:
        """[B, S, H] hidden states at positions `at`; positions past the end (the last TTT steps of a row read there)
        are zeros or the last position's: padding, masked by the caller's valid."""
        N = self.hidden.shape[1]
        if isinstance(at, slice):
            start, stop = at.start or 0, N if at.stop is None else at.stop
            h = self.hidden[:, start:stop]
            if stop - start > h.shape[1]:
                h = torch.cat([h, h.new_zeros(h.shape[0], stop - start - h.shape[1], h.shape[2])], 1)
            return h
        return self.hidden[:, at.clamp_max(N - 1)]

    @staticmethod
    def matmul(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h [.., H] x w [Vd, H]^T in w's dtype (the policy's logits were computed so), as float32 [.., Vd]."""
        return (h.to(w.dtype) @ w.T).float()

    def logits(self, at, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, Vd] the policy's logits on `ids` (None: the whole vocabulary)."""
        return self.matmul(self._h(at), self.head.rows(ids, self.device))

    def lse(self, at) -> torch.Tensor:
        """[B, S] logsumexp of the full-vocabulary logits at `at`: every position's computed once, on the first read
        (in chunks of positions), where the batch did not bring them."""
        if self._lse is None:
            h, w = self.hidden, self.head.rows(None, self.device)  # [B, N, H], [V, H]
            n = position_chunk(h.shape[0], w.shape[0])
            self._lse = torch.cat([self.matmul(h[:, i:i + n], w).logsumexp(-1) for i in range(0, h.shape[1], n)], 1)
        N = self._lse.shape[1]
        if isinstance(at, slice):
            start, stop = at.start or 0, N if at.stop is None else at.stop
            at = torch.arange(start, stop, device=self.device)
        return self._lse[:, at.clamp_max(N - 1)]

    def draft_probs(self, at, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, Vd] softmax over `ids` alone: the policy's distribution restricted to them and renormalized."""
        return self.logits(at, ids).softmax(-1)

    def probs(self, at, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, Vd] the policy's full-vocabulary probabilities of `ids` (their sum is the mass they cover)."""
        lg = self.logits(at, ids)
        if ids is None or len(ids) == self.vocab_size:
            return lg.softmax(-1)
        return (lg - self.lse(at).unsqueeze(-1)).exp()

    def token_probs(self, at, x: torch.Tensor) -> torch.Tensor:
        """[B, S] p(x) of the token x [B, S] (target ids) at each position: one row of the head per position, plus
        the full normalizer."""
        h = self._h(at).float()  # [B, S, H]
        w = self.head.rows(None, self.device)[x.to(self.device)].float()  # [B, S, H]
        return ((h * w).sum(-1) - self.lse(at)).exp()
