"""The end-of-run report: live vs frozen (vs oracle) MAL, live minus frozen with its running mean, the tokens/s the
live drafter bought, and legends that stay off the data; the terminal table's live-vs-frozen rows."""
from __future__ import annotations

import math

import pytest

from drafttrain.report import derived, frozen_tokens_per_s, plot_run, run_figure, running_mean, summary_table


def records(n: int = 40) -> list[dict]:
    """Noisy series that fill their panels (every corner of the axes holds data, as a long run's do)."""
    out = []
    for s in range(n):
        wob = math.sin(1.7 * s) + (s % 3 - 1)
        out.append({"step": s, "reward_mean": 0.3 + 0.1 * wob, "resp_len_mean": 100.0,
                    "rollout_tokens_per_s": 400 + 60 * wob, "rollout_wall_s": 10.0, "rollout_prefill_s": 1.0,
                    "live_mal": 3.5 + 0.4 * wob, "live_tf_mal": 3.4 + 0.02 * s + 0.3 * wob,
                    "frozen_tf_mal": 3.4 - 0.01 * s + 0.3 * math.cos(s), "drafter_train_s": 0.2 + 0.1 * wob,
                    "rl_step_s": 5 + wob, "oracle_tf_mal": 4.5 if s in (19, 39) else None})
    return out


def test_frozen_tokens_per_s_scales_decode_time_by_the_mal_ratio():
    """100 tok/s over 10 s, 2 s of it prefill, live MAL 4 vs frozen 2: the frozen drafter needs twice the verify
    steps, 2 + 8 x 2 = 18 s for the same 1000 tokens."""
    rec = {"rollout_tokens_per_s": 100.0, "rollout_wall_s": 10.0, "rollout_prefill_s": 2.0, "live_tf_mal": 4.0,
           "frozen_tf_mal": 2.0}
    assert frozen_tokens_per_s(rec) == pytest.approx(1000 / 18)
    (d,) = derived([rec])
    assert d["live_minus_frozen_tf_mal"] == 2.0 and d["tokens_per_s_bought"] == pytest.approx(100 - 1000 / 18)
    assert derived([{"rollout_tokens_per_s": 1.0}]) == [{"live_minus_frozen_tf_mal": None,
                                                         "tokens_per_s_bought": None}]


def test_running_mean_skips_missing_steps():
    assert running_mean([1.0, float("nan"), 3.0, 5.0], w=2) == [1.0, 1.0, 2.0, 4.0]
    assert math.isnan(running_mean([float("nan")])[0])


def test_summary_table_has_the_live_vs_frozen_rows():
    table = summary_table(records())
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]}
    assert {"live_minus_frozen_tf_mal", "tokens_per_s_bought", "oracle_tf_mal", "live_tf_mal"} <= set(rows)
    assert table.splitlines()[0].split() == ["metric", "first", "last", "mean", "last_quarter"]
    diffs = [d["live_minus_frozen_tf_mal"] for d in derived(records())]
    assert float(rows["live_minus_frozen_tf_mal"][3]) == pytest.approx(sum(diffs[-10:]) / 10, abs=2e-3)


def test_report_panels_and_legends_off_the_data(tmp_path):
    """Each panel the issue asks for is there, and no legend overlaps any panel's plotting area or title."""
    fig = run_figure(records(), "eagle3_track")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = fig.axes
    titles = [a.get_title() for a in axes]
    assert any("live minus frozen" in t for t in titles)
    assert any("bought" in t and "estimated" in t for t in titles)
    labels = [line.get_label() for a in axes for line in a.get_lines()]
    assert any("oracle" in x for x in labels) and any(x.startswith("mean of the last") for x in labels)
    legends = [a.get_legend() for a in axes if a.get_legend() is not None]
    assert len(legends) >= 5
    for leg in legends:
        box = leg.get_window_extent(r)
        for a in axes:
            assert not box.overlaps(a.get_window_extent(r)), (leg.get_texts()[0].get_text(), a.get_title())
            assert not box.overlaps(a.title.get_window_extent(r)), a.get_title()
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # not cut off
    for a in axes:  # nor a title
        box = a.title.get_window_extent(r)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), a.get_title()
    assert plot_run(records(), tmp_path / "report.png").stat().st_size > 0
