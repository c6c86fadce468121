"""One device per run (run.device), checked without a GPU: the hooks, the GRPO step and the trainer under the meta
check (tests/devcheck.py: every tensor drafttrain makes without naming a device lands on `meta` and fails against
the CPU models, the same bug as a CPU tensor meeting a CUDA one), the device's resolution and its one-line errors,
random states that cross devices on resume, and the CUDA-marked tests a GPU machine runs (scripts/gpu_check.sh)."""
from __future__ import annotations

import pytest
import torch

from drafttrain.config import ConfigError, load_recipe, sampling_params
from drafttrain.device import (device_rng_state, generator_state, load_device_rng_state, load_generator_state,
                               resolve_device)
from tests.devcheck import models_on_cpu_tensors_on_meta

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
TRAINABLE = ["eagle3_track", "mtp_track", "draft_model_track"]


def _world(recipe: str, device: str = "cpu", *extra):
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer, encode_prompt, make_prompts
    from drafttrain.tracking.tracker import DraftTracker

    torch.manual_seed(0)
    policy, tok = build_policy(TINY).eval().to(device), build_tokenizer()
    cfg = load_recipe(recipe, ["drafter.path=null", "train.batch_size=2", "online.steps_per_update=2",
                               "online.budget_frac=0", "online.holdout_frac=0", "online.publish_gate=false",
                               "online.canary_max_new_tokens=8", "engine.drafter_int8=false", *extra])
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(4, seed=0)]
    engine = build_engine(cfg.engine, policy, build_drafter(cfg.drafter, policy))
    tracker = DraftTracker(cfg, policy, [engine], build_drafter(cfg.drafter, policy), log=lambda m: None)
    return policy, cfg, prompts, engine, tracker


def _capture(tracker, policy, prompts, ro) -> None:
    seqs = [p + t for p, t in zip(prompts, ro.tokens)]
    L = min(map(len, seqs))
    ids = torch.tensor([s[:L] for s in seqs], device=next(policy.parameters()).device)
    with tracker.capture(policy, response_start=len(prompts[0])):
        policy(input_ids=ids)


@pytest.mark.parametrize("recipe", TRAINABLE)
def test_the_hooks_make_every_tensor_on_the_policys_device(recipe):
    """capture, on_policy_update (train, estimate, publish into the engine) and measure, with the models on the CPU:
    nothing drafttrain makes lands on meta (no tensor without a device), and the update trained and published."""
    policy, cfg, prompts, engine, tracker = _world(recipe)
    ro = engine.generate(prompts, sampling_params(cfg.sampling, max_new_tokens=12, seed=0))
    with models_on_cpu_tensors_on_meta() as mode:
        _capture(tracker, policy, prompts, ro)
        out = tracker.measure(step=0)
        rec = tracker.on_policy_update(policy, step=0)
    assert mode.redirected == set(), f"tensors made without a device at {sorted(mode.redirected)}"
    assert rec["drafter_steps"] >= 1 and rec["published"] and engine.drafter_version == 1
    assert out["live_tf_mal"] >= 1.0


def test_the_grpo_step_makes_every_tensor_on_the_policys_device():
    from drafttrain.policy import build_tokenizer
    from drafttrain.rl.grpo import GRPO

    policy, cfg, prompts, engine, tracker = _world("eagle3_track", "cpu", "rl.prompts_per_step=2",
                                                   "rl.group_size=2", "sampling.max_new_tokens=8")
    grpo = GRPO.from_config(cfg, policy, build_tokenizer(), engine, tracker)
    ro = grpo.rollout(0)
    ro.rewards = [1.0, 0.0, 0.0, 1.0]
    before = [p.detach().clone() for p in policy.parameters()]
    with models_on_cpu_tensors_on_meta() as mode:
        out = grpo.train_step(ro)
    assert mode.redirected == set(), f"tensors made without a device at {sorted(mode.redirected)}"
    assert out["rl_loss"] == out["rl_loss"] and any(not torch.equal(a, p) for a, p in zip(before, policy.parameters()))


def test_the_check_catches_a_tensor_made_without_a_device_in_drafttrains_code():
    """The check itself, on code compiled as if it sat in drafttrain/: a tensor made there without a device fails
    against a CPU tensor; the same call elsewhere (a library's, this test's) stays on the CPU; one made with the
    device of the data passes; a CPU generator drawing on another device fails."""
    from tests.devcheck import OURS

    src = ("def bad(x): return x + torch.zeros(3)\n"
           "def good(x): return x + torch.zeros(3, device=x.device)\n"
           "def draw(x, g): return torch.rand(3, generator=g)\n")
    ns = {"torch": torch}
    exec(compile(src, f"{OURS}/_devcheck_probe.py", "exec"), ns)
    x = torch.ones(3)
    with models_on_cpu_tensors_on_meta() as mode:
        with pytest.raises(RuntimeError, match="meta"):
            ns["bad"](x)
        assert torch.equal(ns["good"](x), x) and torch.zeros(3).device.type == "cpu"
        with pytest.raises(RuntimeError, match="a generator on cpu draws on meta"):
            ns["draw"](x, torch.Generator(device="cpu"))
    assert mode.redirected == {"drafttrain/_devcheck_probe.py:1", "drafttrain/_devcheck_probe.py:3"}
    assert torch.equal(ns["bad"](x), x)  # outside the check: the CPU default


def test_run_device_resolves_and_says_in_one_line_what_the_machine_has(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^run\.device: must be auto, cpu, cuda or cuda:N, got 'gpu'$"):
        load_recipe("eagle3_track", ["run.device=gpu"])
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match=r"^run\.device: cuda asked for, but torch sees no CUDA GPU here"):
            resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("auto") == torch.device("cuda", 0) == resolve_device("cuda:0")
    with pytest.raises(ValueError) as e:
        resolve_device("cuda:3")
    assert str(e.value) == "run.device: cuda:3 asked for, but this machine has 1 CUDA GPU(s): cuda:0..cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "1")  # a second process of a launcher on a machine with one GPU
    with pytest.raises(ValueError, match=r"run\.device: cuda \(local rank 1\) asked for, but this machine has 1"):
        resolve_device("cuda")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # an accelerate config with use_cpu (ddp2.yaml): CPU processes
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^run\.device: cuda:0 asked for, but the accelerate config launched CPU"):
        resolve_device("cuda:0")


def test_the_main_job_refuses_a_cuda_device_it_does_not_have_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "drafttrain.online", "recipe=eagle3_track", "run.device=cuda",
                        f"run.out_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    lines = [l for l in p.stderr.splitlines() + p.stdout.splitlines() if "run.device" in l]
    assert p.returncode != 0 and len(lines) == 1 and "no CUDA GPU" in lines[0], p.stderr[-2000:]
    assert not (tmp_path / "run" / "ckpt").exists()


def test_random_states_resume_on_another_kind_of_device_with_one_line():
    g = torch.Generator(device="cpu").manual_seed(3)
    saved = generator_state(g)
    want = torch.rand(4, generator=g, device="cpu")
    h = torch.Generator(device="cpu").manual_seed(9)
    assert load_generator_state(h, saved, "x") is None  # same kind: exact
    assert torch.equal(torch.rand(4, generator=h, device="cpu"), want)
    assert load_generator_state(h, g.get_state(), "x") is None  # an older bare state: a CPU generator's
    note = load_generator_state(h, {"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)}, "the draws")
    assert note.startswith("the draws: the checkpoint's random state is a cuda generator's") and "\n" not in note
    # the run's device random state: the CPU's is torch.get_rng_state's; a CUDA one cannot land on the CPU
    assert device_rng_state(torch.device("cpu")) is None and load_device_rng_state(None, torch.device("cpu")) is None
    note = load_device_rng_state({"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)}, torch.device("cpu"))
    assert note.startswith("run.device: the checkpoint was written on cuda, this run is on cpu") and "\n" not in note


def test_a_gpu_run_keeps_the_buffer_on_the_host_or_the_device_as_asked():
    from drafttrain.tracking.buffer import FeatureBuffer

    on = load_recipe("eagle3_track", ["online.buffer_device=device"]).online
    host = load_recipe("eagle3_track").online
    assert FeatureBuffer.of(on, 0, torch.device("meta")).device.type == "meta"
    b = FeatureBuffer.of(host, 0, torch.device("meta"))
    assert b.device.type == "cpu" and not b.pin  # a meta "GPU" has no pinned memory; a CUDA run pins
    with pytest.raises(ConfigError, match=r"^online\.buffer_device: must be cpu or device, got 'gpu'$"):
        load_recipe("eagle3_track", ["online.buffer_device=gpu"])


# ---- on a GPU (scripts/gpu_check.sh's CUDA stage) ----------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("recipe", TRAINABLE)
def test_the_hooks_run_with_a_cuda_policy(recipe):
    policy, cfg, prompts, engine, tracker = _world(recipe, "cuda")
    ro = engine.generate(prompts, sampling_params(cfg.sampling, max_new_tokens=12, seed=0))
    _capture(tracker, policy, prompts, ro)
    out = tracker.measure(step=0)
    rec = tracker.on_policy_update(policy, step=0)
    assert rec["published"] and engine.drafter_version == 1 and out["live_tf_mal"] >= 1.0
    assert all(p.device.type == "cuda" for p in tracker.drafter.parameters())
    ro2 = engine.generate(prompts, sampling_params(cfg.sampling, max_new_tokens=12, seed=0))
    assert ro2.drafter_version == 1 and all(len(t) for t in ro2.tokens)


@pytest.mark.cuda
def test_a_cuda_run_killed_between_checkpoints_resumes_exactly(tmp_path):
    import subprocess
    import sys

    from drafttrain.report import read_jsonl

    def run(out, steps, *extra):
        subprocess.run([sys.executable, "-m", "drafttrain.online", "recipe=eagle3_track", "run.device=cuda",
                        f"rl.steps={steps}", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_prompts=0",
                        f"run.out_dir={out}", *extra], check=True, timeout=900)
        return read_jsonl(out / "metrics.jsonl")

    whole = run(tmp_path / "a", 3)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 3)  # the same command with more steps: continues from step 2
    assert [r["rl_loss"] for r in resumed] == pytest.approx([r["rl_loss"] for r in whole], rel=1e-4)
