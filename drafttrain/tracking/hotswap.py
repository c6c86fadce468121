"""Publisher: versioned drafter publishing to every engine, a canary after each swap, rollback when it fails.

    pub = Publisher(engines, initial_weights, cfg.online, log)
    rec = pub.publish(weights, expected_mal, probe_prompts, params)   # -> version, swap_s, canary, rolled_back
    rec = pub.observe(rollout_batch)      # inline canary: judge the swap on the engine's own next rollouts

Order of checks: non-finite weights, or a non-finite trainer estimate (a diverged drafter whose outputs are NaN),
are never published (the engine would refuse NaN weights too); each engine's load_drafter is atomic and
versioned; then the canary compares the engine's mean accepted length (over the decode steps that drafted: an
AR step of engine.toggle emits one token whatever the drafter) with the trainer's own teacher-forced estimate.
Silently dropped or corrupted weights (acceptance pinned at 0, or 2.7 -> 1.0) fall far below it, and a
drafter that makes the engine fail counts as failing: the engine is rolled back to the last good weights under a
new version number, and the event is logged loudly.

Two canaries (online.canary):
- probe: right after the swap, generate a short SD probe on recent prompts (probe_prompts). Costs a little
  generation per publish.
- inline: no extra generation. The swap is pending until observe() sees a rollout batch that the new version
  generated from start to end; its mean accepted length is the canary. A bad drafter thus serves one batch
  (outputs stay exact: SD is lossless; only slower) before the rollback. Batches of an older version, or of mixed
  versions, leave the check pending. A publish while a check is pending leaves the pending weights unverified:
  rollbacks go to the last verified weights.
Several processes (pool: a sum over processes): each sees its own rollouts, and a verdict one process reached alone
would roll back its engines only (versions and, through the publish gate's reset, drafter weights diverge). There
observe() and fail() only record, and settle(), which every process calls at the same point (the tracker: at each
policy update), judges on the MAL pooled over all of them; the probe canary pools its probes too.
Per member (publish(members=...): drafter.kind=auto, tracking/members.py): each new member is judged on the steps
it drafted, against its own estimate at those steps' k, and one that fails is rolled back alone (the engines get
the served weights with that member's last good ones, under a new version). A member that drafted no
step stays on probation until a batch of the served version has it draft; a probe is that batch's first chance.
"""
from __future__ import annotations

import math
import threading
import time

import torch

from drafttrain.tracking.members import ALL, batch_mal, merged

# a member is judged once it drafted this many verify rows of the version on probation (summed over batches and
# processes): a few rows' MAL is noise (a long-tail step holds 1-3 rows; the main job rolled a good draft model
# back on such a handful)
CANARY_ROWS = 32


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


class Publisher:
    def __init__(self, engines, initial_weights: dict, cfg_online, log=print, tag=0, pool=None):
        self.engines, self.cfg, self.log = list(engines), cfg_online, log
        self.pool = pool  # several processes: list[float] -> its elementwise sum over them (a collective)
        # pooled mode, since the last settle(): MAL x verify rows, verify rows, failures, expected MAL x verify rows
        self._seen = [0.0, 0.0, 0.0, 0.0]
        self._seen_m: dict[str, list[float]] = {}  # per member on probation: tokens, rows, expected MAL x rows
        self.version = max([e.drafter_version for e in self.engines] + [0])
        # version -> the caller's tag of the weights it serves (the tracker: the policy version they were published
        # at); a rollback's new version carries the tag of the weights it restores
        self.tags: dict[int, object] = {self.version: tag}
        self.good_weights = {k: v.detach().clone() for k, v in initial_weights.items()}
        self.good_version = self.version
        self.rollbacks = 0
        self.pending: dict | None = None  # inline canary: {version, weights, expected} not yet judged
        self._lock = threading.RLock()  # publish (trainer thread) vs observe (a rollout thread, async RL)

    def _load_all(self, weights: dict, version: int) -> float:
        """Swap into every engine; returns the slowest engine's swap time (s)."""
        worst = 0.0
        for e in self.engines:
            t0 = time.perf_counter()
            e.load_drafter(weights, version)
            worst = max(worst, time.perf_counter() - t0)
        self.version = version
        return worst

    def publish(self, weights: dict, expected_mal: float | None = None, probe_prompts=None, params=None,
                tag=None, members: dict | None = None) -> dict:
        """members: {member: {"mal": its estimate, "curve": its acceptance per position or None}} of the members
        whose weights are new, each canaried on its own (tracking/members.py); {ALL: ...} or None: the whole drafter,
        against expected_mal (then at the k of each step, from the curve)."""
        curve = None
        if members is not None and list(members) == [ALL]:
            expected_mal, curve, members = members[ALL]["mal"], members[ALL]["curve"], None
        with self._lock:
            if members is not None:
                return self._publish_members(weights, members, probe_prompts, params, tag)
            return self._publish(weights, expected_mal, probe_prompts, params, tag, curve=curve)

    def _publish(self, weights: dict, expected_mal, probe_prompts, params, tag=None, estimates=None,
                 curve=None) -> dict:
        bad = first_nonfinite(weights)
        if bad is None and any(e is not None and not math.isfinite(e) for e in [expected_mal, *(estimates or [])]):
            bad = "outputs (the trainer's acceptance estimate)"
        if bad is not None:
            self.log(f"[drafttrain] NOT PUBLISHED: drafter {bad} has NaN/inf; engines keep v{self.version}")
            return {"published": False, "version": self.version, "reason": f"nonfinite {bad}"}
        weights = {k: v.detach().clone() for k, v in weights.items()}
        v = self.version + 1
        swap_s = self._load_all(weights, v)
        self.tags[v] = tag
        rec = {"published": True, "version": v, "swap_s": swap_s, "rolled_back": False, "canary_mal": None,
               "expected_mal": expected_mal}
        self.pending = None
        self._seen, self._seen_m = [0.0, 0.0, 0.0, 0.0], {}
        if estimates is not None:  # per member: _publish_members judges
            rec["weights"] = weights
            return rec
        judged = self.engines and expected_mal is not None
        if judged and self.cfg.canary == "inline":
            self.pending = {"version": v, "weights": weights, "expected": expected_mal, "curve": curve}
            return rec
        if judged and probe_prompts and params is not None:
            error, at_k = None, expected_mal
            try:
                probes = [batch_mal(e.generate(probe_prompts, params, speculative=True), ALL, curve, expected_mal)
                          for e in self.engines]
                # the engine whose probe falls furthest below what it should read at its k
                mal, _, x = min(probes, key=lambda t: (t[0] - 1) / max((t[2] or expected_mal) - 1, 1e-9))
                at_k = expected_mal if x is None else x
            except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
                mal, error = float("nan"), str(err).splitlines()[0]
            if self.pool is not None:  # every process judges the mean of all processes' probes
                total, n, failed, x = self.pool([0.0, 0.0, 1.0, 0.0] if error else [mal, 1.0, 0.0, at_k])
                mal, at_k = (float("nan"), expected_mal) if failed else (total / n, x / n)
                error = error or ("an engine failed with it in another process" if failed else None)
            rec.update(self._judge(v, weights, at_k, mal, error, expected_mal))
            return rec
        self.good_weights, self.good_version = weights, v
        return rec

    def _publish_members(self, weights: dict, members: dict, probe_prompts, params, tag) -> dict:
        """Publish with each new member on probation (and the members of the last publish still on it: their weights
        are unchanged); a probe (canary=probe) is the first batch that judges them."""
        prev = self.pending
        rec = self._publish(weights, None, None, None, tag, estimates=[e["mal"] for e in members.values()])
        weights = rec.pop("weights", None)
        if not rec["published"]:
            return rec
        left = prev["members"] if prev is not None and "members" in prev else {}
        on = {**left, **{m: e for m, e in members.items() if e["mal"] is not None}}  # no estimate: nothing to judge by
        if not self.engines or not on:
            self.good_weights, self.good_version = weights, rec["version"]
            return rec
        self.pending = {"version": rec["version"], "weights": weights, "members": on}
        if probe_prompts and params is not None:
            for e in self.engines:  # the probe is this canary's evidence: a member that drafted in it is judged
                try:
                    batch = e.generate(probe_prompts, params, speculative=True)
                    verdict = self._observe_members(self.pending, batch, min_rows=1) if batch.stats.drafted else {}
                except (RuntimeError, ValueError) as err:
                    verdict = self.fail(err)
                rec.update({k: v for k, v in verdict.items() if k != "deferred"})
                if self.pending is None:
                    break
        return rec

    def observe(self, batch) -> dict:
        """Inline canary: judge the pending swap on a rollout batch (RolloutBatch) if the pending version generated
        all of it; {} while the check stays pending (or nothing is pending)."""
        versions = list(getattr(batch, "drafter_versions", None) or [batch.drafter_version])
        with self._lock:
            p = self.pending
            if p is None or any(x != p["version"] for x in versions) or batch.stats.drafted == 0:
                return {}
            if "members" in p:
                return self._observe_members(p, batch)
            mal, rows, at_k = batch_mal(batch, ALL, p["curve"], p["expected"])
            at_k = p["expected"] if at_k is None else at_k
            if self.pool is not None:  # recorded; settle() judges with every process
                self._seen[0] += mal * rows
                self._seen[1] += rows
                self._seen[3] += at_k * rows
                return {}
            self.pending = None
            return self._judge(p["version"], p["weights"], at_k, mal, None, p["expected"])

    def fail(self, error: BaseException) -> dict:
        """Inline canary: the engine failed while the pending version served (e.g. NaN draft probabilities): roll
        back now. {} if nothing is pending (the failure is not the new drafter's; the caller re-raises). Several
        processes: recorded for settle(), which rolls every process back; {"deferred": True} (the caller decodes
        this batch without the drafter)."""
        with self._lock:
            if self.pending is None:
                return {}
            if self.pool is not None:
                self._seen[2] += 1
                return {"deferred": True}
            if "members" in self.pending:  # which member broke it is not known: every one on probation goes back
                return self._judge_members(self.pending, dict.fromkeys(self.pending["members"], (math.nan, None)),
                                           str(error).splitlines()[0])
            p, self.pending = self.pending, None
            return self._judge(p["version"], p["weights"], p["expected"], float("nan"), str(error).splitlines()[0])

    def settle(self) -> dict:
        """Several processes: judge the pending version on what every process's engines recorded since it was
        published (a collective: call it on every process at the same point). {} with one process, with nothing
        pending (alike everywhere: publishing is decided alike), or with nothing recorded anywhere yet."""
        with self._lock:
            p = self.pending
            if self.pool is None or p is None:
                return {}
            if "members" in p:
                names = list(p["members"])
                x = self.pool([self._seen[2]] + [v for m in names for v in self._seen_m.get(m, [0.0] * 3)])
                self._seen[2] = 0.0
                if x[0]:
                    return self._judge_members(p, dict.fromkeys(names, (math.nan, None)),
                                               f"the engines of {int(x[0])} batch(es) failed with it")
                return self._judge_ready(p, dict(zip(names, zip(x[1::3], x[2::3], x[3::3]))))
            total, rows, failed, at_k = self.pool(self._seen)
            self._seen = [0.0, 0.0, 0.0, 0.0]
            if not failed and rows == 0:
                return {}
            self.pending = None
            if failed:
                return self._judge(p["version"], p["weights"], p["expected"], float("nan"),
                                   f"the engines of {int(failed)} batch(es) failed with it")
            return self._judge(p["version"], p["weights"], at_k / rows, total / rows, None, p["expected"])

    def _observe_members(self, p: dict, batch, min_rows: int = CANARY_ROWS) -> dict:
        """Per-member inline canary: what the members on probation drafted in `batch` adds to their running totals
        (tokens, verify rows, expected MAL x rows), and those with CANARY_ROWS rows are judged (several processes:
        settle() judges on the totals pooled)."""
        for m, e in p["members"].items():
            mal, rows, at_k = batch_mal(batch, m, e["curve"], e["mal"])
            acc = self._seen_m.setdefault(m, [0.0, 0.0, 0.0])
            at_k = e["mal"] if at_k is None else at_k
            acc[0], acc[1], acc[2] = acc[0] + mal * rows, acc[1] + rows, acc[2] + at_k * rows
        return {} if self.pool is not None else self._judge_ready(p, self._seen_m, min_rows)

    def _judge_ready(self, p: dict, totals: dict, min_rows: int = CANARY_ROWS) -> dict:
        """Judge the members whose totals ({member: (tokens, rows, expected MAL x rows)}) hold min_rows verify rows;
        the others stay on probation, their totals kept."""
        ready = {m: (t / n, e / n) for m, (t, n, e) in totals.items() if m in p["members"] and n >= max(min_rows, 1)}
        return self._judge_members(p, ready) if ready else {}

    def _judge_members(self, p: dict, seen: dict, error: str | None = None) -> dict:
        """Each member of `seen` ({member: (engine MAL on the steps it drafted, NaN: the engine failed; its estimate
        at those steps' k, None: its estimate)}) keeps its new weights, which join the last good ones, or is rolled
        back alone; done once no member is left on probation."""
        rec = {"canary_mal": min(mal for mal, _ in seen.values()), "rolled_back": False, "member_canary": {}}
        failed = []
        for m, (mal, at_k) in seen.items():
            est = p["members"].pop(m)
            self._seen_m.pop(m, None)
            expected = est["mal"] if at_k is None else at_k
            floor = 1.0 + self.cfg.canary_min_ratio * (expected - 1.0)
            rec["member_canary"][m] = {"canary_mal": mal, "expected_mal": expected, "rolled_back": not mal >= floor}
            if mal >= floor:
                self.good_weights = merged(self.good_weights, p["weights"], [m])
            else:
                failed.append(m)
                why = (f"the engine failed with it: {error}" if error else
                       f"engine MAL on its steps {mal:.2f} < {floor:.2f}")
                self.log(f"[drafttrain] ROLLBACK: drafter v{p['version']} member {m} failed its canary ({why}, trainer "
                         f"estimate at their k {expected:.2f}); its last good weights go back")
        if failed:
            self.rollbacks += 1
            back = self.version + 1
            p["weights"] = merged(p["weights"], self.good_weights, failed)
            self._load_all(p["weights"], back)
            self.tags[back] = self.tags.get(p["version"])
            self.log(f"[drafttrain] engines now serve v{p['version']} with {', '.join(failed)} rolled back, as v{back}")
            p["version"] = back
            rec.update(rolled_back=True, version=back)
        if not p["members"]:
            self.pending, self.good_version = None, p["version"]
        return rec

    def _judge(self, v: int, weights: dict, expected_mal: float, mal: float, error: str | None = None,
               estimate: float | None = None) -> dict:
        """Keep v as the last good version, or roll every engine back to the last good weights. expected_mal: the
        estimate at the k the engine drafted with (estimate: at k_max, for the log)."""
        floor = 1.0 + self.cfg.canary_min_ratio * (expected_mal - 1.0)
        rec = {"canary_mal": mal, "rolled_back": False}
        if mal >= floor:
            self.good_weights, self.good_version = weights, v
            return rec
        why = (f"the engine failed with it: {error}" if error else
               f"engine mean accepted length {mal:.2f} < {floor:.2f}")
        self.rollbacks += 1
        back = self.version + 1
        self._load_all(self.good_weights, back)
        self.tags[back] = self.tags.get(self.good_version)
        at = "" if estimate is None or estimate == expected_mal else f" ({estimate:.2f} at k_max)"
        self.log(f"[drafttrain] ROLLBACK: drafter v{v} failed its canary ({why}, trainer estimate at its k "
                 f"{expected_mal:.2f}{at}); engines now serve the weights of v{self.good_version} as v{back}")
        rec.update(rolled_back=True, version=back)
        return rec
