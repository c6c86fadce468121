"""The run's deliverable (tracking/deliverable.py, python -m drafttrain.export): the served drafter round-trips into
OUT/drafter in its vLLM form beside OUT/policy and serve.json; OUT is written whole or not at all; a kind vLLM cannot
serve gets the policy and one line; bad input is one line naming the argument. Loading the pair in plain vLLM:
tests/vllm/test_plugin.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import PROJECT_ROOT, load_recipe
from drafttrain.drafters import build_drafter
from drafttrain.export import load_drafter
from drafttrain.tracking import deliverable

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


def make_run(root, recipe="eagle3_track", step=3, overrides=(), weights=None):
    """A run folder as the job leaves it, the parts export reads: ckpt/step-N/{policy, state.pt}, ckpt/latest.
    The served weights are a fresh drafter's, perturbed (not what build_drafter alone gives)."""
    from drafttrain.policy import build_policy, build_tokenizer, save_policy

    torch.manual_seed(0)
    policy, tok = build_policy(TINY), build_tokenizer()
    cfg = load_recipe(recipe, ["drafter.path=null", *overrides])
    ckpt = root / "ckpt" / f"step-{step}"
    save_policy(policy, tok, str(ckpt / "policy"))
    if weights is None:
        weights = {n: (t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t)
                   for n, t in build_drafter(cfg.drafter, policy).state_dict().items()}
    torch.save({"step": step, "config": OmegaConf.to_container(cfg, resolve=True),
                "tracker": {"good_weights": weights}}, ckpt / "state.pt")
    (root / "ckpt" / "latest").write_text(f"step-{step}")
    return cfg, weights


def test_export_run_writes_the_served_drafter_in_vllm_form(tmp_path):
    cfg, weights = make_run(tmp_path / "run")
    lines = []
    res = deliverable.export_run(tmp_path / "run", tmp_path / "out", log=lines.append)
    out = tmp_path / "out"
    serve = json.loads((out / "serve.json").read_text())
    assert serve == {"model": "policy", "speculative_config": {"model": "drafter", "method": "eagle3",
                                                              "num_speculative_tokens": cfg.engine.k}}
    assert (out / "policy" / "tokenizer.json").is_file() and (out / "policy" / "model.safetensors").is_file()
    got = load_drafter(out / "drafter").state_dict()
    assert all(torch.equal(got[n], weights[n]) for n in weights)  # the served weights, not a fresh drafter's
    kw = deliverable.serve_kwargs(out)
    assert kw["model"] == str(out / "policy") and kw["speculative_config"]["model"] == str(out / "drafter")
    assert len(lines) == 1 and lines[0].endswith(deliverable.serve_command(out)) and "\n" not in lines[0]
    assert deliverable.serve_command(out) == (f"python -m drafttrain.serve {out / 'policy'} --drafter {out / 'drafter'} --k "
                                              f"{serve['speculative_config']['num_speculative_tokens']}")
    assert res["unservable"] is None


@pytest.mark.parametrize("recipe", ["auto_track", "suffix_track"])
def test_unservable_kind_is_one_line_and_the_policy_is_written(tmp_path, recipe):
    extra = ["drafter.auto.paths=[null,null]"] if recipe == "auto_track" else []
    make_run(tmp_path / "run", recipe, overrides=extra, weights={})
    lines = []
    res = deliverable.export_run(tmp_path / "run", tmp_path / "out", log=lines.append)
    assert res["unservable"] and len(lines) == 1 and "\n" not in lines[0] and "policy only" in lines[0]
    assert json.loads((tmp_path / "out" / "serve.json").read_text()) == {"model": "policy"}
    assert (tmp_path / "out" / "policy" / "config.json").is_file() and not (tmp_path / "out" / "drafter").exists()


def test_a_failed_export_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    make_run(tmp_path / "run")
    out = tmp_path / "out"
    deliverable.export_run(tmp_path / "run", out, log=lambda m: None)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    from drafttrain.engines import vllm_forms

    def broken(*a, **kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(vllm_forms.EAGLE3, "write", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        deliverable.export_run(tmp_path / "run", out, log=lambda m: None)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporary folder left behind


def test_step_picks_that_checkpoint(tmp_path):
    make_run(tmp_path / "run", step=2)
    _, w5 = make_run(tmp_path / "run", step=5)
    deliverable.export_run(tmp_path / "run", tmp_path / "out", step=5, log=lambda m: None)
    assert torch.equal(load_drafter(tmp_path / "out" / "drafter").fc.weight, w5["fc.weight"])


@pytest.mark.parametrize("case, arg", [("missing", "RUN_DIR"), ("no_ckpt", "RUN_DIR"), ("bad_step", "--step")])
def test_cli_bad_input_is_one_line_naming_the_argument(tmp_path, case, arg):
    run = tmp_path / "run"
    if case == "no_ckpt":
        run.mkdir()
    elif case == "bad_step":
        make_run(run, step=3)
    cmd = [sys.executable, "-m", "drafttrain.export", str(run), str(tmp_path / "out")]
    cmd += ["--step", "7"] if case == "bad_step" else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT,
                       env={**__import__("os").environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert r.returncode == 2 and r.stdout == ""
    err = r.stderr.strip()
    assert "\n" not in err and err.startswith(f"error: {arg}:"), err
    assert not (tmp_path / "out").exists()
