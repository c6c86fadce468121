"""The user's data at its edges, through the main job: a relative data.path from the user's own folder, an empty
file, rows with an empty prompt, and fewer rows than data.eval_size."""
from __future__ import annotations

import json
import shutil

import pytest

from drafttrain.config import ConfigError, load_recipe
from drafttrain.data import Prompts
from drafttrain.policy import load_policy
from tests.integration.test_own_model import keys, own  # noqa: F401  (own: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["drafter.path=null", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=8",
        "rl.eval_prompts=4", "online.publish_gate=false", "run.tensorboard=false"]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_main_job_reads_a_relative_data_path_from_where_the_user_stands(own, tmp_path, monkeypatch):  # noqa: F811
    from drafttrain.online import cli

    shutil.copy(own / "prompts.jsonl", tmp_path / "prompts.jsonl")
    monkeypatch.chdir(tmp_path)
    cli(["recipe=eagle3_track", *keys(own, "data.path=prompts.jsonl", "run.out_dir=run", *TINY)])
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "run" / "eval.json").is_file()


def _prompts(own, tmp_path, *extra):  # noqa: F811
    _, tok = load_policy(str(own / "qwen3"))
    cfg = load_recipe("eagle3_track", keys(own, f"data.path={tmp_path / 'p.jsonl'}", *extra))
    return Prompts(cfg.data, cfg.reward, tok)


def test_an_empty_file_is_no_rows_in_one_line(own, tmp_path):  # noqa: F811
    (tmp_path / "p.jsonl").write_text("\n")
    with pytest.raises(ConfigError) as e:
        _prompts(own, tmp_path)
    assert str(e.value) == f"data.path: {tmp_path / 'p.jsonl'}: no rows"


def test_rows_with_an_empty_prompt_are_skipped_with_a_count(own, tmp_path):  # noqa: F811
    _write(tmp_path / "p.jsonl", [{"question": q, "answer": "1"} for q in ["Q:1*1=", "", "  ", "Q:2*1=", "Q:3*1="]])
    p = _prompts(own, tmp_path, "data.eval_size=1")
    assert len(p.notes) == 1 and "skipped 2 of 5 rows" in p.notes[0] and "data.prompt_field" in p.notes[0]
    assert all(r["question"].strip() for r in p.train + p.held) and len(p.train) + len(p.held) == 3


def test_only_empty_prompts_is_refused_naming_the_key(own, tmp_path):  # noqa: F811
    _write(tmp_path / "p.jsonl", [{"question": "", "answer": "1"}] * 3)
    with pytest.raises(ConfigError) as e:
        _prompts(own, tmp_path)
    assert str(e.value).startswith("data.path:") and "0 rows with a non-empty 'question'" in str(e.value)


def test_fewer_rows_than_eval_size_warns_and_eval_json_states_the_rows_scored(own, tmp_path, capsys):  # noqa: F811
    from drafttrain.online import cli

    _write(tmp_path / "p.jsonl", [{"question": f"Q:{i}*1=", "answer": str(i)} for i in range(2)])
    cli(["recipe=eagle3_track", *keys(own, f"data.path={tmp_path / 'p.jsonl'}", f"run.out_dir={tmp_path / 'run'}",
                                      *TINY, "data.eval_size=256")])
    out = capsys.readouterr().out
    assert "data.eval_size: 256, but" in out and "holds 2 usable rows: 1 held out for eval.json, 1 left" in out
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["prompts"] == 1
