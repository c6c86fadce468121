"""SpecStats: what speculative decoding did, accumulated over decode steps and mergeable across batches/engines.

mean_accepted_length (MAL) = response tokens emitted per (row, verify) pair over the steps that drafted. A step that
drafted nothing (an AR step of engine.toggle, or one the end of the context cut to k = 0) emits one token whatever
the drafter: it counts in verify_rows and emitted (ar_rows, ar_emitted), not in MAL, which would otherwise read the
toggle's choices as the drafter's acceptance (1.2 on a batch the toggle ran AR, 4.8 on the next); AR alone gives 1.0.
A step emits num_accepted + 1 tokens (the accepted drafts, then the resampled or bonus token), except a row's last
step when a stop token or the length limit cuts it: it emits only the tokens up to the cut, and drafts past the cut
count as neither drafted nor reached (they are not part of the response, whatever the verify pass said about them).
The prefill's first token is no verify step and is not counted. So MAL = (response tokens - 1) / verify steps per
row, pooled over rows; teacher_forced_acceptance (tracking/acceptance.py) reports the expectation of the same counts.
acceptance_per_position[i] = P(draft i accepted | drafts 0..i-1 accepted) as a rate over rows that drafted i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def drafts_kept(num_accepted, emitted, k):
    """Of a row's k drafts in one verify step, those before its response ended: all k, unless a stop token or the
    length limit cut the row inside its accepted drafts (emitted <= num_accepted). Drafts past the cut predict text
    the policy never writes, so they are neither drafted nor rejected (SpecStats, the SD schedule's estimates).
    Ints (one row), or integer tensors of one shape (elementwise: SpecStats.from_steps)."""
    if isinstance(emitted, torch.Tensor):
        return torch.where(emitted <= num_accepted, emitted, k).clamp(max=k)
    return min(emitted if emitted <= num_accepted else k, k)


def _rows_past(x: torch.Tensor, width: int) -> list[int]:
    """x [N] integers in 0..width -> [width] counts: entry i is the number of x > i."""
    hist = torch.bincount(x, minlength=width + 1)  # [width + 1]
    return hist.flip(0).cumsum(0).flip(0)[1:].tolist()


@dataclass
class SpecStats:
    drafted: float = 0  # draft tokens proposed (inside the response)
    accepted: float = 0  # draft tokens accepted (inside the response)
    verify_rows: float = 0  # (row, target forward) pairs, AR steps included
    target_forwards: int = 0  # batched target forward calls (prefill excluded)
    emitted: float = 0  # response tokens the verify steps emitted
    ar_rows: float = 0  # of verify_rows, those of steps that drafted nothing (k = 0)
    ar_emitted: float = 0  # of emitted, the tokens those steps emitted
    accepted_per_position: list = field(default_factory=list)  # count of rows accepting draft i
    reached_per_position: list = field(default_factory=list)  # count of rows whose drafts 0..i-1 were accepted

    def update(self, num_accepted, k: int, emitted=None) -> None:
        """num_accepted[B] (tensor or list) from one verify step that drafted k tokens per row; emitted[B]: the
        tokens each row kept (num_accepted + 1 unless a stop token or the length limit cut the row; None = no cut).
        Plain Python over the rows: a handful of small tensor ops per decode step cost more than the loop."""
        na = num_accepted.tolist() if isinstance(num_accepted, torch.Tensor) else list(num_accepted)
        em = [n + 1 for n in na] if emitted is None else (
            emitted.tolist() if isinstance(emitted, torch.Tensor) else list(emitted))
        self.target_forwards += 1
        self.verify_rows += len(na)
        self.emitted += sum(em)
        if k == 0:
            self.ar_rows += len(na)
            self.ar_emitted += sum(em)
            return
        self._grow(k)
        acc_pp, reach_pp = self.accepted_per_position, self.reached_per_position
        for n, e in zip(na, em):
            inside = drafts_kept(n, e, k)
            self.drafted += inside
            self.accepted += min(n, inside)
            for i in range(min(n + 1, inside)):  # rows that got to try draft i, and those that accepted it
                reach_pp[i] += 1
                if i < n:
                    acc_pp[i] += 1

    @classmethod
    def from_steps(cls, num_accepted: torch.Tensor, k: torch.Tensor, emitted: torch.Tensor,
                   target_forwards: int | None = None) -> "SpecStats":
        """SpecStats of N single-row verify steps at once, in tensor ops: equal to update(num_accepted[j:j+1], k[j],
        emitted[j:j+1]) for every j. num_accepted, k, emitted: [N] integer tensors, one entry per (row, step) in any
        order (k = 0: an AR step). target_forwards: the batched forwards they ran (None: N, one per update)."""
        n, k, em = num_accepted.long(), k.long(), emitted.long()
        ar = k == 0
        sd_n, sd_k = n[~ar], k[~ar]
        inside = drafts_kept(sd_n, em[~ar], sd_k)  # [N_sd] drafts before each row's end
        reached = torch.minimum(sd_n + 1, inside)  # rows that got to try draft i: i < reached
        accepted = torch.minimum(sd_n, inside)  # and those that accepted it: i < accepted
        width = int(sd_k.max()) if len(sd_k) else 0  # update grows the per-position lists to every k it saw
        return cls(drafted=int(inside.sum()), accepted=int(accepted.sum()), verify_rows=len(n),
                   target_forwards=len(n) if target_forwards is None else target_forwards,
                   emitted=int(em.sum()), ar_rows=int(ar.sum()), ar_emitted=int(em[ar].sum()),
                   accepted_per_position=_rows_past(accepted, width),
                   reached_per_position=_rows_past(reached, width))

    def _grow(self, k: int) -> None:
        while len(self.accepted_per_position) < k:
            self.accepted_per_position.append(0)
            self.reached_per_position.append(0)

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(self.drafted + other.drafted, self.accepted + other.accepted,
                        self.verify_rows + other.verify_rows, self.target_forwards + other.target_forwards,
                        self.emitted + other.emitted, self.ar_rows + other.ar_rows, self.ar_emitted + other.ar_emitted)
        out._grow(max(len(self.accepted_per_position), len(other.accepted_per_position)))
        for s in (self, other):
            for i, (a, r) in enumerate(zip(s.accepted_per_position, s.reached_per_position)):
                out.accepted_per_position[i] += a
                out.reached_per_position[i] += r
        return out

    @property
    def mean_accepted_length(self) -> float:
        sd = self.verify_rows - self.ar_rows  # rows of the steps that drafted
        if sd > 0:
            return (self.emitted - self.ar_emitted) / sd
        return self.emitted / self.verify_rows if self.verify_rows else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "verify_rows": self.verify_rows,
                "target_forwards": self.target_forwards, "emitted": self.emitted, "ar_rows": self.ar_rows,
                "ar_emitted": self.ar_emitted,
                "mean_accepted_length": self.mean_accepted_length, "acceptance_rate": self.acceptance_rate,
                "acceptance_per_position": self.acceptance_per_position}
