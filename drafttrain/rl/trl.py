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

Speculative rollouts in TRL's own vLLM (use_vllm=True, vllm_mode="colocate"), with the tracked drafter hot-swapped
into it after each optimizer step:

    with speculative_vllm("checkpoints/eagle3", k=3):       # TRL's vllm.LLM starts with this speculative_config
        trainer = GRPOTrainer(model=model, ..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    tracker = DraftTracker(cfg, model, [attach_trainer(trainer)], drafter)
    callback = DraftTrackerCallback(tracker); trainer.add_callback(callback); callback.train(trainer)

TRL builds its vllm.LLM through the module-level name LLM of trl.generation.vllm_generation with no way to pass
more arguments: speculative_vllm wraps that name while the trainer is built (and turns vLLM's log stats on: the
canary reads the engine's spec-decode counters). TRL passes no dtype: vLLM serves the fp32 checkpoint in bf16
here, and each push reads back within bf16's tolerance (vllm_transfer.tolerance). TRL syncs the policy into its
LLM itself before each generation; the callback pushes the drafter at on_step_end, and attach_trainer makes TRL's
generate and weight sync hold the handle's lock, so a push (from online.mode=async's thread too) lands between
them. Server mode (trl vllm-serve) is not covered: its NCCL weight sync needs CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

from transformers import TrainerCallback

from drafttrain.tracking.tracker import DraftTracker

_TRL_NOTE = "TRL currently supports vLLM versions"  # the start of TRL's own version warning
_noted: set[str] = set()  # the one-line version notes already given


def trl_vllm_range() -> str | None:
    """TRL's own warning that this vLLM is outside its declared range (its first line), or None when inside."""
    from trl.import_utils import is_vllm_available

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        is_vllm_available()
    return next((str(w.message).split(". ")[0] for w in seen if str(w.message).startswith(_TRL_NOTE)), None)


@contextlib.contextmanager
def speculative_vllm(drafter_dir, k: int | None = None, log=print):
    """While the GRPOTrainer is built: its colocated vllm.LLM starts with the drafter folder's speculative_config
    (drafttrain.serve.drafter_spec: its kind's method, k its own or `k`) and log stats on. A folder that is no
    drafter is a one-line ValueError before anything starts. Yields the speculative_config."""
    import trl
    import trl.generation.vllm_generation as vg

    from drafttrain.serve import drafter_spec

    try:
        spec = drafter_spec(drafter_dir, k)
    except (OSError, ValueError) as e:
        msg = str(e).split(": ", 1)[1] if str(e).startswith("--") else str(e)
        raise ValueError(f"speculative_vllm: {msg}") from None
    note = trl_vllm_range()
    if note and note not in _noted:
        _noted.add(note)
        import vllm

        log(f"[drafttrain] TRL {trl.__version__}: {note} (this is {vllm.__version__}, drafttrain's pin); "
            f"colocate generation, weight sync and drafter hot-swap are tested with it")
    built = vg.LLM

    def LLM(**kw):  # TRL's VLLMGeneration._init_vllm calls LLM(...) by this module-level name
        kw["speculative_config"] = spec
        kw.setdefault("disable_log_stats", False)
        return built(**kw)

    vg.LLM = LLM
    try:
        with warnings.catch_warnings():  # said once above; TRL repeats it at every check
            warnings.filterwarnings("ignore", message=_TRL_NOTE)
            yield spec
    finally:
        vg.LLM = built


def attach_trainer(trainer, log=print):
    """The handle (engines.vllm_server.attach) on a GRPOTrainer's colocated vllm.LLM, for DraftTracker's engines.
    TRL's generate and sync_weights then hold the handle's lock, which each drafter push takes: a swap never lands
    inside a generation or a policy sync. One-line ValueError where there is nothing to swap into."""
    from drafttrain.engines.vllm_server import attach

    gen = getattr(trainer, "vllm_generation", None)
    llm = getattr(gen, "llm", None)
    if llm is None:
        raise ValueError("attach_trainer: the trainer has no vLLM engine in this process (GRPOConfig(use_vllm=True, "
                         "vllm_mode='colocate') builds one)")
    if getattr(gen, "enable_sleep_mode", False):
        raise ValueError("attach_trainer: vllm_enable_sleep_mode=True discards the drafter's weights at every "
                         "sleep (level 2) and TRL puts back only the policy's; leave it off")
    if llm.llm_engine.vllm_config.speculative_config is None:
        raise ValueError("attach_trainer: TRL's vllm.LLM runs no speculative decoding; build the trainer inside "
                         "`with speculative_vllm(drafter_dir):`")
    handle = attach(llm, log=log)
    for name in ("generate", "sync_weights"):
        setattr(gen, name, _holding(handle.lock, getattr(gen, name)))
    return handle


def _holding(lock, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with lock:
            return fn(*args, **kwargs)
    return call


class DraftTrackerCallback(TrainerCallback):
    def __init__(self, tracker: DraftTracker):
        self.tracker = tracker
        # TRL's rollouts never pass through the tracker's engines: a probe judges a swap, unless every engine is a
        # handle on TRL's own vLLM (attach_trainer), whose spec-decode counters judge it (hotswap.Publisher.settle)
        counted = bool(tracker.engines) and all(hasattr(e, "spec_since_swap") for e in tracker.engines)
        if tracker.cfg.online.canary != "probe" and not counted:
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
