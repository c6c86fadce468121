"""The drafter chooser (drafter.kind=auto): per decode step, which of several loaded drafters drafts, or none.

Arms are the member kinds, and "ar" (no drafting) where engine.toggle is off (with it on, the chosen member's toggle
decides SD on or off, as for a single kind). Per power-of-two active-batch bucket, each arm's measured reward has a
Gaussian posterior of its mean (exponentially forgetting, so a hot-swap or the policy's drift moves it), each arm
tried min_tries times first; in a bucket where an arm has not run yet, it starts from the nearest bucket's estimate
at the weight of one observation. The reward of a step is its measured speed-up over the modelled AR step at that
batch, tokens / B * T(B, 1) / step time: comparable across the batches a bucket spans (raw tokens/s grows with B,
and which arm ran while the batch was larger would decide). Every step counts, a member's catch-up on the positions
since it last drafted included: switching has that cost.

Thompson sampling, once per generation (begin: plan()): each bucket that holds a real share of the decode time gets
the arm that wins its draw, and the generation serves those arms only (every one until each has been tried), so a
member no bucket favours costs nothing that generation (AutoDrafter.plan); a member set aside sees its evidence
fade generation by generation, so that a drafter that got better (a hot-swap) comes back to be measured. Per step
(pick) a bucket takes its planned arm, a tail bucket the planned arm of best mean: no member switch but where the
plan changes arm.

ChooserController sits on top of the per-kind schedule: the chosen member's own SpecController (engine.k: fixed, auto
or ladder; engine.toggle) sets k, and may still decide on an AR step. It has SpecController's engine-facing
interface (begin, decide, observe, observe_step, trace, k_max, calibrate, refresh_drafts); arm_steps counts the
decode steps each arm ran over the run. Outputs never change with the choice: every member's SD is exact, and so is
AR.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from drafttrain.engines.schedule import TRACE_LEN, CostModel, SpecController, bucket, measure_costs

AR = "ar"


class Chooser:
    def __init__(self, arms: list[str], seed: int = 0, decay: float = 0.95, min_tries: int = 2,
                 noise_floor: float = 0.05, plan_share: float = 0.1, switch_margin: float = 0.05):
        self.arms, self.decay, self.min_tries, self.floor = list(arms), decay, min_tries, noise_floor
        self.plan_share, self.switch_margin = plan_share, switch_margin
        self.ms: dict[int, float] = {}  # bucket -> decode time measured there (its share of a generation: plan)
        self.assigned: dict[int, str] = {}  # bucket -> its arm in this generation (plan)
        self.stats: dict[tuple[int, str], list[float]] = {}  # (bucket, arm) -> [n_eff, mean, var]
        self.tries: dict[str, int] = dict.fromkeys(self.arms, 0)  # steps each arm was rewarded for, any bucket
        self.gen = torch.Generator(device="cpu").manual_seed(seed)  # host: it draws scalars for host decisions

    def _posterior(self, b: int, arm: str) -> list[float]:
        """(n_eff, mean, var) at bucket b; a bucket the arm has not run in yet borrows the nearest such bucket's mean
        and a wider spread, at the weight of one observation (informed, and soon overruled by its own steps)."""
        if (b, arm) in self.stats:
            return self.stats[(b, arm)]
        x = min((x for (x, a) in self.stats if a == arm), key=lambda x: abs(x.bit_length() - b.bit_length()))
        n, mean, var = self.stats[(x, arm)]
        return [1.0, mean, 4 * max(var, self.floor ** 2)]

    def _draw(self, b: int, arm: str) -> float:
        n, mean, var = self._posterior(b, arm)
        z = float(torch.randn((), generator=self.gen, device="cpu"))
        return mean + math.sqrt(max(var, self.floor ** 2) / n) * z

    def pick(self, batch: int, arms: list[str] | None = None) -> str:
        """One arm for a step at `batch`, among `arms` (default: all): every arm min_tries times first, then the plan's
        arm for the bucket, else the best posterior mean. No draw per step: with close arms, per-step draws switched
        member every few steps, and each switch pays the new member's catch-up on every position since it drafted."""
        arms = self.arms if arms is None else arms
        b = bucket(batch)
        for arm in arms:  # every arm a few times first (wherever the batch is then), in order
            if self.tries[arm] < self.min_tries:
                return arm
        if self.assigned.get(b) in arms:
            return self.assigned[b]
        return max(arms, key=lambda a: self._posterior(b, a)[1])

    def plan(self) -> list[str]:
        """The arms the next generation serves, and the arm of each bucket that takes at least plan_share of the
        measured decode time: its Thompson draw's winner (the exploration; an arm not yet tried min_tries times: all
        arms, none assigned); a smaller bucket keeps the larger one's arm unless its winner draws switch_margin more.
        The tail's few-row buckets take little time and are measured seldom and noisily: planning for them kept a
        third member ready all generation for a few steps at its end; they take the best planned arm (pick). An arm
        set aside loses a share (1 - decay) of its evidence in every bucket, down to a floor, so that its draws widen
        until one wins again and it is measured afresh."""
        self.assigned = {}
        if any(self.tries[a] < self.min_tries for a in self.arms):
            return list(self.arms)
        total = sum(self.ms.values())
        buckets = sorted(b for b, ms in self.ms.items() if ms >= self.plan_share * total)
        prev = None
        for b in reversed(buckets):  # as a generation runs: from the full batch down
            draws = {a: self._draw(b, a) for a in self.arms}
            best = max(draws, key=draws.get)
            if prev is not None and draws[best] <= (1 + self.switch_margin) * draws[prev]:
                best = prev  # a switch pays the new member's catch-up: only for a clear gain
            self.assigned[b] = prev = best
        won = {*self.assigned.values(), *([AR] if AR in self.arms else [])}  # "ar", where an arm, stays one
        for (b, arm), st in self.stats.items():
            if arm not in won:
                st[0] = max(self.decay * st[0], 0.01)
        return [a for a in self.arms if a in won]

    def observe(self, batch: int, arm: str, reward: float, ms: float = 0.0) -> None:
        """A step's reward; ms: its wall time (the bucket's share of decode time)."""
        key = (bucket(batch), arm)
        self.ms[key[0]] = self.ms.get(key[0], 0.0) + ms
        self.tries[arm] += 1
        if key not in self.stats:
            self.stats[key] = [1.0, reward, 0.0]
            return
        n, mean, var = self.stats[key]
        n = self.decay * n + 1.0  # effective count: old evidence fades
        w = 1.0 / n
        d = reward - mean
        self.stats[key] = [n, mean + w * d, (1 - w) * (var + w * d * d)]

    def means(self) -> dict[str, dict[str, float]]:
        """bucket -> arm -> its current mean reward (for the report)."""
        out: dict[str, dict[str, float]] = {}
        for (b, arm), (_, mean, _) in sorted(self.stats.items()):
            out.setdefault(str(b), {})[arm] = round(mean, 4)
        return out


class ChooserController:
    def __init__(self, kinds: list[str], serving, make_ctl, seed: int = 0):
        """kinds: the AutoDrafter's members; serving() -> the AutoDrafter the engine drafts with now (a hot-swap
        replaces it); make_ctl() -> a fresh SpecController per member."""
        self.serving = serving
        self.ctls: dict[str, SpecController] = {k: make_ctl() for k in kinds}
        self.k_max = max(c.k_max for c in self.ctls.values())
        self.mode = "auto"  # the engine calibrates a chooser's cost model always
        # "none" is an arm only without the toggle: with it, the chosen member's own toggle decides SD on or off (a
        # second, chooser-level AR arm trapped the long tail in AR: a member's first step back after AR steps pays
        # its catch-up, scores low, and AR kept winning the few-row buckets where SD paid: bench/NOTES.md, Auto)
        self.ar_arm = not any(c.toggle for c in self.ctls.values())
        self.chooser = Chooser([*kinds, *([AR] if self.ar_arm else [])], seed=seed)
        self.trace: deque[dict] = deque(maxlen=TRACE_LEN)  # the latest decisions (schedule.TRACE_LEN)
        self.arm_steps: dict[str, int] = dict.fromkeys(self.chooser.arms, 0)  # decode steps each arm ran, whole run
        self.step = 0
        self._arm = AR
        self.planned = list(self.chooser.arms)  # the arms this generation serves (begin)
        self._pending: tuple[int, str, float] | None = None  # (batch, arm, ms) of the step whose tokens come next

    @property
    def cost(self):
        return next(iter(self.ctls.values())).cost

    def calibrate(self, engine) -> None:
        """The target's cost once, each member's drafting cost with that member drafting."""
        target = None
        self.serving().plan(self.ctls)  # every member, timed on a state of all of them
        for kind, ctl in self.ctls.items():
            self.serving().use(kind)
            if target is None:
                ctl.cost = CostModel.calibrate(engine, self.k_max)
                target = ctl.cost.target_ms
            else:
                ctl.cost = CostModel(target, _draft_ms(engine, target, self.k_max))

    def refresh_drafts(self, engine) -> None:
        self.serving().plan(self.ctls)
        for kind, ctl in self.ctls.items():
            self.serving().use(kind)
            ctl.cost.set_draft(_draft_ms(engine, ctl.cost.draft_ms, self.k_max))

    def begin(self) -> None:
        """A generation starts: the members it serves (Chooser.plan; "ar" stays an arm where it is one)."""
        for c in self.ctls.values():
            c.begin()
        self._pending = None
        members = [a for a in self.chooser.plan() if a != AR] or [max(self.ctls, key=lambda k: self.chooser.tries[k])]
        self.serving().plan(members)
        self.planned = [*members, *([AR] if self.ar_arm else [])]

    def decide(self, batch: int) -> int:
        """k for this decode step (0: AR), from the arm the chooser picks; the decision record is trace[-1]."""
        arm = self.chooser.pick(batch, self.planned)
        k = 0
        if arm != AR:
            self.serving().use(arm)
            k = self.ctls[arm].decide(batch)
        self._arm = arm
        self.arm_steps[arm] += 1
        self.trace.append({"step": self.step, "batch": batch, "kind": arm, "on": k > 0, "k": k})
        self.step += 1
        return k

    def observe(self, num_accepted: list[int], k: int, emitted: list[int] | None = None) -> None:
        if self._arm != AR:
            self.ctls[self._arm].observe(num_accepted, k, emitted)
        if self._pending is not None and emitted is not None:
            batch, arm, ms = self._pending
            if batch == len(emitted) and ms > 0:
                ar_ms = self.cost.target(batch, 1) if self.cost is not None else ms
                self.chooser.observe(batch, arm, sum(emitted) / batch * ar_ms / ms, ms)
        self._pending = None

    def observe_step(self, batch: int, k: int, ms: float, typical: bool = True) -> None:
        if k > 0:
            self.ctls[self._arm].observe_step(batch, k, ms, typical)
        elif typical:  # an AR step (the AR arm, or a member's toggle off) informs every member's AR timing
            for c in self.ctls.values():
                c.observe_step(batch, 0, ms)
        self._pending = (batch, self._arm, ms)


def _draft_ms(engine, batches, k_max: int) -> dict[int, float]:
    return {b: measure_costs(engine, b, [], min(k_max, 4), repeats=3)["draft_ms_per_token"] for b in batches}
