"""Per-member publishing: with drafter.kind=auto, each trainable member is its own drafter to the publish gate and
to the canary, so one member's gain never carries another's noise into the engines, one member's failure never
takes back another's gain, and a member is judged only on the decode steps it drafted.

- Gate: every trainable member's new weights and its serving weights are scored on the same held-out rows (the
  paired bound of tracking/gate.py, one decision per member; several processes pool every member's sums in one
  collective). The update publishes the serving weights with the members that passed swapped in; the members
  shown worse go back to their serving weights in the trainer; the undecided ones train on.
- Canary: each newly published member is judged on the decode steps it drafted (the chooser's trace says which
  member drafted each step, and at which k), against its own estimate at those steps' k (from the estimate's
  per-position acceptance: the engine's auto k and toggle draft shorter than the k_max the estimate scores, and AR
  steps emit one token; a whole-batch MAL against the estimate at k_max rolled good drafters back). A member that
  fails is rolled back alone; one that drafted no step of a batch stays on probation until one does.

Any other drafter is one member, ALL: every weight, the plain gate and canary.
"""
from __future__ import annotations

from drafttrain.simulate import expected_tokens  # 1 + sum over i < k of P(drafts 0..i accepted)
from drafttrain.tracking.gate import gate_decision, paired_sums

ALL = ""  # the member that is every weight: a drafter gated and canaried as one


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
    """{member: gate_decision} on its paired rows (tracking/gate.py), every member's sums pooled over the processes
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


def probation(pool_sum, ests: dict | None, expected: dict, members: list[str], k: int) -> dict:
    """What the canary judges each of `members` by: {member: {"mal": its pooled estimate, "curve": its estimated
    acceptance per draft position (rate over steps that reached it)}}, the curves' counts pooled over the processes
    in one collective (None where no process scored it: the canary then expects the estimate at k_max)."""
    x = []
    for m in members:
        st = (ests or {}).get(m, {}).get("stats")
        x += [float(v) for c in ("accepted_per_position", "reached_per_position")
              for v in (list(getattr(st, c, [])) + [0.0] * k)[:k]]
    x = pool_sum(x)
    out = {}
    for i, m in enumerate(members):
        acc, reach = x[2 * i * k:(2 * i + 1) * k], x[(2 * i + 1) * k:(2 * i + 2) * k]
        curve = [a / r if r else 0.0 for a, r in zip(acc, reach)] if any(reach) else None
        out[m] = {"mal": expected[m], "curve": curve}
    return out


def batch_mal(batch, member: str, curve: list[float] | None = None, mal: float | None = None
              ) -> tuple[float, float, float | None]:
    """(mean accepted length, verify rows, expected MAL) over the decode steps `member` drafted in a rollout batch
    (ALL: every step that drafted; an AR step of the toggle emits one token whatever the drafter); rows 0: it drafted
    none. From the batch's timeline: per step, the drafts verified, the chooser's choice (schedule), the active rows
    and the tokens they emitted; an engine that keeps no per-step k (vLLM): the batch's own stats. Expected:
    expected_tokens(curve, k) of each step, weighted by its rows (without a curve, or without a step to read: mal,
    the estimate at k_max, itself), times
    mal / expected_tokens(curve, len(curve)) where the estimate's own MAL is given: it counts the last step of a row
    cut at its end, which the curve does not (exact at the estimate's k, a little low below it)."""
    tl = batch.timeline
    n = len(tl.tokens)
    if not n or len(tl.k) != n or (member != ALL and len(tl.schedule) < n):
        st = batch.stats  # its MAL is over the steps that drafted
        return (st.mean_accepted_length, st.verify_rows - st.ar_rows, mal) if member == ALL else (1.0, 0.0, mal)
    steps = [i for i in range(n) if tl.k[i] > 0 and (member == ALL or tl.schedule[i].get("kind") == member)]
    rows = float(sum(tl.batch[i] for i in steps))
    if not rows:
        return 1.0, 0.0, mal
    if curve is None:
        return sum(tl.tokens[i] for i in steps) / rows, rows, mal
    scale = 1.0 if mal is None else mal / expected_tokens(curve, len(curve))
    at_k = sum(tl.batch[i] * expected_tokens(curve, tl.k[i]) for i in steps) * scale / rows
    return sum(tl.tokens[i] for i in steps) / rows, rows, at_k
