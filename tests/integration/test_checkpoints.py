"""Checkpoints at a cadence (run.checkpoint_every), the newest run.keep_checkpoints kept, the frozen drafter stored
once per run folder: a run killed or stopped between checkpoints, or resumed from an earlier kept one (in a copy of
its folder), ends as the uninterrupted run does, each step's record once."""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.checkpoint import load_checkpoint, shared_sets
from drafttrain.config import load_recipe
from drafttrain.report import read_jsonl
from drafttrain.tracking.weightsets import weight_sets
from tests.integration.test_job import overrides

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 5
# every update's estimate and gate on held-out rows (the gate judges too few rows to publish here: the canary's
# tests drive it), no time bank (its wall-clock budget is not reproducible)
KEYS = [f"rl.steps={STEPS}", "run.checkpoint_every=2", "rl.eval_prompts=0", "online.budget_frac=0",
        "online.publish_gate=true"]


class Killed(BaseException):
    """The job's process dies (a SIGKILL leaves the run folder as this does: checkpoints are atomic)."""


def _run(policy_dir, out, *extra) -> list[dict]:
    from drafttrain.rl.job import main

    return main(load_recipe("eagle3_track", overrides(policy_dir, out, *KEYS, *extra)))


def _during_step(monkeypatch, at: int, act) -> None:
    """act() runs as the job begins its step `at` (0-based)."""
    from drafttrain.rl.grpo import GRPO

    real = GRPO.run_step

    def run_step(self, step, *a, **kw):
        if step == at:
            act()
        return real(self, step, *a, **kw)

    monkeypatch.setattr(GRPO, "run_step", run_step)


@pytest.fixture(scope="module")
def reference(policy_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    return out, _run(policy_dir, out)


def _same_run(out, recs, ref_out, ref_recs) -> None:
    """The same records (wall-clock timings aside), each step once, and the same final policy and drafters."""
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(STEPS))
    timed = [k for k in ref_recs[0] if k.endswith("_s")]
    assert [{k: v for k, v in r.items() if k not in timed} for r in read_jsonl(out / "metrics.jsonl")] == \
        [{k: v for k, v in r.items() if k not in timed} for r in ref_recs]
    last = f"ckpt/step-{STEPS}"
    a, b = (load_file(o / last / "policy" / "model.safetensors") for o in (out, ref_out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (weight_sets(load_checkpoint(o / last / "state.pt")["tracker"], shared_sets(o / last))
              for o in (out, ref_out))
    for name in ("frozen", "trained", "good_weights"):
        assert all(torch.equal(sa[name][k], sb[name][k]) for k in sb[name]), name


def test_checkpoints_at_a_cadence_keep_the_newest_and_one_frozen_drafter(reference):
    out, recs = reference
    ckpt = out / "ckpt"
    assert len(recs) == STEPS
    names = sorted(p.name for p in ckpt.iterdir())
    frozen = [n for n in names if n.startswith("frozen-")]
    assert [n for n in names if n not in frozen] == ["finished", "latest", "step-4", "step-5"]  # due at 2, 4, last
    assert len(frozen) == 1 and all((ckpt / s / "shared.json").read_text().strip() == f'{{"run_frozen": "{frozen[0]}"}}'
                                    for s in ("step-4", "step-5"))


def test_a_run_killed_between_checkpoints_resumes_exactly_from_the_last(policy_dir, tmp_path, monkeypatch, reference):
    """Killed in step 3: steps 0-2 logged, step-2 the last checkpoint. The rerun drops step 2's record, redoes it."""
    out = tmp_path / "run"

    def kill():
        raise Killed

    _during_step(monkeypatch, 3, kill)
    with pytest.raises(Killed):
        _run(policy_dir, out)
    assert (out / "ckpt" / "latest").read_text() == "step-2"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.undo()
    _same_run(out, _run(policy_dir, out), *reference)


def test_a_stop_between_checkpoints_saves_the_step_it_reached(policy_dir, tmp_path, monkeypatch, capsys, reference):
    """SIGTERM in step 2: the job stops after it, with a checkpoint of step 3 (not due), named in its one line."""
    out = tmp_path / "run"
    _during_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as e:
        _run(policy_dir, out)
    assert e.value.code == 128 + signal.SIGTERM
    stopped = [ln for ln in capsys.readouterr().err.splitlines() if "[drafttrain] stopped" in ln]
    assert len(stopped) == 1 and f"at step 3 of {STEPS}: saved in {out / 'ckpt' / 'step-3'}" in stopped[0], stopped
    assert (out / "ckpt" / "latest").read_text() == "step-3"
    assert sorted(p.name for p in (out / "ckpt").glob("step-*")) == ["step-2", "step-3"]
    monkeypatch.undo()
    _same_run(out, _run(policy_dir, out), *reference)


def test_an_earlier_kept_checkpoint_resumes_exactly_in_a_copied_folder(policy_dir, tmp_path, reference):
    """The finished run's folder copied elsewhere, its last checkpoint unreadable: the error names the other kept
    one; named in ckpt/latest, it resumes (with other checkpoint settings: they change nothing computed) and ends as
    the run did. The checkpoints of the steps after it go, as the resumed run writes its own."""
    from drafttrain.online import cli

    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    state = out / "ckpt" / "step-5" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(SystemExit) as e:
        cli(["recipe=eagle3_track", *overrides(policy_dir, out, *KEYS)])
    msg = str(e.value.code)
    assert msg.startswith("error: run.resume: ") and str(state) in msg, msg
    assert f"write the name of another kept checkpoint (step-4) into {out / 'ckpt' / 'latest'}" in msg, msg
    (out / "ckpt" / "latest").write_text("step-4")
    recs = _run(policy_dir, out, "run.checkpoint_every=1", "run.keep_checkpoints=1")
    _same_run(out, recs, *reference)
    assert sorted(p.name for p in (out / "ckpt").glob("step-*")) == ["step-5"]


def test_a_checkpoint_written_on_a_gpu_resumes_on_the_cpu_saying_so_in_one_line(policy_dir, tmp_path, reference,
                                                                                capsys):
    """The checkpoint of step 4 as a CUDA run writes it (its device random state a CUDA generator's), resumed on
    this CPU: one line says that state does not move to the CPU, and the run ends as it did (everything it draws
    on the CPU resumes exactly)."""
    out = tmp_path / "copy"
    shutil.copytree(reference[0], out)
    shutil.rmtree(out / "ckpt" / "step-5")
    (out / "ckpt" / "finished").unlink()
    (out / "ckpt" / "latest").write_text("step-4")
    path = out / "ckpt" / "step-4" / "state.pt"
    state = load_checkpoint(path)
    assert state["device_rng"] is None  # written on the CPU: its random state is torch.get_rng_state()'s
    state["device_rng"] = {"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)}
    torch.save(state, path)
    capsys.readouterr()
    recs = _run(policy_dir, out)
    cap = capsys.readouterr()
    said = [ln for ln in (cap.out + cap.err).splitlines() if "run.device:" in ln]
    assert len(said) == 1 and "written on cuda, this run is on cpu" in said[0], said
    _same_run(out, recs, *reference)
