"""The TRL callback in a real trl.GRPOTrainer run on CPU (use_vllm=False): tiny random policy, 2 optimizer steps."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tests.integration.conftest import TINY


@pytest.fixture(autouse=True)
def one_thread():  # spinning intra-op threads slow the tiny model 10x on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_grpo_trainer_with_draft_tracker_callback(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer, encode_prompt, make_prompts
    from drafttrain import DraftTracker
    from drafttrain.rl.trl import DraftTrackerCallback

    torch.manual_seed(0)
    policy, tok = build_policy(TINY), build_tokenizer()
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "online.steps_per_update=2", "train.batch_size=4",
                                       "online.canary_prompts=2", "online.canary_max_new_tokens=8",
                                       "online.budget_frac=0", "online.publish_gate=false",
                                       "online.holdout_frac=0"])  # every step publishes; every row trains
    drafter = build_drafter(cfg.drafter, policy)
    engine = build_engine(cfg.engine, policy, drafter)  # embedded engine, kept in sync for measurement
    tracker = DraftTracker(cfg, policy, [engine], drafter)
    problems = make_prompts(8, seed=0)
    tracker.set_probe([encode_prompt(tok, p.prompt) for p in problems[:2]], (tok.eos_token_id,))
    before = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}

    loss_forwards = []  # (rows, grad enabled) of every full-model forward TRL makes
    policy.register_forward_hook(lambda m, a, kw, out: loss_forwards.append(
        (kw["input_ids"].shape[0], torch.is_grad_enabled())), with_kwargs=True)

    def digits(prompts, completions, **kw):  # trivial reward with some spread
        return [float(sum(c.isdigit() for c in x)) for x in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, max_steps=2, learning_rate=1e-3, report_to="none", bf16=False,
                      use_cpu=True, logging_steps=1, save_strategy="no", use_vllm=False, temperature=1.0,
                      dataloader_num_workers=0, disable_tqdm=True)
    cb = DraftTrackerCallback(tracker)
    trainer = GRPOTrainer(model=policy, reward_funcs=digits, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": [p.prompt for p in problems]}), callbacks=[cb])
    cb.train(trainer)

    # features: exactly the rows of TRL's grad-enabled loss forwards, none of its no-grad generation forwards
    grad_rows = sum(n for n, g in loss_forwards if g)
    assert grad_rows == 2 * 4 and any(not g for _, g in loss_forwards)
    assert tracker.buffer.added == grad_rows
    assert tracker._capture is None and not policy.model.layers[1]._forward_pre_hooks  # hooks removed
    # the drafter trained, was published to the engine and versions advanced once per optimizer step
    assert [r["step"] for r in cb.history] == [0, 1]
    assert tracker.version == engine.drafter_version == 2 and tracker.policy_version == 2
    assert all(r["published"] and r["drafter_steps"] >= 1 for r in cb.history)
    assert all(r["frozen_tf_mal"] >= 1.0 and r["canary_mal"] is not None for r in cb.history)
    after = tracker.drafter.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_capture_hooks_come_off_when_training_raises():
    """HF calls no callback when a step raises: callback.train(trainer) removes the hooks on_step_begin put on, so
    a later grad-enabled forward of the model feeds nothing to the tracker."""
    from drafttrain.config import load_recipe
    from drafttrain.policy import build_policy
    from drafttrain import DraftTracker
    from drafttrain.rl.trl import DraftTrackerCallback

    torch.manual_seed(0)
    policy = build_policy(TINY)
    tracker = DraftTracker(load_recipe("eagle3_track", ["drafter.path=null"]), policy, [], log=lambda m: None)
    cb = DraftTrackerCallback(tracker)

    class Trainer:  # a step began (hooks on), then the reward function raised
        def train(self):
            cb.on_step_begin(None, None, None, model=policy)
            raise RuntimeError("reward function failed")

    with pytest.raises(RuntimeError, match="reward function failed"):
        cb.train(Trainer())
    assert tracker._capture is None and not policy.model.layers[1]._forward_pre_hooks
    ids = torch.randint(1, 30, (2, 12))
    policy(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    assert tracker.buffer.added == 0
