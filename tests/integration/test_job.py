"""The main job end to end on a tiny random policy (CPU): RL steps with hot-swaps (sync and async), the
records' keys, kill and resume, and bad input.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from drafttrain.checkpoint import shared_sets
from drafttrain.config import PROJECT_ROOT, load_recipe
from drafttrain.export import load_drafter
from drafttrain.report import read_jsonl
from drafttrain.tracking.weightsets import weight_sets
from tests.integration.conftest import kill_at_checkpoint

KEYS = {"step", "reward_mean", "resp_len_mean", "rollout_tokens_per_s", "live_mal", "live_k", "live_acc_pos",
        "live_tf_mal", "live_tf_acc_pos", "frozen_tf_mal", "frozen_tf_acc_pos", "drafter_train_s", "swap_s",
        "policy_minus_drafter_version", "rl_step_s", "drafter_version", "published", "rolled_back", "canary_mal"}

pytestmark = pytest.mark.usefixtures("one_thread")


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

    from drafttrain.rl import job

    engines = []
    build = job.build_engine
    monkeypatch.setattr(job, "build_engine", lambda *a, **kw: engines.append(build(*a, **kw)) or engines[-1])
    settled, settle = [], job.Collective.settle
    monkeypatch.setattr(job.Collective, "settle", lambda self: settled.append(self.n) or settle(self))
    cfg = load_recipe("eagle3_track", overrides(policy_dir, tmp_path, f"rl.mode={mode}", f"online.mode={mode}",
                                                "online.canary=probe"))
    (rec,) = job.main(cfg)
    assert settled == [1]  # the job's last act: its processes settle (Collective.settle says why)

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
    served = load_drafter(tmp_path / "export" / "drafter").state_dict()  # the deliverable: the drafter it served
    good = weight_sets(state["tracker"], shared_sets(tmp_path / "ckpt" / "step-1"))["good_weights"]
    assert all(torch.equal(served[n], t) for n, t in good.items())


def test_rl_step_time_includes_the_steps_own_rollout(policy_dir, tmp_path, monkeypatch):
    """rl_step_s adds up to the RL loop's wall time: a step's rollouts are generated inside the step before it,
    except the first step's, which the loop makes before it starts; that one counts in the first step (it did not,
    so online overhead against the RL step read ~0.2 points high)."""
    from drafttrain.rl import job
    from drafttrain.rl.grpo import GRPO

    took = {}
    real = GRPO.rollout

    def timed(self, step):
        t = time.perf_counter()
        out = real(self, step)
        took[step] = time.perf_counter() - t
        return out

    monkeypatch.setattr(GRPO, "rollout", timed)
    (rec,) = job.main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "rl.eval_prompts=0")))
    assert 0 in took and rec["rl_step_s"] >= took[0]
    assert rec["rl_step_s"] - took[0] >= rec["drafter_train_s"]  # the rest is the step's own training


def test_inline_canary_judges_a_swap_on_the_next_rollouts(policy_dir, tmp_path):
    """online.canary=inline (the default): no probe generation; step 1's rollouts, the first the v1 drafter
    generated, are its canary, and the verdict lands in step 0's record."""
    from drafttrain.rl.job import main

    cfg = load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "rl.steps=2", "online.budget_frac=0"))
    assert cfg.online.canary == "inline"
    r0, r1 = main(cfg)
    assert r0["published"] and r1["rollout_drafter_version"] == 1
    assert r0["canary_mal"] == r1["live_mal"] >= 1.0 and not r0["rolled_back"]


def test_frozen_drafter_records_the_same_keys(policy_dir, tmp_path):
    """online.track=false (the frozen baseline): no swap, but metrics.jsonl has the same keys as a tracking run."""
    from drafttrain.rl.job import main

    (rec,) = main(load_recipe("eagle3_track", overrides(policy_dir, tmp_path, "online.track=false")))
    assert KEYS <= set(rec), KEYS - set(rec)
    assert rec["drafter_version"] == 0 and not rec["published"] and rec["swap_s"] is None
    assert rec["live_tf_mal"] == rec["frozen_tf_mal"]


# ---- kill and resume ------------------------------------------------------------------------------------------
RESUME_RECIPES = ["eagle3_track", "mtp_track", "draft_model_track", "selfdraft_int8_track", "suffix_track",
                  "auto_track"]


def test_kill_and_resume_covers_every_registered_kind():
    """One recipe per kind of the registry: a kind added to it without a kill-and-resume run here fails."""
    from drafttrain.drafters import DRAFTERS

    assert sorted(load_recipe(r).drafter.kind for r in RESUME_RECIPES) == sorted(DRAFTERS)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RESUME_RECIPES)
def test_kill_and_resume(policy_dir, tmp_path, recipe):
    """Each drafter kind (suffix: nothing to save; its index is rebuilt from the resumed run's rollouts)."""
    out, steps = tmp_path / "run", 6
    fresh = ["drafter.auto.paths=[null,null]"] if recipe == "auto_track" else []  # members fresh for this policy
    cmd = [sys.executable, "-m", "drafttrain.online", f"recipe={recipe}",
           *overrides(policy_dir, out, f"rl.steps={steps}", "sampling.max_new_tokens=24", *fresh)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    latest = out / "ckpt" / "latest"
    kill_at_checkpoint(cmd, env, latest, 1, timeout_s=240)
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
    serve = json.loads((out / "export" / "serve.json").read_text())  # the deliverable, written by the rerun
    assert (out / "export" / "policy" / "config.json").is_file()
    assert ("speculative_config" in serve) == (recipe not in ("suffix_track", "auto_track"))


# ---- bad input: one clear line, nothing written so far lost ---------------------------------------------------
@pytest.fixture(scope="module")
def first_run(policy_dir, tmp_path_factory):
    from drafttrain.online import cli

    out = tmp_path_factory.mktemp("first")
    cli(["recipe=eagle3_track", *overrides(policy_dir, out)])
    return out


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _bad_aux_recipe(tmp_path, policy_dir) -> str:
    path = tmp_path / "bad_aux.yaml"
    path.write_text(f"policy:\n  path: {policy_dir}\ndrafter:\n  kind: eagle3\n  path: null\n"
                    f"  eagle3:\n    aux_layer_ids: [1, 2, 9]\n")
    return str(path)


@pytest.mark.parametrize("case", ["aux_layer_ids", "buffer_mb", "resume_other_recipe"])
def test_bad_input_one_line_error_nothing_lost(first_run, policy_dir, tmp_path, case):
    from drafttrain.online import cli

    args = {"aux_layer_ids": [f"recipe={_bad_aux_recipe(tmp_path, policy_dir)}", "run.resume=false"],
            "buffer_mb": ["recipe=eagle3_track", "online.buffer_mb=0"],
            "resume_other_recipe": ["recipe=eagle3_frozen"]}[case]
    expect = {"aux_layer_ids": "drafter.eagle3.aux_layer_ids", "buffer_mb": "online.buffer_mb",
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

    from drafttrain.online import cli

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


def test_progress_bar_shows_the_frozen_drafter_only_where_measured():
    """A kind that trains nothing (suffix, selfquant, auto) has no frozen MAL: the bar read frozen=0.00 there."""
    from drafttrain.rl.job import postfix

    rec = {"reward_mean": 0.5, "live_mal": 2.25, "frozen_tf_mal": None}
    assert postfix(rec, 3) == {"reward": "0.50", "mal": "2.25", "v": 3}
    assert postfix({**rec, "frozen_tf_mal": 1.5}, 4)["frozen"] == "1.50"
