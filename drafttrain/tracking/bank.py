"""The sync-mode time bank: how much drafter work (capture, training steps, estimate, publish) an RL step may buy.

Each RL step earns online.budget_frac x its own time (capped at online.time_budget_s); drafter work spends it, so on
average it adds at most budget_frac to the RL step time. A drafter step's cost is predicted from its batch's padded
tokens (seconds per token, a moving average: batches of long rollouts cost several times those of short ones), an
update's fixed work (estimate + publish) from a moving average; both with MARGIN, so the bank goes into debt by no
more than the error of those predictions.
"""
from __future__ import annotations

# predicted costs x this: their errors (timing noise, a slower publish) come out of the margin, not the RL step
MARGIN = 1.25


def padded_tokens(group: list[dict]) -> int:
    """Positions a collated batch of these records computes: rows x the longest record."""
    return len(group) * max(r["aux"].shape[0] for r in group)


class TimeBank:
    def __init__(self, budget_frac: float, time_budget_s: float):
        self.frac, self.cap_s = budget_frac, time_budget_s
        self.bank_s = 0.0  # drafter time earned minus drafter time spent
        self.tok_cost_s: float | None = None  # moving average of a drafter step's seconds per padded token
        self.fixed_cost_s: float | None = None  # moving average of an update's estimate + publish

    @property
    def on(self) -> bool:
        return self.frac > 0

    @property
    def measured(self) -> bool:
        """Both costs predicted: before that an update takes one whole batch."""
        return self.tok_cost_s is not None and self.fixed_cost_s is not None

    def earn(self, rl_s: float, capture_s: float) -> None:
        """An RL step of rl_s seconds (drafter work excluded) earns; the capture work inside it is paid at once."""
        self.bank_s = min(self.bank_s + self.frac * rl_s, self.cap_s) - capture_s

    def spend(self, seconds: float) -> None:
        self.bank_s -= seconds

    def allowance(self, spent: float, banked: bool) -> float:
        """What the next drafter step may cost, `spent` seconds into the update: what time_budget_s leaves, and
        (banked) what the bank leaves after the update's predicted fixed work."""
        left = self.cap_s - spent
        return min(left, self.bank_s - spent - MARGIN * (self.fixed_cost_s or 0.0)) if banked else left

    def fit(self, group: list[dict], allowance: float | None) -> list[dict] | None:
        """The most records of `group` (ascending lengths: a prefix) whose predicted step fits `allowance` (None:
        all); None if not even one does. Nothing measured yet: the whole group."""
        if allowance is None or self.tok_cost_s is None:
            return group
        per_row = MARGIN * self.tok_cost_s
        n = 0
        while n < len(group) and per_row * (n + 1) * group[n]["aux"].shape[0] <= allowance:
            n += 1
        return group[:n] if n else None

    def covers(self, groups: list[list[dict]], allowance: float) -> bool:
        """The predicted cost of every record of these groups (one drafter step each) fits `allowance`; nothing
        measured yet: True."""
        if self.tok_cost_s is None:
            return True
        return MARGIN * self.tok_cost_s * sum(padded_tokens(g) for g in groups) <= allowance

    def step_took(self, seconds: float, group: list[dict]) -> None:
        per_tok = seconds / padded_tokens(group)
        self.tok_cost_s = per_tok if self.tok_cost_s is None else 0.8 * self.tok_cost_s + 0.2 * per_tok

    def fixed_took(self, seconds: float) -> None:
        self.fixed_cost_s = seconds if self.fixed_cost_s is None else 0.8 * self.fixed_cost_s + 0.2 * seconds

    def state_dict(self) -> dict:
        # the cost predictions too: a resumed run that forgot them would overspend its first update
        return {"bank_s": self.bank_s, "tok_cost_s": self.tok_cost_s, "fixed_cost_s": self.fixed_cost_s}

    def load_state_dict(self, state: dict) -> None:
        self.bank_s = state.get("bank_s", 0.0)
        self.tok_cost_s, self.fixed_cost_s = state.get("tok_cost_s"), state.get("fixed_cost_s")
