"""Unit tests for the tiny policy world: task, reward, tokenizer, save/load, shipped checkpoint."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from drafttrain.policy.model import PolicyConfig, build_policy, load_policy, save_policy
from drafttrain.policy.sft import IGNORE, encode_example, sample_eval
from drafttrain.policy.task import (
    LABELS,
    MAX_STEPS,
    WRONG_P,
    extract_answer,
    f,
    g,
    make_problem,
    make_prompts,
    reward,
    sample_problem,
    sample_solution,
    solve,
    wrong_rule_share,
)
from drafttrain.policy.tokenizer import VOCAB_SIZE, build_tokenizer, decode, encode_prompt, load_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "policy"
TINY = PolicyConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64)


# --- task -------------------------------------------------------------------------------------

def test_problem_format_and_solution():
    p = make_problem(37, 4)  # 37 -> 44 -> 51 -> 58 -> 65 under f(x) = (x + 7) mod 100
    assert p.prompt == "Q:37*4="
    assert p.solution == "d:44;c:51;b:58;a:65;A:65"  # every step labelled with the steps left after it
    assert p.answer == "65"
    # g(x) = (x + 3) mod 100 where asked, marked `-`; the chain goes on from the value written
    assert solve(37, 4, [False, True, False, True]) == "d:44;c-47;b:54;a-57;A:57"
    assert make_problem(0, 1).solution == "a:07;A:07"  # two digits always
    assert make_problem(95, 2).solution == "b:02;a:09;A:09" and g(98) == 1  # mod 100
    for bad in ((100, 1), (5, 0), (5, MAX_STEPS + 1)):
        with pytest.raises(ValueError):
            make_problem(*bad)


def test_task_is_deterministic_in_seed():
    a, b, c = make_prompts(50, seed=3), make_prompts(50, seed=3), make_prompts(50, seed=4)
    assert a == b
    assert a != c


def test_solutions_are_correct():
    rng = random.Random(0)
    for _ in range(200):
        p = sample_problem(rng)
        start, n = (int(v) for v in p.prompt[2:-1].split("*"))
        assert 1 <= n <= MAX_STEPS and (start, n) == (p.start, p.n)
        x = start
        for _ in range(n):
            x = f(x)
        assert int(p.answer) == x
        assert reward(p, p.solution) == 1.0
        written = sample_solution(p, rng, wrong_p=0.0, check_p=0.0)  # the right rule, no check: the reference
        assert written == p.solution
        slipped = sample_solution(p, rng, wrong_p=1.0)  # the wrong rule throughout: a wrong answer
        assert reward(p, slipped) == 0.0 and wrong_rule_share([slipped]) == 1.0


def test_sft_corpus_mixes_the_two_rules():
    """The SFT text takes the wrong rule at about WRONG_P of its steps (the choice RL sharpens), marks each step with
    the rule it applied, labels every step with the countdown, and gets exactly the chains without a slip right."""
    rng = random.Random(1)
    problems = make_prompts(2000, seed=2)
    texts = [sample_solution(p, rng) for p in problems]
    assert 0.1 < WRONG_P < 0.9 and abs(wrong_rule_share(texts) - WRONG_P) < 0.03
    assert wrong_rule_share([make_problem(5, 3).solution]) == 0.0 and wrong_rule_share(["b-08;a:15;A:15"]) == 0.5
    for p, t in zip(problems[:300], texts[:300]):
        chain = t.split(";A:")[0]  # the check after the answer has its own test below
        steps, x = chain.split(";"), p.start
        for i, step in enumerate(steps):
            assert step[0] == LABELS[len(steps) - 1 - i] and step[1] in ":-"
            x = f(x) if step[1] == ":" else g(x)
            assert int(step[2:]) == x
        assert reward(p, t) == float("-" not in chain)


def test_lengths_are_long_tailed():
    lens = np.array([len(p.solution) + 1 for p in make_prompts(4000, seed=0)])
    p50, p90 = np.percentile(lens, [50, 90])
    assert p90 >= 2.0 * p50
    assert lens.max() >= 4 * p50


def test_reward_exact_match():
    p = make_problem(37, 4)
    assert reward(p, "d:44;c:51;b:58;a:65;A:65") == 1.0
    assert reward("65", "A:65") == 1.0
    assert reward(p, "d:44;c-47;b:54;a:61;A:61") == 0.0  # wrong
    assert reward(p, "A:650") == 0.0  # extra digit
    assert reward(p, "A:6") == 0.0  # truncated
    assert reward(p, "d:44;c:51;b:58;a:65") == 0.0  # no A:
    assert reward(p, "") == 0.0
    assert reward(p, "A:5;A:65") == 1.0  # the last A: counts
    assert extract_answer("x;A:77") == "77"
    assert extract_answer("no answer") is None
    # malformed answers score nothing (they scored 1.0: the last *well-formed* A: counted, trailing text ignored)
    for bad in ("A:65;A:", "A:65;A:-", "A:65=66", "A:6 5", "A:;65"):
        assert reward(p, bad) == 0.0, bad


def test_the_check_after_the_answer_is_drawn_per_sample_and_scored_only_under_strict(monkeypatch):
    """The SFT teacher checks after its answer in CHECK_P of its responses (a coin per sample, not per problem), for
    c = 1 + Geometric(CHECK_STOP) steps capped at CHECK_MAX, written once in the first step's count label (c - 1,
    counting down to 00), each step by f or g (the chain's choice) from the value before; the answer is read before
    the check, and only STRICT scoring asks the check to be right."""
    import drafttrain.policy.task as task

    p = make_problem(37, 4)
    rng = random.Random(5)
    texts = [sample_solution(p, rng, check_p=0.3) for _ in range(3000)]  # one problem: any spread is per sample
    checked = [t for t in texts if len(t) > len(p.solution)]
    assert abs(len(checked) / len(texts) - 0.3) < 0.03
    lens = []
    for t in checked:
        head, check = t.split(";A:")[0], t.split(";A:")[1].split(";")
        x, steps = int(check[0]), check[1:]
        assert check[0] == extract_answer(t) and reward(p, t) == float("-" not in head)
        for i, step in enumerate(steps):
            assert step[:2] == f"{len(steps) - 1 - i:02d}" and step[2] in ":-"
            x = f(x) if step[2] == ":" else g(x)
            assert int(step[3:]) == x
        lens.append(len(steps))
    assert 1 <= min(lens) and max(lens) == task.CHECK_MAX  # the cap binds: P(c = max) = (1 - stop)^(max - 1)
    capped = sum(n == task.CHECK_MAX for n in lens) / len(lens)
    assert abs(capped - (1 - task.CHECK_STOP) ** (task.CHECK_MAX - 1)) < 0.04
    short = [n for n in lens if n < 20]  # below the cap: geometric, P(c) = stop (1 - stop)^(c - 1)
    assert abs(len(short) / len(lens) - (1 - (1 - task.CHECK_STOP) ** 19)) < 0.05
    assert all(len(t) == len(p.solution) for t in (sample_solution(p, rng, check_p=0.0) for _ in range(50)))
    assert abs(wrong_rule_share(checked) - WRONG_P) < 0.03  # the check's steps take the chain's choice

    right = "d:44;c:51;b:58;a:65;A:65;01:72;00:79"
    slipped = "d:44;c:51;b:58;a:65;A:65;01:72;00-75"
    assert task.check_right(right) and not task.check_right(slipped) and task.check_right(p.solution)
    assert wrong_rule_share([slipped]) == 1 / 6
    for bad in ("d:44;c:51;b:58;a:65;A:65;01:72", "d:44;c:51;b:58;a:65;A:65;00:72;00:79", "A:65;00:7"):
        assert not task.check_right(bad), bad  # cut short, a count that does not count down, a step cut short
    assert reward(p, right) == reward(p, slipped) == 1.0
    monkeypatch.setattr(task, "STRICT", True)
    assert reward(p, right) == 1.0 and reward(p, slipped) == 0.0 and reward(p, p.solution) == 1.0


def test_check_form_scores_a_malformed_or_unfinished_check_zero(monkeypatch):
    """Under CHECK_FORM a check must count down to 00 with each value the rule its mark names (either rule): a label
    off by one, a value neither rule gives, or a check the token budget cut short scores 0; the rule taken does not."""
    import drafttrain.policy.task as task

    p = make_problem(37, 4)
    rng = random.Random(3)
    teacher = [t for t in (sample_solution(p, rng, check_p=1.0) for _ in range(200))]
    assert all(task.check_formed(t) for t in teacher) and task.check_formed(p.solution)
    slipped = "d:44;c:51;b:58;a:65;A:65;01:72;00-75"  # the wrong rule, marked as such: well formed
    bad = {"label": "d:44;c:51;b:58;a:65;A:65;01:72;01-75", "value": "d:44;c:51;b:58;a:65;A:65;01:72;00-77",
           "mark": "d:44;c:51;b:58;a:65;A:65;01:72;00:75", "cut": "d:44;c:51;b:58;a:65;A:65;02:72;01:79",
           "runaway": "d:44;c:51;b:58;a:65;A:65;" + ";".join(["43:72"] * 60), "torn": "d:44;c:51;b:58;a:65;A:65;00:7"}
    for why, t in bad.items():
        assert not task.check_formed(t), why
        assert reward(p, t) == 1.0, why  # off by default: the check is reward-neutral
    monkeypatch.setattr(task, "CHECK_FORM", True)
    assert reward(p, slipped) == reward(p, p.solution) == 1.0
    for why, t in bad.items():
        assert reward(p, t) == 0.0, why


def test_reward_sees_special_tokens_inside_the_answer():
    """decode keeps special tokens other than EOS (as their names): dropped, A:2 <pad> 9 read as A:29."""
    from drafttrain.policy.tokenizer import build_tokenizer, decode

    tok = build_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert reward("29", decode(tok, enc("A:29") + [tok.eos_token_id] + enc("junk"))) == 1.0  # cut at EOS
    for special in (tok.pad_token_id, tok.bos_token_id, tok.unk_token_id, tok.convert_tokens_to_ids("<unused_3>")):
        assert reward("29", decode(tok, enc("A:2") + [special] + enc("9"))) == 0.0, special


# --- tokenizer --------------------------------------------------------------------------------

def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer()
    assert len(tok) == VOCAB_SIZE and VOCAB_SIZE % 8 == 0
    p = make_problem(98, 3)
    text = p.prompt + p.solution
    ids = encode_prompt(tok, text)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per char
    assert decode(tok, ids + [tok.eos_token_id] + encode_prompt(tok, "A:1")[1:]) == text  # cut at EOS
    assert tok(p.prompt)["input_ids"] == encode_prompt(tok, p.prompt)  # HF path adds BOS too
    tok.save_pretrained(tmp_path)
    tok2 = load_tokenizer(str(tmp_path))
    assert encode_prompt(tok2, text) == ids
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.bos_token_id,
                                                                         tok.eos_token_id)


def test_sft_labels_mask_prompt():
    tok = build_tokenizer()
    p = make_problem(1, 2)
    ids, labels = encode_example(tok, p)
    n_prompt = len(p.prompt) + 1
    assert labels[:n_prompt] == [IGNORE] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:] and ids[-1] == tok.eos_token_id


# --- model save / load ------------------------------------------------------------------------

def test_load_policy_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_policy(str(missing))
    missing.mkdir()
    (missing / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_policy(str(missing))


@pytest.mark.parametrize("name,how", [("model.safetensors", "truncated"), ("model.safetensors", "emptied"),
                                      ("model.safetensors", "garbled"), ("config.json", "garbled"),
                                      ("tokenizer.json", "truncated")])
def test_load_policy_unreadable_file_is_one_line_naming_it(tmp_path, name, how):
    """A damaged file in a policy checkpoint was a SafetensorError (or JSON) traceback that named no file."""
    from drafttrain.config import ConfigError

    torch.manual_seed(0)
    save_policy(build_policy(TINY), build_tokenizer(), str(tmp_path / "pol"))
    f = tmp_path / "pol" / name
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "emptied": b"",
                   "garbled": bytes(random.Random(0).randrange(256) for _ in range(64)) + data[64:]}[how])
    with pytest.raises(ConfigError) as e:
        load_policy(str(tmp_path / "pol"))
    assert str(f) in str(e.value) and "\n" not in str(e.value), e.value


def test_save_load_round_trip_and_atomic(tmp_path):
    torch.manual_seed(0)
    model, tok = build_policy(TINY), build_tokenizer()
    out = tmp_path / "pol"
    save_policy(model, tok, str(out))
    save_policy(model, tok, str(out))  # overwriting works
    assert sorted(os.listdir(tmp_path)) == ["pol"]  # no temp dirs left behind
    loaded, tok2 = load_policy(str(out))
    x = torch.tensor([encode_prompt(tok2, "Q:12*3=")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model.eval()(x).logits)

    class Boom(RuntimeError):
        pass

    def fail(*a, **k):
        raise Boom

    tok.save_pretrained = fail  # a failure mid-write must leave the old checkpoint intact
    with pytest.raises(Boom):
        save_policy(build_policy(TINY), tok, str(out))
    assert sorted(os.listdir(tmp_path)) == ["pol"]
    again, _ = load_policy(str(out))
    torch.testing.assert_close(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


# --- shipped checkpoint -----------------------------------------------------------------------

def test_shipped_checkpoint_matches_documented_config():
    model, tok = load_policy(str(SHIPPED))
    want = PolicyConfig()
    c = model.config
    assert c.model_type == "llama"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "max_position_embeddings", "vocab_size"):
        assert getattr(c, k) == getattr(want, k), k
    assert next(model.parameters()).dtype == torch.float32
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    ev = json.loads((SHIPPED / "task_eval.json").read_text())
    # sampled (T=1) about (1 - WRONG_P)^n: it takes the wrong rule as often as its SFT teacher did, so RL has room;
    # well above a random policy's 0 (test_shipped_policy_computes_greedy checks the computing itself)
    assert 0.05 <= ev["accuracy"] <= 0.5
    assert ev["response_tokens_p90"] > ev["response_tokens_p50"]
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size < 45e6


def test_shipped_policy_computes_greedy():
    """Problems greedily decoded: the trained policy applies the rule each step marks to the value before it, labels
    every step with the countdown and stops after exactly n steps with the last value as its answer (a random one
    would not). Which rule it marks is the choice RL sharpens, so not checked here."""
    model, tok = load_policy(str(SHIPPED))
    for p in (make_problem(3, 2), make_problem(50, 1), make_problem(71, 3), make_problem(96, 5)):
        ids = torch.tensor([encode_prompt(tok, p.prompt)])
        out = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        text = decode(tok, out[0, ids.shape[1]:].tolist())
        steps, x = text.split(";"), p.start
        assert len(steps) == p.n + 1 and steps[-1] == f"A:{steps[-2][2:]}", (p.prompt, text)
        for i, step in enumerate(steps[:-1]):
            x = f(x) if step[1] == ":" else g(x)
            assert step == f"{LABELS[p.n - 1 - i]}{step[1]}{x:02d}", (p.prompt, text)


def test_shipped_policy_samples_the_long_tail():
    """The shipped world's long tail is per sample: at T=1 the policy checks after its answer in some of its responses
    (the SFT teacher in CHECK_P of them; the checkpoint before this world never did), each check many times longer
    than the median response, counting down from the length it wrote once and computing each value as its mark says
    (at T=1 a few digits slip)."""
    from drafttrain.policy.task import CHECK_P

    model, tok = load_policy(str(SHIPPED))
    texts = []
    sample_eval(model, tok, make_prompts(96, seed=7), max_new_tokens=320, texts=texts)
    checks = [t.rsplit("A:", 1)[1].split(";") for t in texts if "A:" in t and ";" in t.rsplit("A:", 1)[1]]
    assert 0.15 * CHECK_P <= len(checks) / len(texts) <= 2.5 * CHECK_P, len(checks)
    counted = valued = n = 0
    for answer, *steps in checks:
        steps = [s for s in steps if len(s) == 5 and s[:2].isdigit() and s[2] in ":-" and s[3:].isdigit()]
        prev_count, x = int(steps[0][:2]) + 1 if steps else 0, int(answer) if answer.isdigit() else -1
        for s in steps:
            x, n = f(x) if s[2] == ":" else g(x), n + 1
            counted += int(s[:2]) == prev_count - 1
            valued += int(s[3:]) == x
            prev_count, x = int(s[:2]), int(s[3:])
    assert n >= 8 * len(checks) and counted >= 0.75 * n and valued >= 0.9 * n, (n, counted, valued)
    lens = sorted(len(t) for t in texts)
    assert lens[-1] >= 8 * lens[len(lens) // 2], lens
