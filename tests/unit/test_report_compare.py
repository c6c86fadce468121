"""`python -m drafttrain.report runs/A runs/B`: finished runs compared in one table and one PNG."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from drafttrain.report import cli, compare_rows, load_run


def _run_folder(path, recipe: str, live: float, frozen: float, before: float, after: float, steps: int = 8):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "reward_mean": 0.1 * s, "live_mal": live, "live_tf_mal": live + 0.01 * s,
                                "frozen_tf_mal": frozen, "rollout_tokens_per_s": 100.0 + s, "drafter_train_s": 0.5,
                                "rl_step_s": 10.5, "measure_s": 0.0}) + "\n")
    (path / "eval.json").write_text(json.dumps({"prompts": 100, "seed": 1, "before": {"eval_sampled_acc": before},
                                                "after": {"eval_sampled_acc": after}}))
    (path / "config.yaml").write_text(f"recipe: {recipe}\n")
    return path


def test_two_runs_side_by_side(tmp_path, capsys):
    a = _run_folder(tmp_path / "runs" / "track", "eagle3_track", 4.0, 3.0, 0.40, 0.55)
    b = _run_folder(tmp_path / "runs" / "frozen", "eagle3_frozen", 3.0, 3.0, 0.40, 0.50)
    png = tmp_path / "cmp.png"
    assert cli([str(a), str(b), f"out={png}"]) == 0
    out = capsys.readouterr().out
    assert "track" in out and "frozen" in out and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = compare_rows([load_run(a), load_run(b)])
    assert [r["recipe"] for r in rows] == ["eagle3_track", "eagle3_frozen"]
    assert rows[0]["live_tf_mal"] == pytest.approx(4.0 + 0.01 * 6.5)  # last quarter: steps 6 and 7
    assert rows[0]["frozen_tf_mal"] == 3.0 and rows[0]["steps"] == 8
    assert rows[0]["overhead_pct"] == pytest.approx(100 * 0.5 / 10.0)  # drafter work over the step's own time
    assert rows[0]["acc_change_pts"] == pytest.approx(15.0) and rows[1]["acc_change_pts"] == pytest.approx(10.0)
    assert rows[0]["acc_change_se"] > 0
    # the default PNG lands beside the first run folder
    assert cli([str(a), str(b)]) == 0
    assert (tmp_path / "runs" / "compare.png").is_file()


def test_run_without_eval_json_still_compares(tmp_path):
    a = _run_folder(tmp_path / "a", "eagle3_track", 4.0, 3.0, 0.4, 0.5)
    (a / "eval.json").unlink()
    (row,) = compare_rows([load_run(a)])
    assert row["acc_before"] is None and row["acc_change_pts"] is None and row["live_mal"] == 4.0


@pytest.mark.parametrize("what", ["missing", "empty", "not_a_run"])
def test_bad_folder_is_one_line_naming_it(tmp_path, capsys, what):
    bad = tmp_path / "bad"
    if what != "missing":
        bad.mkdir()
    if what == "not_a_run":
        (bad / "metrics.jsonl").write_text("not json\n")
    good = _run_folder(tmp_path / "good", "eagle3_track", 4.0, 3.0, 0.4, 0.5)
    assert cli([str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(bad) in err and "\n" not in err, err
    assert not (tmp_path / "compare.png").exists()  # nothing drawn from half the runs


def test_module_entry_point(tmp_path):
    a = _run_folder(tmp_path / "a", "eagle3_track", 4.0, 3.0, 0.4, 0.5)
    r = subprocess.run([sys.executable, "-m", "drafttrain.report", str(a), f"out={tmp_path / 'c.png'}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.png").is_file() and "eagle3_track" in r.stdout
    r = subprocess.run([sys.executable, "-m", "drafttrain.report"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage" in r.stderr
