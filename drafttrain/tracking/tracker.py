"""DraftTracker: what any RL loop calls to keep its rollout engines' drafter fresh.

    tracker = DraftTracker.from_recipe("eagle3_track", policy=policy, engines=[engine])
    with tracker.capture(policy, response_start=prompt_lens):   # hidden states of the loss forward: no extra pass
        loss = rl_loss(policy(ids, attention_mask=mask))
    tracker.on_policy_update(policy, step)                      # train the drafter, publish v+1 to every engine
    tracker.measure(k)                                          # live vs frozen step-0 drafter, teacher-forced
    tracker.start_capture(policy, grad_only=True) ... tracker.stop_capture()   # the same, for callback APIs (TRL)

Orchestration only: capture (capture.py), the time bank (bank.py), scoring (scoring.py), the publish gate (gate.py),
publishing with a canary (hotswap.py), per auto member (gate.py), agreement across processes (collective.py).
online.mode=sync trains between RL steps within the time bank; async in a background thread (wait() returns its
record and raises what it raised). online.track=false keeps the drafter frozen but still captures for measurement.
A non-finite or diverged update is not published (training goes back to the last good weights).
"""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from drafttrain.config import load_recipe, max_draft_len, sampling_params
from drafttrain.device import module_device, synchronize
from drafttrain.drafters import build_drafter
from drafttrain.drafters.targets import TargetHead
from drafttrain.tracking.bank import TimeBank, buy_steps
from drafttrain.tracking.buffer import FeatureBuffer, collate
from drafttrain.tracking.capture import PolicyCapture, choose_rows
from drafttrain.tracking.collective import Collective
from drafttrain.tracking.gate import ALL, gate_members, members_of, merged
from drafttrain.tracking.hotswap import Publisher, probation
from drafttrain.tracking.record import UpdateRecord
from drafttrain.tracking.scoring import Scorer
from drafttrain.tracking.trainer import DrafterTrainer
from drafttrain.tracking.weightsets import stored, whole


class DraftTracker:
    def __init__(self, cfg, policy, engines, drafter=None, accelerator=None, log=print):
        self.cfg, self.engines, self.log = cfg, list(engines), log
        self.device = module_device(policy)  # the run's device: the drafter, its trainer and scoring live there
        self.drafter = (drafter if drafter is not None else build_drafter(cfg.drafter, policy)).to(self.device)
        n_layers, aux = policy.config.num_hidden_layers, self.drafter.reads.aux_layers
        # only a drafter that trains needs features; a self-drafter (selfquant) is rebuilt from the policy
        self.self_drafter, self.learns = bool(self.drafter.follows_policy), bool(self.drafter.trains)
        # AR rollouts and a drafter never trained: nothing drafts, nothing to capture or score (AR pays no drafter work)
        self.unused = not cfg.engine.speculative and not cfg.online.track
        if not self.self_drafter and aux and max(aux) >= n_layers:
            raise ValueError(f"drafter.eagle3.aux_layer_ids: {list(aux)} are not among the policy's {n_layers} layers")
        # features serve both training and k-step measurement
        self.steps = max(cfg.drafter.ttt_steps, max_draft_len(cfg.engine))
        self.max_len = cfg.train.max_len  # a drafter step trains on windows of at most this many positions
        self.buffer = FeatureBuffer.of(cfg.online, cfg.run.seed, self.device)
        self.trainer = None if not self.learns else DrafterTrainer(self.drafter, cfg.train, cfg.drafter,
                                                                     accelerator, buffer=self.buffer)
        self.collective = Collective(self.trainer.acc if self.trainer is not None else None)
        if self.trainer is not None and cfg.online.mode == "async" and self.collective.n > 1:
            # a background update's collectives (DDP backward, reduces) would run beside the RL loop's on the same
            # process group, in no agreed order: a hang or a mismatched reduce
            raise ValueError(f"online.mode: async runs with one process only (got {self.collective.n}"
                             "); use online.mode=sync under accelerate launch with several processes")
        # several processes: canary verdicts on what every process saw, alike everywhere
        pool = self.collective.sum if self.collective.n > 1 else None
        [e.bind(policy, self.drafter) for e in self.engines if hasattr(e, "bind")]  # servers' handles: vllm_server.py
        self.publisher = Publisher(self.engines, self.drafter.state_dict(), cfg.online, log, tag=0, pool=pool)
        self.bank = TimeBank(cfg.online.budget_frac, cfg.online.time_budget_s, self.max_len)
        self._gen = {name: torch.Generator(device="cpu").manual_seed(cfg.run.seed + 11 + i)  # row draws, resumable
                     for i, name in enumerate(("estimate", "measure", "holdout", "capture"))}
        self.scorer = Scorer(cfg.online, cfg.engine, self.drafter, self.publisher, self.steps, self._gen)
        self.probe_prompts, self.probe_stop = [], ()  # set_probe: recent prompts, the rollouts' stop tokens
        self.policy, self.policy_version = policy, 0
        # the LM head the targets are recomputed with (drafters/targets.py): taken here and after each update, so it
        # is the head of the policy the next capture runs (a resumed run takes the same one)
        self.head = TargetHead.of(policy, 0) if self.learns and not self.unused else None
        self._last_update_t: float | None = None  # RL time is measured from here: set by the first rollout or
        # capture (not construction: loading and engine set-up are not RL time), then after each update's work
        self._capture_s = 0.0  # time spent capturing since the last update (drafter work inside RL time)
        self._capture_last = 0.0  # that time, for the update now running
        self._measure_s = 0.0  # time measure() took since the last update: reporting, neither RL time nor training
        self._thread, self._result = None, {}  # the background update's thread (online.mode=async); the last record
        self._error: BaseException | None = None  # what the background update raised, for wait() to raise
        self._lock = threading.Lock()  # guards the drafter and the buffer against a background update
        self._capture: PolicyCapture | None = None  # start_capture's, until stop_capture

    @classmethod
    def from_recipe(cls, name_or_path, policy, engines, overrides=(), **kw) -> "DraftTracker":
        return cls(load_recipe(name_or_path, list(overrides)), policy, engines, **kw)

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def frozen(self):
        return self.scorer.frozen

    @property
    def drafter_lag(self) -> int | None:
        """Policy updates since the serving drafter was published (not the difference of the version counters:
        an update the time bank skipped would widen that for good)."""
        t = self.publisher.tags.get(self.version)
        return None if t is None else self.policy_version - t

    def _now(self) -> float:  # the bank's and the records' clock: after the device's queued work
        synchronize(self.device)
        return time.perf_counter()

    # ---- capture ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self, policy, response_start=None, grad_only: bool = False, extra: bool = False):
        """Every policy forward inside the block feeds the buffer (start_capture ... stop_capture). extra: the
        forward inside runs only because the tracker reads its rows (the RL update does not need them): its time is
        not RL time. It is drafter work (paid from the bank, as the capture copies are) where the drafter trains on
        such rows (online.capture_rows=all), else reporting (measure(): neither earns nor spends the bank)."""
        t0, before = self._now(), self._capture_s
        cap = self.start_capture(policy, response_start, grad_only)
        try:
            yield cap
        finally:
            self.stop_capture()
            if extra and cap is not None:  # the forward around the capture's own copies (counted in _keep)
                forward, oc = (self._now() - t0) - (self._capture_s - before), self.cfg.online
                if oc.track and not self.self_drafter and oc.capture_rows == "all":  # the drafter trains on them
                    self._capture_s += forward
                else:
                    self._measure_s += forward

    def start_capture(self, policy, response_start=None, grad_only: bool = False) -> PolicyCapture | None:
        """From now until stop_capture(), every policy forward feeds the buffer (PolicyCapture says how)."""
        if self._capture is not None:
            raise RuntimeError("start_capture: a capture is already running (call stop_capture first)")
        self._mark_rl_start()
        if not self.learns or self.unused:
            return None  # nothing to capture
        self._capture = PolicyCapture(policy, self.drafter.reads, self.steps, self._keep, self._now,
                                      response_start, grad_only, rows=self._rows).start()
        return self._capture

    def _rows(self, B: int) -> torch.Tensor | None:  # the rows of a captured forward to keep (choose_rows)
        idx, self._held = choose_rows(B, self.cfg.online.holdout_frac, self.cfg.online.capture_frac,
                                      self._gen["holdout"], self._gen["capture"])
        return idx

    def _keep(self, feats: dict, started: float) -> None:
        """A captured forward's kept rows (_rows) into the buffer, the held-out ones flagged (never trained on)."""
        with self._lock:
            self.buffer.add(feats, version=self.policy_version, heldout=self._held)
        self._capture_s += self._now() - started

    def stop_capture(self) -> None:  # remove the hooks start_capture installed (a no-op when none are)
        cap, self._capture = self._capture, None
        if cap is not None:
            cap.stop()

    def set_probe(self, prompts: list[list[int]], stop_token_ids) -> None:  # the probe canary's recent prompts
        self.probe_prompts = [list(p) for p in prompts[: self.cfg.online.canary_prompts]]
        self.probe_stop = tuple(stop_token_ids)  # the rollouts': a probe without them drafted past the text's end

    # ---- training + publishing ----------------------------------------------------------------------------
    def on_policy_update(self, policy=None, step: int | None = None, background: bool | None = None) -> dict:
        """The policy just changed: train the drafter on buffered features and publish v+1 to every engine."""
        self.wait()
        # the canary of the version published last, where it is judged here: several processes' pooled rollouts,
        # or the counters of servers (one process, own engines: judged as its first batch came, {} here)
        verdict = self.publisher.settle()
        for line in self.buffer.notes(self.policy_version, step):  # what the buffer could not keep of this step
            self.log(f"[drafttrain] {line}")
        out = self._on_policy_update(policy, step, background)
        if self.head is not None:  # the next capture's policy (a background update keeps the head it started with)
            self.head = TargetHead.of(policy if policy is not None else self.policy, self.policy_version, self.head)
        if verdict:
            rolled = verdict["rolled_back"] or out.get("rolled_back", False)
            out.update(canary_mal=verdict["canary_mal"], rolled_back=rolled, drafter_version=self.version)
        return out

    def _on_policy_update(self, policy, step, background) -> dict:
        self._result = {}  # until this update sets it: a failed update must not leave the last one's record
        self._capture_last, self._capture_s = self._capture_s, 0.0
        measured, self._measure_s = self._measure_s, 0.0
        self._trained_version = self.policy_version  # the version whose rows this update's estimate reads
        self.policy_version = step + 1 if step is not None else self.policy_version + 1
        if self.self_drafter and self.cfg.online.track:
            return self._requantize(policy)
        if not self.cfg.online.track or not self.learns:
            return self._idle()
        self.scorer.keep_heldout(self.buffer, self._trained_version)  # before any idle return: a skipped update too
        # every go/no-go before a drafter step is agreed by all processes. This first one also lines them up: the
        # wait here for a slower process is RL time, so every process earns the same bank
        if not self.collective.everywhere(self.buffer.trainable() > 0):  # no update
            return self._idle()
        now = self._now()
        # the RL step's own time since the last update (its drafter work and measure() excluded) earns the budget
        rl_s = now - (self._last_update_t if self._last_update_t is not None else now) - self._capture_last - measured
        bg = self.cfg.online.mode == "async" if background is None else background
        if bg:
            self._thread = threading.Thread(target=self._background, args=(self.head,), daemon=True)
            self._thread.start()
            self._last_update_t = self._now()
            return {}
        out = self._update(rl_s, self.head)
        self._last_update_t = self._now()
        return out

    @contextlib.contextmanager
    def outside_rl_step(self):
        """Host work between RL steps that is not RL time (checkpoint saves, logging): it earns the bank nothing."""
        t = self._now()
        try:
            yield
        finally:
            if self._last_update_t is not None:
                self._last_update_t += self._now() - t

    def wait(self) -> dict:
        """The background update's result, once it is done; what it raised is raised here (its traceback kept)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result

    def _background(self, head) -> None:
        try:
            self._update(None, head)
        except BaseException as err:  # a thread's exception reaches no caller: wait() raises it in the RL loop
            self._error = err

    def _train(self, rl_s: float | None, t0: float, head) -> tuple[list[float], int] | None:
        """The drafter steps the bank buys (bank.buy_steps): (losses, non-finite steps); None: the bank could not pay
        for one (a run of those is said in one line)."""
        bank = self.bank

        def draw(n: int) -> list[list[dict]]:
            with self._lock:
                return self.buffer.sample_groups(self.cfg.train.batch_size, n, self.max_len)

        def step(group: list[dict]) -> dict:
            with self._lock:  # per step, so captures and measurements wait at most one drafter step
                return self.trainer.step(collate(group, self.buffer.steps, self.max_len, self.buffer.gen), head)

        if bank.on and rl_s is not None:
            bank.earn(rl_s, self._capture_last)
        trained, drawn = buy_steps(bank, self.cfg.online, rl_s, t0, draw, step, self.collective.everywhere,
                                   self._now)
        if bank.on and rl_s is not None:
            note = bank.fed(bool(trained and trained[0]), bank.one_record_s(drawn))
            if note:
                self.log(note)
        return trained

    def _update(self, rl_s: float | None, head) -> dict:
        """Train (_train), estimate the new weights' acceptance, gate, publish; the record of it all."""
        oc, t0, bank = self.cfg.online, self._now(), self.bank
        banked = bank.on and rl_s is not None
        trained = self._train(rl_s, t0, head)
        if not trained or not trained[0]:  # the bank is empty, or not one record fit what it had left
            if banked and trained:
                bank.spend(self._now() - t0)
            return self._idle()
        losses, skipped = trained
        t_fixed = self._now()
        gating = oc.publish_gate and skipped < len(losses)
        members = members_of(self.drafter)  # gated and canaried each on its own (tracking/gate.py)
        with self._lock:
            weights = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
            ests = servs = new_rt = None  # scored here, then the MAL pooled over the processes
            recs = self.scorer.estimate_records(self.buffer, self._trained_version)
            if recs:
                ests, new_rt = self.scorer.estimate(self.drafter, collate(recs, self.steps), head, members)
                servs = {m: self.scorer.serving_scores(recs, head, m) for m in members} if gating else None
        # every process decides alike (the sums are a collective): its own rows alone would part the drafters
        gates = gate_members(self.collective.sum, ests, servs, members, oc) if gating else None
        pooled = self.collective.pooled_mal(*[None if ests is None else ests[m] for m in members],
                                            None if servs is None else servs[members[0]])
        expected, est, serving = dict(zip(members, pooled)), pooled[0], pooled[-1]
        rec = UpdateRecord(self.version, self._capture_last, drafter_train_s=self._now() - t0,
                           drafter_loss=sum(losses) / len(losses), drafter_steps=len(losses),
                           drafter_skipped_nonfinite=skipped, expected_mal=est, serving_mal=serving)
        rec.set_gate(gates and gates[members[0]], gates if members != [ALL] else None, expected)
        t1 = self._now()
        passed = [m for m in members if gates is None or gates[m]["publish"]]
        worse = [m for m in members if gates is not None and gates[m]["worse"]]
        # not shown better on the rows (a NaN estimate goes on to the publisher's check)
        rec.gated = not passed and all(e == e for e in expected.values())
        pub = {"published": False}
        if skipped == len(losses):  # every step was skipped: the weights did not change, nothing new to publish
            self.log(f"[drafttrain] NOT PUBLISHED: all {skipped} drafter steps had a NaN/inf loss or gradient; "
                     f"engines keep v{self.version}")
        elif worse:  # shown worse: train on from the serving weights; undecided: from these
            with self._lock:
                self.trainer.set_weights(merged(weights, self.scorer.serving_weights(), worse))
        if skipped < len(losses) and not rec.gated:
            params = sampling_params(self.cfg.sampling, max_new_tokens=oc.canary_max_new_tokens,
                                     stop_token_ids=self.probe_stop)
            probe = self.probe_prompts if oc.canary == "probe" else None
            out = weights if passed == members else merged(self.scorer.serving_weights(), weights, passed)
            per = probation(self.collective.sum, ests, expected, passed, self.scorer.k)  # what each canary expects
            pub = self.publisher.publish(out, est, probe, params, tag=self.policy_version, members=per)
            if new_rt is not None and pub["published"] and not pub.get("rolled_back") and passed == members:
                self.scorer.served(pub["version"], new_rt)  # the gate's next reference: these very weights
        if pub.get("reason", "").startswith("nonfinite"):  # diverged: train on from the last good weights
            with self._lock:
                self.trainer.restore(self.publisher.good_weights)
        rec.publish_s, rec.swap_s, rec.canary_mal = self._now() - t1, pub.get("swap_s"), pub.get("canary_mal")
        rec.rolled_back, rec.published = pub.get("rolled_back", False), pub["published"]
        rec.drafter_version = self.version
        t_end = self._now()
        bank.fixed_took(t_end - t_fixed)
        if banked:
            bank.spend(t_end - t0)
            rec.budget_bank_s = bank.bank_s
        self._result = rec.as_dict()
        return self._result

    def _idle(self) -> dict:
        """No update (frozen, nothing captured, or the time bank in debt): the same keys."""
        self._result = UpdateRecord(self.version, self._capture_last,
                                    budget_bank_s=self.bank.bank_s if self.bank.on else None).as_dict()
        return self._result

    def _requantize(self, policy) -> dict:
        """Self-drafter: every engine requantizes the new policy weights into its standby drafter and swaps."""
        t0 = self._now()
        pub = self.publisher.publish({k: v.detach() for k, v in policy.state_dict().items()}, tag=self.policy_version)
        self._result = UpdateRecord(self.version, publish_s=self._now() - t0, swap_s=pub.get("swap_s"),
                                    published=pub["published"]).as_dict()
        return self._result

    def observe_rollout(self, batch) -> dict:
        """Hand a rollout batch of one of the engines to the inline canary (online.canary=inline): the first batch
        the newly published version generated decides keep or roll back. {} while nothing is decided."""
        return self.publisher.observe(batch)

    def generate(self, engine, prompts, params, speculative: bool = True):
        """engine.generate with the inline canary watching (Publisher.generate): (batch, canary verdict)."""
        self._mark_rl_start()
        return self.publisher.generate(engine, prompts, params, speculative)

    def _mark_rl_start(self) -> None:
        if self._last_update_t is None:
            self._last_update_t = self._now()

    # ---- measurement --------------------------------------------------------------------------------------
    def reads_rows(self, step: int | None, last: bool = False, ungraded: bool = False) -> bool:
        """Are step `step`'s captured features used (training, or a due measure())? If not, skip their forwards.
        ungraded: of the rows the policy update does not learn from; under online.capture_rows=graded, a report's."""
        skip = ungraded and self.cfg.online.capture_rows == "graded"
        trains = self.cfg.online.track and not self.self_drafter and not skip
        return self.learns and not self.unused and (trains or self.scorer.due(step, last))

    def measure(self, k: int | None = None, step: int | None = None, last: bool = False) -> dict:
        """Teacher-forced acceptance of the live (served) and the frozen step-0 drafter on the rollouts captured since
        the last on_policy_update (the buffer's records of this policy version; call it before on_policy_update:
        live is then the drafter that generated them), at the steps Scorer.due names (the keys with None at the
        others). Its time (measure_s) is reporting: the time bank counts it neither as RL time nor as drafter work."""
        if not self.learns or not self.scorer.due(step, last):  # the same keys all the same
            return {"live_tf_mal": None, "live_tf_acc_pos": None, "frozen_tf_mal": None, "frozen_tf_acc_pos": None,
                    "policy_minus_drafter_version": self.drafter_lag, "measure_s": 0.0}
        recs = self.buffer.of_version(self.policy_version)
        if not recs:
            return {}
        t0 = self._now()
        with self._lock:  # what the engines serve: the trainer's weights may be an update the gate holds back
            live = self.scorer.serving_form()
        out = self.scorer.measure(recs, k or self.scorer.k, live, self.head)
        self._measure_s += (dt := self._now() - t0)
        return {**out, "policy_minus_drafter_version": self.drafter_lag, "measure_s": dt}

    # ---- checkpointing ------------------------------------------------------------------------------------
    def save_training(self, folder) -> None:  # every process: optimizer, buffer shard; the weights: state_dict()'s
        self.wait()
        if self.trainer is not None:
            self.trainer.save(Path(folder) / "trainer.pt", weights=False)

    def agreement(self) -> dict | None:  # several processes: the same drafter version, equal weights; None: untrained
        return None if self.trainer is None else self.collective.agreement(self.version, self.drafter)

    def state_dict(self, shared: dict | None = None) -> dict:
        """What a resume needs beside save_training's (weightsets.stored: shared, the sets stored elsewhere)."""
        self.wait()
        trained = None if self.trainer is None else self.trainer.weights_left_out()
        return stored({**self.scorer.state_dict(), **self.publisher.state_dict(), **self.bank.state_dict(),
                       "trained": trained, "policy_version": self.policy_version}, shared)

    def load_state_dict(self, state: dict, folder=None, shared: dict | None = None) -> None:
        """state_dict(shared)'s; folder: also save_training's there (CheckpointError / ValueError: unreadable)."""
        state = whole(state, shared)
        if folder is not None and self.trainer is not None:
            self.trainer.load(Path(folder) / "trainer.pt", weights=state["trained"])
            if self.trainer.buffer_note:  # what it could not keep of the saved buffer and random state
                self.log(f"[drafttrain] {self.trainer.buffer_note}")
        self.scorer.load_state_dict(state)
        self.policy_version = state["policy_version"]
        self.bank.load_state_dict(state)
        self.publisher.load_state_dict(state)
