"""UpdateRecord: what one on_policy_update did, with the same keys whatever happened (report.py's rule)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class UpdateRecord:
    drafter_version: int  # what the engines serve after the update
    capture_s: float = 0.0  # capture work in the RL step's loss forwards
    drafter_train_s: float = 0.0  # training steps + the acceptance estimate
    publish_s: float = 0.0
    drafter_loss: float | None = None  # mean over the update's steps
    drafter_steps: int = 0
    drafter_skipped_nonfinite: int = 0  # steps with a NaN/inf loss or gradient
    swap_s: float | None = None  # the slowest engine's hot-swap
    canary_mal: float | None = None
    expected_mal: float | None = None  # the update's teacher-forced estimate (the canary's reference)
    serving_mal: float | None = None  # the serving drafter's, on the same rows (publish gate)
    gated: bool = False  # held back by the publish gate
    gate_rows: int | None = None  # rows paired by the gate (None where it did not decide)
    gate_mean_diff: float | None = None  # mean per-row MAL difference, update - serving
    gate_lower: float | None = None  # its lower confidence bound
    # drafter.kind=auto with several trainable members (tracking/gate.py): per member, its gate's decision and
    # its estimate; the gate_* fields above are then the first member's
    member_gates: dict | None = None
    rolled_back: bool = False
    published: bool = False
    budget_bank_s: float | None = None  # the time bank after the update (None: no bank)

    def set_gate(self, gate: dict | None, members: dict | None = None, expected: dict | None = None) -> None:
        if gate is not None:
            self.gate_rows = gate["n"]
            self.gate_mean_diff = gate["mean"] if gate["n"] else None
            self.gate_lower = gate["lower"] if gate["lower"] > -float("inf") else None  # JSON has no -inf
        if members is not None:
            self.member_gates = {m: {"passed": g["publish"], "worse": g["worse"], "rows": g["n"],
                                     "mean_diff": g["mean"] if g["n"] else None, "expected_mal": expected.get(m),
                                     "lower": g["lower"] if g["lower"] > -float("inf") else None}
                                 for m, g in members.items()}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
