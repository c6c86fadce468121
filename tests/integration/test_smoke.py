"""Every command the README, a recipe header or a script's docstring tells a user to run, run as a user would (bash,
from the project root) at its smallest size: it must exit 0 and write what it promises, into the test's tmp folder,
never over a committed file. The list is tests/integration/smoke_commands.py; the last tests check that it covers
every documented command and that this check can fail."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drafttrain.config import PROJECT_ROOT
from tests.integration import smoke_commands as S


def _param(s: S.Smoke):
    marks = ([pytest.mark.slow] if s.slow else []) + ([pytest.mark.vllm] if s.vllm else [])
    return pytest.param(s, id=s.id, marks=marks)


def _committed() -> dict:
    """mtime of every file under the folders a run could overwrite by default."""
    return {p: p.stat().st_mtime_ns for d in ("bench", "checkpoints") for p in (PROJECT_ROOT / d).rglob("*")
            if p.is_file()}


@pytest.mark.parametrize("smoke", [_param(s) for s in S.SMOKE])
def test_command(smoke: S.Smoke, tmp_path):
    if smoke.vllm and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs the vllm extra")
    cmd = smoke.cmd.format(tmp=tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    before = _committed()
    r = subprocess.run(["bash", "-c", cmd], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                       timeout=smoke.timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{out[-4000:]}"
    for e in smoke.expect:
        e.check(tmp_path, out)
    assert _committed() == before, "a smoke run wrote into bench/ or checkpoints/"


# ---- the list covers every documented command -------------------------------------------------------------------
def test_every_documented_command_is_smoke_run():
    docs = S.documented_commands()
    assert len({d.source for d in docs}) >= 10  # README, 4 recipes, the scripts and the main job were all read
    missing = S.uncovered(docs)
    assert not missing, "documented commands with no entry in tests/integration/smoke_commands.py:\n" + "\n".join(
        f"  {d.source}: {d}" for d in missing)


def test_a_new_documented_command_fails_the_check():
    readme = (PROJECT_ROOT / "README.md").read_text()
    extra = ("\n```bash\npython scripts/bench_rollout.py vllm=true new_knob=3   # a new option\n```\n"
             "Try `python scripts/new_tool.py out=/tmp/x`, or `engine.kind=sglang`, or\n"
             "`... recipe=eagle3_track rl.mode=async`.\n")
    assert not S.uncovered(S.readme_commands(readme))
    missing = {str(c) for c in S.uncovered(S.readme_commands(readme + extra))}
    assert missing == {"python scripts/bench_rollout.py vllm=true new_knob=3", "python scripts/new_tool.py out=/tmp/x",
                       f"{S.MAIN} engine.kind=sglang", f"{S.MAIN} recipe=eagle3_track rl.mode=async"}


def test_normalize_reads_the_documented_spellings():
    two = S.normalize(f"{S.TWO_PROC}\n  drafttrain/online.py recipe=eagle3_track")  # wrapped over two lines
    assert two.head == f"{S.TWO_PROC} drafttrain/online.py" and two.options == (("recipe", "eagle3_track"),)
    spaced = S.docstring_commands("    accelerate launch --config_file         recipes/accelerate/ddp2.yaml "
                                  "scripts/pretrain_drafter.py threads=1", "x")
    assert [c.head for c in spaced] == [f"{S.TWO_PROC} scripts/pretrain_drafter.py"]
    (recipe, module) = S.docstring_commands("# Launch: accelerate launch drafttrain/online.py recipe=a   "
                                            "(or: python -m drafttrain.online recipe=a)", "x")
    assert (recipe.head, module.head) == (S.MAIN, "python -m drafttrain.online")
    assert S.normalize("the `--help` flag") is None and S.normalize("runs/eagle3_track/") is None
    help_ = S.normalize("accelerate launch drafttrain/online.py [key=value ...] --help")
    assert help_.options == (("--help", ""),)


def test_an_entry_covers_only_what_it_runs():
    doc = S.normalize("python scripts/bench_rollout.py vllm=true batches=[1,4]")
    assert S.covers(S.normalize("python scripts/bench_rollout.py vllm=true batches=[1] n_prompts=2"), doc)
    assert not S.covers(S.normalize("python scripts/bench_rollout.py vllm=false batches=[1]"), doc)  # a mode word
    assert not S.covers(S.normalize("python scripts/bench_rollout.py vllm=true"), doc)  # batches never set
    assert not S.covers(S.normalize("python -m scripts.bench_rollout vllm=true batches=[1]"), doc)  # other head


def test_smoke_entries_write_into_tmp():
    """Every entry parses, and each output path it names lies in the test's tmp folder."""
    assert len({s.id for s in S.SMOKE}) == len(S.SMOKE)
    for s in S.SMOKE:
        c = S.normalize(s.cmd)
        assert c is not None, s.id
        for k, v in c.options:
            if k in ("out", "run_dir", "run.out_dir"):
                assert v.startswith("{tmp}/"), (s.id, k, v)
