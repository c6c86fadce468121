"""python -m drafttrain.staleness on the shipped world: the shipped (step-0) drafter loses MAL on a policy that moved
away from the step-0 one (a run folder's later checkpoint) and none on the step-0 policy; its outputs (table, PNG,
JSON); bad input is one line naming the argument; it imports no RL code."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from drafttrain import staleness
from drafttrain.config import PROJECT_ROOT
from drafttrain.policy import load_policy, save_policy

DRAFTER = str(PROJECT_ROOT / "checkpoints" / "eagle3")
FAST = ["--prompts", "16", "--max-new-tokens", "48", "--drafter", DRAFTER]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder whose last checkpoint is the shipped policy moved away from itself (as RL moves it)."""
    root = tmp_path_factory.mktemp("stale") / "run"
    policy, tok = load_policy(str(PROJECT_ROOT / "checkpoints" / "policy"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, w in policy.named_parameters():
            if w.dim() == 2 and "embed" not in n:
                w.add_(0.5 * w.std() * torch.randn(w.shape, generator=g))
    save_policy(policy, tok, str(root / "ckpt" / "step-4" / "policy"))
    (root / "config.yaml").write_text("policy:\n  path: checkpoints/policy\n")
    return root


def test_the_step0_drafter_drops_on_a_moved_policy_and_not_on_its_own(run_dir, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "st"
    assert staleness.main([str(run_dir), *FAST, "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    first, last = res["checkpoints"]
    assert (first["checkpoint"], last["checkpoint"]) == ("step-0", "step-4")
    assert len(first["acceptance_per_position"]) == 5 and res["mal_drop"] == pytest.approx(first["mal"] - last["mal"])
    assert res["mal_drop"] > 0.1, res  # stale on the moved policy
    assert out.with_suffix(".png").stat().st_size > 0
    assert "MAL drop" in capsys.readouterr().out
    same = tmp_path / "same"  # the step-0 policy twice: other rollouts (seeds), no drop
    policy0 = str(PROJECT_ROOT / "checkpoints" / "policy")
    assert staleness.main([policy0, *FAST, "--out", str(same), "--seed", "1"]) == 0
    assert staleness.main([policy0, *FAST, "--out", str(tmp_path / "same2"), "--seed", "2"]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["checkpoints"][0]["mal"] for n in ("same", "same2"))
    assert abs(a - b) < 0.5 * res["mal_drop"], (a, b, res["mal_drop"])


@pytest.mark.parametrize("case, arg", [("empty", "CHECKPOINT"), ("missing", "CHECKPOINT"), ("vocab", "CHECKPOINT"),
                                       ("no_drafter", "--drafter")])
def test_bad_input_is_one_line_naming_the_argument(tmp_path, capsys, case, arg):
    from transformers import LlamaForCausalLM

    policy0 = str(PROJECT_ROOT / "checkpoints" / "policy")
    if case == "vocab":  # the shipped policy's sizes but another vocabulary
        policy, tok = load_policy(policy0)
        policy.config.vocab_size += 8
        save_policy(LlamaForCausalLM(policy.config), tok, str(tmp_path / "other"))
    ckpts = {"empty": [], "missing": [policy0, str(tmp_path / "nope")], "vocab": [policy0, str(tmp_path / "other")],
             "no_drafter": [policy0]}[case]
    drafter = str(tmp_path / "nope") if case == "no_drafter" else DRAFTER
    rc = staleness.main([*ckpts, "--prompts", "2", "--max-new-tokens", "8", "--drafter", drafter,
                         "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {arg}:"), err
    assert case != "vocab" or "vocab_size" in err[0]
    assert not (tmp_path / "o.json").exists()


def test_imports_no_rl_code():
    code = "import sys, drafttrain.staleness; print([m for m in sys.modules if m.startswith('drafttrain.rl')])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                       env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_catch_up_retrains_a_copy_and_reports_its_mal(run_dir, tmp_path):
    """--catch-up S: a copy of the drafter trained S seconds on each checkpoint's rollouts; its MAL is reported beside
    the frozen one's, and the drafter given is left as it was."""
    torch.set_num_threads(1)
    before = (PROJECT_ROOT / "checkpoints" / "eagle3" / "model.safetensors").read_bytes()
    out = tmp_path / "cu"
    assert staleness.main([str(run_dir), *FAST, "--catch-up", "2", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    for c in res["checkpoints"]:
        assert c["catch_up_mal"] is not None and 1.0 <= c["catch_up_mal"] <= 6.0
    assert (PROJECT_ROOT / "checkpoints" / "eagle3" / "model.safetensors").read_bytes() == before
