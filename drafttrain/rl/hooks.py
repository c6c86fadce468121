"""DraftTracker: what any RL loop calls to keep its rollout engines' drafter fresh.

    tracker = DraftTracker.from_recipe("eagle3_track", policy=policy, engines=[engine])
    with tracker.capture(policy, response_start=prompt_lens):   # hidden states of the loss forward: no extra pass
        loss = rl_loss(policy(ids, attention_mask=mask))
    tracker.on_policy_update(policy, step)                      # train the drafter, publish v+1 to every engine
    tracker.measure(k)                                          # live vs frozen step-0 drafter, teacher-forced
    tracker.start_capture(policy, grad_only=True) ... tracker.stop_capture()   # the same, for callback APIs (TRL)

online.mode=sync trains between RL steps, within online.time_budget_s and a time bank: each RL step earns
online.budget_frac x its own time (measured between on_policy_update calls, drafter work excluded), and drafter work
(capturing features in the loss forward, training steps, the acceptance estimate, publishing) spends it, so on
average it adds at most budget_frac to the RL step time. An update the bank cannot pay for (one record's step
plus the estimate and publish) trains and publishes nothing. online.mode=async trains and publishes in a background
thread (call wait() before reading its result: it raises what the update raised; the next on_policy_update waits
by itself).
With online.canary=inline (the default) the loop hands each rollout batch to observe_rollout(batch): the first
batch a new version generated is its canary (no extra generation).
online.track=false keeps the drafter frozen (the baseline recipe) but still captures for measurement.
An update whose every step was non-finite publishes nothing; one that diverged (NaN/inf weights or outputs) is
not published and the drafter goes back to the last good weights. With online.publish_gate (default) an update is
published only if it beats the serving drafter on the same held-out rows, paired row by row, at a stated confidence
(online/gate.py); one significantly worse goes back to the serving weights: online noise cannot wear down a drafter
the policy barely drifts from.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time

import torch

from drafttrain.config import load_recipe, max_draft_len, sampling_params
from drafttrain.drafters import build_drafter
from drafttrain.engines.torch_engine import runtime_copy
from drafttrain.online.acceptance import teacher_forced_acceptance
from drafttrain.online.buffer import FeatureBuffer, collate
from drafttrain.online.capture import HiddenCapture, build_features
from drafttrain.online.gate import gate_decision, paired_sums
from drafttrain.online.hotswap import Publisher
from drafttrain.online.trainer import DrafterTrainer
from drafttrain.spec import SpecStats


class DraftTracker:
    def __init__(self, cfg, policy, engines, drafter=None, accelerator=None, log=print):
        self.cfg, self.engines, self.log = cfg, list(engines), log
        self.drafter = drafter if drafter is not None else build_drafter(cfg.drafter, policy)
        n_layers = policy.config.num_hidden_layers
        # a self-drafter (selfquant) needs no hidden states and no training: it is requantized from the policy
        self.self_drafter = not self.drafter.aux_layer_ids
        if not self.self_drafter and max(self.drafter.aux_layer_ids) >= n_layers:
            raise ValueError(f"drafter.aux_layer_ids: {list(self.drafter.aux_layer_ids)} do not exist in the "
                             f"policy ({n_layers} layers)")
        self.frozen = copy.deepcopy(self.drafter).eval().requires_grad_(False)  # the step-0 drafter
        self._frozen_rt = None  # its runtime form, for measure()
        self._serving_rt = None  # (engine version, runtime form of the weights it serves), for online.publish_gate
        # features serve both training and k-step measurement
        self.steps = max(cfg.drafter.ttt_steps, max_draft_len(cfg.engine))
        self.buffer = FeatureBuffer(int(cfg.online.buffer_mb * 2 ** 20), seed=cfg.run.seed, name="online.buffer_mb",
                                    half_life=cfg.online.buffer_half_life)
        self.trainer = None if self.self_drafter else DrafterTrainer(self.drafter, cfg.train, cfg.drafter,
                                                                     accelerator, buffer=self.buffer)
        if self.trainer is not None and cfg.online.mode == "async" and self.trainer.acc.num_processes > 1:
            # a background update's collectives (DDP backward, reduces) would run beside the RL loop's on the same
            # process group, in no agreed order: a hang or a mismatched reduce
            raise ValueError(f"online.mode: async runs with one process only (got {self.trainer.acc.num_processes}"
                             "); use online.mode=sync under accelerate launch with several processes")
        # several processes: canary verdicts on what every process saw, alike everywhere
        pool = self._sum_over_processes if self.trainer is not None and self.trainer.acc.num_processes > 1 else None
        self.publisher = Publisher(self.engines, self.drafter.state_dict(), cfg.online, log, tag=0, pool=pool)
        self.pending: list[dict] = []  # features captured since the last on_policy_update
        self.latest: list[dict] = []  # the previous step's: the background update reads only these
        self._heldout: list[dict] = []  # the most recent held-out rows (records), the estimate's and the gate's
        self.probe_prompts: list[list[int]] = []
        self.policy_version = 0
        self._last_update_t: float | None = None  # RL time is measured from here: set by the first rollout or
        # capture (not construction: loading and engine set-up are not RL time), then after each update's work
        self._capture_s = 0.0  # time spent in the capture hooks since the last update (drafter work inside RL time)
        self._capture_last = 0.0  # that time, for the update now running
        self._measure_s = 0.0  # time measure() took since the last update: reporting, neither RL time nor training
        self.bank_s = 0.0  # sync mode: drafter time earned (budget_frac x RL time) minus drafter time spent
        # moving average of a drafter step's seconds per padded token (rows x longest record): a step's cost follows
        # its batch's lengths, which vary several-fold between the length-grouped batches (for the bank)
        self._tok_cost_s: float | None = None
        self._fixed_cost_s: float | None = None  # moving average of an update's estimate + publish (for the bank)
        self._thread: threading.Thread | None = None
        self._result: dict = {}
        self._error: BaseException | None = None  # what the background update raised, for wait() to raise
        self._lock = threading.Lock()  # guards the drafter and the buffer against a background update
        self._capture: tuple[HiddenCapture, list] | None = None  # start_capture's hooks, until stop_capture
        # which rows the estimate and measure() score: a random sample (the captured rows come in the loss's
        # micro-batch order, by advantage and length: the last ones are the longest with no gradient)
        self._gen = {"estimate": torch.Generator().manual_seed(cfg.run.seed + 11),
                     "measure": torch.Generator().manual_seed(cfg.run.seed + 12),
                     "holdout": torch.Generator().manual_seed(cfg.run.seed + 13)}

    @classmethod
    def from_recipe(cls, name_or_path, policy, engines, overrides=(), **kw) -> "DraftTracker":
        return cls(load_recipe(name_or_path, list(overrides)), policy, engines, **kw)

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def drafter_lag(self) -> int | None:
        """Policy updates since the drafter the engines serve was published (0: at the latest one; a rollback
        serves older weights). Not the difference of the two version counters: an update the time bank skipped
        would widen that for good, though the next publish brings the drafter up to date."""
        t = self.publisher.tags.get(self.version)
        return None if t is None else self.policy_version - t

    # ---- capture ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, policy, response_start=None, grad_only: bool = False):
        """Every policy forward inside the block feeds the buffer (start_capture ... stop_capture)."""
        cap = self.start_capture(policy, response_start, grad_only)
        try:
            yield cap
        finally:
            self.stop_capture()

    def start_capture(self, policy, response_start=None, grad_only: bool = False) -> HiddenCapture:
        """From now until stop_capture(), every policy forward feeds the buffer: aux states via layer pre-hooks,
        token ids and logits via a hook on the model itself.
        response_start: int or [B] (first response column per row); None = the first column whose `labels` is not
        -100 when the forward gets labels, else 0. grad_only: keep only forwards run with autograd on (the loss
        forward), not no-grad generation or scoring forwards of the same model (TRL). A forward that returns no
        logits (TRL's fused LM head) has them projected from the captured final hidden state (no extra backbone
        pass); with logits_to_keep=n only the last n positions can be targets."""
        if self._capture is not None:
            raise RuntimeError("start_capture: a capture is already running (call stop_capture first)")
        self._mark_rl_start()
        if self.self_drafter:
            return None  # nothing to capture
        cap = HiddenCapture(policy, self.drafter.aux_layer_ids)
        final: dict[str, torch.Tensor] = {}

        def on_backbone(module, args, output):
            final["h"] = (output[0] if isinstance(output, tuple) else output.last_hidden_state).detach()

        def on_forward(module, args, kwargs, output):
            if grad_only and not torch.is_grad_enabled():
                return
            t0 = time.perf_counter()
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if mask is None:
                mask = torch.ones_like(ids)
            logits = getattr(output, "logits", None)
            if logits is None:
                with torch.no_grad():
                    logits = policy.get_output_embeddings()(final["h"])  # [B, T, V]
            B, T = ids.shape
            logits = logits.detach()
            kept = logits.shape[1]  # logits_to_keep: the last `kept` positions
            if kept < T:
                logits = torch.cat([logits.new_zeros(B, T - kept, logits.shape[-1]), logits], 1)
            rs = _response_start(response_start, kwargs.get("labels"), B, T)
            if kept < T:
                rs = rs.clamp_min(T - kept + 1)  # a position's target needs its logits
            feats = build_features(ids.detach(), mask.detach(), cap.features(), logits, self.steps, rs)
            # rows held out of training: the update's estimate (the publish gate's and the canary's reference)
            # scores the new weights on rollouts they were not trained on
            feats["heldout"] = torch.rand(B, generator=self._gen["holdout"]) < self.cfg.online.holdout_frac
            with self._lock:
                self.buffer.add(feats, version=self.policy_version, skip=feats["heldout"])
            self.pending.append(feats)
            self._capture_s += time.perf_counter() - t0

        handles = [policy.register_forward_hook(on_forward, with_kwargs=True),
                   policy.model.register_forward_hook(on_backbone)]
        cap.__enter__()
        self._capture = (cap, handles)
        return cap

    def stop_capture(self) -> None:
        """Remove the hooks start_capture installed (a no-op when none are)."""
        if self._capture is None:
            return
        cap, handles = self._capture
        self._capture = None
        for h in handles:
            h.remove()
        cap.__exit__(None, None, None)

    def set_probe(self, prompts: list[list[int]]) -> None:
        """Recent prompts the canary generates from after each swap."""
        self.probe_prompts = [list(p) for p in prompts[: self.cfg.online.canary_prompts]]

    # ---- training + publishing ----------------------------------------------------------------------------
    def on_policy_update(self, policy=None, step: int | None = None, background: bool | None = None) -> dict:
        """The policy just changed: train the drafter on buffered features and publish v+1 to every engine."""
        self.wait()
        # several processes: the inline canary of the version published last is judged here, on every process's
        # rollouts at once (Publisher.settle; one process: judged as its first batch came, {} here)
        verdict = self.publisher.settle()
        out = self._on_policy_update(policy, step, background)
        if verdict:
            out["canary_mal"], out["rolled_back"] = verdict["canary_mal"], verdict["rolled_back"] or out.get(
                "rolled_back", False)
            out["drafter_version"] = self.version
        return out

    def _on_policy_update(self, policy, step, background) -> dict:
        self._result = {}  # until this update sets it: a failed update must not leave the last one's record
        self.latest, self.pending = self.pending, []
        self._capture_last, self._capture_s = self._capture_s, 0.0
        measured, self._measure_s = self._measure_s, 0.0
        self.policy_version = step + 1 if step is not None else self.policy_version + 1
        if self.self_drafter and self.cfg.online.track:
            return self._requantize(policy)
        if not self.cfg.online.track:
            return self._idle()
        self._keep_heldout()  # before any idle return: an update the bank skips still adds its step's rows
        # every go/no-go before a drafter step is agreed by all processes (_everywhere). This first one also lines
        # them up: the time waiting here for a slower process is RL time (its own collectives would wait as long),
        # so every process earns the same bank instead of charging the wait to its first drafter step
        if not self._everywhere(len(self.buffer) > 0):  # no update
            return self._idle()
        now = time.perf_counter()
        # the RL step's own time since the last update (its drafter work and measure() excluded) earns the budget
        rl_s = now - (self._last_update_t if self._last_update_t is not None else now) - self._capture_last - measured
        bg = self.cfg.online.mode == "async" if background is None else background
        if bg:
            self._thread = threading.Thread(target=self._background, daemon=True)
            self._thread.start()
            self._last_update_t = time.perf_counter()
            return {}
        out = self._update(rl_s)
        self._last_update_t = time.perf_counter()
        return out

    @contextlib.contextmanager
    def outside_rl_step(self):
        """Host work between RL steps that is not RL time (checkpoint saves, logging): the time inside earns the
        sync time bank nothing, so drafter work stays a share of the RL steps themselves."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._last_update_t is not None:
                self._last_update_t += time.perf_counter() - t

    def wait(self) -> dict:
        """The background update's result, once it is done; what it raised is raised here (its traceback kept)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result

    def _background(self) -> None:
        try:
            self._update(None)
        except BaseException as err:  # a thread's exception reaches no caller: wait() raises it in the RL loop
            self._error = err

    def _update(self, rl_s: float | None) -> dict:
        """Train up to online.steps_per_update steps, then publish. Sync mode (rl_s = the RL step's own time):
        within time_budget_s and the time bank (budget_frac, see the module doc). A step is predicted as its batch's
        padded tokens x a moving average of seconds per token (batches of long rollouts cost several times those of
        short ones), with a margin. Each step trains on as many records of its length-grouped batch as the bank
        still covers after the update's fixed work (acceptance estimate, publish: a moving average of what it
        took); the update ends when not one record fits. So the bank does not go into debt beyond the error of
        those predictions, and a long batch is cut to what is paid for rather than skipped (the first update, with
        nothing measured yet, takes one whole batch)."""
        oc, t0 = self.cfg.online, time.perf_counter()
        bank = oc.budget_frac > 0 and rl_s is not None
        fixed = BANK_MARGIN * (self._fixed_cost_s or 0.0)  # predictions with a margin: the bank pays what they miss
        groups: list[list[dict]] = []

        def refill(left: int) -> None:  # length-grouped batches (less padding), collated only when used
            if not groups and left > 0:
                with self._lock:
                    groups.extend(self.buffer.sample_groups(self.cfg.train.batch_size, left))

        refill(oc.steps_per_update)

        def fit(group: list[dict], budget: float | None) -> list[dict] | None:
            """The most records of `group` (ascending lengths: a prefix) whose predicted step fits `budget`
            (None: all); None if not even one does. Nothing measured yet: the whole group."""
            if budget is None or self._tok_cost_s is None:
                return group
            per_row = BANK_MARGIN * self._tok_cost_s
            n = 0
            while n < len(group) and per_row * (n + 1) * group[n]["aux"].shape[0] <= budget:
                n += 1
            return group[:n] if n else None

        def budget(spent: float) -> float | None:  # what the next step may cost (sync mode)
            if rl_s is None:
                return None
            left = oc.time_budget_s - spent
            return min(left, self.bank_s - spent - fixed) if bank else left

        if bank:
            self.bank_s = min(self.bank_s + oc.budget_frac * rl_s, oc.time_budget_s) - self._capture_last
            if not self._everywhere(self.bank_s > 0 and fit(groups[-1], budget(0.0)) is not None):
                return self._idle()
        losses, skipped = [], 0
        unmeasured = self._tok_cost_s is None or self._fixed_cost_s is None  # the bank's first update: one batch
        while True:
            go = groups and len(losses) < oc.steps_per_update and not (unmeasured and bank and losses)
            group = fit(groups.pop(), budget(time.perf_counter() - t0)) if go else None  # None: not one record fits
            if not self._everywhere(group is not None):  # every process takes this step, or none does
                break
            ts = time.perf_counter()
            with self._lock:  # per step, so captures and measurements wait at most one drafter step
                out = self.trainer.step(collate(group, self.buffer.steps))
            dt = time.perf_counter() - ts
            per_tok = dt / _padded_tokens(group)
            self._tok_cost_s = per_tok if self._tok_cost_s is None else 0.8 * self._tok_cost_s + 0.2 * per_tok
            skipped += out["nonfinite"]
            losses.append(out["loss"])
            refill(oc.steps_per_update - len(losses))
        if not losses:  # not one record fit what the bank had left by then: nothing to estimate or publish
            if bank:
                self.bank_s -= time.perf_counter() - t0
            return self._idle()
        t_fixed = time.perf_counter()
        with self._lock:
            weights = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
            est = serving = new_rt = None  # teacher_forced_acceptance here, then the MAL pooled over the processes
            rows = self._estimate_rows()
            if rows is not None:
                k = max_draft_len(self.cfg.engine)
                new_rt = self._runtime_form(self.drafter)
                est = teacher_forced_acceptance(new_rt, rows, k)
                if oc.publish_gate and skipped < len(losses):
                    serving = self._serving_scores(rows, k)
        # every process gates (and publishes or resets) alike: a decision on its own rows alone would leave the
        # processes' drafters different (one published the trained weights, another reset to the serving ones)
        gate = None
        if oc.publish_gate and skipped < len(losses):  # agreed by every process: the sums are a collective
            sums = paired_sums(est["row_mal"], serving["row_mal"]) if serving is not None else [0.0, 0.0, 0.0]
            gate = gate_decision(*self._sum_over_processes(sums), oc.gate_confidence, oc.gate_margin,
                                 oc.gate_min_rows)
        est, serving = self._pooled_mal(est, serving)
        train_s = time.perf_counter() - t0
        params = sampling_params(self.cfg, max_new_tokens=oc.canary_max_new_tokens)
        probe = self.probe_prompts if oc.canary == "probe" else None
        t1 = time.perf_counter()
        # not shown better on the rows (a NaN estimate goes on to the publisher's check)
        gated = gate is not None and not gate["publish"] and est == est
        if skipped == len(losses):  # every step was skipped: the weights did not change, nothing new to publish
            self.log(f"[drafttrain] NOT PUBLISHED: all {skipped} drafter steps had a NaN/inf loss or gradient; "
                     f"engines keep v{self.version}")
            pub = {"published": False}
        elif gated:  # not shown better than what the engines serve: not published. Shown worse: train on from the
            if gate["worse"]:  # serving weights; undecided: from these, whose gain may clear the bound later
                with self._lock:
                    self.drafter.load_state_dict(self._serving_weights())
            pub = {"published": False}
        else:
            pub = self.publisher.publish(weights, est, probe, params, tag=self.policy_version)
            if new_rt is not None and pub["published"] and not pub.get("rolled_back"):
                self._serving_rt = (pub["version"], new_rt)  # the gate's next reference: these very weights
        if pub.get("reason", "").startswith("nonfinite"):  # diverged: train on from the last good weights
            with self._lock:
                self.trainer.restore(self.publisher.good_weights)
        self._result = {"drafter_train_s": train_s, "publish_s": time.perf_counter() - t1,
                        "drafter_loss": sum(losses) / max(len(losses), 1),
                        "drafter_steps": len(losses), "drafter_skipped_nonfinite": skipped,
                        "swap_s": pub.get("swap_s"), "canary_mal": pub.get("canary_mal"),
                        "expected_mal": est, "serving_mal": serving, "gated": gated, **_gate_keys(gate),
                        "rolled_back": pub.get("rolled_back", False),
                        "published": pub["published"], "drafter_version": self.version,
                        "capture_s": self._capture_last}
        t_end = time.perf_counter()
        f = t_end - t_fixed
        self._fixed_cost_s = f if self._fixed_cost_s is None else 0.8 * self._fixed_cost_s + 0.2 * f
        if bank:
            self.bank_s -= t_end - t0
        self._result["budget_bank_s"] = self.bank_s if bank else None
        return self._result

    def _keep_heldout(self) -> None:
        """The latest step's rows held out of training join the estimate's rows: the most recent, over the last
        steps, up to online.estimate_rows (a random sample of one step's where it holds more)."""
        n = self.cfg.online.estimate_rows
        new = _records(self.latest, self.steps, heldout_only=True)
        new = _sample(new, n, self._gen["estimate"])
        self._heldout = ([{k: v.clone() if torch.is_tensor(v) else v for k, v in r.items()} for r in new]
                         + self._heldout)[:n]

    def _estimate_rows(self) -> dict | None:
        """The rows the update's estimate and the publish gate score: the held-out ones (_keep_heldout); with none
        held out (online.holdout_frac=0), a sample of the latest step's rows, which the update trained on. None: no
        rows at all."""
        if self._heldout:
            return collate(self._heldout, self.steps)
        return _rows(self.latest, self.steps, self.cfg.online.estimate_rows, self._gen["estimate"]) \
            if self.latest else None

    def _serving_scores(self, rows: dict, k: int) -> dict:
        """teacher_forced_acceptance of the serving drafter on the estimate's rows. A held-out row is scored once per
        serving version (kept with the row: rows stay for a few steps, the serving drafter changes only at a publish
        or a rollback), by measure() when it ran (reporting, which scores the served drafter anyway), so the gate
        pays for the update's scoring and at most the new rows', not twice every row."""
        if not self._heldout:  # the latest step's rows: no cache
            return teacher_forced_acceptance(self._serving_form(), rows, k)
        todo = [r for r in self._heldout if r.get("served", (None,))[0] != self.version]
        if todo:
            out = teacher_forced_acceptance(self._serving_form(), collate(todo, self.steps), k)
            for r, m, n in zip(todo, out["row_mal"].tolist(), out["row_steps"].tolist()):
                r["served"] = (self.version, m, n)
        mal = torch.tensor([r["served"][1] for r in self._heldout], dtype=torch.float64)  # [n]
        steps = torch.tensor([r["served"][2] for r in self._heldout], dtype=torch.float64)
        ok = steps > 0
        st = SpecStats(verify_rows=float(steps[ok].sum()), emitted=float((mal[ok] * steps[ok]).sum()))
        return {"mal": st.mean_accepted_length if st.verify_rows else 1.0, "stats": st, "row_mal": mal}

    def _pooled_mal(self, *scores) -> list[float | None]:
        """The MAL of each teacher_forced_acceptance result (None: not scored here) pooled over every process's
        rows (weighted by verify rows: emitted / verify rows, as it pools chunks; 1.0 with none), None where no
        process scored; one process: its own. A NaN anywhere is NaN everywhere: the publisher's check decides alike."""
        if self.trainer.acc.num_processes == 1:
            return [None if s is None else s["mal"] for s in scores]
        x = []  # per result: (scored here, MAL x verify rows, verify rows)
        for s in scores:
            x += [0.0, 0.0, 0.0] if s is None else [1.0, s["mal"] * s["stats"].verify_rows, s["stats"].verify_rows]
        x = self._sum_over_processes(x)
        return [None if n == 0 else w / rows if rows else 1.0 for n, w, rows in zip(x[0::3], x[1::3], x[2::3])]

    def _everywhere(self, ok: bool) -> bool:
        """`ok` on every process (one process: `ok`). A drafter step is a collective (DDP backward, the trainer's
        reduce), so each decision to take one is agreed: processes decide on their own clocks, banks and buffers,
        and one that stepped alone would hang or break the others."""
        return self._sum_over_processes([float(not ok)])[0] == 0  # no process said no

    def _sum_over_processes(self, values: list[float]) -> list[float]:
        """Elementwise sum of `values` over every process, through the trainer's accelerator (a collective: every
        process calls it at the same point); one process: `values`."""
        acc = self.trainer.acc
        if acc.num_processes == 1:
            return list(values)
        return acc.reduce(torch.tensor(values, dtype=torch.float64, device=acc.device), "sum").cpu().tolist()

    def _idle(self) -> dict:
        """No update (frozen, nothing captured, or the time bank in debt): the same keys (report.py's rule)."""
        self._result = {"drafter_train_s": 0.0, "publish_s": 0.0, "drafter_loss": None, "drafter_steps": 0,
                        "drafter_skipped_nonfinite": 0, "swap_s": None, "canary_mal": None, "expected_mal": None,
                        "serving_mal": None, "gated": False, **_gate_keys(None),
                        "rolled_back": False, "published": False, "drafter_version": self.version,
                        "capture_s": self._capture_last,
                        "budget_bank_s": self.bank_s if self.cfg.online.budget_frac > 0 else None}
        return self._result

    def observe_rollout(self, batch) -> dict:
        """Hand a rollout batch of one of the engines to the inline canary (online.canary=inline): the first batch
        the newly published version generated decides keep or roll back. {} while nothing is decided."""
        return self.publisher.observe(batch)

    def generate(self, engine, prompts, params, speculative: bool = True):
        """engine.generate, with the inline canary watching: if it fails while a newly published drafter is on
        probation, roll back to the last good drafter and generate again. Returns (batch, canary verdict)."""
        self._mark_rl_start()
        try:
            batch = engine.generate(prompts, params, speculative=speculative)
        except (RuntimeError, ValueError) as err:  # e.g. NaN draft probabilities from broken weights
            verdict = self.publisher.fail(err)
            if not verdict:
                raise
            if verdict.get("deferred"):  # several processes: rolled back at the next update, everywhere alike;
                return engine.generate(prompts, params, speculative=False), {}  # this batch decodes without it
            return engine.generate(prompts, params, speculative=speculative), verdict
        return batch, self.observe_rollout(batch)

    def _mark_rl_start(self) -> None:
        if self._last_update_t is None:
            self._last_update_t = time.perf_counter()

    def _requantize(self, policy) -> dict:
        """Self-drafter: every engine requantizes the new policy weights into its standby drafter and swaps."""
        t0 = time.perf_counter()
        pub = self.publisher.publish({k: v.detach() for k, v in policy.state_dict().items()},
                                     tag=self.policy_version)
        self._result = {"drafter_train_s": 0.0, "publish_s": time.perf_counter() - t0, "drafter_loss": None,
                        "drafter_steps": 0, "drafter_skipped_nonfinite": 0, "swap_s": pub.get("swap_s"),
                        "canary_mal": None, "expected_mal": None, "serving_mal": None, "gated": False,
                        **_gate_keys(None), "rolled_back": False,
                        "published": pub["published"], "drafter_version": self.version, "capture_s": 0.0}
        return self._result

    # ---- measurement --------------------------------------------------------------------------------------
    def measure(self, k: int | None = None) -> dict:
        """Teacher-forced acceptance of the live (served) and the frozen step-0 drafter on the rollouts captured since
        the last on_policy_update (call it before on_policy_update: live is then the drafter that generated them).
        Its time (measure_s) is reporting: the time bank counts it neither as RL time nor as drafter work.
        Both are scored in the torch engine's runtime form (_runtime_form), as is the trainer's estimate."""
        if self.self_drafter:  # no teacher-forced scoring for a self-drafter; the same keys all the same
            return {"live_tf_mal": None, "live_tf_acc_pos": None, "frozen_tf_mal": None, "frozen_tf_acc_pos": None,
                    "policy_minus_drafter_version": self.drafter_lag, "measure_s": 0.0}
        if not self.pending:
            return {}
        t0 = time.perf_counter()
        gate_k = max_draft_len(self.cfg.engine)
        k = k or gate_k
        # the rows held out of training first (a random share of the step's: the sample stays content-blind), then
        # a random sample of the rest: the served drafter's scores of held-out rows are the publish gate's too
        every, m = _records(self.pending, self.steps, where=True), self.cfg.online.measure_rows
        held = [bool(self.pending[r["where"][0]]["heldout"][r["where"][1]]) for r in every]
        recs = [r for r, h in zip(every, held) if h][:m]
        rest = [r for r, h in zip(every, held) if not h]
        recs += _sample(rest, m - len(recs), self._gen["measure"])
        batch = collate(recs, self.steps)
        with self._lock:  # what the engines serve: the trainer's weights may be an update the gate holds back
            live_rt = self._serving_form()
        if self._frozen_rt is None:
            self._frozen_rt = self._runtime_form(self.frozen)
        live = teacher_forced_acceptance(live_rt, batch, k)
        frozen = teacher_forced_acceptance(self._frozen_rt, batch, k)
        if k == gate_k:  # kept with the held-out rows' features, for _keep_heldout
            for r, mal, n in zip(recs, live["row_mal"].tolist(), live["row_steps"].tolist()):
                f, b = self.pending[r["where"][0]], r["where"][1]
                if bool(f["heldout"][b]):
                    f.setdefault("served", {})[b] = (self.version, mal, n)
        dt = time.perf_counter() - t0
        self._measure_s += dt
        return {"live_tf_mal": live["mal"], "live_tf_acc_pos": live["acceptance_per_position"],
                "frozen_tf_mal": frozen["mal"], "frozen_tf_acc_pos": frozen["acceptance_per_position"],
                "policy_minus_drafter_version": self.drafter_lag, "measure_s": dt}

    def _serving_weights(self) -> dict:
        """The weights the engines serve now: the version on probation (inline canary), else the last good one."""
        p = self.publisher.pending
        return p["weights"] if p is not None and p["version"] == self.version else self.publisher.good_weights

    def _serving_form(self):
        """_runtime_form of the serving weights, cached per engine version (publish_gate scores it every update)."""
        if self._serving_rt is None or self._serving_rt[0] != self.version:
            d = copy.deepcopy(self.frozen)
            d.load_state_dict(self._serving_weights())
            self._serving_rt = (self.version, self._runtime_form(d, owned=True))
        return self._serving_rt[1]

    def _runtime_form(self, drafter, owned: bool = False):
        """`drafter` as the torch engine runs it (runtime_copy; int8 linears if engine.drafter_int8): the drafter
        teacher-forced scoring should score (int8 changes acceptance a little), and 1.7x cheaper to score in int8.
        vLLM runs the fp32 head: fp32 there."""
        int8 = self.cfg.engine.kind == "torch" and bool(self.cfg.engine.drafter_int8)
        return runtime_copy(drafter, int8, owned)

    # ---- checkpointing ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.wait()
        return {"frozen": self.frozen.state_dict(), "version": self.publisher.version,
                "good_weights": self.publisher.good_weights, "good_version": self.publisher.good_version,
                "version_tags": dict(self.publisher.tags),
                "policy_version": self.policy_version, "bank_s": self.bank_s,
                # the bank's cost predictions: a resumed run that forgot them would overspend its first update
                "tok_cost_s": self._tok_cost_s, "fixed_cost_s": self._fixed_cost_s,
                "row_gens": {k: g.get_state() for k, g in self._gen.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.frozen.load_state_dict(state["frozen"])
        self._frozen_rt = None
        self.policy_version = state["policy_version"]
        self.bank_s = state.get("bank_s", 0.0)
        self._tok_cost_s, self._fixed_cost_s = state.get("tok_cost_s"), state.get("fixed_cost_s")
        for k, g in state.get("row_gens", {}).items():
            self._gen[k].set_state(g)
        self.publisher.good_weights, self.publisher.good_version = state["good_weights"], state["good_version"]
        self.publisher.tags.update(state.get("version_tags", {}))
        if state["version"] > 0:  # engines serve the last good weights; the drafter may hold newer, rejected ones
            back = max(state["version"], self.publisher.version + 1)
            self.publisher._load_all({k: v.detach().clone() for k, v in state["good_weights"].items()}, back)
            self.publisher.tags[back] = self.publisher.tags.get(state["good_version"])


def _response_start(given, labels, B: int, T: int) -> torch.Tensor:
    """[B] first response column: as given, else the first column whose label is not -100 (T if none), else 0."""
    if given is not None:
        return torch.as_tensor(given, dtype=torch.long).flatten()[:B].expand(B)
    if labels is None:
        return torch.zeros(B, dtype=torch.long)
    scored = labels != -100  # [B, T]
    return torch.where(scored.any(1), scored.long().argmax(1), torch.full((B,), T)).long()


# the bank's predicted costs (next step, estimate + publish) x this: their errors (timing noise, a publish that
# takes longer) come out of the margin, not out of the RL step (measured without it: 5.1-5.4% at budget_frac 0.05)
BANK_MARGIN = 1.25


def _padded_tokens(group: list[dict]) -> int:
    """Positions a collated batch of these records computes: rows x the longest record."""
    return len(group) * max(r["aux"].shape[0] for r in group)


def _gate_keys(gate: dict | None) -> dict:
    """The publish gate's record keys (None where it did not decide): rows paired, mean per-row MAL difference
    (update - serving) and its lower confidence bound."""
    if gate is None:
        return {"gate_rows": None, "gate_mean_diff": None, "gate_lower": None}
    lower = gate["lower"] if gate["lower"] > -float("inf") else None  # JSON has no -inf
    return {"gate_rows": gate["n"], "gate_mean_diff": gate["mean"] if gate["n"] else None, "gate_lower": lower}


def _records(features: list[dict], steps: int, heldout_only: bool = False, where: bool = False) -> list[dict]:
    """Every sequence of several build_features batches as a record (collate's input), heldout_only: of the rows
    held out of training. A row the served drafter was scored on (measure) carries that score ("served");
    where: each record also says which (batch, row) it is."""
    recs = []
    for i, f in enumerate(features):
        for b in range(f["aux"].shape[0]):
            if heldout_only and not bool(f["heldout"][b]):
                continue
            n = int(f["lengths"][b])
            recs.append({"aux": f["aux"][b, :n], "next_ids": f["next_ids"][b, :n + steps - 1],
                         "target_probs": f["target_probs"][b, :n + steps], "valid": f["valid"][b, :n + steps]})
            if b in f.get("served", {}):
                recs[-1]["served"] = f["served"][b]
            if where:
                recs[-1]["where"] = (i, b)
    return recs


def _rows(features: list[dict], steps: int, max_rows: int, gen: torch.Generator) -> dict:
    """max_rows sequences drawn at random (all if fewer) from several build_features batches, in one padded batch."""
    return collate(_sample(_records(features, steps), max_rows, gen), steps)


def _sample(recs: list, n: int, gen: torch.Generator) -> list:
    """n of recs drawn at random, in their order (all if there are no more than n)."""
    if len(recs) <= n:
        return recs
    return [recs[i] for i in sorted(torch.randperm(len(recs), generator=gen)[:n].tolist())]
