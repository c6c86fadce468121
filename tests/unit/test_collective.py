"""Agreement across processes (tracking/collective.py) with one process and with a fake two-process reduce."""
from __future__ import annotations

import pytest
import torch

from drafttrain.spec import SpecStats
from drafttrain.tracking.collective import Collective


class _TwoProcesses:
    """An accelerator whose reduce adds what the other process sends (fixed per call)."""
    num_processes, device = 2, "cpu"

    def __init__(self, other: list[list[float]]):
        self.other = other

    def reduce(self, t, op):
        assert op == "sum"
        return t + torch.tensor(self.other.pop(0), dtype=t.dtype)


def _score(mal: float, rows: float) -> dict:
    return {"mal": mal, "stats": SpecStats(verify_rows=rows, emitted=mal * rows)}


def test_one_process_decides_alone():
    c = Collective(None)
    assert c.n == 1 and c.sum([1.0, 2.0]) == [1.0, 2.0]
    assert c.everywhere(True) and not c.everywhere(False)
    assert c.pooled_mal(_score(2.0, 3), None) == [2.0, None]


def test_every_process_must_agree():
    c = Collective(_TwoProcesses([[0.0], [1.0]]))
    assert c.everywhere(True)  # the other said yes
    assert not c.everywhere(True)  # the other said no


def test_mal_is_pooled_by_verify_rows():
    other = [[1.0, 4.0 * 1, 1.0, 0.0, 0.0, 0.0]]  # the other scored the first (MAL 4 on 1 row), not the second
    c = Collective(_TwoProcesses(other))
    pooled = c.pooled_mal(_score(2.0, 3), None)
    assert pooled[0] == pytest.approx((2.0 * 3 + 4.0) / 4) and pooled[1] is None


def test_several_processes_settle_before_exiting(monkeypatch):
    """The job's last act: with several processes a pause that holds no lock (gloo's workers free the last
    collective's tensors before interpreter shutdown, not during it); one process has no workers and does not wait."""
    from drafttrain.tracking import collective

    slept = []
    monkeypatch.setattr(collective.time, "sleep", slept.append)
    Collective(None).settle()
    assert slept == []
    Collective(_TwoProcesses([[0.0]])).settle()
    assert slept == [0.2]
