"""FeatureBuffer: a bounded, memory-capped store of per-sequence drafter training records.

    buf = FeatureBuffer(max_bytes=256 << 20, dtype=torch.bfloat16, seed=0)
    buf.add(build_features(...))          # splits a padded batch into per-row records, evicts the oldest
    buf.add(build_features(...), version=policy_step)   # the policy version the features came from
    batch = buf.sample(16)                # padded float32 batch: aux, next_ids, target_probs, valid, lengths
    groups = buf.sample_groups(16, 8)     # 8 groups of 16 similar-length records (less padding) ...
    batch = collate(groups[0], buf.steps)  # ... each collated as sample() returns it, when it is used

A record is one row of build_features trimmed to its length L: aux [L, X] and target_probs [L+s, V] in reduced
precision, next_ids [L+s-1] (int32), valid [L+s] (bool), where s is the TTT unroll the features were built for.
Memory is the sum of the stored tensors' bytes; records whose loss mask is empty are not stored. Sampling is
without replacement from a seeded generator, so a restored buffer continues the same draws: uniform, or with
half_life h (in policy versions) a record v versions older than the newest is drawn with weight 0.5^(v/h). Online,
the policy moves every step; uniform draws over a buffer that spans many steps train the drafter mostly on policies
that are gone (bench_tracking: a drafter trained on the current policy's rollouts alone caught up in ~25 steps,
the uniformly-fed online one had not after as many).
"""
from __future__ import annotations

from collections import deque

import torch

_KEYS = ("aux", "next_ids", "target_probs", "valid")


def _nbytes(rec: dict) -> int:
    return sum(rec[k].numel() * rec[k].element_size() for k in _KEYS)


class FeatureBuffer:
    def __init__(self, max_bytes: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 name: str = "online.buffer_mb", half_life: float | None = None):
        if max_bytes <= 0:
            raise ValueError(f"{name}: the feature buffer size must be > 0, got {max_bytes}")
        if half_life is not None and not half_life > 0:
            raise ValueError(f"online.buffer_half_life: must be > 0 or null (uniform), got {half_life}")
        self.half_life = half_life
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {dtype}")
        self.max_bytes, self.dtype = int(max_bytes), dtype
        self.records: deque[dict] = deque()
        self.nbytes = 0
        self.added = 0  # records ever added
        self.evicted = 0  # records dropped for the cap (including one too large to store at all)
        self.steps: int | None = None  # TTT unroll the stored records were built for
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.records)

    def add(self, batch: dict[str, torch.Tensor], version: int = 0, skip: torch.Tensor | None = None) -> int:
        """batch: build_features output, from policy `version`; skip [B] bool: rows not to store (held out).
        Returns the number of records stored."""
        L = batch["lengths"].tolist()
        T = batch["aux"].shape[1]
        s = batch["valid"].shape[1] - T
        if self.steps is None:
            self.steps = s
        elif s != self.steps:
            raise ValueError(f"FeatureBuffer.add: features built for ttt_steps={s}, the buffer holds "
                             f"ttt_steps={self.steps}")
        keep = batch["valid"].any(1)
        if skip is not None:
            keep &= ~skip.bool()
        # converted once per batch, not per row (the rows are then cut and copied out of it)
        aux, probs = batch["aux"].to(self.dtype), batch["target_probs"].to(self.dtype)
        ids = batch["next_ids"].to(torch.int32)
        first = batch["first_ids"].tolist() if "first_ids" in batch else [0] * len(L)
        n = 0
        for b, n_b in enumerate(L):
            if not keep[b]:
                continue
            rec = {"aux": aux[b, :n_b].clone(), "next_ids": ids[b, :n_b + s - 1].clone(),
                   "target_probs": probs[b, :n_b + s].clone(),
                   "valid": batch["valid"][b, :n_b + s].clone(), "version": int(version), "first": int(first[b])}
            self.records.append(rec)
            self.nbytes += _nbytes(rec)
            self.added += 1
            n += 1
        self._evict()
        return n

    def _evict(self) -> None:
        while self.records and self.nbytes > self.max_bytes:
            self.nbytes -= _nbytes(self.records.popleft())
            self.evicted += 1

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        """min(n, len) records without replacement, padded to the longest: float32 aux/target_probs."""
        if not self.records:
            raise ValueError("FeatureBuffer.sample: the buffer is empty")
        return collate([self.records[i] for i in self._draw(n)], self.steps)

    def sample_groups(self, n: int, count: int) -> list[list[dict]]:
        """Up to `count` groups of n records: min(n*count, len) records drawn as in sample(), grouped by length
        (less padding: each record is used once, so long rollouts are not under-drawn), in random order. Lists of
        records (references: still valid after an eviction), so a caller that may stop early, or save the groups
        it has not used yet, collates (collate(group, steps)) only the batches it uses."""
        if not self.records:
            raise ValueError("FeatureBuffer.sample_groups: the buffer is empty")
        idx = self._draw(n * count)
        idx.sort(key=lambda i: self.records[i]["aux"].shape[0])
        groups = [idx[j:j + n] for j in range(0, len(idx), n)]
        order = torch.randperm(len(groups), generator=self.gen).tolist()
        return [[self.records[i] for i in groups[g]] for g in order]

    def _draw(self, n: int) -> list[int]:
        """min(n, len) distinct record indices: uniform, or weighted by recency (half_life)."""
        size = len(self.records)
        if self.half_life is None:
            return torch.randperm(size, generator=self.gen)[:n].tolist()
        v = torch.tensor([r.get("version", 0) for r in self.records], dtype=torch.float64)
        w = torch.pow(0.5, (v.max() - v) / self.half_life)
        return torch.multinomial(w, min(n, size), replacement=False, generator=self.gen).tolist()

    def state_dict(self) -> dict:
        return {"records": list(self.records), "nbytes": self.nbytes, "added": self.added,
                "evicted": self.evicted, "steps": self.steps, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.records = deque(state["records"])
        self.nbytes = sum(_nbytes(r) for r in self.records)
        self.added, self.evicted, self.steps = state["added"], state["evicted"], state["steps"]
        self.gen.set_state(state["gen"])
        self._evict()  # a smaller cap than the saved buffer's


def collate(records: list[dict], steps: int) -> dict[str, torch.Tensor]:
    """Per-sequence records -> padded batch: aux [B, T, X], next_ids [B, T+s-1], target_probs [B, T+s, V],
    valid [B, T+s], lengths [B], first_ids [B]."""
    B, s = len(records), steps
    lengths = torch.tensor([r["aux"].shape[0] for r in records])
    T = int(lengths.max())
    X, V = records[0]["aux"].shape[1], records[0]["target_probs"].shape[1]
    aux = torch.zeros(B, T, X)
    next_ids = torch.zeros(B, T + s - 1, dtype=torch.long)
    probs = torch.zeros(B, T + s, V)
    valid = torch.zeros(B, T + s, dtype=torch.bool)
    for b, r in enumerate(records):
        L = r["aux"].shape[0]
        aux[b, :L] = r["aux"]
        next_ids[b, :L + s - 1] = r["next_ids"]
        probs[b, :L + s] = r["target_probs"]
        valid[b, :L + s] = r["valid"]
    first = torch.tensor([r.get("first", 0) for r in records], dtype=torch.long)  # 0: a record saved before it was kept
    return {"aux": aux, "next_ids": next_ids, "target_probs": probs, "valid": valid, "lengths": lengths,
            "first_ids": first}
