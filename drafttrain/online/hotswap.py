"""Publisher: versioned drafter publishing to every engine, a canary after each swap, rollback when it fails.

    pub = Publisher(engines, initial_weights, cfg.online, log)
    rec = pub.publish(weights, expected_mal, probe_prompts, params)   # -> version, swap_s, canary, rolled_back

Order of checks: non-finite weights, or a non-finite trainer estimate (a diverged drafter whose outputs are NaN),
are never published (the engine would refuse NaN weights too); each engine's load_drafter is atomic and
versioned; then the canary generates a short SD probe on recent prompts and compares the engine's mean accepted
length with the trainer's own teacher-forced estimate. Silently dropped or corrupted weights (acceptance pinned at
0, or 2.7 -> 1.0) fall far below it, and a drafter that makes the engine fail counts as failing: the engine is
rolled back to the last good weights under a new version number, and the event is logged loudly.
"""
from __future__ import annotations

import math
import time

import torch


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    for name, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


class Publisher:
    def __init__(self, engines, initial_weights: dict, cfg_online, log=print):
        self.engines, self.cfg, self.log = list(engines), cfg_online, log
        self.version = max([e.drafter_version for e in self.engines] + [0])
        self.good_weights = {k: v.detach().clone() for k, v in initial_weights.items()}
        self.good_version = self.version
        self.rollbacks = 0

    def _load_all(self, weights: dict, version: int) -> float:
        """Swap into every engine; returns the slowest engine's swap time (s)."""
        worst = 0.0
        for e in self.engines:
            t0 = time.perf_counter()
            e.load_drafter(weights, version)
            worst = max(worst, time.perf_counter() - t0)
        self.version = version
        return worst

    def publish(self, weights: dict, expected_mal: float | None = None, probe_prompts=None, params=None) -> dict:
        bad = first_nonfinite(weights)
        if bad is None and expected_mal is not None and not math.isfinite(expected_mal):
            bad = "outputs (the trainer's acceptance estimate)"
        if bad is not None:
            self.log(f"[drafttrain] NOT PUBLISHED: drafter {bad} has NaN/inf; engines keep v{self.version}")
            return {"published": False, "version": self.version, "reason": f"nonfinite {bad}"}
        weights = {k: v.detach().clone() for k, v in weights.items()}
        v = self.version + 1
        swap_s = self._load_all(weights, v)
        rec = {"published": True, "version": v, "swap_s": swap_s, "rolled_back": False, "canary_mal": None,
               "expected_mal": expected_mal}
        if probe_prompts and self.engines and expected_mal is not None and params is not None:
            floor = 1.0 + self.cfg.canary_min_ratio * (expected_mal - 1.0)
            try:
                rec["canary_mal"] = min(e.generate(probe_prompts, params, speculative=True)
                                        .stats.mean_accepted_length for e in self.engines)
                why = f"engine mean accepted length {rec['canary_mal']:.2f} < {floor:.2f}"
            except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
                rec["canary_mal"], why = float("nan"), f"the engine failed with it: {str(err).splitlines()[0]}"
            if not rec["canary_mal"] >= floor:
                self.rollbacks += 1
                back = v + 1
                self._load_all(self.good_weights, back)
                self.log(f"[drafttrain] ROLLBACK: drafter v{v} failed its canary ({why}, trainer estimate "
                         f"{expected_mal:.2f}); engines now serve the weights of v{self.good_version} as v{back}")
                rec.update(rolled_back=True, version=back)
                return rec
        self.good_weights, self.good_version = weights, v
        return rec
