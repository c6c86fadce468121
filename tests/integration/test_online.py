"""The online loop end to end on a tiny random policy (CPU): RL steps with hot-swaps (sync and async), atomic
swaps mid-generation, the canary and rollback, non-finite drafter updates, kill and resume, and bad input.

Torch runs with one intra-op thread here: on a shared 2-core machine, spinning worker threads made the tiny
model's decode steps 10-100x slower.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from drafttrain.config import PROJECT_ROOT, load_recipe, sampling_params
from drafttrain.report import read_jsonl

from tests.integration.conftest import TINY
# the per-step keys DESIGN.md and the README promise in metrics.jsonl
KEYS = {"step", "reward_mean", "resp_len_mean", "rollout_tokens_per_s", "live_mal", "live_acc_pos", "live_tf_mal",
        "live_tf_acc_pos", "frozen_tf_mal", "frozen_tf_acc_pos", "drafter_train_s", "swap_s",
        "policy_minus_drafter_version", "rl_step_s", "drafter_version", "published", "rolled_back", "canary_mal"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def overrides(policy_dir, out, *extra) -> list[str]:
    """Tiny runs: 4 rollouts a step, too few rows for the publish gate's bound (its tests drive it directly), so
    every update publishes."""
    return [f"policy.path={policy_dir}", "drafter.path=null", "rl.steps=1", "rl.prompts_per_step=2",
            "rl.group_size=2", "sampling.max_new_tokens=16", "online.steps_per_update=2", "online.canary_prompts=2",
            "online.canary_max_new_tokens=8", "train.batch_size=4", "run.tensorboard=false", "rl.eval_prompts=4",
            "online.publish_gate=false", f"run.out_dir={out}", *extra]


# ---- one RL step with a hot-swap ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_rl_step_with_hot_swap(policy_dir, tmp_path, monkeypatch, mode):
    from omegaconf import OmegaConf

    from drafttrain.online import run

    engines = []
    build = run.build_engine
    monkeypatch.setattr(run, "build_engine", lambda *a, **kw: engines.append(build(*a, **kw)) or engines[-1])
    cfg = load_recipe("eagle3_track", overrides(policy_dir, tmp_path, f"rl.mode={mode}", f"online.mode={mode}",
                                                "online.canary=probe"))
    (rec,) = run.main(cfg)

    assert KEYS <= set(rec), KEYS - set(rec)
    assert rec["rollout_drafter_version"] == 0 and rec["published"] and not rec["rolled_back"]
    assert rec["drafter_version"] == 1 == engines[0].drafter_version  # hot-swapped into the engine
    assert rec["drafter_steps"] >= 1 and rec["swap_s"] > 0 and rec["canary_mal"] >= 1.0
    assert all(math.isfinite(rec[k]) for k in ("reward_mean", "live_mal", "live_tf_mal", "frozen_tf_mal"))
    assert read_jsonl(tmp_path / "metrics.jsonl") == [rec]
    assert (tmp_path / "report.png").stat().st_size > 0
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.rl.mode == mode and saved.online.mode == mode and saved.recipe == "eagle3_track"
    state = torch.load(tmp_path / "ckpt" / "step-1" / "state.pt", weights_only=False)
    assert state["step"] == 1 and state["tracker"]["version"] == 1
    ev = json.loads((tmp_path / "eval.json").read_text())  # held-out accuracy before and after the run
    assert ev["prompts"] == 4 and set(ev["before"]) == set(ev["after"]) == {"eval_sampled_acc", "eval_greedy_acc"}
    assert state["eval_before"] == ev["before"]  # carried through a resume


def test_rl_step_time_includes_the_steps_own_rollout(policy_dir, tmp_path, monkeypatch):
    """rl_step_s adds up to the RL loop's wall time: a step's rollouts are generated inside the step before it,
    except the first step's, which the loop makes before it starts; that one counts in the first step (it did not,
    so online overhead against the RL step read ~0.2 points high)."""
    from drafttrain.online import run
    from drafttrain.rl.grpo import GRPO

    took = {}
    real = GRPO.rollout

    def timed(self, step):
        t = time.perf_counter()
        out = real(self, step)
        took[step] = time.perf_counter() - t
        return out

    monkeypatch.setattr(GRPO, "rollout", timed)
    (rec,) = run.main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "rl.eval_prompts=0")))
    assert 0 in took and rec["rl_step_s"] >= took[0]
    assert rec["rl_step_s"] - took[0] >= rec["drafter_train_s"]  # the rest is the step's own training


def test_inline_canary_judges_a_swap_on_the_next_rollouts(policy_dir, tmp_path):
    """online.canary=inline (the default): no probe generation; step 1's rollouts, the first the v1 drafter
    generated, are its canary, and the verdict lands in step 0's record."""
    from drafttrain.online.run import main

    cfg = load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "rl.steps=2", "online.budget_frac=0"))
    assert cfg.online.canary == "inline"
    r0, r1 = main(cfg)
    assert r0["published"] and r1["rollout_drafter_version"] == 1
    assert r0["canary_mal"] == r1["live_mal"] >= 1.0 and not r0["rolled_back"]


def test_frozen_drafter_records_the_same_keys(policy_dir, tmp_path):
    """online.track=false (the frozen baseline): no swap, but metrics.jsonl has the same keys as a tracking run."""
    from drafttrain.online.run import main

    (rec,) = main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "online.track=false")))
    assert KEYS <= set(rec), KEYS - set(rec)
    assert rec["drafter_version"] == 0 and not rec["published"] and rec["swap_s"] is None
    assert rec["live_tf_mal"] == rec["frozen_tf_mal"]


# ---- a swap in the middle of generation -----------------------------------------------------------------------
def test_swap_mid_generation_never_mixes_versions(policy_dir, monkeypatch):
    """Three swaps, each landing while a decode step is drafting (forced from inside propose). Every module call of
    every step must come from one runtime drafter, and that drafter must hold the weights of the step's version."""
    from drafttrain.drafters import build_drafter
    from drafttrain.engines.torch_engine import TorchEngine
    from drafttrain.policy import load_policy
    from drafttrain.spec import SamplingParams

    policy, _ = load_policy(str(policy_dir))
    cfg = load_recipe("eagle3_track", [f"policy.path={policy_dir}", "drafter.path=null"])
    torch.manual_seed(1)
    drafter = build_drafter(cfg.drafter, policy)
    base = drafter.state_dict()
    weights = {v: {**base, "fc.weight": base["fc.weight"] + 0.01 * v} for v in range(4)}
    fp = lambda sd: round(float(sd["fc.weight"].double().sum()), 3)  # noqa: E731  weights fingerprint
    version_of = {fp(w): v for v, w in weights.items()}
    assert len(version_of) == 4

    log: list[tuple[str, int]] = []  # ("step" | "call", version of the runtime that made it)
    swap_at = {6: 1, 14: 2, 25: 3}  # decode step -> version swapped in while that step drafts
    go = {v: threading.Event() for v in swap_at.values()}
    done = {v: threading.Event() for v in swap_at.values()}
    landed_mid_step = []
    make_runtime = TorchEngine._runtime

    def runtime(self, d, **kw):  # every runtime the engine builds records its own version on each module call
        rt = make_runtime(self, d, **kw)
        v = version_of[fp(d.state_dict())]
        for m in rt.modules():
            m.register_forward_hook(lambda *a, v=v: log.append(("call", v)))
        for name, lin in (rt._fused or {}).items():  # the fused inference linears are plain callables
            if not isinstance(lin, torch.Tensor):  # (the normed embedding table and rms_unit's constant are not)
                rt._fused[name] = lambda x, lin=lin, v=v: (log.append(("call", v)), lin(x))[1]
        propose = rt.propose

        def recording_propose(*a, **kw):
            n = sum(1 for e in log if e[0] == "step")
            log.append(("step", v))
            if n in swap_at:  # let another thread swap now, in the middle of this step
                go[swap_at[n]].set()
                assert done[swap_at[n]].wait(60)
                landed_mid_step.append((n, v, engine.drafter_version))
            return propose(*a, **kw)

        rt.propose = recording_propose
        return rt

    monkeypatch.setattr(TorchEngine, "_runtime", runtime)
    cfg.engine.drafter_int8 = False
    drafter.load_state_dict(weights[0])
    engine = TorchEngine(cfg.engine, policy, drafter)

    def swapper():
        for v in (1, 2, 3):
            if not go[v].wait(60):
                return
            engine.load_drafter(weights[v], v)
            done[v].set()

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    batch = engine.generate([[1, 5, 6, 7, 8], [1, 9, 10]], SamplingParams(temperature=1.0, max_new_tokens=400, seed=0))
    t.join(5)

    vs = batch.drafter_versions
    assert vs == sorted(vs) and vs[0] == 0 and vs[-1] == 3 and set(vs) == {0, 1, 2, 3}  # changed mid-batch
    assert landed_mid_step == [(6, 0, 1), (14, 1, 2), (25, 2, 3)]  # each swap landed while a step was drafting
    steps = []  # the versions of each step's module calls
    for kind, v in log:
        if kind == "step":
            steps.append((v, set()))
        else:
            steps[-1][1].add(v)
    assert len(steps) == len(vs)
    for i, ((v, called), served) in enumerate(zip(steps, vs)):
        assert called == {v} and v == served, f"decode step {i} used versions {called}, recorded {served}"


# ---- canary, rollback, non-finite updates, resume after a rollback ---------------------------------------------
@pytest.fixture(scope="module")
def trained():
    """A sharp tiny policy and an EAGLE-3 drafter trained on its rollouts (engine MAL ~3 at k=4, fresh ~1.4)."""
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.online import DrafterTrainer, teacher_forced_features
    from drafttrain.online.acceptance import teacher_forced_acceptance
    from drafttrain.policy import build_policy, build_tokenizer, encode_prompt, make_prompts

    torch.manual_seed(0)
    policy, tok = build_policy(TINY).eval(), build_tokenizer()
    with torch.no_grad():
        policy.lm_head.weight.mul_(16.0)  # a peaked next-token distribution: a broken drafter is far worse
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "engine.drafter_int8=false", "train.lr=1e-2",
                                       "online.canary_max_new_tokens=48"])
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(8, seed=0)]
    engine = build_engine(cfg.engine, policy, build_drafter(cfg.drafter, policy))
    ro = engine.generate(prompts, sampling_params(cfg, max_new_tokens=32, seed=0), speculative=False)
    drafter = build_drafter(cfg.drafter, policy)
    feats = teacher_forced_features(policy, prompts, ro.tokens, drafter.aux_layer_ids, 4)
    trainer = DrafterTrainer(drafter, cfg.train, cfg.drafter)
    for _ in range(60):
        trainer.step(feats)
    good = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    expected = teacher_forced_acceptance(drafter, feats, 4)["mal"]
    assert expected > 3.0
    return dict(policy=policy, cfg=cfg, prompts=prompts, good=good, expected=expected, feats=feats)


def _engine(trained, int8: bool = False):
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine

    cfg = trained["cfg"].engine.copy()
    cfg.drafter_int8 = int8
    return build_engine(cfg, trained["policy"], build_drafter(trained["cfg"].drafter, trained["policy"]))


def _corrupt(weights: dict, how: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if how == "zeroed":
        return {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in weights.items()}
    return {k: v.flatten()[torch.randperm(v.numel(), generator=g)].view_as(v) if v.is_floating_point() else v
            for k, v in weights.items()}


@pytest.mark.parametrize("canary", ["probe", "inline"])
@pytest.mark.parametrize("how", ["zeroed", "shuffled"])
def test_canary_rolls_back_a_corrupt_drafter(trained, how, canary):
    """probe: judged by a probe right after the swap; inline: by the first rollout batch the new version serves."""
    from drafttrain.online.hotswap import Publisher

    engine, logs = _engine(trained), []
    cfg, probe = trained["cfg"].copy(), trained["prompts"][:4]
    cfg.online.canary = canary
    params = sampling_params(cfg, max_new_tokens=cfg.online.canary_max_new_tokens)
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=logs.append)

    def publish(weights):
        rec = pub.publish(weights, trained["expected"], probe, params)
        if canary == "inline":
            assert rec["canary_mal"] is None and pub.pending["version"] == rec["version"]
            rec.update(pub.observe(engine.generate(probe, params)))  # the engine's next rollouts
        return rec

    ok = publish(trained["good"])
    assert ok["published"] and not ok["rolled_back"] and engine.drafter_version == 1

    bad = publish(_corrupt(trained["good"], how))
    assert bad["rolled_back"] and bad["canary_mal"] < ok["canary_mal"]
    assert bad["version"] == engine.drafter_version == 3 and pub.good_version == 1  # v2 failed; v3 = v1's weights
    served = engine.drafter.state_dict()
    assert all(torch.equal(served[k], trained["good"][k]) for k in served)
    assert engine.generate(probe, params).stats.mean_accepted_length > 2.0
    assert any("ROLLBACK" in m and "v2" in m for m in logs), logs


def test_inline_canary_waits_for_a_batch_of_the_new_version(trained):
    """A batch the old version generated (or a mix) does not judge the new one; the next pure batch does."""
    from drafttrain.online.hotswap import Publisher

    engine, cfg, probe = _engine(trained), trained["cfg"], trained["prompts"][:2]
    params = sampling_params(cfg, max_new_tokens=16)
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=lambda m: None)
    old_batch = engine.generate(probe, params)
    assert pub.publish(_corrupt(trained["good"], "zeroed"), trained["expected"])["published"]
    assert pub.observe(old_batch) == {} and pub.pending is not None  # v0's batch says nothing about v1
    rec = pub.observe(engine.generate(probe, params))
    assert rec["rolled_back"] and pub.pending is None and engine.drafter_version == 2 and pub.good_version == 0
    assert pub.observe(engine.generate(probe, params)) == {}  # nothing pending any more


def test_pooled_canary_judges_with_every_process(trained):
    """Several processes (Publisher pool; here a second process simulated by what it adds to the sums): observe
    and fail only record, and settle judges on what every process recorded, so all take the same verdict."""
    from drafttrain.online.hotswap import Publisher

    engine, cfg, probe = _engine(trained), trained["cfg"], trained["prompts"][:2]
    params = sampling_params(cfg, max_new_tokens=16)
    other = [0.0, 0.0, 0.0]  # the other process's MAL x verify rows, verify rows, failures
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=lambda m: None,
                    pool=lambda xs: [a + b for a, b in zip(xs, other)])
    assert pub.publish(_corrupt(trained["good"], "zeroed"), trained["expected"])["published"]  # v1
    assert pub.observe(engine.generate(probe, params)) == {} and pub.pending is not None  # recorded, not judged
    other[:] = [6.0 * 1000, 1000.0, 0.0]  # there, v1 accepted everything over 1000 verify steps
    rec = pub.settle()
    assert rec["canary_mal"] > 5.0 and not rec["rolled_back"] and pub.good_version == 1 == engine.drafter_version
    assert pub.settle() == {}  # nothing pending
    assert pub.publish(trained["good"], trained["expected"])["published"]  # v2
    other[:] = [0.0, 0.0, 0.0]
    assert pub.settle() == {} and pub.pending is not None  # nothing recorded anywhere yet: still pending
    other[:] = [0.0, 0.0, 1.0]  # an engine failed with v2 in the other process: this one rolls back too
    rec = pub.settle()
    assert rec["rolled_back"] and engine.drafter_version == 3 and pub.good_version == 1
    assert pub.publish(trained["good"], trained["expected"])["published"]  # v4
    other[:] = [0.0, 0.0, 0.0]
    assert pub.fail(RuntimeError("boom")) == {"deferred": True} and engine.drafter_version == 4  # not alone
    assert pub.settle()["rolled_back"] and engine.drafter_version == 5
    # the probe canary pools its probes: good weights here, but the other process's engine failed with them
    probe_cfg = cfg.copy()
    probe_cfg.online.canary = "probe"
    engine2 = _engine(trained)
    pub2 = Publisher([engine2], trained["good"], probe_cfg.online, log=lambda m: None,
                     pool=lambda xs: [a + b for a, b in zip(xs, [0.0, 0.0, 1.0])])
    rec = pub2.publish(trained["good"], trained["expected"], probe, params)
    assert rec["rolled_back"] and engine2.drafter_version == 2


@pytest.mark.parametrize("canary", ["probe", "inline"])
def test_canary_rolls_back_a_drafter_that_crashes_the_engine(trained, canary):
    """Huge (finite) weights make the int8 drafter's kernels fail: a failed canary, not a dead RL job. Inline, the
    rollout that failed is generated again with the good drafter (DraftTracker.generate)."""
    from drafttrain.online.hotswap import Publisher

    engine, logs = _engine(trained, int8=True), []
    cfg, probe = trained["cfg"].copy(), trained["prompts"][:2]
    cfg.online.canary = canary
    params = sampling_params(cfg, max_new_tokens=16)
    huge = {k: v * 1e10 if v.is_floating_point() else v for k, v in trained["good"].items()}
    if canary == "probe":
        pub = Publisher([engine], trained["good"], cfg.online, log=logs.append)
        rec = pub.publish(huge, trained["expected"], probe, params)
    else:
        tracker, logs = _tracker_with_features(trained, engine)
        rec = tracker.publisher.publish(huge, trained["expected"])
        with pytest.raises((RuntimeError, ValueError)):
            engine.generate(probe, params)  # what the rollout would die of
        batch, verdict = tracker.generate(engine, probe, params)
        rec.update(verdict)
        assert batch.drafter_versions and set(batch.drafter_versions) == {2}
    assert rec["rolled_back"] and engine.drafter_version == 2 and any("ROLLBACK" in m for m in logs)
    assert engine.generate(probe, params).stats.mean_accepted_length > 2.0  # the good weights serve again


def _tracker_with_features(trained, engine, *extra):
    """A DraftTracker on the trained setup whose buffer holds one captured loss forward."""
    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.rl.hooks import DraftTracker

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
    tracker.set_probe(trained["prompts"][:2])
    return tracker, logs


def _fake_clock(monkeypatch):
    """hooks.time.perf_counter replaced by a clock that only moves when a test (or a patched cost) moves it."""
    import types

    from drafttrain.rl import hooks

    clock = [0.0]
    monkeypatch.setattr(hooks, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def _slowed(monkeypatch, clock, name: str, seconds: float) -> None:
    """hooks.<name> made to take `seconds` of the fake clock per call."""
    from drafttrain.rl import hooks

    real = getattr(hooks, name)

    def slow(*a, **kw):
        clock[0] += seconds
        return real(*a, **kw)

    monkeypatch.setattr(hooks, name, slow)


def _banked_tracker(trained, monkeypatch, clock):
    """A tracker with budget_frac=0.05 whose drafter steps take 5 ms of the fake clock per record (20 ms for a
    whole batch of 4 equal-length records); every update with a step publishes (no publish gate), every row trains
    (none held out)."""
    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.budget_frac=0.05",
                                        "online.steps_per_update=50", "online.publish_gate=false",
                                        "online.holdout_frac=0")
    step = tracker.trainer.step

    def slow_step(batch):
        clock[0] += 0.005 * batch["aux"].shape[0]
        return step(batch)

    monkeypatch.setattr(tracker.trainer, "step", slow_step)
    return tracker


def test_sync_training_is_held_to_its_time_bank(trained, monkeypatch):
    """online.budget_frac=0.05: each RL second earns 50 ms of drafter work. On a fake clock where only drafter steps
    take time (5 ms a record, 20 ms a batch), the steps per update follow the bank: after a first update of one
    batch (nothing measured yet), whole batches while the bank covers one (with the 1.25 margin: 25 ms), then as
    many records as it covers, never going into debt."""
    clock = _fake_clock(monkeypatch)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    taken = []
    for rl_s in (1.0, 0.0, 0.0, 10.0):  # RL time before each update
        clock[0] += rl_s
        out = tracker.on_policy_update(trained["policy"], len(taken))
        taken.append(out["drafter_steps"])
        assert out["published"] == (out["drafter_steps"] > 0)
    # 50 ms: the first update (nothing measured yet) takes one batch, 30 ms left; then 1 batch (25 ms predicted)
    # and 1 record (6.25 ms), 5 ms left; 5 ms covers no record: nothing (no debt); 505 ms: 25 batches, 5 ms left
    assert taken == [1, 2, 0, 25]
    assert tracker.bank_s == pytest.approx(0.005)


def test_drafter_lag_counts_policy_updates_since_the_serving_drafter_was_published(trained, monkeypatch):
    """The time bank skips the third update: the drafter is one policy update behind, and the next publish brings
    it level again (0). The version counters' difference stayed 1 from then on (the main job's ended at 5 while its
    drafter was published the step before). A rollback serves older weights: their lag."""
    clock = _fake_clock(monkeypatch)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    lags = []
    for step, rl_s in enumerate((1.0, 0.0, 0.0, 10.0)):  # the bank pays for updates 0, 1 and 3 (the bank test)
        clock[0] += rl_s
        tracker.on_policy_update(trained["policy"], step)
        lags.append((tracker.drafter_lag, tracker.policy_version - tracker.version))
    assert lags == [(0, 0), (0, 0), (1, 1), (0, 1)]
    policy = trained["policy"]
    ids = torch.tensor([p[:3] + [5, 6, 7, 8] for p in trained["prompts"][:2]])
    with tracker.capture(policy, response_start=3):  # rollouts: the next update has an estimate, its canary
        policy(input_ids=ids)
    clock[0] += 10.0
    out = tracker.on_policy_update(policy, 4)  # v4, published at policy version 5, on probation
    assert out["published"] and tracker.publisher.pending is not None and tracker.drafter_lag == 0
    assert tracker.publisher.fail(RuntimeError("NaN draft probabilities"))["rolled_back"]
    assert tracker.drafter_lag == 1  # the engines serve v3's weights again, published at policy version 4
    fresh = _banked_tracker(trained, monkeypatch, clock)  # a resumed run keeps the lag
    fresh.load_state_dict(tracker.state_dict())
    assert fresh.drafter_lag == 1


def test_publish_gate_decides_on_paired_rows(trained, monkeypatch):
    """online.publish_gate: the update's weights and the serving drafter's are scored on the same rows, and the gate
    takes the per-row MAL differences (online/gate.py), not the two pooled MALs. A higher pooled MAL whose rows
    disagree is not published and training goes on from the update (undecided); a small loss on every row resets
    to the serving weights (worse); a small gain on every row is published. The serving drafter's runtime form is
    built once per engine version, and after a publish it is the form the update's own estimate scored."""
    from drafttrain.rl import hooks

    engine = _engine(trained)
    tracker, _ = _tracker_with_features(trained, engine, "online.publish_gate=true", "online.gate_min_rows=4",
                                        "online.holdout_frac=0")
    feats = list(tracker.pending)
    served = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}
    base = torch.tensor([2.0, 3.0, 4.0, 5.0])  # the serving drafter's MAL on each of the 4 rows
    scores, calls = [], []  # the update's per-row MAL offsets; the drafters scored, in order

    def scripted(drafter, batch, k):
        new = len(calls) % 2 == 0  # each update scores its new weights, then the serving ones
        rows = base + scores[-1] if new else base
        calls.append(drafter)
        return {"mal": float(rows.mean()), "acceptance_per_position": [], "stats": None, "row_mal": rows}

    monkeypatch.setattr(hooks, "teacher_forced_acceptance", scripted)
    cases = [(torch.tensor([0.6, -0.4, 0.6, -0.4]), "undecided"), (torch.full((4,), -0.05), "worse"),
             (torch.full((4,), 0.05), "published"), (torch.full((4,), 0.05), "published")]
    for offsets, want in cases:
        scores.append(offsets)
        tracker.pending = list(feats)  # this step's rollouts
        before = tracker.version
        out = tracker.on_policy_update(trained["policy"], len(scores))
        publish = want == "published"
        assert out["gated"] == (not publish) and out["published"] == publish, (want, out)
        assert out["expected_mal"] == pytest.approx(3.5 + float(offsets.mean())) and out["serving_mal"] == 3.5
        assert out["gate_rows"] == 4 and out["gate_mean_diff"] == pytest.approx(float(offsets.mean()), abs=1e-6)
        assert (out["gate_lower"] > 0) == publish
        assert tracker.version == before + publish and engine.drafter_version == tracker.version
        kept = all(torch.equal(v, served[k]) for k, v in tracker.drafter.state_dict().items())
        assert kept == (want == "worse")  # undecided: the trainer goes on from the update's weights
        served = {k: v.clone() for k, v in tracker._serving_weights().items()}
    assert len(calls) == 8 and calls[1] is calls[3] is calls[5]  # one serving form per served version
    assert calls[7] is calls[4]  # the third update's estimate form serves as the fourth's reference


def _capture_with_held_out_rows(tracker, trained) -> int:
    """Three captured forwards of 4 rows each, so that some rows are held out; returns how many were."""
    policy = trained["policy"]
    for extra in range(3):
        seqs = [p + list(range(5, 12 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 7 - extra):
            policy(input_ids=ids)
    return int(torch.cat([f["heldout"] for f in tracker.pending]).sum())


def test_publish_gate_scores_each_held_out_row_once_per_serving_version(trained, monkeypatch):
    """The serving drafter's score of a held-out row is kept with the row: an update that adds no rows to the gate's
    and publishes nothing scores its own weights only; after a publish (a new serving version) the rows are scored
    again, by the new serving drafter."""
    from drafttrain.rl import hooks

    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.holdout_frac=0.5",
                                        "online.estimate_rows=64")
    policy = trained["policy"]
    held = _capture_with_held_out_rows(tracker, trained)
    assert held >= 2
    scored, decide = [], iter([False, True, False])  # publish at the second update only
    real = hooks.teacher_forced_acceptance

    def spy(drafter, batch, k):
        scored.append((drafter is tracker._serving_form(), batch["aux"].shape[0]))
        return real(drafter, batch, k)

    monkeypatch.setattr(hooks, "teacher_forced_acceptance", spy)
    monkeypatch.setattr(hooks, "gate_decision", lambda n, *a: {"n": int(n), "mean": 0.0, "lower": 0.0,
                                                                "publish": next(decide), "worse": False})
    versions = []
    for step in range(3):
        tracker.on_policy_update(policy, step)  # after the first, no new rows: the gate's stay
        versions.append(tracker.version)
    assert versions == [0, 1, 1]
    assert scored == [(False, held), (True, held), (False, held), (False, held), (True, held)]


def test_measure_scores_the_served_drafter_on_the_gates_rows_for_it(trained, monkeypatch):
    """measure() (reporting: it scores the served drafter every step anyway) takes the step's held-out rows first,
    and its scores of them are the publish gate's: the update then scores only its own weights, and the serving MAL
    it reports is the one a fresh scoring of those rows gives."""
    from drafttrain.online.acceptance import teacher_forced_acceptance
    from drafttrain.online.buffer import collate
    from drafttrain.rl import hooks

    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.holdout_frac=0.5",
                                        "online.measure_rows=64", "online.gate_min_rows=2", "online.estimate_rows=64")
    policy = trained["policy"]
    held = _capture_with_held_out_rows(tracker, trained)
    assert held >= 2
    tracker.measure()
    serving = tracker._serving_form()
    scored = []
    real = hooks.teacher_forced_acceptance

    def spy(drafter, batch, k):
        scored.append((drafter is serving, batch["aux"].shape[0]))
        return real(drafter, batch, k)

    monkeypatch.setattr(hooks, "teacher_forced_acceptance", spy)
    out = tracker.on_policy_update(policy, 0)
    assert scored == [(False, held)] and out["gate_rows"] == held
    fresh = teacher_forced_acceptance(serving, collate(tracker._heldout, tracker.steps), tracker.steps)["mal"]
    assert out["serving_mal"] == pytest.approx(fresh, rel=1e-5)


def test_the_estimate_scores_rollouts_held_out_of_training(trained, monkeypatch):
    """online.holdout_frac: captured rows drawn out of the training buffer; the update's estimate (the publish gate's
    and the canary's reference) scores only those. It scored the latest step's rows, which the update had just
    trained on: every update looked better than the serving drafter (+0.1% on average on the main job) while the
    live drafter fell 0.9% below the frozen one on fresh rollouts."""
    from drafttrain.rl import hooks

    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.holdout_frac=0.5")
    policy = trained["policy"]
    for extra in range(6):  # 24 more rows, of distinct lengths per capture
        seqs = [p + list(range(5, 12 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 7 - extra):
            policy(input_ids=ids)
    held = torch.cat([f["heldout"] for f in tracker.pending])
    assert len(held) == 28 and 0 < int(held.sum()) < 28
    assert len(tracker.buffer) == 28 - int(held.sum())  # held-out rows never reach the buffer
    held_aux = {f["aux"][b, :int(f["lengths"][b])].sum().item() for f in tracker.pending
                for b in range(len(f["heldout"])) if f["heldout"][b]}
    scored = []
    real = hooks.teacher_forced_acceptance

    def spy(drafter, batch, k):
        scored.extend(batch["aux"][b, :int(batch["lengths"][b])].sum().item() for b in range(len(batch["lengths"])))
        return real(drafter, batch, k)

    monkeypatch.setattr(hooks, "teacher_forced_acceptance", spy)
    out = tracker.on_policy_update(policy, 0)
    assert out["expected_mal"] is not None and scored and set(scored) <= held_aux


def test_an_update_with_no_step_is_idle_not_a_nan_alarm(trained, monkeypatch):
    """The bank covered a record when the update began, but not by the time its first step was due (here the
    buffer's sampling took the time): no drafter step ran. That is an idle update, not "all 0 drafter steps had a
    NaN/inf loss" (the main job logged that false alarm) nor a weight clone and an acceptance estimate for nothing."""
    clock = _fake_clock(monkeypatch)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    logs = tracker.log.__self__
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1  # 50 ms earned, 30 ms left
    sample = tracker.buffer.sample_groups

    def slow_sample(*a, **kw):
        clock[0] += 0.028
        return sample(*a, **kw)

    monkeypatch.setattr(tracker.buffer, "sample_groups", slow_sample)
    est = []
    monkeypatch.setattr("drafttrain.rl.hooks.teacher_forced_acceptance", lambda *a, **kw: est.append(1))
    out = tracker.on_policy_update(trained["policy"], 1)
    assert out["drafter_steps"] == 0 and not out["published"] and out["expected_mal"] is None
    assert not any("NOT PUBLISHED" in m for m in logs), logs
    assert est == [] and tracker.bank_s == pytest.approx(0.002)  # the 28 ms spent is charged


def test_time_bank_predicts_each_step_from_its_batch_lengths(trained, monkeypatch):
    """A drafter step costs in proportion to its batch's padded tokens: batches of long rollouts cost several times
    those of short ones. The bank predicts each step from its batch (seconds per token, a moving average), so an
    update never starts a step it cannot pay for and the bank never goes into debt; a per-step average let a long
    batch after short ones overspend it."""
    clock = _fake_clock(monkeypatch)
    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.budget_frac=0.05",
                                        "online.steps_per_update=50", "train.batch_size=1")
    rec = tracker.buffer.records[0]
    s, X, V = tracker.buffer.steps, rec["aux"].shape[1], rec["target_probs"].shape[1]
    g = torch.Generator().manual_seed(0)

    def record(L):
        return {"aux": torch.randn(L, X, generator=g), "next_ids": torch.randint(0, V, (L + s - 1,), generator=g),
                "target_probs": torch.softmax(torch.randn(L + s, V, generator=g), -1),
                "valid": torch.ones(L + s, dtype=torch.bool)}

    tracker.buffer.records.clear()
    for L in (4, 4, 4, 40, 4, 4, 4, 40):
        tracker.buffer.records.append(record(L))
    step = tracker.trainer.step

    def step_by_tokens(batch):  # 0.5 ms per padded position
        clock[0] += 0.0005 * batch["aux"].shape[0] * batch["aux"].shape[1]
        return step(batch)

    monkeypatch.setattr(tracker.trainer, "step", step_by_tokens)
    tracker._last_update_t = 0.0
    banks, steps = [], 0
    for i in range(16):
        clock[0] += 0.2  # each RL step earns 10 ms: five short steps, half a long one
        out = tracker.on_policy_update(trained["policy"], i)
        steps += out["drafter_steps"]
        banks.append(tracker.bank_s)
    assert steps >= 16
    assert min(banks[1:]) >= -1e-9, banks  # the first update, with nothing measured yet, may overspend


def test_host_work_outside_rl_steps_earns_no_budget(trained, monkeypatch):
    """Checkpoint saves and logging between RL steps (tracker.outside_rl_step) are not RL time: 1 s of RL plus 10 s
    of saving earns 50 ms, not 550 ms."""
    clock = _fake_clock(monkeypatch)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 0.5
    with tracker.outside_rl_step():
        clock[0] += 10.0
    clock[0] += 0.5
    tracker.on_policy_update(trained["policy"], 0)  # the first update: one batch (20 ms)
    assert tracker.bank_s == pytest.approx(0.03)


def test_resumed_tracker_keeps_the_banks_cost_predictions(trained, monkeypatch):
    """A resumed run restores the bank and its cost predictions: without them its first update trains whole batches
    unpredicted and overspends (bench_tracking resumes at each checkpoint; it overspent 0.19 s there)."""
    clock = _fake_clock(monkeypatch)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    tracker.on_policy_update(trained["policy"], 0)
    state = tracker.state_dict()
    fresh = _banked_tracker(trained, monkeypatch, clock)
    fresh.load_state_dict(state)
    assert fresh._tok_cost_s == pytest.approx(tracker._tok_cost_s) and fresh._tok_cost_s is not None
    assert fresh.bank_s == pytest.approx(tracker.bank_s)
    fresh._last_update_t = clock[0]
    clock[0] += 0.1  # earns 5 ms: with the 30 ms kept, one batch (25 ms predicted) and two records (12.5 ms)
    assert fresh.on_policy_update(trained["policy"], 1)["drafter_steps"] == 2
    assert fresh.bank_s == pytest.approx(0.005)


def test_time_bank_counts_rl_time_from_the_first_capture(trained, monkeypatch):
    """Set-up before the first rollout or capture (loading, engine builds) is not RL time: 100 s of it must not
    fill the bank. Only the 1 s from the first capture to the update earns: 50 ms, of which the first update (one
    batch, nothing measured yet) spends 20 ms."""
    from drafttrain.rl import hooks

    clock = _fake_clock(monkeypatch)
    real_capture = hooks.DraftTracker.start_capture

    def late_capture(self, *a, **kw):
        clock[0] += 100.0  # set-up time between construction and the first capture
        return real_capture(self, *a, **kw)

    monkeypatch.setattr(hooks.DraftTracker, "start_capture", late_capture)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    clock[0] += 1.0
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1
    assert tracker.bank_s == pytest.approx(0.03)  # 100 s earning 5 s would have left ~4.98 s


def test_capture_time_is_charged_to_the_time_bank(trained, monkeypatch):
    """Capturing features in the loss forward is online-training work inside the RL step: it does not earn budget
    and the bank pays for it. 1 s of RL with 30 ms of capture earns 0.05 x 0.97 s, less 30 ms: 18.5 ms, one step."""
    clock = _fake_clock(monkeypatch)
    _slowed(monkeypatch, clock, "build_features", 0.03)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    clock[0] += 0.97
    out = tracker.on_policy_update(trained["policy"], 0)
    assert out["capture_s"] == pytest.approx(0.03) and out["drafter_steps"] == 1
    assert tracker.bank_s == pytest.approx(0.0485 - 0.03 - 0.02)


def test_measure_time_earns_the_time_bank_nothing(trained, monkeypatch):
    """Scoring the live and frozen drafters (measure, every RL step) is reporting, not RL time: 1 s of RL and 0.6 s
    of measure earn 0.05 x 1 s (50 ms: the first update's batch, 20 ms, leaves 30 ms), not 0.05 x 1.6 s. It took
    1.5 s of a 3.4 s step of the main job, so it had inflated the bank by ~80%."""
    clock = _fake_clock(monkeypatch)
    _slowed(monkeypatch, clock, "teacher_forced_acceptance", 0.3)
    tracker = _banked_tracker(trained, monkeypatch, clock)
    tracker._last_update_t = 0.0
    clock[0] += 1.0
    assert tracker.measure()["measure_s"] == pytest.approx(0.6)
    assert tracker.on_policy_update(trained["policy"], 0)["drafter_steps"] == 1
    assert tracker.bank_s == pytest.approx(0.05 - 0.02 - 0.3)  # the update's own estimate (0.3 s) is drafter work


def test_measure_scores_a_random_sample_of_the_steps_rollouts(trained, monkeypatch):
    """online.measure_rows=3 of 12 captured rows: a sample drawn over all of them. The loss forward runs
    zero-advantage sequences last, sorted by length, so "the last rows" (the old rule) always scored the same kind."""
    from drafttrain.rl import hooks

    tracker, _ = _tracker_with_features(trained, _engine(trained), "online.measure_rows=3")
    policy = trained["policy"]
    for extra in (2, 4):  # rows of 3 response lengths: 6 (the helper's), 8, 10
        seqs = [p + list(range(5, 11 + extra)) for p in trained["prompts"][:4]]
        ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
        with tracker.capture(policy, response_start=ids.shape[1] - 6 - extra):
            policy(input_ids=ids)
    seen = []
    n_rows = lambda b: b["aux"].shape[0]  # noqa: E731
    monkeypatch.setattr(hooks, "teacher_forced_acceptance",
                        lambda d, batch, k: seen.append(batch["valid"].sum(1).tolist()) or
                        {"mal": 2.0, "acceptance_per_position": [0.5] * k, "row_mal": torch.full((n_rows(batch),), 2.0),
                         "row_steps": torch.ones(n_rows(batch))})
    for _ in range(10):
        tracker.measure()
    assert len(seen) == 20 and all(len(rows) == 3 for rows in seen)
    assert {n for rows in seen for n in rows} == {6, 8, 10}, seen  # every length drawn from


def test_measure_scores_the_drafters_the_engine_runs(trained):
    """engine.drafter_int8 (the default): the engine drafts with int8 linears, so measure() scores the live and the
    frozen drafter in that form (what the engine's acceptance is), not the fp32 training form. Live is what the
    engines serve, not the trainer's weights, which an undecided publish gate keeps training unpublished."""
    import copy

    from drafttrain.online.acceptance import teacher_forced_acceptance
    from drafttrain.rl.hooks import _rows

    tracker, _ = _tracker_with_features(trained, _engine(trained), "engine.drafter_int8=true")
    with torch.no_grad():
        for p in tracker.drafter.parameters():  # live and frozen differ
            p.add_(0.01 * torch.randn_like(p))
    tracker.publisher.good_weights = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}  # served
    batch = _rows(tracker.pending, tracker.steps, 64, torch.Generator())  # all 4 rows
    want = {name: teacher_forced_acceptance(copy.deepcopy(d).eval().fuse_for_inference(True), batch, 5)["mal"]
            for name, d in (("live", tracker.drafter), ("frozen", tracker.frozen))}
    fp32 = teacher_forced_acceptance(tracker.frozen, batch, 5)["mal"]
    with torch.no_grad():
        for p in tracker.drafter.parameters():  # an update the publish gate has not passed yet: not what serves
            p.add_(0.05 * torch.randn_like(p))
    got = tracker.measure(5)
    assert got["live_tf_mal"] == pytest.approx(want["live"], abs=1e-6)
    assert got["frozen_tf_mal"] == pytest.approx(want["frozen"], abs=1e-6)
    assert want["live"] != want["frozen"] and got["frozen_tf_mal"] != fp32


def test_captured_features_carry_the_policy_version(trained):
    # the buffer's recency weighting (online.buffer_half_life) needs each record's policy version
    engine = _engine(trained)
    tracker, _ = _tracker_with_features(trained, engine)
    n0 = len(tracker.buffer)
    assert tracker.buffer.half_life == 2.0 and {r["version"] for r in tracker.buffer.records} == {0}
    tracker.on_policy_update(trained["policy"], 4)
    seqs = [p + [5, 6, 7, 8] for p in trained["prompts"][:2]]
    ids = torch.tensor([s_[:min(map(len, seqs))] for s_ in seqs])
    with tracker.capture(trained["policy"], response_start=ids.shape[1] - 4):
        trained["policy"](input_ids=ids)
    assert [r["version"] for r in tracker.buffer.records] == [0] * n0 + [5] * (len(tracker.buffer) - n0)
    assert len(tracker.buffer) > n0


def test_nan_update_is_never_published(trained):
    engine = _engine(trained)
    tracker, logs = _tracker_with_features(trained, engine)
    for rec in tracker.buffer.records:  # features that make every drafter step non-finite
        rec["target_probs"].fill_(float("nan"))
    before = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}
    out = tracker.on_policy_update(trained["policy"], 0)
    assert out["drafter_skipped_nonfinite"] == out["drafter_steps"] == 2
    assert not out["published"] and tracker.version == 0 == engine.drafter_version
    assert all(torch.equal(before[k], v) for k, v in tracker.drafter.state_dict().items())
    assert any("NOT PUBLISHED" in m for m in logs), logs


def test_publisher_refuses_nonfinite_weights(trained):
    from drafttrain.online.hotswap import Publisher

    engine, logs = _engine(trained), []
    pub = Publisher([engine], trained["good"], trained["cfg"].online, log=logs.append)
    bad = {**trained["good"], "fc.weight": trained["good"]["fc.weight"].clone().fill_(float("inf"))}
    rec = pub.publish(bad, trained["expected"])
    assert not rec["published"] and engine.drafter_version == 0 == pub.version
    assert any("NOT PUBLISHED" in m and "fc.weight" in m for m in logs)


@pytest.mark.parametrize("lr", ["1e30", "inf"])
def test_diverged_update_is_not_published_and_training_recovers(trained, lr):
    """lr=1e30: finite but huge weights whose outputs are NaN; lr=inf: NaN weights. Neither reaches the engine, and
    the drafter goes back to its last good weights instead of staying broken."""
    engine = _engine(trained)
    tracker, logs = _tracker_with_features(trained, engine, f"train.lr={lr}", "online.publish_gate=false")
    out = tracker.on_policy_update(trained["policy"], 0)
    assert not out["published"] and tracker.version == 0 == engine.drafter_version
    assert any("NOT PUBLISHED" in m for m in logs), logs
    now = tracker.drafter.state_dict()
    assert all(torch.equal(now[k], trained["good"][k]) for k in now)  # back to the last good weights
    tracker.trainer.set_lr(1e-3)
    tracker.set_probe([])
    out = tracker.on_policy_update(trained["policy"], 1)
    assert out["published"] and out["drafter_skipped_nonfinite"] == 0 and engine.drafter_version == 1


def test_resume_after_rollback_serves_the_good_weights(trained):
    """The tracker's own drafter failed its canary: after a resume, the engine must serve the rolled-back-to weights."""
    from drafttrain.drafters import build_drafter
    from drafttrain.rl.hooks import DraftTracker

    engine = _engine(trained)
    tracker, _ = _tracker_with_features(trained, engine, "online.canary=probe")
    cfg, probe = tracker.cfg, trained["prompts"][:4]
    params = sampling_params(cfg, max_new_tokens=48)
    assert tracker.publisher.publish(trained["good"], trained["expected"], probe, params)["published"]
    zeros = _corrupt(trained["good"], "zeroed")
    tracker.drafter.load_state_dict(zeros)  # the trainer's drafter went bad
    assert tracker.publisher.publish(zeros, trained["expected"], probe, params)["rolled_back"]
    state = tracker.state_dict()

    engine2 = _engine(trained)  # a restart: fresh engine; the trainer restores its (bad) drafter
    drafter2 = build_drafter(cfg.drafter, trained["policy"])
    drafter2.load_state_dict(zeros)
    DraftTracker(cfg, trained["policy"], [engine2], drafter2, log=lambda m: None).load_state_dict(state)
    assert engine2.drafter_version == engine.drafter_version == 3
    served = engine2.drafter.state_dict()
    assert all(torch.equal(served[k], trained["good"][k]) for k in served)


# ---- kill and resume ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kill_and_resume(policy_dir, tmp_path):
    out, steps = tmp_path / "run", 6
    cmd = [sys.executable, "-m", "drafttrain.online", "recipe=eagle3_track",
           *overrides(policy_dir, out, f"rl.steps={steps}", "sampling.max_new_tokens=24")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    latest = out / "ckpt" / "latest"
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text().strip().split("-")[1]) >= 1:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before it was killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    state = torch.load(out / "ckpt" / latest.read_text().strip() / "state.pt", weights_only=False)
    step, version = state["step"], state["tracker"]["version"]
    assert 1 <= step < steps

    r = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"[drafttrain] resumed {out} at step {step}, drafter v{version}" in r.stdout + r.stderr
    recs = read_jsonl(out / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(steps))  # no lost or duplicated steps
    assert recs[step]["rollout_drafter_version"] == version  # the engine resumed at the checkpointed version
    assert [x["drafter_version"] for x in recs] == sorted(x["drafter_version"] for x in recs)
    assert (out / "report.png").is_file()
    assert json.loads((out / "eval.json").read_text())["before"] == state["eval_before"] is not None


# ---- bad input: one clear line, nothing written so far lost ---------------------------------------------------
@pytest.fixture(scope="module")
def first_run(policy_dir, tmp_path_factory):
    from drafttrain.online.run import cli

    out = tmp_path_factory.mktemp("first")
    cli(["recipe=eagle3_track", *overrides(policy_dir, out)])
    return out


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _bad_aux_recipe(tmp_path, policy_dir) -> str:
    path = tmp_path / "bad_aux.yaml"
    path.write_text(f"policy:\n  path: {policy_dir}\ndrafter:\n  kind: eagle3\n  path: null\n"
                    f"  aux_layer_ids: [1, 2, 9]\n")
    return str(path)


@pytest.mark.parametrize("case", ["aux_layer_ids", "buffer_mb", "resume_other_recipe"])
def test_bad_input_one_line_error_nothing_lost(first_run, policy_dir, tmp_path, case):
    from drafttrain.online.run import cli

    args = {"aux_layer_ids": [f"recipe={_bad_aux_recipe(tmp_path, policy_dir)}", "run.resume=false"],
            "buffer_mb": ["recipe=eagle3_track", "online.buffer_mb=0"],
            "resume_other_recipe": ["recipe=eagle3_frozen"]}[case]
    expect = {"aux_layer_ids": "drafter.aux_layer_ids", "buffer_mb": "online.buffer_mb",
              "resume_other_recipe": "run.resume"}[case]
    before = _files(first_run)
    assert (first_run / "ckpt" / "step-1" / "state.pt").is_file() and (first_run / "config.yaml").is_file()
    with pytest.raises(SystemExit) as e:
        cli([*overrides(policy_dir, first_run), *args])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and expect in msg, msg
    assert _files(first_run) == before  # the first run's config, metrics and checkpoint are untouched


def test_resume_with_another_number_of_processes_is_one_line(first_run, policy_dir, tmp_path):
    """The drafter trainer's state holds one buffer shard per process: resuming it with another number of
    processes is bad input (it was a ValueError traceback), and the checkpoint stays as it was."""
    import shutil

    from drafttrain.online.run import cli

    run = tmp_path / "run"
    shutil.copytree(first_run, run)
    tpath = run / "ckpt" / (run / "ckpt" / "latest").read_text().strip() / "trainer.pt"
    state = torch.load(tpath, weights_only=False)
    state["world"] = 2  # as written by a 2-process run
    torch.save(state, tpath)
    before = _files(run)
    with pytest.raises(SystemExit) as e:
        cli([*overrides(policy_dir, run), "recipe=eagle3_track"])
    msg = str(e.value.code)
    assert msg.startswith("error: run.resume: ") and "2 processes" in msg and "\n" not in msg, msg
    assert _files(run) == before
