"""Publisher: versioned drafter publishing to every engine, a canary after each swap, rollback when it fails.

    pub = Publisher(engines, initial_weights, cfg.online, log)
    rec = pub.publish(weights, expected_mal, probe_prompts, params)   # -> version, swap_s, canary, rolled_back
    rec = pub.observe(rollout_batch)      # inline canary: judge the swap on the engine's own next rollouts

Order of checks: non-finite weights, or a non-finite trainer estimate (a diverged drafter whose outputs are NaN),
are never published (the engine would refuse NaN weights too); each engine's load_drafter is atomic and
versioned; then the canary compares the engine's mean accepted length with the trainer's own teacher-forced
estimate. Silently dropped or corrupted weights (acceptance pinned at 0, or 2.7 -> 1.0) fall far below it, and a
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
"""
from __future__ import annotations

import math
import threading
import time

import torch


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


class Publisher:
    def __init__(self, engines, initial_weights: dict, cfg_online, log=print, tag=0, pool=None):
        self.engines, self.cfg, self.log = list(engines), cfg_online, log
        self.pool = pool  # several processes: list[float] -> its elementwise sum over them (a collective)
        self._seen = [0.0, 0.0, 0.0]  # pooled mode, since the last settle(): MAL x verify rows, verify rows, failures
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
                tag=None) -> dict:
        with self._lock:
            return self._publish(weights, expected_mal, probe_prompts, params, tag)

    def _publish(self, weights: dict, expected_mal, probe_prompts, params, tag=None) -> dict:
        bad = first_nonfinite(weights)
        if bad is None and expected_mal is not None and not math.isfinite(expected_mal):
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
        self._seen = [0.0, 0.0, 0.0]
        judged = self.engines and expected_mal is not None
        if judged and self.cfg.canary == "inline":
            self.pending = {"version": v, "weights": weights, "expected": expected_mal}
            return rec
        if judged and probe_prompts and params is not None:
            error = None
            try:
                mal = min(e.generate(probe_prompts, params, speculative=True).stats.mean_accepted_length
                          for e in self.engines)
            except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
                mal, error = float("nan"), str(err).splitlines()[0]
            if self.pool is not None:  # every process judges the mean of all processes' probes
                total, n, failed = self.pool([0.0 if error else mal, 0.0 if error else 1.0, float(bool(error))])
                mal = float("nan") if failed else total / n
                error = error or ("an engine failed with it in another process" if failed else None)
            rec.update(self._judge(v, weights, expected_mal, mal, error))
            return rec
        self.good_weights, self.good_version = weights, v
        return rec

    def observe(self, batch) -> dict:
        """Inline canary: judge the pending swap on a rollout batch (RolloutBatch) if the pending version generated
        all of it; {} while the check stays pending (or nothing is pending)."""
        versions = list(getattr(batch, "drafter_versions", None) or [batch.drafter_version])
        with self._lock:
            p = self.pending
            if p is None or any(x != p["version"] for x in versions) or batch.stats.drafted == 0:
                return {}
            if self.pool is not None:  # recorded; settle() judges with every process
                rows = batch.stats.verify_rows
                self._seen[0] += batch.stats.mean_accepted_length * rows
                self._seen[1] += rows
                return {}
            self.pending = None
            return self._judge(p["version"], p["weights"], p["expected"], batch.stats.mean_accepted_length)

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
            total, rows, failed = self.pool(self._seen)
            self._seen = [0.0, 0.0, 0.0]
            if not failed and rows == 0:
                return {}
            self.pending = None
            if failed:
                return self._judge(p["version"], p["weights"], p["expected"], float("nan"),
                                   f"the engines of {int(failed)} batch(es) failed with it")
            return self._judge(p["version"], p["weights"], p["expected"], total / rows)

    def _judge(self, v: int, weights: dict, expected_mal: float, mal: float, error: str | None = None) -> dict:
        """Keep v as the last good version, or roll every engine back to the last good weights."""
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
        self.log(f"[drafttrain] ROLLBACK: drafter v{v} failed its canary ({why}, trainer estimate "
                 f"{expected_mal:.2f}); engines now serve the weights of v{self.good_version} as v{back}")
        rec.update(rolled_back=True, version=back)
        return rec
