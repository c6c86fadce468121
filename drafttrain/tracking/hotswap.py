"""Publisher: versioned drafter publishing to every engine, a canary after each swap, rollback when it fails.

    pub = Publisher(engines, initial_weights, cfg.online, log)
    rec = pub.publish(weights, expected_mal, probe_prompts, params)   # -> version, swap_s, canary, rolled_back
    rec = pub.observe(rollout_batch)      # inline canary: judge the swap on the engine's own next rollouts

Order of checks: non-finite weights, or a non-finite trainer estimate (a diverged drafter whose outputs are NaN),
are never published (the engine would refuse NaN weights too); each engine's load_drafter is atomic and
versioned; then the canary compares the engine's mean accepted length on the decode steps that drafted (an AR step
of engine.toggle emits one token whatever the drafter), with the trainer's teacher-forced estimate at those steps' k.
Silently dropped or corrupted weights (acceptance pinned at 0, or 2.7 -> 1.0) fall far below it, and a drafter
that makes the engine fail counts as failing: the engine is rolled back to the last good weights under a new
version number, and the event is logged loudly.

One canary path, per member (the members of tracking/gate.py): a drafter is one member, ALL (every weight); with
drafter.kind=auto (publish(members=...)) each trainable member is its own, judged on the steps it drafted (the
chooser's trace says which) against its own estimate, and one that fails is rolled back alone (the engines get the
served weights with its last good ones, under a new version). The whole drafter is judged on a batch of the new
version; a member once it drafted CANARY_ROWS verify rows (it may draft a step or two of a batch). A publish while
members are on probation keeps the unchanged ones on it; rollbacks go to the last verified weights. A member is
judged against its own estimate at the k of the steps it drafted (probation, batch_mal: the engine's auto k and
toggle draft shorter than the k_max the estimate scores, and AR steps emit one token; a whole-batch MAL against the
estimate at k_max rolled good drafters back).

Two canaries (online.canary):
- probe: right after the swap, generate a short SD probe on recent prompts (probe_prompts); a member that drafted
  in it is judged on it. Costs a little generation per publish.
- inline: no extra generation. observe() reads the rollout batches that the new version generated from start to
  end (a batch of an older version, or of mixed versions, says nothing). A bad drafter thus serves one batch
  (outputs stay exact: SD is lossless; only slower) before the rollback.
Engines whose rollouts the tracker never sees (a server or a user's vllm.LLM: engines/vllm_server.py) are judged by
their own spec-decode counters since the push (spec_since_swap) at settle(), once they verified SERVER_STEPS drafts;
pushes to several of them run at once.
Several processes (pool: a sum over processes): each sees its own rollouts, and a verdict one process reached alone
would roll back its engines only (versions and, through the publish gate's reset, drafter weights diverge). There
observe() and fail() only record, and settle(), which every process calls at the same point (the tracker: at each
policy update), judges on the totals pooled over all of them; the probe canary pools its probes too.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from drafttrain.device import now
from drafttrain.spec import expected_tokens  # 1 + sum over i < k of P(drafts 0..i accepted)
from drafttrain.tracking.gate import ALL, merged

# a member is judged once it drafted this many verify rows of the version on probation (summed over batches and
# processes): a few rows' MAL is noise (a long-tail step holds 1-3 rows; the main job rolled a good draft model
# back on such a handful)
CANARY_ROWS = 32
SERVER_STEPS = 32  # verify steps a server's counters must hold since a push before it is judged


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


class Publisher:
    def __init__(self, engines, initial_weights: dict, cfg_online, log=print, tag=0, pool=None):
        self.engines, self.cfg, self.log = list(engines), cfg_online, log
        self.pool = pool  # several processes: list[float] -> its elementwise sum over them (a collective)
        # since the last publish: per member on probation, MAL x verify rows, verify rows, expected MAL x verify rows
        # of the steps it drafted; and (pooled mode, since the last settle()) batches whose engine failed with it
        self._seen: dict[str, list[float]] = {}
        self._failures = 0.0
        self.version = max([e.drafter_version for e in self.engines] + [0])
        # version -> the caller's tag of the weights it serves (the tracker: the policy version they were published
        # at); a rollback's new version carries the tag of the weights it restores
        self.tags: dict[int, object] = {self.version: tag}
        self.good_weights = {k: v.detach().clone() for k, v in initial_weights.items()}
        self.good_version = self.version
        self.rollbacks = 0
        # {version, weights, members: {member: {"mal", "curve"}}}: the published version and its members on probation
        self.pending: dict | None = None
        self._lock = threading.RLock()  # publish (trainer thread) vs observe (a rollout thread, async RL)

    def state_dict(self) -> dict:
        """What a resume needs: the served version, the last good one and the version still on probation, if any
        (published, its canary not judged yet: nothing has drafted with it)."""
        return {"version": self.version, "good_weights": self.good_weights, "good_version": self.good_version,
                "pending": self.pending, "version_tags": dict(self.tags)}

    def load_state_dict(self, state: dict) -> None:
        """Engines serve the last good weights (the trainer may hold newer, rejected ones) or, where a version was on
        probation, that version again, still on probation: it was not rejected (AR rollouts, or a toggle that kept
        SD off, never judged it), and the last good one may be many updates old."""
        self.good_weights, self.good_version = state["good_weights"], state["good_version"]
        self.tags.update(state.get("version_tags", {}))
        if state["version"] > 0:
            back = max(state["version"], self.version + 1)
            pending = state.get("pending")  # older checkpoints: none kept
            served = pending["weights"] if pending is not None else state["good_weights"]
            self._load_all({k: v.detach().clone() for k, v in served.items()}, back)
            self._tag(back, self.tags.get(pending["version"] if pending is not None else state["good_version"]))
            if pending is not None:
                self.pending = {**pending, "version": back}

    def _tag(self, version: int, tag) -> None:
        """tags[version] = tag, dropping the tags nothing reads any more (there would be one a publish, for the whole
        run): only the served version's (the one on probation, if any) and the last good one's are read (the
        tracker's drafter lag, a rollback, a resume)."""
        self.tags[version] = tag
        live = {version, self.version, self.good_version}
        for v in [v for v in self.tags if v not in live]:
            del self.tags[v]

    def served(self) -> tuple[dict, int]:
        """(the weights the engines serve, their version): the version on probation's, or the last good ones, as
        load_state_dict puts back; what a restarted engine is given."""
        with self._lock:
            p = self.pending
            return (p["weights"] if p is not None else self.good_weights), self.version

    def _load_all(self, weights: dict, version: int) -> float:
        """Swap into every engine; returns the slowest engine's swap time (s)."""
        def load(e) -> float:
            t0 = now()
            e.load_drafter(weights, version)
            return now() - t0  # the copies into the engine done, not only queued

        remote = [e for e in self.engines if getattr(e, "remote", False)]  # servers: pushed at once
        with ThreadPoolExecutor(max(len(remote), 1)) as pool:
            futures = [pool.submit(load, e) for e in remote]
            times = [load(e) for e in self.engines if e not in remote] + [f.result() for f in futures]
        self.version = version
        return max(times, default=0.0)

    def publish(self, weights: dict, expected_mal: float | None = None, probe_prompts=None, params=None,
                tag=None, members: dict | None = None) -> dict:
        """members: {member: {"mal": its estimate, "curve": its acceptance per position or None}} of the members
        whose weights are new, each canaried on its own (per member); None: the whole drafter (ALL) against
        expected_mal (None: published unjudged, e.g. a requantized self-drafter)."""
        if members is None:
            members = {} if expected_mal is None else {ALL: {"mal": expected_mal, "curve": None}}
        with self._lock:
            return self._publish(weights, members, probe_prompts, params, tag)

    def _publish(self, weights: dict, members: dict, probe_prompts, params, tag) -> dict:
        bad = first_nonfinite(weights)
        if bad is None and any(e["mal"] is not None and not math.isfinite(e["mal"]) for e in members.values()):
            bad = "outputs (the trainer's acceptance estimate)"
        if bad is not None:
            self.log(f"[drafttrain] NOT PUBLISHED: drafter {bad} has NaN/inf; engines keep v{self.version}")
            return {"published": False, "version": self.version, "reason": f"nonfinite {bad}"}
        weights = {k: v.detach().clone() for k, v in weights.items()}
        v = self.version + 1
        swap_s = self._load_all(weights, v)
        self._tag(v, tag)
        rec = {"published": True, "version": v, "swap_s": swap_s, "rolled_back": False, "canary_mal": None}
        # members of the last publish still on probation stay on it (their weights are unchanged; the whole
        # drafter's never are); one without an estimate has nothing to be judged by
        left = {} if self.pending is None or ALL in members else self.pending["members"]
        on = {**{m: e for m, e in left.items() if m != ALL},
              **{m: e for m, e in members.items() if e["mal"] is not None}}
        self._seen, self._failures = {}, 0.0
        if not self.engines or not on:
            self.pending, self.good_weights, self.good_version = None, weights, v
            return rec
        self.pending = {"version": v, "weights": weights, "members": on}
        if self.cfg.canary == "probe" and probe_prompts and params is not None:
            rec.update(self._probe(self.pending, probe_prompts, params))
        return rec

    def _probe(self, p: dict, prompts, params) -> dict:
        """canary=probe: every engine generates a short SD probe right after the swap; each member that drafted in
        it is judged, however few its rows (the probe is this canary's evidence), on the engine where it reads
        furthest below what it should read at its k. An engine failure fails every member on probation. Several
        processes: judged now on the probes of all (every process publishes, and so probes, at the same point)."""
        worst, error = {}, None
        for e in self.engines:
            if not hasattr(e, "generate"):  # a handle on a stack's engine: its own counters judge it (settle)
                continue
            try:
                batch = e.generate(prompts, params, speculative=True)
            except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
                error = str(err).splitlines()[0]
                break
            for m, est in p["members"].items():
                mal, rows, at_k = batch_mal(batch, m, est["curve"], est["mal"])
                below = (mal - 1) / max(at_k - 1, 1e-9)  # how far under what it should read, relative
                if rows and (m not in worst or below < worst[m][0]):
                    worst[m] = (below, mal, at_k)
        if self.pool is None:
            if error:
                return self._judge(p, dict.fromkeys(p["members"], (math.nan, None)), error)
            return self._judge(p, {m: (mal, at_k) for m, (_, mal, at_k) in worst.items()}) if worst else {}
        self._failures += error is not None
        self._seen = {m: [mal, 1.0, at_k] for m, (_, mal, at_k) in worst.items()}
        return self._settle(p, min_rows=1)

    def observe(self, batch) -> dict:
        """Inline canary: what each member on probation drafted in a rollout batch (RolloutBatch) of the published
        version adds to its totals, and those with enough rows are judged; {} while the check stays pending (or
        nothing is pending). A batch of an older version, or of mixed versions, says nothing."""
        versions = list(getattr(batch, "drafter_versions", None) or [batch.drafter_version])
        with self._lock:
            p = self.pending
            if p is None or any(x != p["version"] for x in versions) or batch.stats.drafted == 0:
                return {}
            for m, e in p["members"].items():
                mal, rows, at_k = batch_mal(batch, m, e["curve"], e["mal"])
                acc = self._seen.setdefault(m, [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + mal * rows, acc[1] + rows, acc[2] + at_k * rows
            return {} if self.pool is not None else self._judge_ready(p, self._seen)

    def generate(self, engine, prompts, params, speculative: bool = True):
        """engine.generate, the inline canary watching: if it fails while a newly published drafter is on probation,
        roll back to the last good drafter and generate again. Returns (batch, canary verdict)."""
        try:
            batch = engine.generate(prompts, params, speculative=speculative)
        except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
            verdict = self.fail(err)
            if not verdict:
                raise
            if verdict.get("deferred"):  # several processes: rolled back at the next update, everywhere alike;
                return engine.generate(prompts, params, speculative=False), {}  # this batch decodes without it
            return engine.generate(prompts, params, speculative=speculative), verdict
        return batch, self.observe(batch)

    def fail(self, error: BaseException) -> dict:
        """Inline canary: the engine failed while the pending version served (e.g. NaN draft probabilities): every
        member on probation goes back now (which one broke it is not known). {} if nothing is pending (the failure is
        not the new drafter's; the caller re-raises). Several processes: recorded for settle(), which rolls every
        process back; {"deferred": True} (the caller decodes this batch without the drafter)."""
        with self._lock:
            p = self.pending
            if p is None:
                return {}
            if self.pool is not None:
                self._failures += 1
                return {"deferred": True}
            return self._judge(p, dict.fromkeys(p["members"], (math.nan, None)), str(error).splitlines()[0])

    def settle(self) -> dict:
        """Several processes: judge the pending version on what every process's engines recorded since it was
        published (a collective: call it on every process at the same point). {} with one process, with nothing
        pending (alike everywhere: publishing is decided alike), or with too little recorded anywhere yet."""
        with self._lock:
            p = self.pending
            if p is None:
                return {}
            return self._poll(p) if self.pool is None else self._settle(p)

    def _poll(self, p: dict) -> dict:
        """The whole drafter on probation, judged on the spec-decode counters of the engines that count their own
        (servers, a user's vllm.LLM) once they verified SERVER_STEPS drafts with it; {} until then."""
        counts = [c for e in self.engines if (c := getattr(e, "spec_since_swap", lambda v: None)(p["version"]))]
        steps = sum(n for _, n in counts)
        if list(p["members"]) != [ALL] or steps < SERVER_STEPS:
            return {}
        return self._judge(p, {ALL: (sum(m * n for m, n in counts) / steps, None)})

    def _settle(self, p: dict, min_rows: int | None = None) -> dict:
        """The pooled verdict: [failures] + (MAL x rows, rows, expected MAL x rows) per member on probation, summed
        over the processes in one collective; the totals are kept until judged."""
        names = list(p["members"])
        x = self.pool([self._failures] + [v for m in names for v in self._seen.get(m, [0.0] * 3)])
        self._failures = 0.0
        if x[0]:
            return self._judge(p, dict.fromkeys(names, (math.nan, None)),
                               f"the engines of {int(x[0])} batch(es) failed with it")
        return self._judge_ready(p, dict(zip(names, zip(x[1::3], x[2::3], x[3::3]))), min_rows)

    def _judge_ready(self, p: dict, totals: dict, min_rows: int | None = None) -> dict:
        """Judge the members whose totals ({member: (MAL x rows, rows, expected MAL x rows)}) hold enough verify
        rows: a member CANARY_ROWS (it may draft a step or two of a batch), the whole drafter a batch (every step of
        it drafts with it); the others stay on probation, their totals kept."""
        def need(m):
            return min_rows if min_rows is not None else 1 if m == ALL else CANARY_ROWS

        ready = {m: (t / n, e / n) for m, (t, n, e) in totals.items() if m in p["members"] and n >= max(need(m), 1)}
        return self._judge(p, ready) if ready else {}

    def _judge(self, p: dict, seen: dict, error: str | None = None) -> dict:
        """Each member of `seen` ({member: (engine MAL on the steps it drafted, NaN: the engine failed; its estimate
        at those steps' k, None: its estimate)}) keeps its new weights, which join the last good ones, or is rolled
        back alone (the engines get the served weights with its last good ones, under a new version; the whole
        drafter: the last good version's weights); done once no member is left on probation."""
        rec = {"canary_mal": min(mal for mal, _ in seen.values()), "rolled_back": False}
        verdicts, failed = {}, []
        for m, (mal, at_k) in seen.items():
            est = p["members"].pop(m)
            self._seen.pop(m, None)
            expected = est["mal"] if at_k is None else at_k
            floor = 1.0 + self.cfg.canary_min_ratio * (expected - 1.0)
            verdicts[m] = {"canary_mal": mal, "expected_mal": expected, "rolled_back": not mal >= floor}
            if mal >= floor:
                self.good_weights = merged(self.good_weights, p["weights"], [m])
                continue
            failed.append(m)
            why = (f"the engine failed with it: {error}" if error else
                   f"engine MAL on the steps it drafted {mal:.2f} < {floor:.2f}")
            at = "" if abs(expected - est["mal"]) < 5e-3 else f" ({est['mal']:.2f} at k_max)"
            who = f"drafter v{p['version']}" + (f" member {m}" if m != ALL else "")
            self.log(f"[drafttrain] ROLLBACK: {who} failed its canary ({why}, trainer estimate at its k "
                     f"{expected:.2f}{at}); its last good weights go back")
        if list(seen) != [ALL]:
            rec["member_canary"] = verdicts
        if failed:
            self.rollbacks += 1
            back = self.version + 1
            p["weights"] = merged(p["weights"], self.good_weights, failed)
            self._load_all(p["weights"], back)
            restored = ALL in failed  # every weight is the last good version's
            self._tag(back, self.tags.get(self.good_version if restored else p["version"]))
            self.log("[drafttrain] engines now serve " + (f"the weights of v{self.good_version}" if restored else
                     f"v{p['version']} with {', '.join(failed)} rolled back") + f", as v{back}")
            p["version"] = back
            rec.update(rolled_back=True, version=back)
            if restored:
                self.pending = None
                return rec
        if not p["members"]:
            self.pending, self.good_version = None, p["version"]
        return rec


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
