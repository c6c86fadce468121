"""Publishing into the engines: atomic swaps mid-generation, the canary and rollback, non-finite drafter updates,
resume after a rollback.
"""
from __future__ import annotations

import threading

import pytest
import torch

from drafttrain.config import load_recipe, sampling_params
from tests.integration.conftest import corrupt, engine_for, tracker_with_features

pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize("canary", ["probe", "inline"])
@pytest.mark.parametrize("how", ["zeroed", "shuffled"])
def test_canary_rolls_back_a_corrupt_drafter(trained, how, canary):
    """probe: judged by a probe right after the swap; inline: by the first rollout batch the new version serves."""
    from drafttrain.tracking.hotswap import Publisher

    engine, logs = engine_for(trained), []
    cfg, probe = trained["cfg"].copy(), trained["prompts"][:4]
    cfg.online.canary = canary
    params = sampling_params(cfg.sampling, max_new_tokens=cfg.online.canary_max_new_tokens)
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=logs.append)

    def publish(weights):
        rec = pub.publish(weights, trained["expected"], probe, params)
        if canary == "inline":
            assert rec["canary_mal"] is None and pub.pending["version"] == rec["version"]
            rec.update(pub.observe(engine.generate(probe, params)))  # the engine's next rollouts
        return rec

    ok = publish(trained["good"])
    assert ok["published"] and not ok["rolled_back"] and engine.drafter_version == 1

    bad = publish(corrupt(trained["good"], how))
    assert bad["rolled_back"] and bad["canary_mal"] < ok["canary_mal"]
    assert bad["version"] == engine.drafter_version == 3 and pub.good_version == 1  # v2 failed; v3 = v1's weights
    served = engine.drafter.state_dict()
    assert all(torch.equal(served[k], trained["good"][k]) for k in served)
    assert engine.generate(probe, params).stats.mean_accepted_length > 2.0
    assert any("ROLLBACK" in m and "v2" in m for m in logs), logs


def test_inline_canary_waits_for_a_batch_of_the_new_version(trained):
    """A batch the old version generated (or a mix) does not judge the new one; the next pure batch does."""
    from drafttrain.tracking.hotswap import Publisher

    engine, cfg, probe = engine_for(trained), trained["cfg"], trained["prompts"][:2]
    params = sampling_params(cfg.sampling, max_new_tokens=16)
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=lambda m: None)
    old_batch = engine.generate(probe, params)
    assert pub.publish(corrupt(trained["good"], "zeroed"), trained["expected"])["published"]
    assert pub.observe(old_batch) == {} and pub.pending is not None  # v0's batch says nothing about v1
    rec = pub.observe(engine.generate(probe, params))
    assert rec["rolled_back"] and pub.pending is None and engine.drafter_version == 2 and pub.good_version == 0
    assert pub.observe(engine.generate(probe, params)) == {}  # nothing pending any more


def test_pooled_canary_judges_with_every_process(trained):
    """Several processes (Publisher pool; here a second process simulated by what it adds to the sums): observe
    and fail only record, and settle judges on what every process recorded, so all take the same verdict."""
    from drafttrain.tracking.hotswap import Publisher

    engine, cfg, probe = engine_for(trained), trained["cfg"], trained["prompts"][:2]
    params = sampling_params(cfg.sampling, max_new_tokens=16)
    other = [0.0] * 4  # the other process's failures, MAL x verify rows, verify rows, expected MAL x verify rows
    pub = Publisher([engine], engine.drafter.state_dict(), cfg.online, log=lambda m: None,
                    pool=lambda xs: [a + b for a, b in zip(xs, other)])
    assert pub.publish(corrupt(trained["good"], "zeroed"), trained["expected"])["published"]  # v1
    assert pub.observe(engine.generate(probe, params)) == {} and pub.pending is not None  # recorded, not judged
    other[:] = [0.0, 6.0 * 1000, 1000.0, trained["expected"] * 1000]  # there, v1 accepted everything over 1000 steps
    rec = pub.settle()
    assert rec["canary_mal"] > 5.0 and not rec["rolled_back"] and pub.good_version == 1 == engine.drafter_version
    assert pub.settle() == {}  # nothing pending
    assert pub.publish(trained["good"], trained["expected"])["published"]  # v2
    other[:] = [0.0] * 4
    assert pub.settle() == {} and pub.pending is not None  # nothing recorded anywhere yet: still pending
    other[:] = [1.0, 0.0, 0.0, 0.0]  # an engine failed with v2 in the other process: this one rolls back too
    rec = pub.settle()
    assert rec["rolled_back"] and engine.drafter_version == 3 and pub.good_version == 1
    assert pub.publish(trained["good"], trained["expected"])["published"]  # v4
    other[:] = [0.0] * 4
    assert pub.fail(RuntimeError("boom")) == {"deferred": True} and engine.drafter_version == 4  # not alone
    assert pub.settle()["rolled_back"] and engine.drafter_version == 5
    # the probe canary pools its probes: good weights here, but the other process's engine failed with them
    probe_cfg = cfg.copy()
    probe_cfg.online.canary = "probe"
    engine2 = engine_for(trained)
    pub2 = Publisher([engine2], trained["good"], probe_cfg.online, log=lambda m: None,
                     pool=lambda xs: [a + b for a, b in zip(xs, [1.0, 0.0, 0.0, 0.0])])
    rec = pub2.publish(trained["good"], trained["expected"], probe, params)
    assert rec["rolled_back"] and engine2.drafter_version == 2


@pytest.mark.parametrize("canary", ["probe", "inline"])
def test_canary_rolls_back_a_drafter_that_crashes_the_engine(trained, canary):
    """Huge (finite) weights make the int8 drafter's kernels fail: a failed canary, not a dead RL job. Inline, the
    rollout that failed is generated again with the good drafter (DraftTracker.generate)."""
    from drafttrain.tracking.hotswap import Publisher

    engine, logs = engine_for(trained, int8=True), []
    cfg, probe = trained["cfg"].copy(), trained["prompts"][:2]
    cfg.online.canary = canary
    params = sampling_params(cfg.sampling, max_new_tokens=16)
    huge = {k: v * 1e10 if v.is_floating_point() else v for k, v in trained["good"].items()}
    if canary == "probe":
        pub = Publisher([engine], trained["good"], cfg.online, log=logs.append)
        rec = pub.publish(huge, trained["expected"], probe, params)
    else:
        tracker, logs = tracker_with_features(trained, engine)
        rec = tracker.publisher.publish(huge, trained["expected"])
        with pytest.raises((RuntimeError, ValueError)):
            engine.generate(probe, params)  # what the rollout would die of
        batch, verdict = tracker.generate(engine, probe, params)
        rec.update(verdict)
        assert batch.drafter_versions and set(batch.drafter_versions) == {2}
    assert rec["rolled_back"] and engine.drafter_version == 2 and any("ROLLBACK" in m for m in logs)
    # the good weights serve again: the same seeded generation as an engine that only ever served them (a bare MAL
    # bound on 2 unseeded rows of 16 tokens sat at its edge on one CPU's int8 kernels)
    ref = engine_for(trained, int8=True)
    ref.load_drafter(trained["good"], 2)
    seeded = sampling_params(cfg.sampling, max_new_tokens=16, seed=3)
    got, want = engine.generate(probe, seeded), ref.generate(probe, seeded)
    assert got.tokens == want.tokens and got.stats.accepted_per_position == want.stats.accepted_per_position
    assert want.stats.mean_accepted_length > 1.0  # the good drafter is accepted at all


def test_nan_update_is_never_published(trained):
    engine = engine_for(trained)
    tracker, logs = tracker_with_features(trained, engine)
    for rec in tracker.buffer.records:  # features that make every drafter step non-finite
        rec["hidden"].fill_(float("nan"))
    before = {k: v.clone() for k, v in tracker.drafter.state_dict().items()}
    out = tracker.on_policy_update(trained["policy"], 0)
    assert out["drafter_skipped_nonfinite"] == out["drafter_steps"] == 2
    assert not out["published"] and tracker.version == 0 == engine.drafter_version
    assert all(torch.equal(before[k], v) for k, v in tracker.drafter.state_dict().items())
    assert any("NOT PUBLISHED" in m for m in logs), logs


def test_publisher_refuses_nonfinite_weights(trained):
    from drafttrain.tracking.hotswap import Publisher

    engine, logs = engine_for(trained), []
    pub = Publisher([engine], trained["good"], trained["cfg"].online, log=logs.append)
    bad = {**trained["good"], "fc.weight": trained["good"]["fc.weight"].clone().fill_(float("inf"))}
    rec = pub.publish(bad, trained["expected"])
    assert not rec["published"] and engine.drafter_version == 0 == pub.version
    assert any("NOT PUBLISHED" in m and "fc.weight" in m for m in logs)


@pytest.mark.parametrize("lr", ["1e30", "inf"])
def test_diverged_update_is_not_published_and_training_recovers(trained, lr):
    """lr=1e30: finite but huge weights whose outputs are NaN; lr=inf: NaN weights. Neither reaches the engine, and
    the drafter goes back to its last good weights instead of staying broken."""
    engine = engine_for(trained)
    tracker, logs = tracker_with_features(trained, engine, f"train.lr={lr}", "online.publish_gate=false")
    out = tracker.on_policy_update(trained["policy"], 0)
    assert not out["published"] and tracker.version == 0 == engine.drafter_version
    assert any("NOT PUBLISHED" in m for m in logs), logs
    now = tracker.drafter.state_dict()
    assert all(torch.equal(now[k], trained["good"][k]) for k in now)  # back to the last good weights
    tracker.trainer.set_lr(1e-3)
    tracker.set_probe([], ())
    out = tracker.on_policy_update(trained["policy"], 1)
    assert out["published"] and out["drafter_skipped_nonfinite"] == 0 and engine.drafter_version == 1


def test_the_probe_canary_stops_where_the_rollouts_stop(trained):
    """The probe generated without the rollouts' stop tokens: it drafted past the end of the text, where no drafter
    was trained, and read low (the main job with online.canary=probe rolled a good drafter back: 2.69 < 2.70)."""
    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine, "online.canary=probe", "online.publish_gate=false")
    seen, generate = [], engine.generate
    engine.generate = lambda prompts, params, speculative=True: (seen.append(params), generate(prompts, params,
                                                                                              speculative))[1]
    tracker.set_probe(trained["prompts"][:2], [7])
    assert tracker.on_policy_update(trained["policy"], 0)["published"]
    assert seen and all(p.stop_token_ids == (7,) for p in seen)


def test_resume_after_rollback_serves_the_good_weights(trained):
    """The tracker's own drafter failed its canary: after a resume, the engine must serve the rolled-back-to weights."""
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker

    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine, "online.canary=probe")
    cfg, probe = tracker.cfg, trained["prompts"][:4]
    params = sampling_params(cfg.sampling, max_new_tokens=48)
    assert tracker.publisher.publish(trained["good"], trained["expected"], probe, params)["published"]
    zeros = corrupt(trained["good"], "zeroed")
    tracker.drafter.load_state_dict(zeros)  # the trainer's drafter went bad
    assert tracker.publisher.publish(zeros, trained["expected"], probe, params)["rolled_back"]
    state = tracker.state_dict()

    engine2 = engine_for(trained)  # a restart: fresh engine; the trainer restores its (bad) drafter
    drafter2 = build_drafter(cfg.drafter, trained["policy"])
    drafter2.load_state_dict(zeros)
    DraftTracker(cfg, trained["policy"], [engine2], drafter2, log=lambda m: None).load_state_dict(state)
    assert engine2.drafter_version == engine.drafter_version == 3
    served = engine2.drafter.state_dict()
    assert all(torch.equal(served[k], trained["good"][k]) for k in served)


def test_resume_serves_a_published_version_its_canary_has_not_judged_yet(trained):
    """Published, then the run stopped before any SD step drafted with it (AR rollouts, a toggle that kept SD off,
    or simply the checkpoint right after the update): not rejected, so a resume serves it again, still on probation
    (a resume served the last judged weights, dropping every update published since)."""
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker

    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine)
    newer = {k: v + 0.01 if v.is_floating_point() else v for k, v in trained["good"].items()}
    assert tracker.publisher.publish(newer, trained["expected"])["published"]
    assert tracker.publisher.pending is not None and tracker.publisher.good_version == 0  # on probation
    state = tracker.state_dict()

    engine2 = engine_for(trained)
    tracker2 = DraftTracker(tracker.cfg, trained["policy"], [engine2],
                            build_drafter(tracker.cfg.drafter, trained["policy"]), log=lambda m: None)
    tracker2.load_state_dict(state)
    served = engine2.drafter.state_dict()
    assert all(torch.equal(served[k], newer[k]) for k in served)
    pend = tracker2.publisher.pending
    assert pend is not None and pend["version"] == engine2.drafter_version == state["version"] == 1
    assert all(torch.equal(pend["weights"][k], newer[k]) for k in newer)
    # judged as before the restart: a batch drafted with it passes its canary and it becomes the good version
    params = sampling_params(tracker.cfg.sampling, max_new_tokens=32)
    tracker2.observe_rollout(engine2.generate(trained["prompts"], params))
    assert tracker2.publisher.pending is None and tracker2.publisher.good_version == 1


def test_a_checkpoint_stores_each_distinct_drafter_tensor_once(trained, tmp_path):
    """The frozen step-0 drafter stored elsewhere (the run folder's file: `shared`), an update published and judged
    good: the trained, the last good and the frozen weights are then one copy, and the frozen ones none. A second
    update on probation: the pending weights are the trained ones; the last good ones a copy of their own. A fresh
    tracker loads every set back exactly, and its engine serves the version on probation."""
    from drafttrain.checkpoint import load_checkpoint
    from drafttrain.drafters import build_drafter
    from drafttrain.tracking.tracker import DraftTracker
    from drafttrain.tracking.weightsets import weight_sets

    engine = engine_for(trained)
    tracker, _ = tracker_with_features(trained, engine, "online.publish_gate=false")
    frozen = {k: v.clone() for k, v in tracker.frozen.state_dict().items()}
    shared = {"run_frozen": frozen}
    params = sampling_params(tracker.cfg.sampling, max_new_tokens=32)
    assert tracker.on_policy_update(trained["policy"], 0)["published"]
    tracker.observe_rollout(engine.generate(trained["prompts"], params))  # its canary passes: good == trained
    assert tracker.publisher.pending is None and tracker.publisher.good_version == 1
    state = tracker.state_dict(shared)
    trained_new = [k for k, v in tracker.drafter.state_dict().items() if not torch.equal(v, frozen[k])]
    assert trained_new and all(v == "run_frozen" for v in state["frozen"].values())
    assert sorted(k for k, v in state["trained"].items() if torch.is_tensor(v)) == sorted(trained_new)
    assert all(isinstance(v, str) for v in state["good_weights"].values())  # one copy: trained's or frozen's

    assert tracker.on_policy_update(trained["policy"], 1)["published"]  # v2, on probation
    assert tracker.publisher.pending is not None and tracker.publisher.good_version == 1
    want = {"frozen": frozen, "trained": tracker.drafter.state_dict(), "good_weights": tracker.publisher.good_weights,
            "pending": tracker.publisher.pending["weights"]}
    torch.save(tracker.state_dict(shared), tmp_path / "state.pt")
    tracker.save_training(tmp_path)
    state = load_checkpoint(tmp_path / "state.pt")
    assert all(v in ("trained", "run_frozen") for v in state["pending"]["weights"].values())
    assert any(torch.is_tensor(v) for v in state["good_weights"].values())  # v1: not v2's weights
    assert weight_sets(state, shared).keys() == want.keys()
    for name, got in weight_sets(state, shared).items():
        assert got.keys() == want[name].keys() and all(torch.equal(got[k], want[name][k]) for k in got), name

    engine2 = engine_for(trained)
    fresh = DraftTracker(tracker.cfg, trained["policy"], [engine2],
                         build_drafter(tracker.cfg.drafter, trained["policy"]), log=lambda m: None)
    fresh.load_state_dict(state, tmp_path, shared)
    got = {"frozen": fresh.frozen.state_dict(), "trained": fresh.drafter.state_dict(),
           "good_weights": fresh.publisher.good_weights, "pending": fresh.publisher.pending["weights"]}
    for name in want:
        assert all(torch.equal(got[name][k], want[name][k]) for k in want[name]), name
    served = engine2.drafter.state_dict()
    assert engine2.drafter_version == 2 and all(torch.equal(served[k], want["pending"][k]) for k in served)
