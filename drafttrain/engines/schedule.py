"""System-aware speculative decoding: when to draft, and how many tokens, at every decode step.

    speed-up(B, k) = E[tokens | k] * T(B, 1) / (T(B, k+1) + k * D(B))
    E[tokens | k]  = the tokens a row emitted per step at k, measured      (once k ran on MEASURED_ROWS rows)
                   = 1 + sum_{i<k} prod_{j<=i} a_j                         (before: a_j, acceptance of draft j
                                                                            given drafts < j accepted)

T(B, m) is the target's forward time for B rows of m tokens and D(B) the drafter's time per drafted token, both
calibrated on the live engine (CostModel.calibrate); a_j and the tokens per step at each k are moving averages of
what the engine observes (AcceptanceEstimate). The chain product alone misjudged the k's it did not draft: where a
chain starts depends on k (text has hard tokens at intervals), so the a_j measured at one k do not multiply out to
another k's tokens, and auto k kept to short drafts where longer ones paid (measured: bench/NOTES.md, SD schedule).
SpecController picks k per step: a fixed k, "auto" (argmax of the predicted speed-up over 1..k_max), or "ladder"
(the EfficientRollout anchor: step up the ladder when (L-1)/k >= up, down when <= down, two decisions in a row).
With the toggle on, SD runs only where the predicted speed-up is >= threshold, and keeps running until it drops
below threshold - hysteresis; while off, a probe SD step keeps the acceptance estimates current: after probe_every
AR steps, then twice as long after each probe that leaves SD off (up to 16x) unless the prediction sits near the
threshold (>= PROBE_NEAR x threshold: acceptance that dips there, e.g. in a stretch of odd text, tends to come back,
and the toggle must notice soon), and never where SD could not pay even with a very good drafter (acceptance
probe_alpha at every position, or the estimate where it is higher: a probe's SD step also catches the drafter up on
every position since it last ran, which at a large batch costs several AR steps). probe_alpha is 0.9 for every
drafter, a self-drafter included: the model prices neither a drafter's catch-up on the positions of the AR steps
before nor the few steps left in a tail (bench/NOTES.md has the measurements). The toggle never changes outputs: AR
and SD are both exact.

The calibrated T and D are bare forward times. A real decode step also samples, verifies, catches the drafter up on
the accepted tokens and does the row bookkeeping, and SD pays more of that than AR. So the engine reports every
step's wall time (observe_step) and the controller keeps, per mode (AR/SD) and power-of-two batch bucket, a moving
average of the ratio measured / modelled (each observation clipped to [1/2, 2] x the current ratio: a stall is not
a trend, while a persistent ratio of any size is reached in a few steps), which scales the model's step times:
    speed-up(B, k) = E[tokens | k] * T(B, 1) f_ar(B) / ((T(B, k+1) + k * D(B)) f_sd(B))
The two are read as a pair: f_ar(B) / f_sd(B) comes from the nearest bucket where both modes were observed (1
before any). Ratios, not ms: a ratio learnt at batch 64 transfers to batch 1 about right, an offset in ms does not.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import torch

from drafttrain.device import now
from drafttrain.spec import SamplingParams, expected_tokens
from drafttrain.spec.stats import drafts_kept


PROBE_ALPHA = 0.9  # probe_alpha's default: about the shipped EAGLE-3's per-position acceptance (bench/NOTES.md)
MEASURED_ROWS = 32  # rows drafted at a k before its measured tokens per step replace the chain product
PROBE_NEAR = 0.9  # predicted speed-up >= this x threshold: probe every probe_every steps, without backing off
# decisions a controller's trace keeps (the latest): a run makes one per decode step for thousands of RL steps; the
# engine keeps each generation's own decisions in its Timeline
TRACE_LEN = 1024


@dataclass
class CostModel:
    """Target forward ms at measured (batch, tokens per row) points; drafter ms per token at measured batches."""

    target_ms: dict[int, dict[int, float]]  # batch -> {m: ms}
    draft_ms: dict[int, float] = field(default_factory=dict)  # batch -> ms per drafted token
    # target() and draft() by argument: auto k asks for k_max of them at every decode step, and interpolating
    # them afresh is a visible share of a batch-1 SD step; the points change only through set_draft
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def _interp(points: dict[int, float], x: float) -> float:
        xs = sorted(points)
        if x <= xs[0]:
            return points[xs[0]]
        if x >= xs[-1]:
            if len(xs) == 1:
                return points[xs[-1]] * x / xs[-1]
            a, b = xs[-2], xs[-1]  # linear extrapolation from the last segment
            return points[b] + (points[b] - points[a]) * (x - b) / (b - a)
        i = bisect.bisect_right(xs, x)
        a, b = xs[i - 1], xs[i]
        return points[a] + (points[b] - points[a]) * (x - a) / (b - a)

    def target(self, batch: int, m: int) -> float:
        key = (batch, m)
        if key not in self._memo:
            per_b = {b: self._interp(ms, m) for b, ms in self.target_ms.items()}
            self._memo[key] = self._interp(per_b, batch)
        return self._memo[key]

    def draft(self, batch: int) -> float:
        key = (batch, None)
        if key not in self._memo:
            self._memo[key] = self._interp(self.draft_ms, batch) if self.draft_ms else 0.0
        return self._memo[key]

    def set_draft(self, draft_ms: dict[int, float]) -> None:
        """New drafter costs (a swapped drafter, recalibrated)."""
        self.draft_ms = draft_ms
        self._memo.clear()

    @classmethod
    def calibrate(cls, engine, k_max: int, batches=(1, 4, 16, 64), repeats: int = 5) -> "CostModel":
        """Cheap: a handful of timed forwards per batch size and tokens per row on the live engine. Every m in
        1..k_max+1 is measured: the curve is not smooth (flat stretches, then steps), and interpolating between
        sparse points mispriced the k in between (measured: bench/NOTES.md, SD schedule).
        Batches: those up to engine.max_batch, and max_batch itself, the largest the engine runs: no step is priced
        by extrapolation."""
        if engine.drafter is None:
            raise ValueError("engine.toggle / engine.k=auto: calibration needs a drafter (the engine has none)")
        ms = list(range(1, k_max + 2))
        target, draft = {}, {}
        top = int(engine.cfg.max_batch)
        for b in sorted({b for b in batches if b <= top} | {top}):
            c = measure_costs(engine, b, ms, min(k_max, 4), repeats=repeats)
            run = 0.0  # more tokens per row never cost less: keep the curve monotone against timing noise
            target[b] = {m: (run := max(run, c["target_ms"][m])) for m in ms}
            draft[b] = c["draft_ms_per_token"]
        return cls(target, draft)


class AcceptanceEstimate:
    """Per-position conditional acceptance, exponential moving averages of the engine's own observations. Each row
    that reached a position is one observation (weight decay per row, so ~1/(1-decay) rows of memory): a batch-64
    step counts 64 times what a batch-1 step of the long tail does, and the estimate is the per-token acceptance the
    throughput depends on, not one skewed by the few odd rows that run longest.
    Until a position has seen ~1/(1-decay) rows it is their plain mean (the prior counts for none, as in Adam's bias
    correction): a batch-1 probe of an unmeasured drafter moved a decayed average only 1 - decay of the way from
    the prior, so a self-drafter's one probe at the long tail (accepting far above the prior) changed nothing."""

    def __init__(self, k_max: int, prior: float = 0.7, decay: float = 0.98):
        self.a = [prior] * k_max
        self.seen = [0] * k_max  # rows observed at each position
        self.decay = decay
        self.at_k: dict[int, list[float]] = {}  # k -> [tokens a row emitted per step at k (moving average), rows]

    def _keep(self, seen: int, rows: int) -> float:
        """The weight an average over `seen` rows keeps when `rows` more come: the plain mean until ~1/(1-decay) rows,
        then an exponential average per row."""
        return min(self.decay ** rows, seen / (seen + rows))

    def observe(self, num_accepted: list[int], k: int, emitted: list[int] | None = None) -> None:
        """num_accepted per row at draft length k; emitted: the tokens each row kept (None: num_accepted + 1). A row
        whose response ended inside its drafts is observed up to the cut only (spec.stats.drafts_kept)."""
        lim = [k] * len(num_accepted)
        if emitted is not None:
            lim = [drafts_kept(n, e, k) for n, e in zip(num_accepted, emitted)]
        # tokens per step at k, over the rows that kept all they emitted (no stop or length cut inside the step)
        whole = [n + 1 for n, e in zip(num_accepted, emitted or [n + 1 for n in num_accepted]) if e == n + 1]
        if whole:
            t = self.at_k.setdefault(k, [0.0, 0])
            keep = self._keep(t[1], len(whole))
            t[0] = keep * t[0] + (1 - keep) * sum(whole) / len(whole)
            t[1] += len(whole)
        deepest, w_deep = None, 0.0  # the deepest position this step measured, and that measurement's weight
        for i in range(k):
            reached = sum(1 for n, m in zip(num_accepted, lim) if n >= i and m > i)
            if reached:
                rate = sum(1 for n, m in zip(num_accepted, lim) if n > i and m > i) / reached
                keep = self._keep(self.seen[i], reached)
                self.a[i] = keep * self.a[i] + (1 - keep) * rate
                self.seen[i] += reached
                deepest, w_deep = i, keep
        # positions past k go unmeasured while k stays below them: they follow the deepest measured one, so that a
        # small k chosen early (on the prior) does not keep the estimates of longer drafts stuck at the prior
        if deepest is not None:
            for i in range(k, len(self.a)):
                self.a[i] = w_deep * self.a[i] + (1 - w_deep) * self.a[deepest]

    def expected_tokens(self, k: int) -> float:
        """Tokens per row per step at k: measured once k ran on MEASURED_ROWS rows, else the chain product (which
        over-predicts the k's away from those drafted, and so gets them tried and measured: module docstring)."""
        t = self.at_k.get(k)
        return t[0] if t is not None and t[1] >= MEASURED_ROWS else self.chain_tokens(k)

    def chain_tokens(self, k: int) -> float:
        """1 + sum over i < k of prod_{j <= i} a_j."""
        return expected_tokens(self.a, k)


class SpecController:
    def __init__(self, k, k_max: int, toggle: bool, threshold: float = 1.05, hysteresis: float = 0.05,
                 ladder=(2, 4, 6, 8), ladder_up: float = 0.94, ladder_down: float = 0.85,
                 cost: CostModel | None = None, acc: AcceptanceEstimate | None = None, probe_every: int = 16,
                 probe_alpha: float = PROBE_ALPHA):
        self.mode = k if isinstance(k, str) else "fixed"
        self.k_fixed = k if isinstance(k, int) else None
        self.k_max = max(ladder) if self.mode == "ladder" else (k_max if self.mode == "auto" else k)
        self.toggle, self.threshold, self.hysteresis = toggle, threshold, hysteresis
        self.ladder, self.ladder_up, self.ladder_down = list(ladder), ladder_up, ladder_down
        self.rung, self._streak = 0, 0
        self.cost = cost
        self.acc = acc or AcceptanceEstimate(self.k_max)
        self.on = True
        self.probe_every, self._off_steps = probe_every, 0  # while off, one SD step now and then refreshes a_j
        self._probe_gap = probe_every
        self.probe_alpha = probe_alpha
        self.trace: deque[dict] = deque(maxlen=TRACE_LEN)  # the latest decisions (TRACE_LEN)
        self.step = 0
        self.factor: dict[tuple[str, int], float] = {}  # (ar|sd, batch bucket) -> measured/modelled, moving average
        self._probe_first = False  # the next decision is a new batch's first: an SD probe (begin())

    def begin(self) -> None:
        """A new batch starts: its first decode step is an SD probe (toggle on). The estimates come from the rows
        SD last ran on, with the toggle mostly the previous batch's long tail, whose acceptance runs below a fresh
        batch's; a toggle that trusted them kept SD off at the start of every batch and so never measured a fresh
        one. With auto k the probe drafts the k a very good drafter would (probe_alpha per position), so that every
        position auto k could use is the new batch's (auto k at a tail's estimates drafted short where longer paid);
        not k_max, whose probe at a large batch costs a visible share of the batch (measured: bench/NOTES.md, SD
        schedule). It also catches the drafter up on the prompts, which turning SD on later would cost about as
        much."""
        self._probe_first = self.toggle

    def model_ms(self, batch: int, k: int) -> float:
        """The cost model's time of one decode step (k = 0: AR)."""
        c = self.cost
        return c.target(batch, 1) if k == 0 else c.target(batch, k + 1) + k * c.draft(batch)

    def _ratio(self, batch: int) -> float:
        """f_ar / f_sd at the bucket nearest to batch's where both modes were observed; 1 before any."""
        both = [b for (m, b) in self.factor if m == "sd" and ("ar", b) in self.factor]
        if not both:
            return 1.0
        want = bucket(batch).bit_length()
        b = min(both, key=lambda x: abs(x.bit_length() - want))
        return self.factor[("ar", b)] / self.factor[("sd", b)]

    def observe_step(self, batch: int, k: int, ms: float, typical: bool = True, decay: float = 0.8) -> None:
        """A decode step of `batch` rows with k drafts (0: AR) took `ms` of wall time. Not typical: a one-off catch-up
        (prompt, or after AR steps) or a step that also dropped finished rows: not learnt from."""
        if self.cost is None or not typical:
            return
        key = ("sd" if k else "ar", bucket(batch))
        f = ms / max(self.model_ms(batch, k), 1e-9)
        if key not in self.factor:
            self.factor[key] = min(max(f, 0.25), 8.0)
            return
        cur = self.factor[key]  # one observation moves at most to [cur/2, 2 cur]: a stall is not a trend, but a
        f = min(max(f, cur / 2), 2 * cur)  # persistent ratio of any size is reached in a few steps
        self.factor[key] = decay * cur + (1 - decay) * f

    def calibrate(self, engine) -> None:
        """The cost model, measured on the live engine (CostModel.calibrate)."""
        self.cost = CostModel.calibrate(engine, self.k_max)

    def refresh_drafts(self, engine) -> None:
        """The drafting cost again (the drafter changed: a hot-swap)."""
        self.cost.set_draft({b: measure_costs(engine, b, [], min(self.k_max, 4), repeats=3)["draft_ms_per_token"]
                             for b in self.cost.draft_ms})

    def speedup(self, batch: int, k: int) -> float:
        t_ar, t_sd = self.model_ms(batch, 0), self.model_ms(batch, k)
        return self.acc.expected_tokens(k) * t_ar * self._ratio(batch) / max(t_sd, 1e-9)

    def _best_speedup(self, batch: int, k: int) -> float:
        """The speed-up a very good drafter would get (probe_alpha per position, or the estimate where it is higher;
        never less than the estimate's own): where it is below the threshold, a probe cannot pay."""
        e, surv = 1.0, 1.0
        for a in self.acc.a[:k]:
            surv *= max(a, self.probe_alpha)
            e += surv
        return self.speedup(batch, k) * e / self.acc.expected_tokens(k)

    def decide(self, batch: int) -> int:
        """k for this decode step; 0 means an AR step. Its decision record is trace[-1] (the engine's Timeline)."""
        if self.mode == "fixed":
            k = self.k_fixed
        elif self.mode == "ladder":
            k = self.ladder[self.rung]
        else:
            k = max(range(1, self.k_max + 1), key=lambda kk: self.speedup(batch, kk))
        pred = self.speedup(batch, k) if self.cost is not None else None
        probe = False
        if self.toggle and self._probe_first:
            self._probe_first = False
            # a new batch: measure it (begin()) where SD could pay at some k with a very good drafter (a
            # self-drafter at a large batch cannot: its probe would cost several AR steps); auto k drafts what such
            # a drafter would draft here, so every position it could use is measured afresh
            best = max(range(1, self.k_max + 1), key=lambda kk: self._best_speedup(batch, kk))
            probe = self._best_speedup(batch, best) >= self.threshold
            if probe and self.mode == "auto":
                k = best
        if self.toggle and not probe:
            bar = self.threshold - (self.hysteresis if self.on else 0.0)
            self.on = pred >= bar
            self._off_steps = 0 if self.on else self._off_steps + 1
            if self.on:
                self._probe_gap = self.probe_every
            elif self.probe_every > 0 and self._off_steps >= self._probe_gap:
                # auto k: the k a very good drafter would draft here, as the first step's probe takes it (the argmax
                # under the current, low estimates is often k=1, where no drafter could pay on a step-shaped curve)
                kp = k if self.mode != "auto" else max(range(1, self.k_max + 1),
                                                       key=lambda kk: self._best_speedup(batch, kk))
                if self._best_speedup(batch, kp) >= self.threshold:  # only where a very good drafter could pay
                    probe, k = True, kp
                    self._off_steps = 0
                    # near the threshold a probe is worth repeating soon (acceptance drifts back across it); far
                    # below it (a poor drafter) back off. Steps where no drafter could pay (a large batch) neither
                    # probe nor back off: the probe comes as soon as the batch has shrunk to where one could
                    near = pred >= PROBE_NEAR * self.threshold
                    self._probe_gap = self.probe_every if near else min(2 * self._probe_gap,
                                                                        16 * self.probe_every)
        run = self.on or probe
        self.trace.append({"step": self.step, "batch": batch, "on": run, "k": k if run else 0,
                           "predicted_speedup": pred, "probe": probe})
        self.step += 1
        return k if run else 0

    def observe(self, num_accepted: list[int], k: int, emitted: list[int] | None = None) -> None:
        """A verify step's accepted counts per row; emitted: see AcceptanceEstimate.observe."""
        if k == 0:
            return
        self.acc.observe(num_accepted, k, emitted)
        if self.mode == "ladder":
            if emitted is not None:
                num_accepted = [min(n, drafts_kept(n, e, k)) for n, e in zip(num_accepted, emitted)]
            L = sum(num_accepted) / len(num_accepted) + 1
            r = (L - 1) / k
            move = 1 if r >= self.ladder_up else (-1 if r <= self.ladder_down else 0)
            self._streak = self._streak + move if move and (self._streak * move) >= 0 else move
            if abs(self._streak) >= 2:
                self.rung = min(max(self.rung + (1 if self._streak > 0 else -1), 0), len(self.ladder) - 1)
                self._streak = 0


def bucket(batch: int) -> int:
    """The power of two at or below batch (1, 2, 4, ...)."""
    return 1 << (max(batch, 1).bit_length() - 1)


@torch.no_grad()
def measure_costs(engine, batch: int, tokens_per_row: list[int], k: int, context: int = 64,
                  repeats: int = 20) -> dict:
    """Time the live embedded engine's pieces on synthetic inputs at a context length: target forward (ms) for each
    m in tokens_per_row, and the drafter's propose of k tokens (ms per drafted token): the cost model's input.
    Each figure is the fastest of `repeats` runs (the workload is deterministic: slower runs are noise). The target
    forwards take turns, one run of each m per round, so a slow spell of the machine slows one round of every m
    rather than every run of one m; the drafter's propose runs back to back, as in a chain of draft steps."""
    lean, dev = engine.lean, engine.device
    gen = torch.Generator(device=dev).manual_seed(0)
    L = context + max([1, *tokens_per_row]) + k + 2
    pos = torch.full((batch,), context, device=dev)

    def fastest(pieces: dict) -> dict:
        """ms of each piece's fastest run after a warm-up; the pieces take turns, one run of each per round (a
        single piece: back to back)."""
        for fn in pieces.values():
            fn()
        best = dict.fromkeys(pieces, float("inf"))
        for _ in range(repeats):
            for key, fn in pieces.items():
                t0 = now(dev)
                fn()
                best[key] = min(best[key], (now(dev) - t0) * 1e3)  # synchronized: the device's time, not launches
        return best

    cache = lean.new_cache(batch, L)
    fwd = {m: torch.randint(0, lean.vocab_size, (batch, m), generator=gen, device=dev) for m in tokens_per_row}
    out = {"batch": batch,
           "target_ms": fastest({m: (lambda t=toks: lean.forward(t, pos, cache, ())) for m, toks in fwd.items()})}
    d = engine.drafter
    if d is not None and k > 0:
        st = d.new_state(batch, L)
        reads = d.generation_reads()  # what new_state expects (auto: the planned members')
        X = (len(reads.aux_layers) + reads.final_hidden) * lean.hidden
        ids = torch.randint(0, lean.vocab_size, (batch, k + 1), generator=gen, device=dev)
        aux = torch.randn(batch, k + 1, X, generator=gen, device=dev)
        params = SamplingParams(temperature=1.0)
        n_new = torch.full((batch,), k + 1, device=dev)

        def propose():
            d.propose(st, ids, aux, n_new, pos - k - 1, k, params, False, gen)

        out["draft_ms_per_token"] = fastest({"propose": propose})["propose"] / k
    return out
