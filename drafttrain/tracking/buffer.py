"""FeatureBuffer: the tracker's one store of captured rollouts, bounded in bytes: the rows it trains on, the rows it
holds out (the estimate's, the publish gate's and the canary's reference) and the rows measure() scores.

    buf = FeatureBuffer(max_bytes=64 << 20, dtype=torch.bfloat16, seed=0, device="cpu", pin=False)
    buf.add(build_features(...), version=policy_step, heldout=held)   # per-row records; evicts the oldest
    batch = buf.sample(16)                # padded float32 batch of training records (held-out ones never drawn)
    groups = buf.sample_groups(16, 8)     # 8 groups of 16 similar-length records (less padding) ...
    batch = collate(groups[0], buf.steps)  # ... each collated as sample() returns it, when it is used
    buf.of_version(v)                      # a policy version's records, in the order they came

A record is one row of build_features trimmed to its length L: aux [L, X] (what the drafter reads) and hidden [L, H]
(the policy's final hidden state: its targets, recomputed with the LM head when read) in reduced precision, the
token ids [L] (int32) and where its response starts. Nothing in it grows with the vocabulary: (X + H) * 2 + 4 bytes
a token at bf16. Memory is the sum of the stored tensors' bytes, and every record counts, held out or not; records
whose loss mask is empty are not stored, nor is a record larger than the whole cap (too_big counts those, for the
caller's warning). Sampling is without replacement from a seeded generator, so a restored buffer continues the same
draws: uniform, or with half_life h (in policy versions) a record v versions older than the newest is drawn with
weight 0.5^(v/h). Online, the policy moves every step; uniform draws over a buffer that spans many steps train the
drafter mostly on policies that are gone (bench_tracking: a drafter trained on the current policy's rollouts alone
caught up in ~25 steps, the uniformly-fed online one had not after as many).
Records live on `device` (online.buffer_device: the host, or the run's device); with pin (a GPU run, records on the
host) a collated batch is built in pinned memory, so the trainer's copy to the GPU does not block. Draws use a host
generator, so they are the same on any device and resume anywhere.
"""
from __future__ import annotations

from collections import deque

import torch

from drafttrain.tracking.capture import valid_mask

_KEYS = ("aux", "hidden", "ids")
FORMAT = 2  # records of hidden states; 1 (unnamed): full-vocabulary distributions, which this version cannot read


def record_bytes(rec: dict) -> int:
    return sum(rec[k].numel() * rec[k].element_size() for k in _KEYS)


class FeatureBuffer:
    def __init__(self, max_bytes: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 name: str = "online.buffer_mb", half_life: float | None = None, device="cpu", pin: bool = False):
        if max_bytes <= 0:
            raise ValueError(f"{name}: the feature buffer size must be > 0, got {max_bytes}")
        if half_life is not None and not half_life > 0:
            raise ValueError(f"online.buffer_half_life: must be > 0 or null (uniform), got {half_life}")
        self.half_life, self.name = half_life, name
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {dtype}")
        self.max_bytes, self.dtype = int(max_bytes), dtype
        self.records: deque[dict] = deque()
        self.nbytes = 0
        self.added, self.added_bytes = 0, 0  # records ever added, and their bytes
        self.evicted = 0  # records dropped for the cap
        self.too_big, self.too_big_bytes = 0, 0  # records larger than the whole cap (never stored); the largest
        self._mark, self._said = (0, 0), set()  # notes(): (records, bytes) added before the step; kinds said
        self.steps: int | None = None  # TTT unroll the stored records are collated for
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = torch.device(device)  # pinned host memory needs a GPU runtime
        self.pin = bool(pin) and self.device.type == "cpu" and torch.cuda.is_available()

    @classmethod
    def of(cls, online, seed: int, device: torch.device) -> "FeatureBuffer":
        """The online.* section's buffer for a run on `device` (online.buffer_device: the host, pinned for a GPU)."""
        host = online.buffer_device == "cpu"
        return cls(int(online.buffer_mb * 2 ** 20), seed=seed, name="online.buffer_mb",
                   half_life=online.buffer_half_life, device="cpu" if host else device, pin=host and torch.device(device).type == "cuda")

    def __len__(self) -> int:
        return len(self.records)

    def add(self, batch: dict[str, torch.Tensor], version: int = 0, heldout: torch.Tensor | None = None) -> int:
        """batch: build_features output, from policy `version`; heldout [B] bool: rows kept out of training.
        Returns the number of records stored."""
        L = batch["lengths"].tolist()
        T = batch["aux"].shape[1]
        s = batch["valid"].shape[1] - T
        if self.steps is None:
            self.steps = s
        elif s != self.steps:
            raise ValueError(f"FeatureBuffer.add: features built for ttt_steps={s}, the buffer holds "
                             f"ttt_steps={self.steps}")
        keep = batch["valid"].any(1).tolist()
        held = [False] * len(L) if heldout is None else heldout.bool().tolist()
        # converted once per batch, not per row (the rows are then cut and copied out of it)
        aux, hid = (batch[k].to(self.device, self.dtype) for k in ("aux", "hidden"))
        ids = torch.cat([batch["first_ids"].view(-1, 1), batch["next_ids"]], 1)  # [B, T'+s]
        ids = ids.to(self.device, torch.int32)
        start = batch["start"].tolist()
        n = 0
        for b, n_b in enumerate(L):
            if not keep[b]:
                continue
            rec = {"aux": aux[b, :n_b].clone(), "hidden": hid[b, :n_b].clone(), "ids": ids[b, :n_b].clone(),
                   "start": int(start[b]), "version": int(version), "heldout": bool(held[b])}
            size = record_bytes(rec)
            if size > self.max_bytes:
                self.too_big, self.too_big_bytes = self.too_big + 1, max(self.too_big_bytes, size)
                continue
            self.records.append(rec)
            self.nbytes += size
            self.added, self.added_bytes = self.added + 1, self.added_bytes + size
            n += 1
        self._evict()
        return n

    def _evict(self) -> None:
        while self.records and self.nbytes > self.max_bytes:
            self.nbytes -= record_bytes(self.records.popleft())
            self.evicted += 1

    def of_version(self, version: int) -> list[dict]:
        """The records of one policy version, in the order they came."""
        return [r for r in self.records if r["version"] == version]

    def notes(self, version: int, step=None) -> list[str]:
        """One line for each way the buffer could not keep what was captured at policy `version` (since the last
        call), each said once: a row larger than the whole buffer (never stored), or a step's rows more than it
        holds (the oldest of them evicted)."""
        rows, nbytes = self.added - self._mark[0], self.added_bytes - self._mark[1]
        self._mark = (self.added, self.added_bytes)
        kept, cap = len(self.of_version(version)), self.max_bytes / 2 ** 20
        fix = f"raise {self.name}"
        notes = {}
        if self.too_big:
            notes["too_big"] = (f"{self.name}: a captured row needs {self.too_big_bytes / 2 ** 20:.1f} MB, more than the "
                                f"whole buffer ({cap:g} MB): {self.too_big} such rows were not stored; {fix}")
        if kept < rows:
            notes["step"] = (f"{self.name}: the buffer ({cap:g} MB) holds {kept} of the {rows} rows captured at step "
                             f"{step} ({nbytes / 2 ** 20:.1f} MB): the oldest were evicted; {fix} to at least "
                             f"{2 * nbytes / 2 ** 20:.0f} (two steps)")
        new = [line for kind, line in notes.items() if kind not in self._said]
        self._said |= notes.keys()
        return new

    def trainable(self) -> int:
        """Records training may draw (not held out)."""
        return sum(not r["heldout"] for r in self.records)

    def sample(self, n: int, max_len: int | None = None) -> dict[str, torch.Tensor]:
        """min(n, trainable) training records without replacement, collated (float32 aux and hidden)."""
        pool = self._pool("sample")
        return collate([pool[i] for i in self._draw(pool, n)], self.steps, max_len, self.gen, self.pin)

    def sample_groups(self, n: int, count: int, max_len: int | None = None) -> list[list[dict]]:
        """Up to `count` groups of n training records: min(n*count, trainable) records drawn as in sample(), grouped
        by length (at most max_len: a longer record trains on a window), less padding; each record is used once, so
        long rollouts are not under-drawn; in random order. Lists of records (references: still valid after an
        eviction), so a caller that may stop early, or save the groups it has not used yet, collates (collate(group,
        steps)) only the batches it uses."""
        pool = self._pool("sample_groups")
        idx = self._draw(pool, n * count)
        cap = max_len or float("inf")
        idx.sort(key=lambda i: min(pool[i]["aux"].shape[0], cap))
        groups = [idx[j:j + n] for j in range(0, len(idx), n)]
        order = torch.randperm(len(groups), generator=self.gen, device="cpu").tolist()
        return [[pool[i] for i in groups[g]] for g in order]

    def _pool(self, what: str) -> list[dict]:
        pool = [r for r in self.records if not r["heldout"]]
        if not pool:
            raise ValueError(f"FeatureBuffer.{what}: the buffer holds no training record")
        return pool

    def _draw(self, pool: list[dict], n: int) -> list[int]:
        """min(n, len(pool)) distinct indices into pool: uniform, or weighted by recency (half_life)."""
        size = len(pool)
        if self.half_life is None:
            return torch.randperm(size, generator=self.gen, device="cpu")[:n].tolist()
        v = torch.tensor([r["version"] for r in pool], dtype=torch.float64, device="cpu")
        w = torch.pow(0.5, (v.max() - v) / self.half_life)
        return torch.multinomial(w, min(n, size), replacement=False, generator=self.gen).tolist()

    def state_dict(self) -> dict:
        return {"format": FORMAT, "records": list(self.records), "added": self.added, "evicted": self.evicted,
                "added_bytes": self.added_bytes, "steps": self.steps, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> str | None:
        """Restores what state_dict() saved. Returns None, or one line saying what could not be kept: records of the
        old format (full-vocabulary distributions; no hidden state to recompute targets from) are dropped, the
        counters and draws continue."""
        note = None
        records = state["records"]
        if state.get("format", 1) != FORMAT:
            note = (f"{self.name}: the checkpoint's feature buffer ({len(records)} records) holds full-vocabulary "
                    f"distributions, which this version no longer stores: it starts empty, and the drafter trains "
                    f"on the rollouts captured from here on (its weights and optimizer are restored)")
            records = []
        self.records = deque({**r, **{k: r[k].to(self.device) for k in _KEYS}} for r in records)
        self.nbytes = sum(record_bytes(r) for r in self.records)
        self.added, self.evicted, self.steps = state["added"], state["evicted"], state["steps"]
        self.added_bytes = state.get("added_bytes", 0)
        self.gen.set_state(state["gen"])
        self._evict()  # a smaller cap than the saved buffer's
        return note


def collate(records: list[dict], steps: int, max_len: int | None = None, gen: torch.Generator | None = None,
            pin: bool = False) -> dict[str, torch.Tensor]:
    """Per-sequence records -> padded batch: aux [B, T, X] and hidden [B, T, H] (float32), next_ids [B, T+s-1],
    valid [B, T+s], lengths [B], start [B], first_ids [B]. max_len: a record longer than that contributes a window of
    max_len positions (drawn with gen among those that start in its response), as a row of that length. On the
    records' device; pin: in pinned host memory (records on the host, a GPU trainer)."""
    recs = [_window(r, max_len, gen) for r in records]
    B, s = len(recs), steps
    dev = recs[0]["aux"].device
    pin = pin and dev.type == "cpu"
    lengths = torch.tensor([r["aux"].shape[0] for r in recs], device=dev)
    T = int(lengths.max())
    X, H = recs[0]["aux"].shape[1], recs[0]["hidden"].shape[1]
    aux = torch.zeros(B, T, X, device=dev, pin_memory=pin)
    hidden = torch.zeros(B, T, H, device=dev, pin_memory=pin)
    next_ids = torch.zeros(B, T + s - 1, dtype=torch.long, device=dev, pin_memory=pin)
    for b, r in enumerate(recs):
        L = r["aux"].shape[0]
        aux[b, :L] = r["aux"]
        hidden[b, :L] = r["hidden"]
        next_ids[b, :L - 1] = r["ids"][1:]
    start = torch.tensor([r["start"] for r in recs], device=dev)
    first = torch.stack([r["ids"][0] for r in recs]).long()
    return {"aux": aux, "hidden": hidden, "next_ids": next_ids, "valid": valid_mask(start, lengths, T + s),
            "lengths": lengths, "start": start, "first_ids": first}


def _window(rec: dict, max_len: int | None, gen: torch.Generator | None) -> dict:
    """A record cut to max_len positions from w on (w drawn among the starts at or after its response start, so its
    targets are response tokens; the last max_len positions when the response is shorter), or the record."""
    L = rec["aux"].shape[0]
    if max_len is None or L <= max_len:
        return rec
    hi = L - max_len
    lo = min(max(rec["start"] - 1, 0), hi)
    w = lo + int(torch.randint(hi - lo + 1, (1,), generator=gen, device="cpu")) if hi > lo else hi
    return {"aux": rec["aux"][w:w + max_len], "hidden": rec["hidden"][w:w + max_len],
            "ids": rec["ids"][w:w + max_len], "start": max(rec["start"] - w, 0)}
