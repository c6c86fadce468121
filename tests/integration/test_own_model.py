"""Your own model, prompts and reward (policy.path, data.*, reward.fn): a tiny random Qwen3 checkpoint, a JSONL of
prompts and a reward module in tests/, through pretrain_drafter.py and the main job; and each bad input refused
with one line naming its key. (The embedded engine's Qwen3 log-probs against HF: tests/test_contract.py,
test_family_greedy_sd_ar_hf.)"""
from __future__ import annotations

import json
import random

import pytest

from drafttrain.config import ConfigError, load_recipe
from drafttrain.data import HOLDOUT_SEED, Prompts, RewardError, stop_ids
from drafttrain.drafters import Reads
from drafttrain.policy import load_policy
from tests import own_reward
from tests.conftest import load_script, qwen3_world

pytestmark = pytest.mark.usefixtures("one_thread")
# ends every chat prompt with "A": a prompt encoded through the template is told apart from a plain one
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}A{% endif %}")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    return qwen3_world(tmp_path_factory.mktemp("own"), vocab=48, rows=40, chat_template=TEMPLATE)


def keys(own, *extra):
    return [f"policy.path={own / 'qwen3'}", f"data.path={own / 'prompts.jsonl'}", "data.prompt_field=question",
            "reward.fn=tests.own_reward:has_digit", "data.eval_size=8", *extra]


def _prompts(cfg, tok) -> Prompts:
    return Prompts(cfg.data, cfg.reward, tok)


def test_pretrain_then_main_job_on_your_own_model(own, monkeypatch):
    """pretrain_drafter.py on the user's Qwen3 and prompts (a few steps; its features cached, and a second run
    loads them instead of regenerating), then the main job: 2 RL steps with EAGLE-3 tracking and a hot-swap,
    rewards from reward.fn on training rows only, eval.json on the held-out rows only."""
    pre = load_script("pretrain_drafter")
    args = ["prompts=32", "chunk=16", "epochs=1", "eval_prompts=4", "threads=1", f"cache={own / 'cache'}",
            "sampling.max_new_tokens=16", *keys(own)]
    extra = pre.main(pre.parse([*args, f"out={own / 'e3'}"]))
    assert extra["pretrain"]["steps"] == 2 and extra["eval"]["mean_accepted_length"] >= 1.0
    assert len(list((own / "cache").glob("chunk-*.pt"))) == 2

    def regenerate(*a, **kw):
        raise AssertionError("the cached features were regenerated")

    monkeypatch.setattr(pre, "teacher_forced_features", regenerate)
    again = pre.main(pre.parse([*args, f"out={own / 'e3b'}", "resume=false"]))
    assert again["pretrain"]["steps"] == 2
    monkeypatch.undo()

    from drafttrain.rl.job import main

    own_reward.SEEN.clear()
    cfg = load_recipe("eagle3_track", keys(own, f"drafter.path={own / 'e3'}", "rl.steps=2", "rl.prompts_per_step=4",
                                          "rl.group_size=4", "rl.eval_prompts=8", "sampling.max_new_tokens=16",
                                          "online.budget_frac=0", "online.publish_gate=false",
                                          "run.tensorboard=false", f"run.out_dir={own / 'run'}"))
    recs = main(cfg)
    assert len(recs) == 2 and recs[-1]["drafter_version"] >= 1  # trained on the captured features and swapped in
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    rows = [json.loads(line) for line in (own / "prompts.jsonl").read_text().splitlines()]
    order = list(range(len(rows)))
    random.Random(HOLDOUT_SEED).shuffle(order)
    held = {rows[i]["question"] for i in order[:8]}
    evals = 2 * 2 * 8  # before and after, sampled and greedy, 8 held-out rows
    trained = own_reward.SEEN[8 * 2:len(own_reward.SEEN) - 8 * 2]  # between the two evaluations
    assert set(own_reward.SEEN[:16]) == held and set(own_reward.SEEN[-16:]) == held
    assert len(own_reward.SEEN) == evals + 2 * 4 * 4 and not set(trained) & held
    ev = json.loads((own / "run" / "eval.json").read_text())
    assert set(ev["before"]) == {"eval_sampled_acc", "eval_greedy_acc"}


def test_chat_template_on_where_the_tokenizer_has_one(own):
    cfg = load_recipe("eagle3_track", keys(own))
    pol, tok = load_policy(str(own / "qwen3"))
    a_id = tok.convert_tokens_to_ids("A")
    row = {"prompt": "Q:12*3="}
    assert Prompts(cfg.data, cfg.reward, tok).encode(row)[-1] == a_id  # data.chat_template unset: the tokenizer has one
    plain = _prompts(load_recipe("eagle3_track", keys(own, "data.chat_template=false")), tok).encode(row)
    assert plain == tok("Q:12*3=")["input_ids"] and plain[-1] != a_id
    assert stop_ids(pol, tok) == (tok.eos_token_id,)


@pytest.mark.parametrize("extra, key", [
    (["data.path=/nonexistent/prompts.jsonl"], "data.path"),
    (["data.prompt_field=prompt"], "data.prompt_field"),
    (["reward.fn=tests.own_reward:missing"], "reward.fn"),
    (["reward.fn=no_such_module:fn"], "reward.fn"),
    (["reward.fn=null", "data.answer_field=solution"], "data.answer_field"),
    (["data.split=test"], "data.split"),
])
def test_bad_data_or_reward_is_one_line_naming_the_key(own, extra, key):
    _, tok = load_policy(str(own / "qwen3"))
    with pytest.raises(ConfigError) as e:
        _prompts(load_recipe("eagle3_track", keys(own, *extra)), tok)
    msg = str(e.value)
    assert msg.startswith(f"{key}:") and "\n" not in msg


@pytest.mark.parametrize("fn, why", [("not_finite", "not a finite number"), ("raises", "raised KeyError")])
def test_a_bad_reward_stops_with_one_line_naming_reward_fn_and_the_row(own, fn, why):
    _, tok = load_policy(str(own / "qwen3"))
    prompts = _prompts(load_recipe("eagle3_track", keys(own, f"reward.fn=tests.own_reward:{fn}")), tok)
    row = prompts.rows(1, seed=0)[0]
    with pytest.raises(RewardError) as e:
        prompts.reward(row, "12")
    msg = str(e.value)
    assert msg.startswith(f"reward.fn: tests.own_reward:{fn}") and why in msg and row["prompt"] in msg
    assert "\n" not in msg


def test_an_architecture_the_engine_does_not_serve_points_to_vllm(tmp_path):
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_policy(str(path))
    msg = str(e.value)
    assert msg.startswith("policy.path:") and "gpt2" in msg and "engine.kind=vllm" in msg and "\n" not in msg


def test_the_main_job_says_a_missing_data_file_in_one_line(own, tmp_path):
    from drafttrain.online import cli

    with pytest.raises(SystemExit) as e:
        cli(["recipe=eagle3_track", *keys(own, "data.path=/nonexistent/p.jsonl", f"run.out_dir={tmp_path}")])
    assert str(e.value).startswith("error: data.path:") and "\n" not in str(e.value)


def test_a_saved_dataset_folder_and_parquet_read_alike(own, tmp_path):
    import datasets

    rows = [json.loads(line) for line in (own / "prompts.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    _, tok = load_policy(str(own / "qwen3"))
    got = [_prompts(load_recipe("eagle3_track", keys(own, f"data.path={p}")), tok).rows(6, seed=3)
           for p in (own / "prompts.jsonl", tmp_path / "saved", tmp_path / "p.parquet")]
    assert got[0] == got[1] == got[2] and all(r["prompt"] == r["question"] for r in got[0])


def test_a_drafter_made_for_another_policy_is_refused_naming_drafter_path(own, tmp_path):
    """The shipped EAGLE-3 drafter (hidden 256) on the user's Qwen3 (hidden 64): the main job said only "drafter
    hidden_size 256 != policy hidden_size 64", naming no key."""
    from drafttrain.online import cli

    with pytest.raises(SystemExit) as e:
        cli(["recipe=eagle3_track", *keys(own, f"run.out_dir={tmp_path}")])  # drafter.path: the shipped one
    msg = str(e.value)
    assert msg.startswith("error: drafter.path:") and "hidden_size" in msg and "\n" not in msg


def test_a_reward_failing_mid_run_stops_in_one_line_and_loses_no_finished_step(own, tmp_path):
    """The verifier fails on step 6's rollouts (16 evaluation calls, then 4 per step), which step 5 generates before
    it is recorded (their canary verdict is part of its record): the main job stops with one line naming reward.fn,
    the 5 recorded steps stay on disk, and the same command, once the verifier is back, resumes after them."""
    from drafttrain.online import cli
    from drafttrain.report import read_jsonl

    args = ["recipe=eagle3_track", *keys(own, "reward.fn=tests.own_reward:fails_after_limit", "drafter.path=null",
                                         "rl.steps=8", "rl.prompts_per_step=2", "rl.group_size=2",
                                         "rl.eval_prompts=8", "sampling.max_new_tokens=8", "run.tensorboard=false",
                                         f"run.out_dir={tmp_path}")]
    own_reward.CALLS[0], own_reward.LIMIT[0] = 0, 16 + 6 * 4
    with pytest.raises(SystemExit) as e:
        cli(args)
    msg = str(e.value)
    assert msg.startswith("error: reward.fn: tests.own_reward:fails_after_limit raised RuntimeError")
    assert "\n" not in msg
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(5))
    own_reward.CALLS[0], own_reward.LIMIT[0] = 0, 10 ** 9
    cli(args)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(8))


def test_the_feature_cache_is_not_reused_across_another_held_out_split(own):
    """data.eval_size decides which rows are held out, so which rows pretraining draws from: a cache written with
    one size must not serve a run with another (the cache key left it out)."""
    pre = load_script("pretrain_drafter")
    key = lambda *extra: pre.cache_key(pre.parse([]), load_recipe("eagle3_track", keys(own, *extra)),  # noqa: E731
                                       Reads(aux_layers=(1, 2, 3)))
    assert key("data.eval_size=8") != key("data.eval_size=4")
    assert key("data.eval_size=8") == key("data.eval_size=8")
    cfg = load_recipe("eagle3_track", keys(own))  # nor one of another feature form (another kind's reads)
    assert pre.cache_key(pre.parse([]), cfg, Reads(final_hidden=True)) != pre.cache_key(pre.parse([]), cfg, Reads())


def _not_identity(d2t, t2d) -> bool:
    return bool(d2t.any()) and not bool(t2d.all())


def test_a_fresh_drafter_takes_its_draft_vocabulary_from_the_first_rollouts(own, tmp_path, capsys):
    """drafter.path null with a draft vocabulary below the policy's (24 of 48 tokens): the main job chooses the map
    from one step's plain rollouts before the tracker starts, says so in one line, and the map is in the checkpoint,
    in the run's export and in `python -m drafttrain.export`'s; a resume keeps it (chosen once)."""
    import torch

    from drafttrain.drafters.speculators import load_drafter
    from drafttrain.export.__main__ import main as export_main
    from drafttrain.rl.job import main
    from drafttrain.tracking.weightsets import checkpoint_sets

    args = keys(own, "drafter.path=null", "drafter.eagle3.draft_vocab_size=24", "rl.prompts_per_step=2",
                "rl.group_size=2", "rl.eval_prompts=0", "sampling.max_new_tokens=8", "online.budget_frac=0",
                "run.tensorboard=false", f"run.out_dir={tmp_path / 'run'}")
    recs = main(load_recipe("eagle3_track", [*args, "rl.steps=1"]))
    lines = [x for x in capsys.readouterr().out.splitlines() if "draft vocabulary:" in x]
    assert len(lines) == 1 and "24 of the policy's 48 tokens" in lines[0] and "drafter v1" in lines[0], lines
    assert len(recs) == 1 and recs[0]["drafter_version"] >= 1
    sets = checkpoint_sets(tmp_path / "run" / "ckpt" / "step-1")
    served = sets["good_weights"]
    assert _not_identity(served["d2t"], served["t2d"]) and int(served["t2d"].sum()) == 24
    _, tok = load_policy(str(own / "qwen3"))
    assert bool(served["t2d"][tok.eos_token_id])  # the stop token is always draftable
    assert torch.equal(sets["frozen"]["d2t"], served["d2t"])  # the frozen reference drafts the same map
    exported = load_drafter(tmp_path / "run" / "export" / "drafter")
    assert torch.equal(exported.d2t, served["d2t"]) and torch.equal(exported.t2d, served["t2d"])
    assert export_main([str(tmp_path / "run"), str(tmp_path / "again")]) == 0
    assert torch.equal(load_drafter(tmp_path / "again" / "drafter").d2t, served["d2t"])

    main(load_recipe("eagle3_track", [*args, "rl.steps=2"]))  # resumed: the checkpoint's map, not chosen again
    assert "draft vocabulary:" not in capsys.readouterr().out
    after = load_drafter(tmp_path / "run" / "export" / "drafter")
    assert torch.equal(after.d2t, served["d2t"]) and torch.equal(after.t2d, served["t2d"])


def test_pretrain_chooses_a_fresh_drafters_draft_vocabulary(own, capsys):
    pre = load_script("pretrain_drafter")
    pre.main(pre.parse(["prompts=16", "chunk=16", "epochs=1", "eval_prompts=4", "threads=1", "vocab_rollouts=16",
                        "sampling.max_new_tokens=8", "drafter.eagle3.draft_vocab_size=24", f"out={own / 'e3v'}",
                        *keys(own)]))
    assert "24 of the policy's 48 tokens, by frequency in 16 plain rollouts" in capsys.readouterr().out
    from drafttrain.drafters.speculators import load_drafter

    d = load_drafter(own / "e3v")
    assert d.config.draft_vocab_size == 24 and _not_identity(d.d2t, d.t2d)
