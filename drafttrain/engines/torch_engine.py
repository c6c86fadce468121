"""The embedded rollout engine: batched AR and lossless speculative decoding over a static KV cache.

Each decode step: the drafter extends its cache with the positions the last verify pass committed and chains k
drafts; the policy verifies [last token, d_1..d_k] for every active row in one forward pass that also returns
the drafter's aux hidden states (no extra pass); spec.rejection_sample keeps the output distribution exactly the
policy's. Rows advance by their own accepted count, finish independently (stop token or max_new_tokens) and are
dropped from every cache when they do. AR mode is the same loop with k = 0.

Drafter hot-swap: load_drafter builds the new drafter (validated, optionally int8) off the decode path, then
swaps one reference; each decode step reads that reference once, so a step never mixes versions. In-flight rows
keep the drafter KV cache the old version wrote (context only); every weight a step uses is the new version's.
"""
from __future__ import annotations

import copy
import threading

import torch

from drafttrain.device import now
from drafttrain.drafters.base import check_compatible, runtime_copy
from drafttrain.drafters.pending import Pending
from drafttrain.drafters.weights import check_finite
from drafttrain.engines.base import RolloutBatch, StaleVersionError, Timeline, check_prompts
from drafttrain.engines.chooser import ChooserController
from drafttrain.engines.schedule import SpecController
from drafttrain.modeling import LeanLlama, keep_order, share_prompts
from drafttrain.spec import SamplingParams, SpecStats, processed_probs, rejection_sample, sample
from drafttrain.spec.sampling import CHUNK


class TorchEngine:
    def __init__(self, cfg, policy, drafter=None):
        self.cfg = cfg
        self.policy = policy
        self.lean = LeanLlama(policy, cfg.max_len)
        self._template = drafter  # the structure new weights are loaded into
        self._active: tuple[object, int] | None = None  # (runtime drafter, version): swapped as one reference
        self._swap_lock = threading.Lock()
        self._stage_lock = threading.Lock()  # one staging at a time
        self._standby = None  # in-place drafters (self-drafters): the copy the next load writes into
        self._in_use: dict[int, threading.Lock] = {}  # id(runtime) -> held while a decode step drafts with it
        self._seed = cfg.seed
        self.last_swap_s = self.last_swap_critical_s = 0.0
        self._ctl: SpecController | None = None
        self._draft_cost_stale = False
        if drafter is not None:
            check_compatible(drafter, policy)  # at build, not as a torch error at the first SD step
            check_finite(drafter.state_dict())  # no corrupt drafter reaches an engine (load_drafter checks too)
            self._active = (self._runtime(drafter), 0)

    # ---- drafter hot-swap ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The policy's device: the engine's caches, indices, generator and drafters live there."""
        return self.lean.device

    @property
    def drafter_version(self) -> int:
        return self._active[1] if self._active else -1

    @property
    def drafter(self):
        return self._active[0] if self._active else None

    def _runtime(self, drafter, owned: bool = False):
        """The inference copy of `drafter` (runtime_copy), with its in-use lock."""
        rt = runtime_copy(drafter, self.cfg.drafter_int8, owned, self.device)
        rt.bind_policy(self.policy)  # a drafter reading the policy's own weights (an MTP head's LM head) reads ours
        self._in_use[id(rt)] = threading.Lock()
        return rt

    def _stage(self, weights: dict):
        """A runtime drafter holding `weights`, built off the decode path. In-place drafters (requantizing into
        their own storage) are double-buffered: the load writes the standby copy, once no step drafts with it."""
        if not self._template.in_place_update:
            staged = copy.deepcopy(self._template)
            staged.load_state_dict(weights)  # validates names, shapes, finiteness: one-line error
            rt = self._runtime(staged, owned=True)
            if self._active is not None:  # an index learnt outside the weights (suffix)
                rt.adopt(self._active[0])
            return rt
        if self._standby is None:
            self._standby = self._runtime(self._template)
        with self._in_use[id(self._standby)]:  # an in-flight step may still draft with the old active copy
            self._standby.load_state_dict(weights)
        return self._standby

    def load_drafter(self, weights: dict, version: int) -> None:
        """Atomic, versioned swap; a version not newer than the served one is refused (StaleVersionError)."""
        if self._template is None:
            raise ValueError("load_drafter: this engine was built without a drafter (build_engine(..., drafter=))")
        if version <= self.drafter_version:
            raise StaleVersionError(f"load_drafter: version {version} is not newer than the served version "
                                    f"{self.drafter_version}")
        t0 = now(self.device)
        with self._stage_lock:
            rt = self._stage(weights)
            t1 = now(self.device)
            with self._swap_lock:
                if version <= self.drafter_version:
                    raise StaleVersionError(f"load_drafter: version {version} lost a race to {self.drafter_version}")
                old, self._active = self._active[0], (rt, version)
            if rt is self._standby:
                self._standby = old
        self.last_swap_s = now(self.device) - t0  # staging (copy, validate, quantize) + the swap itself
        self.last_swap_critical_s = now(self.device) - t1  # the part a decode step could wait on
        self._draft_cost_stale = True  # recalibrated (drafter part only) before the next generation

    def controller(self):
        """The per-step SD schedule (engine.k / toggle; with drafter.kind=auto, the chooser over its members on top);
        calibrates its cost model on this engine when needed."""
        cfg = self.cfg
        if self._ctl is None:
            def make():
                return SpecController(cfg.k, cfg.k_max, cfg.toggle, cfg.toggle_threshold, cfg.toggle_hysteresis,
                                      tuple(cfg.ladder), cfg.ladder_up, cfg.ladder_down)

            auto = self._template is not None and bool(self._template.kinds)
            self._ctl = (ChooserController(self._template.kinds, lambda: self.drafter, make, cfg.seed) if auto
                         else make())
        ctl = self._ctl
        if cfg.toggle or ctl.mode != "fixed":
            if ctl.cost is None:
                ctl.calibrate(self)
            elif self._draft_cost_stale:
                ctl.refresh_drafts(self)
        self._draft_cost_stale = False
        return ctl

    def close(self) -> None:
        """Nothing to free: the engine lives in this process's memory."""

    def update_policy(self, policy=None) -> None:
        """The policy's weights changed (an RL step): refresh the packed copies in place."""
        if policy is not None and policy is not self.policy:
            if self._template is not None:
                check_compatible(self._template, policy)
            self.policy = policy
            self.lean = LeanLlama(policy, self.cfg.max_len)
            for rt in (self.drafter, self._standby):
                if rt is not None:
                    rt.bind_policy(policy)
        else:
            self.lean.refresh()

    # ---- generation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True) -> RolloutBatch:
        """Responses to `prompts`, at most engine.max_batch rows at once: more prompts run in waves of max_batch, in
        order, on one sampling generator (one seed gives one result). A wave does not start before the last one's
        longest row ended (vLLM admits waiting prompts as rows finish): eval-sized batches (512 problems) took about
        the same time either way here (bench/NOTES.md)."""
        check_prompts(prompts, self.lean.max_len, self.lean.vocab_size)
        if params.seed is None:
            self._seed += 1
        gen = torch.Generator(device=self.device).manual_seed(params.seed if params.seed is not None else self._seed)
        m = self.cfg.max_batch
        waves = [self._wave(prompts[i:i + m], params, speculative, gen) for i in range(0, len(prompts), m)]
        return waves[0] if len(waves) == 1 else join_waves(waves)

    def _wave(self, prompts: list[list[int]], params: SamplingParams, speculative: bool, gen) -> RolloutBatch:
        """At most max_batch rows: the prefill, then decode steps (draft, verify), each followed by a commit, until
        every row finished."""
        w = _Wave(self, prompts, params, speculative, gen)
        while w.commit():
            w.step()
        return w.result()


class _Wave:
    """One wave's decode state: set up and prefilled at construction; `commit` appends what the last forward emitted
    and drops finished rows; `step` drafts (maybe) and verifies; `result` packs the RolloutBatch."""

    def __init__(self, engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, speculative: bool, gen):
        self.engine, self.prompts, self.params, self.gen = engine, prompts, params, gen
        self.active = engine._active if speculative else None
        self.drafter, self.version = self.active if self.active else (None, engine.drafter_version)
        self.ctl = engine.controller() if self.drafter is not None else None
        self.k_max = self.ctl.k_max if self.ctl is not None else 0
        if self.ctl is not None:
            self.ctl.begin()  # drafter.kind=auto: plans the members this generation serves, and so what they read
        reads = None if self.drafter is None else self.drafter.generation_reads()
        self.aux_ids = reads.aux_layers if reads is not None else ()
        self.final = reads is not None and reads.final_hidden
        self.greedy_drafts = engine.cfg.draft_sampling == "greedy" or params.greedy
        self.stop = set(params.stop_token_ids)
        B = len(prompts)
        self.resp: list[list[int]] = [[] for _ in range(B)]
        self.lps: list[list[float]] = [[] for _ in range(B)]
        self.reasons = ["length"] * B
        self.lens_l = [len(p) for p in prompts]  # by original index
        self.stats, self.versions, self.ends = SpecStats(), [], []
        self.step_batch, self.step_tokens, self.step_k = [], [], []
        self.schedule: list[dict] = []  # the controller's decision at each step (it keeps only its latest few)
        self.k, self.dropped = 0, False
        self._prefill()

    def _prefill(self) -> None:
        """Every row's prompt into the caches (each distinct prompt once) and its first token: a k=0 verify of the
        last prompt position."""
        eng, prompts, B = self.engine, self.prompts, len(self.prompts)
        # rows in the order of share_prompts: each distinct prompt's first copy, then the repeats (a GRPO batch
        # holds G copies of each prompt), which take the prefill's cache and outputs instead of recomputing them
        self.order, src = share_prompts(prompts)
        dev = self.dev = eng.device
        self.t_start = now(dev)  # after any (re)calibration of the schedule
        lens_l = [len(prompts[b]) for b in self.order]
        lens, P = torch.tensor(lens_l, device=dev), max(lens_l)
        self.L = L = min(eng.lean.max_len, P + self.params.max_new_tokens + self.k_max + 1)
        tokens = torch.tensor([list(prompts[b]) + [0] * (P - n) for b, n in zip(self.order, lens_l)], device=dev)
        self.cache = eng.lean.new_cache(B, L)
        self.dstate = self.drafter.new_state(B, L, tokens) if self.drafter is not None else None
        U = B - len(src)  # distinct prompts: the prefill runs on these rows only
        head = self.cache.head(U) if src else self.cache
        h, aux = eng.lean.forward(tokens[:U], torch.zeros(U, dtype=torch.long, device=dev), head, self.aux_ids,
                                  self.final, head=False)  # [U, P, hidden]: the head runs on the last positions alone
        rows = from_prefill = torch.arange(B, device=dev)  # the prefill row each row reads
        if src:
            src_t = torch.tensor(src, device=dev)
            self.cache.fill_rows(head, src_t)
            from_prefill = torch.cat([torch.arange(U, device=dev), src_t])
            aux = None if aux is None else aux[from_prefill]
        h = h[from_prefill, lens - 1].unsqueeze(1)  # [B, 1, hidden]: the last prompt position's
        empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
        self.out, self.n, self.lp = sample_step(h, None, empty, self.params, self.gen, eng.lean)
        # drafter inputs: position t of the prompt pairs aux_t with token_{t+1}; the last one is the sampled token
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(B, 1)], 1)
        nxt[rows, lens - 1] = self.out[:, 0]
        # the drafter's pending input: positions committed since it last ran (ragged: n_new[b] of them per row)
        self.pend = Pending(nxt, aux, lens.clone(), torch.zeros(B, dtype=torch.long, device=dev))
        self.pos = lens.clone()  # position of the last committed token, fed next
        self.row_ids = self.order  # original index of each active row
        self.last = self.out[:, 0]
        self.t_prev = now(dev)
        self.prefill_s = self.t_prev - self.t_start

    def _full(self, b: int) -> bool:
        """Row b holds max_new_tokens, or its last token sits at position L-1 (its maximum position: no room)."""
        return len(self.resp[b]) >= self.params.max_new_tokens or self.lens_l[b] + len(self.resp[b]) >= self.L

    def commit(self) -> bool:
        """Append what the last forward emitted to each row (up to a stop token or the row's limit), count it, and
        drop the rows that finished from every cache; False once no row is left."""
        done, emitted, resp = [], [], self.resp
        out_l, n_l, lp_l = self.out.tolist(), self.n.tolist(), self.lp.tolist()
        for j, b in enumerate(self.row_ids):
            before = len(resp[b])
            for t, l in zip(out_l[j][: n_l[j] + 1], lp_l[j][: n_l[j] + 1]):
                resp[b].append(t)
                self.lps[b].append(l)
                if t in self.stop:
                    self.reasons[b] = "stop"
                    break
                if self._full(b):
                    break
            emitted.append(len(resp[b]) - before)
            if self.reasons[b] == "stop" or self._full(b):
                done.append(j)
        if self.versions:  # `out` came from a verify step (not the prefill): count only what the rows kept
            self.stats.update(n_l, self.k, emitted)
            self.step_tokens.append(sum(emitted))
            if self.ctl is not None:  # drafts past a row's stop are not text: not acceptance either
                self.ctl.observe(n_l, self.k, emitted)
        self.dropped = bool(done)
        if done:
            keep = keep_order(len(self.row_ids), done, self.dev)  # moves the fewest rows of every cache
            self.row_ids = [self.row_ids[j] for j in keep.tolist()]
            if not self.row_ids:
                return False
            self.cache.select_rows(keep)
            if self.dstate is not None:
                self.dstate.select_rows(keep)
            self.pos, self.last = self.pos[keep], self.last[keep]
            self.pend.select_rows(keep)
        return True

    def step(self) -> None:
        """One decode step on the active rows: pick up a landed hot-swap, choose k, draft, verify."""
        eng, ctl = self.engine, self.ctl
        if self.active is not None and eng._active is not None and eng._active[1] != self.version:
            self.active = eng._active  # a hot-swap landed: use the new version from this step on
            self.drafter, self.version = self.active
        self.versions.append(self.version)
        Bn = len(self.row_ids)
        self.step_batch.append(Bn)
        self.k = 0
        if ctl is not None:
            self.k = max(0, min(ctl.decide(Bn), self.L - 1 - int(self.pos.max())))
            self.schedule.append(ctl.trace[-1])
        self.step_k.append(self.k)
        catch_up = self.pend.width() if self.k > 0 else 0  # pending positions the drafter extends its cache by
        self._verify(Bn, *self._draft(Bn))
        self.ends.append(now(self.dev))
        # typical: not a one-off catch-up (prompt, or after AR steps), nor a step that also dropped finished rows
        # from every cache (a cost of the batch shrinking that AR and SD pay alike, in bursts)
        if ctl is not None:
            ctl.observe_step(Bn, self.k, (self.ends[-1] - self.t_prev) * 1e3,
                             typical=catch_up <= self.k_max + 1 and not self.dropped)
        self.t_prev = self.ends[-1]

    def _draft(self, Bn: int):
        """(drafts [Bn, k], their probabilities or None): the drafter takes the positions committed since it last
        ran, then chains k drafts; none at k = 0."""
        if self.k == 0:
            return torch.zeros(Bn, 0, dtype=torch.long, device=self.dev), None
        with self.engine._in_use[id(self.drafter)]:
            d, q = self.drafter.propose(self.dstate, *self.pend.view(), self.k, self.params, self.greedy_drafts,
                                        self.gen)
        self.pend.consumed()
        return d, q

    def _verify(self, Bn: int, d, q) -> None:
        """The policy's forward on [last token, drafts] and rejection sampling: what the next commit appends."""
        inp = torch.cat([self.last.view(Bn, 1), d], 1) if self.k > 0 else self.last.view(Bn, 1)  # [B, k+1]
        extra = (self.aux_ids, self.final) if self.k_max > 0 else ()
        h, aux_v = self.engine.lean.forward(inp, self.pos, self.cache, *extra, head=False)
        out, n, self.lp = sample_step(h, q, d, self.params, self.gen, self.engine.lean)
        if self.drafter is not None:  # AR steps (toggle off) accumulate; the next SD step catches up in one pass
            self.pend.append(out.clamp_min(0), aux_v, n + 1, self.pos)
        self.out, self.n = out, n
        self.pos = self.pos + n + 1
        self.last = out.gather(1, n.view(-1, 1)).squeeze(1)

    def result(self) -> RolloutBatch:
        """The responses in prompt order, their log-probs, stats and the timeline."""
        if self.dstate is not None:  # a drafter that indexes text (the suffix drafter) takes every row's whole text
            self.drafter.complete(self.dstate, [list(self.prompts[b]) + self.resp[b] for b in self.order])
        timeline = Timeline(self.ends, self.schedule, self.step_batch, self.step_tokens, self.prefill_s, self.step_k)
        first = self.engine.drafter_version if not self.versions else self.versions[0]
        return RolloutBatch(self.resp, self.lps, self.stats, first, self.reasons, now(self.dev) - self.t_start,
                            self.versions, timeline)


def sample_step(h, q, d, params, gen, lean=None):
    """The policy's normed hidden states h [B, k+1, hidden] and its LeanLlama (None: h are the logits [B, k+1, V])
    -> (tokens [B, k+1], num_accepted [B], log-probs [B, k+1] of those tokens). Runs in chunks of rows whose
    [rows, k+1, V] logits stay within CHUNK elements, each chunk's head, probs and sampling in turn: at a real
    vocabulary a whole step's logits, probs and their temporaries took GBs at 128 rows."""
    B, k1 = h.shape[:2]
    rows = max(1, CHUNK // (k1 * (h.shape[-1] if lean is None else lean.vocab_size)))
    parts = [sample_rows(h[i:i + rows] if lean is None else lean.logits(h[i:i + rows]),
                         None if q is None else q[i:i + rows], d[i:i + rows], params, gen) for i in range(0, B, rows)]
    return parts[0] if len(parts) == 1 else tuple(torch.cat(x) for x in zip(*parts))


def sample_rows(logits, q, d, params, gen):
    """sample_step on logits [b, k+1, V] of some rows."""
    # the sum first (one reduction): isfinite().all() makes a float and three bool copies of [b, k+1, V]
    if not torch.isfinite(logits.sum()) and not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the policy produced NaN/inf logits (check the policy weights)")
    p = processed_probs(logits, params)  # [b, k+1, V]
    if d.shape[1] == 0:  # an AR step: plain sampling (what rejection_sample does at k = 0, with fewer ops)
        out = sample(p[:, 0], gen).unsqueeze(-1)
        return out, out.new_zeros(out.shape[0]), p[:, 0].gather(-1, out).log()
    out, n = rejection_sample(p, q, d, gen)
    lp = p.gather(-1, out.clamp_min(0).unsqueeze(-1)).squeeze(-1).log()  # [b, k+1]
    return out, n, lp


def join_waves(waves: list[RolloutBatch]) -> RolloutBatch:
    """One RolloutBatch of waves run one after another: rows in order, stats pooled, the waves' timelines end to end
    (a wave's first step follows the previous wave's last step and its own prefill; prefill_s sums the waves')."""
    stats, tl = waves[0].stats, Timeline()
    for w in waves[1:]:
        stats = stats.merge(w.stats)
    for w in waves:
        t = w.timeline
        tl.ends += t.ends
        tl.schedule += t.schedule
        tl.batch += t.batch
        tl.tokens += t.tokens
        tl.k += t.k
        tl.prefill_s += t.prefill_s
    return RolloutBatch([r for w in waves for r in w.tokens], [r for w in waves for r in w.logprobs], stats,
                        waves[0].drafter_version, [r for w in waves for r in w.finish_reasons],
                        sum(w.wall_s for w in waves), [v for w in waves for v in w.drafter_versions], tl)
