"""bench_e2e's arithmetic: the RL loop's wall time split by phase, the paired speed-up over AR, the learning check."""
from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def e2e():
    return load_script("bench_e2e")


def test_phase_split_adds_up_to_the_rl_loop(e2e):
    recs = [{"rl_step_s": 3.0, "rollout_wall_s": 1.0, "drafter_train_s": 0.1, "publish_s": 0.05, "capture_s": 0.05,
             "measure_s": 0.3},
            {"rl_step_s": 2.0, "rollout_wall_s": 0.5, "drafter_train_s": None, "publish_s": None, "measure_s": None}]
    s = e2e.phase_split(recs)
    assert s["rl_wall_s"] == pytest.approx(5.0)
    assert (s["rollout_s"], s["drafter_s"], s["measure_s"]) == pytest.approx((1.5, 0.2, 0.3))
    assert s["policy_s"] == pytest.approx(5.0 - 1.5 - 0.2 - 0.3)
    assert sum(s[p] for p in e2e.PHASES) == pytest.approx(s["rl_wall_s"])
    assert s["rollout_share"] == pytest.approx(1.5 / 5.0) and s["tail10_s"] == 0.0


def test_tail_share_is_the_rollout_time_of_the_longest_running_rows(e2e):
    recs = [{"rl_step_s": 4.0, "rollout_wall_s": 2.0, "rollout_tail10_s": 0.5},
            {"rl_step_s": 4.0, "rollout_wall_s": 2.0, "rollout_tail10_s": 1.5}]
    s = e2e.phase_split(recs)
    assert s["tail10_share"] == pytest.approx(0.5) and s["rollout_share"] == pytest.approx(0.5)


def _run(arm, seed, wall, measure=0.0, reward=0.5, acc=0.4):
    return {"arm": arm, "seed": seed, "rl_wall_s": wall, "measure_s": measure, "job_wall_s": wall + 10,
            "rollout_s": wall / 2, "policy_s": wall / 2 - measure, "drafter_s": 0.0, "reward_mean": reward,
            "heldout_acc_after": acc, "rewards": [reward - 0.1, reward + 0.1]}


def test_speedup_is_paired_by_seed_and_learning_is_judged_against_the_spread(e2e):
    runs = [_run("ar", 0, 100.0, reward=0.50, acc=0.40), _run("ar", 1, 120.0, reward=0.52, acc=0.44),
            _run("tracking", 0, 50.0, measure=10.0, reward=0.51, acc=0.41),
            _run("tracking", 1, 80.0, measure=20.0, reward=0.49, acc=0.43),
            _run("frozen", 0, 90.0, reward=0.90, acc=0.90), _run("frozen", 1, 100.0, reward=0.91, acc=0.92)]
    s = e2e.summarize(runs, ["ar", "tracking", "frozen"], spread=2.0)
    assert s["tracking"]["speedup_over_ar"] == pytest.approx((100 / 50 + 120 / 80) / 2)  # per seed, then the mean
    assert s["tracking"]["speedup_over_ar_no_measure"] == pytest.approx((100 / 40 + 120 / 60) / 2)
    assert "speedup_over_ar" not in s["ar"]
    assert s["tracking"]["speedup_over_frozen"] == pytest.approx((90 / 50 + 100 / 80) / 2)  # paired by seed too
    assert "speedup_over_frozen" not in s["frozen"] and "speedup_over_frozen" not in s["ar"]
    assert s["tracking"]["reward_vs_ar"]["within_spread"] is True
    assert s["frozen"]["reward_vs_ar"]["within_spread"] is False  # learned something else: flagged
    assert s["frozen"]["heldout_acc_vs_ar"]["diff"] == pytest.approx(0.91 - 0.42)
    assert s["ar"]["reward_curve"] == pytest.approx([0.41, 0.61])  # step by step, the mean over seeds


def test_per_token_speedup_divides_out_how_many_tokens_a_trajectory_drew(e2e):
    recs = [{"rl_step_s": 3.0, "rollout_wall_s": 1.0, "rollout_tokens": 1000},
            {"rl_step_s": 2.0, "rollout_wall_s": 1.0, "rollout_tokens_per_s": 500.0}]  # a record from before the key
    s = e2e.phase_split(recs)
    assert s["tokens"] == pytest.approx(1500) and s["rl_ms_per_token"] == pytest.approx(5e3 / 1500)
    assert s["rollout_ms_per_token"] == pytest.approx(2e3 / 1500)
    ar = {**_run("ar", 0, 100.0), "rl_ms_per_token": 1.0, "rollout_ms_per_token": 0.5}
    sd = {**_run("tracking", 0, 150.0), "rl_ms_per_token": 0.8, "rollout_ms_per_token": 0.25}  # 2x the tokens
    out = e2e.summarize([ar, sd], ["ar", "tracking"], spread=2.0)["tracking"]
    assert out["speedup_over_ar"] == pytest.approx(100 / 150)  # slower in wall time: it drew more tokens
    assert out["speedup_over_ar_per_token"] == pytest.approx(1.25)
    assert out["speedup_over_ar_rollout_per_token"] == pytest.approx(2.0)


def test_same_batches_prices_an_arms_own_batches_at_ars_fitted_cost(e2e):
    """AR's rollout seconds = 2 ms a decode step + 0.1 ms a token: the fit recovers it; an arm twice as fast on
    batches of another shape reads 2x on its own batches, whatever its tokens."""
    shapes = [(40, 3000), (90, 5000), (200, 6000), (60, 4500), (300, 9000)]
    ar_steps = [[m, t, 2e-3 * m + 1e-4 * t, 0.0] for m, t in shapes]
    roll = sum(x[2] for x in ar_steps)
    ar = {"steps": ar_steps, "rollout_s": roll, "rl_wall_s": roll + 2.0, "tokens": sum(t for _, t in shapes)}
    fit = e2e.ar_cost(ar)
    assert fit["c_step"] == pytest.approx(2e-3) and fit["c_token"] == pytest.approx(1e-4) and fit["r2"] > 0.999
    other = [(120, 2000), (400, 7000)]  # a longer tail, fewer tokens
    steps = [[m, t, (2e-3 * m + 1e-4 * t) / 2, 0.0] for m, t in other]
    run = {"steps": steps, "rollout_s": sum(x[2] for x in steps), "tokens": 9000}
    run["rl_wall_s"] = run["rollout_s"] + 9000 * fit["policy_s_per_token"]  # the same loop outside the rollout
    r, loop = e2e.same_batches(ar, run)
    assert r == pytest.approx(2.0)
    assert loop == pytest.approx((2 * run["rollout_s"] + 9000 * fit["policy_s_per_token"]) / run["rl_wall_s"])
    assert e2e.same_batches(ar, {**run, "steps": None}) == (None, None)


def test_resummarize_reads_the_run_folders_again_and_reruns_nothing(e2e, tmp_path, monkeypatch):
    import json

    from omegaconf import OmegaConf

    runs = []
    for arm, speed in (("ar", 1.0), ("tracking", 1.5)):
        folder = tmp_path / "run" / f"{arm}-seed-0"
        folder.mkdir(parents=True)
        recs = [{"step": i, "reward_mean": 0.5, "resp_len_max": m, "rollout_tokens": t,
                 "rollout_wall_s": (2e-3 * m + 1e-4 * t) / speed, "rl_step_s": (2e-3 * m + 1e-4 * t) / speed + 1.0}
                for i, (m, t) in enumerate([(40, 3000), (90, 5000), (200, 6000)])]
        folder.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        runs.append({**_run(arm, 0, 1.0), "job_wall_s": 9.0})  # phases stale: reread from the folder
    out = tmp_path / "e.json"
    out.write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(e2e, "run_one", lambda *a: pytest.fail("resummarize reran a job"))
    cfg = OmegaConf.create({**e2e.DEFAULTS, "arms": ["ar", "tracking"], "run_dir": str(tmp_path / "run"),
                            "out": str(out), "plot": str(tmp_path / "e.png"), "resummarize": True})
    res = e2e.main(cfg)
    assert res["summary"]["tracking"]["rollout_speedup_same_batches"] == pytest.approx(1.5)
    assert res["runs"][0]["tokens"] == 14000 and res["runs"][0]["job_wall_s"] == 9.0
    assert json.loads(out.read_text())["summary"]["ar"]["ar_cost_fit_r2"] == [1.0]


def test_one_seed_decides_nothing_about_learning(e2e):
    assert e2e.same_learning([0.5], [0.4], 2.0)["within_spread"] is None
    assert e2e.same_learning([0.5, 0.52], [0.5, 0.48], 2.0)["within_spread"] is True


def test_unknown_arm_is_refused_in_one_line(e2e):
    from omegaconf import OmegaConf

    with pytest.raises(SystemExit, match=r"arms: \['fast'\]"):
        e2e.main(OmegaConf.create({**e2e.DEFAULTS, "arms": ["ar", "fast"]}))
