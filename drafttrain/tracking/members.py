"""Per-member publishing: with drafter.kind=auto and two or more trainable members, each member is its own drafter
to the publish gate and to the canary, so one member's gain never carries another's noise into the engines, and one
member's failure never takes back another's gain.

- Gate: every trainable member's new weights and its serving weights are scored on the same held-out rows (the
  paired bound of tracking/gate.py, one decision per member; several processes pool every member's sums in one
  collective). The update publishes the serving weights with the members that passed swapped in; the members
  shown worse go back to their serving weights in the trainer; the undecided ones train on.
- Canary: each newly published member is judged on the decode steps it drafted (the chooser's trace says which
  member drafted each step), against its own estimate. A member that fails is rolled back alone; a member that
  drafted no step of a batch stays on probation until one does.

Any other drafter (and auto with one trainable member) is one member, ALL: every weight, the plain gate and canary.
"""
from __future__ import annotations

from drafttrain.tracking.gate import gate_decision, paired_sums

ALL = ""  # the member that is every weight: a drafter gated and canaried as one


def members_of(drafter) -> list[str]:
    """The members gated and canaried on their own: an auto drafter's trainable ones (two or more), else [ALL]."""
    trainable = list(getattr(drafter, "trainable", None) or [])
    return trainable if getattr(drafter, "kind", None) == "auto" and len(trainable) > 1 else [ALL]


def owns(name: str, member: str) -> bool:
    """Weight `name` belongs to `member` (auto drafters prefix each member's weights with "<kind>.")."""
    return member == ALL or name.startswith(member + ".")


def merged(base: dict, new: dict, members) -> dict:
    """`base` with the weights of `members` taken from `new`."""
    return {k: new[k] if any(owns(k, m) for m in members) else v for k, v in base.items()}


def gate_members(pool_sum, ests: dict | None, servs: dict | None, members: list[str], oc) -> dict:
    """{member: gate_decision} on its paired rows (tracking/gate.py), every member's sums pooled over the processes
    in one collective (pool_sum); no rows scored here: zero sums."""
    sums = pool_sum([x for m in members for x in (paired_sums(ests[m]["row_mal"], servs[m]["row_mal"])
                                                   if servs is not None else [0.0, 0.0, 0.0])])
    return {m: gate_decision(*sums[3 * i:3 * i + 3], oc.gate_confidence, oc.gate_margin, oc.gate_min_rows)
            for i, m in enumerate(members)}


def score(form, rows: dict, k: int, member: str, tfa) -> dict:
    """tfa (teacher_forced_acceptance) of `member` of the drafter `form` on `rows`."""
    if member == ALL:
        return tfa(form, rows, k)
    with form.scoring(member):
        return tfa(form, rows, k)


def batch_mal(batch, member: str) -> tuple[float, float]:
    """(mean accepted length, verify rows) of the decode steps `member` drafted in a rollout batch (ALL: every
    step, the batch's own stats); rows 0: it drafted none. From the batch's timeline: per step, the chooser's
    choice (schedule), the active rows and the tokens they emitted."""
    if member == ALL:
        return batch.stats.mean_accepted_length, batch.stats.verify_rows
    tl = batch.timeline
    steps = [i for i, s in enumerate(tl.schedule[:len(tl.tokens)]) if s.get("kind") == member and s.get("on")]
    rows = float(sum(tl.batch[i] for i in steps))
    return (sum(tl.tokens[i] for i in steps) / rows if rows else 1.0), rows
