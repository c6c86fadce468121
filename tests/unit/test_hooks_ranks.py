"""DraftTracker's update decisions: a failed background update reaches the RL loop, and under DDP (2 gloo processes,
tiny sizes) every process takes the same drafter steps and the same publish decision, so their drafters stay equal."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from drafttrain.config import load_recipe
from tests.conftest import tiny_policy


def _cfg(*over):
    return load_recipe("eagle3_track", ["drafter.path=null", "run.tensorboard=false", "train.batch_size=4",
                                        "online.steps_per_update=2", "sampling.max_new_tokens=16", *over])


def _tracker(c, accelerator=None, engines=()):
    from drafttrain.drafters import build_drafter
    from drafttrain import DraftTracker

    policy = tiny_policy()
    torch.manual_seed(1)
    return policy, DraftTracker(c, policy, list(engines), build_drafter(c.drafter, policy), accelerator=accelerator,
                                log=lambda m: None)


class _Engine:
    """Just what the publisher needs of an engine: versioned loads."""

    def __init__(self):
        self.drafter_version = 0

    def load_drafter(self, weights, version):
        self.drafter_version = version


def _batch(version: int, mal: int):
    """A rollout batch of 4 rows that drafter `version` generated, every verify step accepting mal - 1 drafts."""
    from drafttrain.engines.base import RolloutBatch
    from drafttrain.spec import SpecStats

    st = SpecStats()
    st.update(torch.full((4,), mal - 1), k=5)
    return RolloutBatch([], [], st, version, drafter_versions=[version])


def _rl_step(tr, policy, step, gen):
    ids = torch.randint(1, 30, (4, 20), generator=gen)
    with tr.capture(policy, response_start=4):
        policy(input_ids=ids, attention_mask=torch.ones_like(ids))
    return tr.on_policy_update(policy, step)


def test_async_update_error_is_raised_by_wait():
    """online.mode=async: what the background update raises comes out of wait(), not the previous step's record."""
    torch.set_num_threads(1)
    policy, tr = _tracker(_cfg("online.mode=async", "online.publish_gate=false"))
    gen = torch.Generator().manual_seed(0)
    _rl_step(tr, policy, 0, gen)
    assert tr.wait()["drafter_steps"] > 0

    def boom(batch, head=None):
        raise RuntimeError("drafter step failed")

    tr.trainer.step = boom
    _rl_step(tr, policy, 1, gen)
    with pytest.raises(RuntimeError, match="drafter step failed") as err:
        tr.wait()
    assert any(e.name == "boom" for e in err.traceback)  # the background thread's traceback, kept
    assert tr.wait() == {}  # raised once; no stale record of step 0 either


def _rank_main(rank: int, store: str, out: str, case: str) -> None:
    """One of 2 gloo processes: a few RL steps whose data (and, for "bank", RL-step time) differ by process."""
    # the process group comes from a file store (no port to pick); accelerate only checks that MASTER_* are set
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from accelerate import Accelerator

    from drafttrain.tracking.collective import Collective

    over = {"buffer": ["online.budget_frac=0", "online.publish_gate=false"],
            "bank": ["online.budget_frac=0.5", "online.publish_gate=false"],
            "gate": ["online.budget_frac=0", "train.lr=3e-2"], "async": ["online.mode=async"],
            "canary": ["online.budget_frac=0", "online.publish_gate=false", "online.canary=inline"]}[case]
    acc = Accelerator(cpu=True)
    try:
        policy, tr = _tracker(_cfg("online.holdout_frac=0.0", *over), acc,
                              [_Engine()] if case == "canary" else ())
    except ValueError as e:
        torch.save({"error": str(e)}, f"{out}/rank{rank}.pt")
        Collective(acc).settle()  # as the main job ends: see Collective.settle
        torch.distributed.destroy_process_group()
        return
    gen = torch.Generator().manual_seed(100 + rank)  # each process its own rollouts
    recs = []
    for step in range(4 if case == "gate" else 3):
        if case == "bank":
            time.sleep(1.0 if rank == 0 else 0.0)  # process 0's rollouts take longer: the other waits for it
        if case == "buffer" and rank == 1 and step == 0:
            recs.append(tr.on_policy_update(policy, step))  # nothing captured here yet: an empty buffer
        else:
            recs.append(_rl_step(tr, policy, step, gen))
        if case == "canary" and step == 0:  # v1's first rollouts: nothing accepted here, all accepted there
            recs.append({"verdict": tr.observe_rollout(_batch(tr.version, 1 if rank == 0 else 6)),
                         "version": tr.version})
    weights = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    agree = []
    if case == "buffer":  # the end-of-run check: equal now; then one process's weights moved, seen by both
        agree.append(tr.collective.agreement(tr.version, tr.drafter))
        if rank == 1:
            with torch.no_grad():
                next(tr.drafter.parameters()).view(-1)[0] += 1.0
        agree.append(tr.collective.agreement(tr.version, tr.drafter))
    torch.save({"recs": recs, "weights": weights, "version": tr.version, "agree": agree}, f"{out}/rank{rank}.pt")
    tr.collective.settle()  # as the main job ends: see Collective.settle
    torch.distributed.destroy_process_group()


def _run_ranks(case: str, tmp_path, timeout_s: float = 240.0) -> list[dict]:
    """Both processes' results; fails (instead of hanging) when one errs or they are not both done in time."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), str(tmp_path), case)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the other would wait on it for good
            break
        time.sleep(0.2)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    assert not alive and codes == [0, 0], f"processes still running: {alive}, exit codes: {codes}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", ["buffer", "bank"])
def test_processes_take_the_same_drafter_steps(case, tmp_path):
    """A drafter step is a collective: processes whose buffers ("buffer": one has captured nothing yet) or time
    banks ("bank": one waits for the other, a wait its own clock would charge to the bank) differ still take the
    same steps, and their drafters stay equal."""
    r0, r1 = _run_ranks(case, tmp_path)
    steps = [[r["drafter_steps"] for r in res["recs"]] for res in (r0, r1)]
    assert steps[0] == steps[1] and sum(steps[0]) > 0, steps
    assert r0["weights"].keys() == r1["weights"].keys()
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    if case == "buffer":  # Collective.agreement, the main job's end-of-run check, sees the same on both processes
        assert r0["agree"] == r1["agree"] and r0["agree"][0]["agree"] and not r0["agree"][1]["agree"]
        assert r0["agree"][1]["versions"] == [r0["version"]] * 2


def test_processes_take_the_same_publish_decision(tmp_path):
    """online.publish_gate: each process scores its own rollouts, but the estimate and the serving drafter's score
    are pooled over all of them, so every process gates (resets to the serving weights) or publishes alike."""
    r0, r1 = _run_ranks("gate", tmp_path)
    decisions = [[(r["gated"], r["published"], r["expected_mal"], r["serving_mal"]) for r in res["recs"]]
                 for res in (r0, r1)]
    assert decisions[0] == decisions[1], decisions
    assert all(d[3] is not None for d in decisions[0])  # the gate scored every update
    assert r0["version"] == r1["version"]
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])


def test_async_mode_with_several_processes_fails_at_start(tmp_path):
    """online.mode=async under DDP: the background update's collectives would interleave with the RL loop's on the
    same process group (a hang or a mismatched reduce): refused at start-up with one line naming the key."""
    errors = [r.get("error", "") for r in _run_ranks("async", tmp_path)]
    assert all(e.startswith("online.mode: async runs with one process only") and "\n" not in e for e in errors)


def test_processes_take_the_same_canary_verdict(tmp_path):
    """online.canary=inline: each process sees its own rollouts (here: one drafted nothing accepted, the other
    everything). A process that judged alone rolled back its engines only (versions, then drafter weights, apart);
    the verdict is now taken at the next update on the MAL pooled over all processes, alike everywhere."""
    r0, r1 = _run_ranks("canary", tmp_path)
    assert [r.get("version") for r in r0["recs"]] == [r.get("version") for r in r1["recs"]]
    assert r0["recs"][1]["verdict"] == r1["recs"][1]["verdict"] == {}  # recorded, not judged alone
    settled = r0["recs"][2]
    assert settled["canary_mal"] == r1["recs"][2]["canary_mal"] == 3.5  # (1 x 4 + 6 x 4) / 8 verify rows
    assert settled["rolled_back"] is r1["recs"][2]["rolled_back"] is False
    assert r0["version"] == r1["version"]
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
