"""scripts/pretrain_drafter.py end to end on a tiny random policy: stop at max_steps, resume, export, eval."""
from __future__ import annotations

import json

import pytest
import torch

from drafttrain.config import ConfigError, load_recipe
from drafttrain.export import load_drafter
from tests.conftest import load_script, tiny_policy




def _script():
    return load_script("pretrain_drafter")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from drafttrain.policy.model import save_policy
    from drafttrain.policy.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("policy") / "policy"
    save_policy(tiny_policy(), build_tokenizer(), str(path))
    return path


def test_pretrain_stops_resumes_and_exports(policy_dir, tmp_path, capsys):
    P = _script()
    out = tmp_path / "eagle3"
    pc = P.parse([f"policy.path={policy_dir}", "sampling.max_new_tokens=12", "train.batch_size=4",
                  f"out={out}", "prompts=16", "chunk=8", "epochs=1", "warmup=1", "eval_prompts=4", "max_steps=3"])
    assert pc.overrides[0] == f"policy.path={policy_dir}" and pc.max_steps == 3
    r1 = P.main(pc)
    assert r1["pretrain"]["steps"] == 3 and "eval" not in r1  # stopped inside the last chunk's training
    assert (tmp_path / "eagle3.state" / "trainer.pt").is_file()
    load_drafter(out)  # a stopped run still exports what it has

    pc.max_steps = 0
    tpath = tmp_path / "eagle3.state" / "trainer.pt"
    saved = tpath.read_bytes()
    state = torch.load(tpath, weights_only=False)
    torch.save({**state, "world": 2}, tpath)  # as a 2-process run writes it: one line, not a ValueError traceback
    with pytest.raises(ConfigError, match="resume: .*saved with 2 processes"):
        P.main(pc)
    tpath.write_bytes(saved)
    with pytest.raises(ConfigError, match="resume: .*other settings"):  # a changed schedule does not resume
        P.main(P.parse([*pc.overrides, f"out={out}", "prompts=16", "chunk=8", "epochs=2"]))
    for other in ("train.loss=tv", "train.positions=rejected"):  # nor another objective (it did, silently)
        with pytest.raises(ConfigError, match="resume: .*other settings"):
            P.main(P.parse([*pc.overrides, other, f"out={out}", "prompts=16", "chunk=8", "epochs=1", "warmup=1",
                            "eval_prompts=4"]))
    r2 = P.main(pc)
    assert "at step 3, chunk 2" in capsys.readouterr().out
    assert r2["pretrain"]["steps"] == r2["pretrain"]["total_steps"] == 4
    assert not (tmp_path / "eagle3.state").exists()  # removed after a completed run
    d = load_drafter(out)
    cfg = json.loads((out / "config.json").read_text())
    ev = cfg["drafttrain"]["extra"]["eval"]
    k = load_recipe("eagle3_track").engine.k  # scored at the recipe's k
    assert ev["k"] == k and ev["mean_accepted_length"] >= 1.0 and len(ev["acceptance_per_position"]) == k
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(policy_dir)
    assert d.aux_layer_ids == (1, 2, 3)


def test_pretrain_resume_mid_bucket_is_exact(policy_dir, tmp_path):
    """Stopped with length-grouped batches still queued (bucket=4, stop at 3): the resumed run trains on those
    first, so 3 + 3 steps end on the weights of 6 uninterrupted ones."""
    from safetensors.torch import load_file

    P = _script()
    args = [f"policy.path={policy_dir}", "sampling.max_new_tokens=12", "train.batch_size=2", "prompts=8", "chunk=8",
            "bucket=4", "warmup=1"]
    P.main(P.parse([*args, f"out={tmp_path / 'a'}", "max_steps=6"]))
    P.main(P.parse([*args, f"out={tmp_path / 'b'}", "max_steps=3"]))
    P.main(P.parse([*args, f"out={tmp_path / 'b'}", "max_steps=6"]))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pretrain_missing_policy_names_path(tmp_path):
    P = _script()
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        P.main(P.parse([f"policy.path={missing}", f"out={tmp_path / 'o'}"]))


def test_pretrain_resume_refuses_a_state_that_would_run_code(policy_dir, tmp_path):
    """<out>.state/trainer.pt from elsewhere: read without unpickling anything but tensors and plain containers."""
    from tests.unit.test_runfolder import Touch

    P, marker = _script(), tmp_path / "ran"
    state = tmp_path / "eagle3.state" / "trainer.pt"
    state.parent.mkdir()
    torch.save({"step": 1, "world": 1, "extra": {"x": Touch(marker)}}, state)
    with pytest.raises(ConfigError, match=r"resume: .*trainer\.pt holds builtins\.exec"):
        P.main(P.parse([f"policy.path={policy_dir}", f"out={tmp_path / 'eagle3'}", "prompts=8", "chunk=8"]))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["mtp", "draft_model"])
def test_pretrain_each_trainable_kind(policy_dir, tmp_path, kind):
    """drafter.kind picks what is pretrained and saved (its own folder form); the folder loads back as that kind
    through drafter.path, with the weights trained (moved off the fresh drafter's)."""
    from omegaconf import OmegaConf

    from drafttrain.config import Config
    from drafttrain.drafters import build_drafter
    from drafttrain.policy import load_policy

    P = _script()
    out = tmp_path / kind
    res = P.main(P.parse([f"policy.path={policy_dir}", f"drafter.kind={kind}", "sampling.max_new_tokens=12",
                          "train.batch_size=4", f"out={out}", "prompts=16", "chunk=8", "epochs=1", "warmup=1",
                          "eval_prompts=4"]))
    assert res["eval"]["mean_accepted_length"] >= 1.0
    policy, _ = load_policy(str(policy_dir))
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = kind, str(out)
    back = build_drafter(cfg, policy)
    assert back.kind == kind
    cfg.path = None
    fresh = build_drafter(cfg, policy)
    moved = [k for k, v in fresh.state_dict().items() if not torch.equal(v, back.state_dict()[k])]
    assert moved, "nothing was trained"


def test_pretrain_refuses_a_kind_with_nothing_to_train(policy_dir, tmp_path):
    P = _script()
    with pytest.raises(ConfigError, match=r"^drafter\.kind: suffix trains nothing"):
        P.main(P.parse([f"policy.path={policy_dir}", "drafter.kind=suffix", "drafter.path=null", f"out={tmp_path}"]))


def test_pretraining_trains_the_attention_whatever_the_recipe_holds_online(policy_dir, tmp_path, monkeypatch):
    """A fresh drafter's attention must learn: pretraining takes the full gradient (train.score_grad true) even from
    eagle3_track, whose online steps hold the attention scores constant."""
    P = _script()
    seen = []

    class Stop(Exception):
        pass

    def trainer(drafter, train_cfg, *a, **kw):
        seen.append(train_cfg.score_grad)
        raise Stop

    monkeypatch.setattr(P, "DrafterTrainer", trainer)
    assert load_recipe("eagle3_track").train.score_grad is False
    with pytest.raises(Stop):
        P.main(P.parse([f"policy.path={policy_dir}", f"out={tmp_path / 'e3'}"]))
    assert seen == [True]
