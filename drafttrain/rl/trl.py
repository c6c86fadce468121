"""A TRL GRPOTrainer callback built on DraftTracker: the drafter keeps up while TRL trains the policy.

    tracker = DraftTracker.from_recipe("eagle3_track", policy=model, engines=[])
    callback = DraftTrackerCallback(tracker)
    trainer = trl.GRPOTrainer(model=model, ..., callbacks=[callback])
    callback.train(trainer)        # trainer.train(), and the capture hooks come off even if it raises
    tracker.drafter, tracker.version, callback.history                # the fresh drafter, its version, metrics

Capture: the tracker's hooks are on the model from on_step_begin to on_step_end, with grad_only=True, so they keep
TRL's loss forward(s) (one per micro-batch) and skip its no-grad generation and scoring forwards of the same model.
TRL's fused LM head returns log-probs, not logits: the tracker projects the final hidden state it captured (no
extra backbone pass), and takes each row's response columns from TRL's labels (-100 = prompt or padding).

After each optimizer step (on_step_end): tracker.measure() (live vs frozen step-0 drafter, teacher-forced, on this
step's features), then tracker.on_policy_update(model, global_step - 1): policy_version = global_step, and the
drafter trains and publishes v+1 (in the background with online.mode=async; train end waits for it).

Engines, a choice: with use_vllm=False TRL samples from the HF model itself, so no engine needs the drafter. Pass
engines=[] and take the drafter from tracker.drafter (export it with drafttrain.export); versions still count up.
An embedded TorchEngine may be passed to measure the drafter in real speculative decoding: the callback refreshes
its policy copy after each optimizer step (engine.update_policy()). TRL generates its own rollouts, so no engine
batch can serve as the inline canary: the callback switches the tracker to online.canary=probe, which runs once the
caller has given probe prompts and the rollouts' stop tokens (tracker.set_probe(prompt_ids, stop_token_ids)): the
callback never sees token-level prompts.
"""
from __future__ import annotations

from transformers import TrainerCallback

from drafttrain.tracking.tracker import DraftTracker


class DraftTrackerCallback(TrainerCallback):
    def __init__(self, tracker: DraftTracker):
        self.tracker = tracker
        if tracker.cfg.online.canary != "probe":  # TRL's rollouts never pass through the tracker's engines
            tracker.cfg.online.canary = "probe"
            tracker.log("[drafttrain] DraftTrackerCallback: online.canary=probe (TRL generates its own rollouts)")
        self.history: list[dict] = []  # one record per optimizer step (measure + update results)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.tracker.stop_capture()  # a step cut short by an exception left its hooks on
        self.tracker.start_capture(model, grad_only=True)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.tracker.stop_capture()
        last = state.max_steps > 0 and state.global_step >= state.max_steps  # measured at the cadence, and last
        rec = {"step": state.global_step - 1, **self.tracker.measure(step=state.global_step - 1, last=last)}
        done = self.tracker.wait()  # the last step's background update ends before the engines change
        if self.history and done:
            self.history[-1].update(done)
        for e in self.tracker.engines:  # the policy just changed: embedded engines re-read its weights
            e.update_policy()
        rec.update(self.tracker.on_policy_update(model, state.global_step - 1))
        rec["drafter_version"] = self.tracker.version
        self.history.append(rec)

    def train(self, trainer, **kwargs):
        """trainer.train(**kwargs), with the capture hooks removed however it ends: HF calls no callback when a
        step raises (a reward function, an OOM), so hooks that on_step_begin put on would stay on the model and
        every later grad-enabled forward of it would feed the tracker's buffer."""
        try:
            return trainer.train(**kwargs)
        finally:
            self.tracker.stop_capture()

    def on_train_end(self, args, state, control, **kw):
        self.tracker.stop_capture()
        if self.history:
            self.history[-1].update(self.tracker.wait())  # a background (async) update finishes and publishes
