"""The publish gate's statistics: a paired comparison of a candidate drafter with the serving one, no model needed.

Both drafters are scored on the same held-out rows (teacher-forced, each row's own MAL), so each row gives one
difference d_i = MAL_candidate(i) - MAL_serving(i): what varies between rows (their length, how predictable they
are) cancels out of d, and the mean of d has far less noise than the difference of two pooled MALs. With n rows,
mean m and sample sd s, the one-sided Student-t bounds at level c are

    lower = m - t_c(n-1) s / sqrt(n),     upper = m + t_c(n-1) s / sqrt(n)

and a candidate is published iff lower > margin: if the drafters are equal (mean difference 0), it is published in
at most 1 - c of the decisions (exactly so for normal d; the t bound is robust to skew at a few dozen rows). It is
reset to the serving weights iff upper < 0 (worse, at the same level); otherwise the gate cannot tell yet and
training goes on from the candidate, whose gain grows until its bound clears (one update's gain is small).
Several processes pool the sums (n, sum d, sum d^2), so every process takes the same decision.

Per member: with drafter.kind=auto each trainable member is its own drafter to the gate (and to the canary:
hotswap.py), so one member's gain never carries another's noise into the engines. Every trainable member's new
weights and its serving weights are scored on the same held-out rows, one decision per member (several processes
pool every member's sums in one collective); the update publishes the serving weights with the members that passed
swapped in, the members shown worse go back to their serving weights in the trainer, the undecided ones train on.
Any other drafter is one member, ALL: every weight, the plain gate.
"""
from __future__ import annotations

import math

import torch
# Student-t quantile, stdtrit(df, p). Imported at start-up: a lazy scipy import inside the first decision (seconds)
# was charged to the drafter's time bank, which could then stay in debt for many RL steps
from scipy.special import stdtrit

ALL = ""  # the member that is every weight: a drafter gated and canaried as one


def paired_sums(new_rows: torch.Tensor, old_rows: torch.Tensor) -> list[float]:
    """[n, sum d, sum d^2] over the rows both drafters scored (nan in either: a row with no verify step, skipped)."""
    d = (new_rows.double() - old_rows.double())
    d = d[torch.isfinite(d)]
    return [float(d.numel()), float(d.sum()), float((d * d).sum())]


def paired_bound(n: float, s: float, s2: float, confidence: float) -> dict:
    """Mean paired difference and its one-sided t bounds at `confidence`, from the pooled sums (n >= 2; else the
    bounds are -inf / +inf: no decision)."""
    if n < 2:
        mean = s / n if n else math.nan
        return {"n": int(n), "mean": mean, "sd": math.nan, "lower": -math.inf, "upper": math.inf}
    mean = s / n
    var = max(s2 - s * s / n, 0.0) / (n - 1)  # sums pooled in float64: rounding can leave a tiny negative
    half = float(stdtrit(n - 1, confidence)) * math.sqrt(var / n)
    return {"n": int(n), "mean": mean, "sd": math.sqrt(var), "lower": mean - half, "upper": mean + half}


def gate_decision(n: float, s: float, s2: float, confidence: float, margin: float = 0.0,
                  min_rows: int = 2) -> dict:
    """paired_bound + the decision: publish iff n >= min_rows and lower > margin; worse (reset the candidate to the
    serving weights) iff n >= min_rows and upper < 0; neither: keep training the candidate, publish nothing."""
    b = paired_bound(n, s, s2, confidence)
    enough = n >= max(min_rows, 2)
    return {**b, "publish": enough and b["lower"] > margin, "worse": enough and b["upper"] < 0}


def members_of(drafter) -> list[str]:
    """The members gated and canaried on their own: an auto drafter's trainable ones, else [ALL]."""
    return list(drafter.trainable) or [ALL]


def owns(name: str, member: str) -> bool:
    """Weight `name` belongs to `member` (auto drafters prefix each member's weights with "<kind>.")."""
    return member == ALL or name.startswith(member + ".")


def merged(base: dict, new: dict, members) -> dict:
    """`base` with the weights of `members` taken from `new`."""
    return {k: new[k] if any(owns(k, m) for m in members) else v for k, v in base.items()}


def gate_members(pool_sum, ests: dict | None, servs: dict | None, members: list[str], oc) -> dict:
    """{member: gate_decision} on its paired rows, every member's sums pooled over the processes
    in one collective (pool_sum); no rows scored here: zero sums. Each member's bound is at confidence
    1 - (1 - online.gate_confidence) / members (Bonferroni), so that when no member is better, an update publishes
    some member in at most 1 - gate_confidence of the decisions, as one drafter's gate does (n members at the plain
    level would publish noise up to n times as often)."""
    sums = pool_sum([x for m in members for x in (paired_sums(ests[m]["row_mal"], servs[m]["row_mal"])
                                                   if servs is not None else [0.0, 0.0, 0.0])])
    c = 1 - (1 - oc.gate_confidence) / len(members)
    return {m: gate_decision(*sums[3 * i:3 * i + 3], c, oc.gate_margin, oc.gate_min_rows)
            for i, m in enumerate(members)}


def score(form, rows: dict, k: int, member: str, tfa) -> dict:
    """tfa (teacher_forced_acceptance) of `member` of the drafter `form` on `rows`."""
    if member == ALL:
        return tfa(form, rows, k)
    with form.scoring(member):
        return tfa(form, rows, k)
