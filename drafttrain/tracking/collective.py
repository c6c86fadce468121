"""Agreement across processes. A drafter step is a collective (DDP backward, the trainer's reduce), so every
decision to take one is agreed: processes decide on their own clocks, banks and buffers, and one that stepped alone
would hang or break the others. Each call but settle is itself a collective: every process calls it at the same
point."""
from __future__ import annotations

import time

import torch


class Collective:
    def __init__(self, accelerator=None):
        self.acc = accelerator  # None: one process
        self.n = accelerator.num_processes if accelerator is not None else 1

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum of `values` over every process; one process: `values`."""
        if self.n == 1:
            return list(values)
        return self.acc.reduce(torch.tensor(values, dtype=torch.float64, device=self.acc.device),
                               "sum").cpu().tolist()

    def everywhere(self, ok: bool) -> bool:
        """`ok` on every process (one process: `ok`)."""
        return self.sum([float(not ok)])[0] == 0  # no process said no

    def pooled_mal(self, *scores) -> list[float | None]:
        """The MAL of each teacher_forced_acceptance result (None: not scored here) pooled over every process's
        rows (weighted by verify rows: emitted / verify rows, as it pools chunks; 1.0 with none), None where no
        process scored; one process: its own. A NaN anywhere is NaN everywhere: the publisher decides alike."""
        if self.n == 1:
            return [None if s is None else s["mal"] for s in scores]
        x = []  # per result: (scored here, MAL x verify rows, verify rows)
        for s in scores:
            x += [0.0, 0.0, 0.0] if s is None else [1.0, s["mal"] * s["stats"].verify_rows, s["stats"].verify_rows]
        x = self.sum(x)
        return [None if n == 0 else w / rows if rows else 1.0 for n, w, rows in zip(x[0::3], x[1::3], x[2::3])]

    def agreement(self, version: int, module: torch.nn.Module) -> dict:
        """Each process's drafter version and a float64 sum of its weights, gathered: DDP keeps the processes' drafters
        equal, so a difference means one trained or published alone. {"versions", "sums", "agree"}."""
        mine = torch.tensor([[float(version), float(sum(p.detach().double().sum() for p in module.parameters()))]],
                            dtype=torch.float64, device="cpu")
        rows = self.acc.gather(mine.to(self.acc.device)).cpu() if self.n > 1 else mine  # [n, 2]
        versions, sums = [int(v) for v in rows[:, 0].tolist()], rows[:, 1].tolist()
        return {"versions": versions, "sums": sums, "agree": len(set(versions)) == 1 and len(set(sums)) == 1}

    def settle(self, grace_s: float = 0.2) -> None:
        """A process's last act after its last collective (several processes): a short pause, holding no lock, so
        gloo's worker threads free that collective's tensors while the interpreter still runs. Exiting at once, a
        worker could still be freeing one at interpreter shutdown, which aborts the process (SIGABRT at exit;
        measured: bench/NOTES.md, Scale). Not a collective: processes settle on their own."""
        if self.n > 1:
            time.sleep(grace_s)
