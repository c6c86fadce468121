"""SpecStats: what speculative decoding did, accumulated over decode steps and mergeable across batches/engines.

mean_accepted_length = tokens emitted per (row, verify) pair = 1 + accepted / verify_rows; AR gives 1.0.
acceptance_per_position[i] = P(draft i accepted | drafts 0..i-1 accepted) as a rate over rows that drafted i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    verify_rows: int = 0  # (row, target forward) pairs, AR steps included
    target_forwards: int = 0  # batched target forward calls (prefill excluded)
    accepted_per_position: list[int] = field(default_factory=list)  # count of rows accepting draft i
    reached_per_position: list[int] = field(default_factory=list)  # count of rows whose drafts 0..i-1 were accepted

    def update(self, num_accepted: torch.Tensor, k: int) -> None:
        """num_accepted[B] from one verify step that drafted k tokens per row."""
        na = num_accepted.detach().cpu()
        B = na.numel()
        self.target_forwards += 1
        self.verify_rows += B
        if k == 0:
            return
        self.drafted += B * k
        self.accepted += int(na.sum())
        self._grow(k)
        pos = torch.arange(k)
        acc = (na.unsqueeze(1) > pos).sum(0).tolist()  # rows that accepted draft i
        reach = (na.unsqueeze(1) >= pos).sum(0).tolist()  # rows that got to try draft i
        for i in range(k):
            self.accepted_per_position[i] += acc[i]
            self.reached_per_position[i] += reach[i]

    def _grow(self, k: int) -> None:
        while len(self.accepted_per_position) < k:
            self.accepted_per_position.append(0)
            self.reached_per_position.append(0)

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(self.drafted + other.drafted, self.accepted + other.accepted,
                        self.verify_rows + other.verify_rows, self.target_forwards + other.target_forwards)
        out._grow(max(len(self.accepted_per_position), len(other.accepted_per_position)))
        for s in (self, other):
            for i, (a, r) in enumerate(zip(s.accepted_per_position, s.reached_per_position)):
                out.accepted_per_position[i] += a
                out.reached_per_position[i] += r
        return out

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.verify_rows if self.verify_rows else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "verify_rows": self.verify_rows,
                "target_forwards": self.target_forwards, "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate": self.acceptance_rate, "acceptance_per_position": self.acceptance_per_position}
