"""The sync-mode time bank: how much drafter work (capture, training steps, estimate, publish) an RL step may buy,
and the drafter steps it buys (buy_steps).

Each RL step earns online.budget_frac x its own time, less the capture work inside it (the bank holds at most
online.time_budget_s); drafter work spends it, so on average it adds at most budget_frac to the RL step time. A
drafter step's cost is predicted from its batch's padded tokens (seconds per token, a moving average: batches of
long rollouts cost several times those of short ones), an update's fixed work (estimate + publish) from a moving
average; both with MARGIN, so the bank goes into debt by no more than the error of those predictions. A bank that
cannot pay for one drafter step STARVED updates in a row is said in one line (starved_note), with the key to change.
"""
from __future__ import annotations

# predicted costs x this: their errors (timing noise, a slower publish) come out of the margin, not the RL step
MARGIN = 1.25
STARVED = 10  # updates in a row the bank could not pay for before one line says so


def padded_tokens(group: list[dict], max_len: int | None = None) -> int:
    """Positions a collated batch of these records computes: rows x the longest record, each cut to max_len (a longer
    record trains on a window of that many: train.max_len)."""
    return len(group) * min(max(r["aux"].shape[0] for r in group), max_len or float("inf"))


class TimeBank:
    def __init__(self, budget_frac: float, time_budget_s: float, max_len: int | None = None):
        self.frac, self.cap_s, self.max_len = budget_frac, time_budget_s, max_len
        self.bank_s = 0.0  # drafter time earned minus drafter time spent
        self.tok_cost_s: float | None = None  # moving average of a drafter step's seconds per padded token
        self.fixed_cost_s: float | None = None  # moving average of an update's estimate + publish
        self.starved = 0  # updates in a row the bank could not pay for (reset by one that trains)
        self.earned_s = self.capture_s = 0.0  # the last RL step's earnings and capture work (for starved_note)

    @property
    def on(self) -> bool:
        return self.frac > 0

    @property
    def measured(self) -> bool:
        """Both costs predicted: before that an update takes one whole batch."""
        return self.tok_cost_s is not None and self.fixed_cost_s is not None

    def earn(self, rl_s: float, capture_s: float) -> None:
        """An RL step of rl_s seconds (drafter work excluded) earns; the capture work inside it is paid at once, out
        of its earnings before the cap (a capture longer than the cap no longer keeps the bank in debt for good)."""
        self.earned_s, self.capture_s = self.frac * rl_s, capture_s
        self.bank_s = min(self.bank_s + self.earned_s - capture_s, self.cap_s)

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
        while n < len(group) and per_row * padded_tokens(group[:n + 1], self.max_len) <= allowance:
            n += 1
        return group[:n] if n else None

    def covers(self, groups: list[list[dict]], allowance: float) -> bool:
        """The predicted cost of every record of these groups (one drafter step each) fits `allowance`; nothing
        measured yet: True."""
        if self.tok_cost_s is None:
            return True
        return MARGIN * self.tok_cost_s * sum(padded_tokens(g, self.max_len) for g in groups) <= allowance

    def step_took(self, seconds: float, group: list[dict]) -> None:
        per_tok = seconds / padded_tokens(group, self.max_len)
        self.tok_cost_s = per_tok if self.tok_cost_s is None else 0.8 * self.tok_cost_s + 0.2 * per_tok

    def fixed_took(self, seconds: float) -> None:
        self.fixed_cost_s = seconds if self.fixed_cost_s is None else 0.8 * self.fixed_cost_s + 0.2 * seconds

    def fed(self, trained: bool, one_record_s: float | None = None) -> str | None:
        """After an update: did it train? The one line (once per run of STARVED updates without a step) saying why
        the drafter is not training and what to change; None otherwise. one_record_s: the predicted cost of the
        cheapest drafter step it could have taken (one record)."""
        self.starved = 0 if trained else self.starved + 1
        if self.starved != STARVED:
            return None
        why = (f"its time bank is {self.bank_s:.2f} s: an RL step earns {self.earned_s:.2f} s "
               f"(online.budget_frac={self.frac:g}) and its capture costs {self.capture_s:.2f} s")
        if one_record_s is not None and one_record_s * MARGIN > self.cap_s:
            why = (f"a drafter step of one record costs ~{one_record_s:.2f} s, more than online.time_budget_s="
                   f"{self.cap_s:g} allows")
        return (f"[drafttrain] the drafter has not trained for {STARVED} RL steps: {why}; raise online.budget_frac "
                f"or online.time_budget_s, or capture less (online.capture_rows=graded, online.capture_frac, "
                f"train.max_len)")

    def one_record_s(self, groups: list[list[dict]]) -> float | None:
        """Predicted cost of a drafter step on the shortest record of these groups (None: nothing measured)."""
        recs = [r for g in groups for r in g]
        if self.tok_cost_s is None or not recs:
            return None
        return self.tok_cost_s * min(min(r["aux"].shape[0] for r in recs), self.max_len or float("inf"))

    def state_dict(self) -> dict:
        # the cost predictions too: a resumed run that forgot them would overspend its first update
        return {"bank_s": self.bank_s, "tok_cost_s": self.tok_cost_s, "fixed_cost_s": self.fixed_cost_s,
                "starved": self.starved}

    def load_state_dict(self, state: dict) -> None:
        self.bank_s = state.get("bank_s", 0.0)
        self.tok_cost_s, self.fixed_cost_s = state.get("tok_cost_s"), state.get("fixed_cost_s")
        self.starved = state.get("starved", 0)


def buy_steps(bank: TimeBank, oc, rl_s: float | None, t0: float, draw, step, everywhere, now):
    """Up to online.steps_per_update drafter steps on length-grouped batches (oc: the online section). Sync mode
    (rl_s: the RL step's own time, already earned) within time_budget_s and the bank: each step trains on as many
    records of its batch as the bank covers after the update's fixed work; the update ends when not one record fits
    (the bank's first update, with nothing measured, takes one whole batch); it starts only when the bank covers
    online.min_steps_per_update whole batches. draw(n) -> up to n groups of records; step(group) -> the trainer's
    record; everywhere(flag) -> flag agreed by every process; now() -> the clock.
    Returns (losses, non-finite steps, the groups it had drawn); None: the bank could not pay for a step."""
    banked = bank.on and rl_s is not None
    groups: list[list[dict]] = []
    drawn: list[list[dict]] = []

    def refill(left: int) -> None:  # length-grouped batches (less padding), collated only when used
        if not groups and left > 0:
            groups.extend(draw(left))
            drawn.extend(groups)

    def allowance(spent: float) -> float | None:
        return None if rl_s is None else bank.allowance(spent, banked)

    refill(oc.steps_per_update)
    if banked:  # an update starts once the bank covers min_steps_per_update whole batches after its fixed work
        afford = bank.bank_s > 0 and bank.covers(groups[-oc.min_steps_per_update:], allowance(0.0))
        if not everywhere(afford):
            return None, drawn
    losses, skipped = [], 0
    first = banked and not bank.measured  # the bank's first update: one batch
    while True:
        go = groups and len(losses) < oc.steps_per_update and not (first and losses)
        group = bank.fit(groups.pop(), allowance(now() - t0)) if go else None  # None: not one record fits
        if not everywhere(group is not None):  # every process takes this step, or none does
            break
        ts = now()
        out = step(group)
        bank.step_took(now() - ts, group)
        skipped += out["nonfinite"]
        losses.append(out["loss"])
        refill(oc.steps_per_update - len(losses))
    return (losses, skipped), drawn
