"""Shared by the integration tests: the tiny policy's sizes, a saved tiny policy checkpoint (one per module), and
the tracker tests' set-up: a sharp tiny policy with a trained EAGLE-3 drafter, trackers on it, a fake clock.

Torch runs with one intra-op thread in the online tests (one_thread): on a shared 2-core machine, spinning worker
threads made the tiny model's decode steps 10-100x slower.
"""
from __future__ import annotations

import pytest
import torch

from drafttrain.config import load_recipe, sampling_params

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from drafttrain.policy import build_policy, build_tokenizer, save_policy

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("policy") / "policy"
    save_policy(build_policy(TINY), build_tokenizer(), str(path))
    return path


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the tracker tests' set-up ---------------------------------------------------------------------------------
# ---- canary, rollback, non-finite updates, resume after a rollback ---------------------------------------------
@pytest.fixture(scope="session")
def trained():
    """A sharp tiny policy and an EAGLE-3 drafter trained on its rollouts (engine MAL ~3 at k=4, fresh ~1.4)."""
    from drafttrain.drafters import TargetHead, build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.tracking import DrafterTrainer, teacher_forced_features
    from drafttrain.tracking.acceptance import teacher_forced_acceptance
    from drafttrain.policy import build_policy, build_tokenizer, encode_prompt, make_prompts

    torch.manual_seed(0)
    policy, tok = build_policy(TINY).eval(), build_tokenizer()
    with torch.no_grad():
        policy.lm_head.weight.mul_(16.0)  # a peaked next-token distribution: a broken drafter is far worse
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "engine.drafter_int8=false", "train.lr=1e-2",
                                       "online.canary_max_new_tokens=48"])
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(8, seed=0)]
    engine = build_engine(cfg.engine, policy, build_drafter(cfg.drafter, policy))
    ro = engine.generate(prompts, sampling_params(cfg.sampling, max_new_tokens=32, seed=0), speculative=False)
    drafter = build_drafter(cfg.drafter, policy)
    feats = teacher_forced_features(policy, prompts, ro.tokens, drafter.aux_layer_ids, 4)
    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter, head=TargetHead.of(policy))
    for _ in range(60):
        trainer.step(feats)
    good = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    expected = teacher_forced_acceptance(drafter, feats, 4, trainer.head)["mal"]
    assert expected > 3.0
    return dict(policy=policy, cfg=cfg, prompts=prompts, good=good, expected=expected, feats=feats)


def engine_for(trained, int8: bool = False):
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine

    cfg = trained["cfg"].engine.copy()
    cfg.drafter_int8 = int8
    return build_engine(cfg, trained["policy"], build_drafter(trained["cfg"].drafter, trained["policy"]))


def corrupt(weights: dict, how: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if how == "zeroed":
        return {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in weights.items()}
    return {k: v.flatten()[torch.randperm(v.numel(), generator=g)].view_as(v) if v.is_floating_point() else v
            for k, v in weights.items()}


def tracker_with_features(trained, engine, *extra):
    """A DraftTracker on the trained setup whose buffer holds one captured loss forward."""
    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker

    cfg = load_recipe("eagle3_track", ["drafter.path=null", "engine.drafter_int8=false", "train.batch_size=4",
                                       "online.steps_per_update=2", "online.canary_max_new_tokens=16",
                                       "online.budget_frac=0", *extra])
    policy = trained["policy"]
    drafter = build_drafter(cfg.drafter, policy)
    drafter.load_state_dict(trained["good"])
    logs = []
    tracker = DraftTracker(cfg, policy, [engine], drafter, log=logs.append)
    seqs = [p + [5, 6, 7, 8, 9, 10] for p in trained["prompts"][:4]]
    ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
    with tracker.capture(policy, response_start=ids.shape[1] - 6):
        policy(input_ids=ids)
    tracker.set_probe(trained["prompts"][:2], ())  # the untrained tiny policy: no stop token
    return tracker, logs


def fake_clock(monkeypatch):
    """The tracker's clock (tracker.time.perf_counter) replaced by one that only moves when a test (or a patched
    cost) moves it."""
    import types

    from drafttrain.tracking import tracker

    clock = [0.0]
    monkeypatch.setattr(tracker, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def slowed(monkeypatch, clock, module, name: str, seconds: float) -> None:
    """module.<name> made to take `seconds` of the fake clock per call."""
    real = getattr(module, name)

    def slow(*a, **kw):
        clock[0] += seconds
        return real(*a, **kw)

    monkeypatch.setattr(module, name, slow)


def banked_tracker(trained, monkeypatch, clock, *overrides):
    """A tracker with budget_frac=0.05 whose drafter steps take 5 ms of the fake clock per record (20 ms for a
    whole batch of 4 equal-length records); every update with a step publishes (no publish gate), every row trains
    (none held out); an update starts once the bank covers one whole batch (unless overridden)."""
    tracker, _ = tracker_with_features(trained, engine_for(trained), "online.budget_frac=0.05",
                                        "online.steps_per_update=50", "online.publish_gate=false",
                                        "online.holdout_frac=0", "online.min_steps_per_update=1", *overrides)
    step = tracker.trainer.step

    def slow_step(batch, head=None):
        clock[0] += 0.005 * batch["aux"].shape[0]
        return step(batch, head)

    monkeypatch.setattr(tracker.trainer, "step", slow_step)
    return tracker


def kill_at_checkpoint(cmd: list[str], env: dict, latest, step: int, timeout_s: float, group: bool = False) -> None:
    """Start the main job and SIGKILL it once its checkpoint pointer `latest` reaches `step`; fails if it ended
    first. group: the job is a launcher with workers (accelerate launch), all of which are killed at once and
    checked gone."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    import psutil

    from drafttrain.config import PROJECT_ROOT

    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=group)
    tree: list[psutil.Process] = []
    try:
        deadline = time.time() + timeout_s
        while time.time() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text().strip().split("-")[1]) >= step:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before it was killed"
        if group:  # torchrun starts each worker in a session of its own: a kill of the group alone leaves them running
            tree = psutil.Process(proc.pid).children(recursive=True)
    finally:
        for pid in [proc.pid, *(p.pid for p in tree)]:  # all at once, as a node failure would
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"still running after the kill: {alive}"
