"""Everything a run or a benchmark measures leaves through here: tables for the terminal and JSON files.
(The online job adds per-step JSONL + TensorBoard records and end-of-run plots on top of these.)

    python -m drafttrain.report runs/eagle3_track runs/eagle3_frozen      # finished runs side by side
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path


def format_table(rows: list[dict], cols: list[str], floatfmt: str = "{:.3g}") -> str:
    """Plain aligned text table; list values are shown as a/b/c."""
    def cell(v):
        if isinstance(v, float):
            return floatfmt.format(v)
        if isinstance(v, (list, tuple)):
            return "/".join(cell(x) for x in v)
        return "-" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, body)])


def write_json(obj: dict, path: str | Path) -> Path:
    """Atomic JSON write (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
    return path


class RunLogger:
    """One JSONL record per RL step (the same keys in every recipe) + TensorBoard scalars.
    On resume, records at or after resume_step are dropped first, so no step is ever logged twice; so are malformed
    lines (a write cut short by a kill, a damaged file), each well-formed record before resume_step is kept, and
    `say` gets one line naming what was dropped."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_step: int = 0, say=print):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        bad: list[int] = []
        self.records = [r for r in read_jsonl(self.path, bad) if r["step"] < resume_step]
        if bad:
            say(f"[drafttrain] {self.path}: dropped {len(bad)} malformed line(s) (line "
                f"{', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''}); every other record was kept")
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: the event files' records at or after resume_step are dropped too (as the JSONL's are)
            self.tb = SummaryWriter(str(self.out / "tb"), purge_step=resume_step if resume_step else None)

    def log(self, rec: dict) -> None:
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, bool) or v is None:
                    continue
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: str | Path, bad: list[int] | None = None) -> list[dict]:
    """The step records of a metrics file. A malformed line (cut short by a kill, or damaged) is skipped, not the
    end of the file: its 1-based number goes to `bad`."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
        elif bad is not None:
            bad.append(i)
    return out


def _col(records: list[dict], key: str) -> list[float]:
    """One metric over the records, nan where a record lacks it (matplotlib leaves a gap)."""
    return [r.get(key) if r.get(key) is not None else float("nan") for r in records]


def _numbers(records: list[dict], key: str) -> list[float]:
    """The records' numeric values of one metric (missing, None and bool values left out)."""
    return [r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def last_quarter(items: list) -> list:
    """The last quarter of a run's per-step items (at least one; none of none): what the summaries average."""
    return items[-max(1, len(items) // 4):] if items else []


def _last_quarter_mean(vals: list[float]) -> float | None:
    q = last_quarter(vals)
    return sum(q) / len(q) if q else None


def running_mean(xs: list[float], w: int = 8) -> list[float]:
    """Mean of the last w finite values at each point (nan until there is one): one step is noisy, the trend is
    not."""
    out, window = [], []
    for x in xs:
        if x == x:  # not nan
            window = (window + [x])[-w:]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


def frozen_tokens_per_s(rec: dict) -> float | None:
    """The rollout tokens/s the frozen step-0 drafter would have given on this step's rollouts, from the measured
    ones and the live / frozen teacher-forced MAL on the same rows: at a fixed k a verify step costs the same
    whichever drafter drafts (the engine's cost model: T(B, k+1) + k D(B)), so the decode time (wall less prefill)
    scales with verify steps, 1 / MAL, and the prefill does not change. Approximate under engine.toggle or auto
    k, whose steps vary; None where a value is missing."""
    tps, wall, live, frozen = (rec.get(k) for k in ("rollout_tokens_per_s", "rollout_wall_s", "live_tf_mal",
                                                    "frozen_tf_mal"))
    if None in (tps, wall, live, frozen) or not frozen or not wall:
        return None
    pre = rec.get("rollout_prefill_s") or 0.0
    return tps * wall / (pre + (wall - pre) * live / frozen)


def derived(records: list[dict]) -> list[dict]:
    """Per-step comparisons of the live and the frozen drafter (None where not measured): live minus frozen
    teacher-forced MAL, and the rollout tokens/s the live drafter bought over the frozen one (frozen_tokens_per_s).
    """
    out = []
    for r in records:
        live, frozen, fz = r.get("live_tf_mal"), r.get("frozen_tf_mal"), frozen_tokens_per_s(r)
        out.append({"live_minus_frozen_tf_mal": live - frozen if None not in (live, frozen) else None,
                    "tokens_per_s_bought": r["rollout_tokens_per_s"] - fz if fz is not None else None})
    return out


def run_figure(records: list[dict], title: str = ""):
    """The report's figure over RL steps: MAL of the live, frozen and (where measured: oracle_tf_mal) oracle
    drafters; live minus frozen MAL with its running mean; rollout tokens/s and what the live drafter bought;
    reward; time per step. Legends sit below their panels, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    get = lambda k, rs=records: _col(rs, k)  # noqa: E731
    more = derived(records)
    fig, ax = plt.subplots(2, 3, figsize=(16, 9), layout="constrained")
    a = ax[0][0]
    a.plot(steps, get("live_mal"), "o-", ms=3, label="live drafter (engine)")
    a.plot(steps, get("live_tf_mal"), "--", zorder=3, label="live drafter (teacher-forced)")  # over frozen at v0
    a.plot(steps, get("frozen_tf_mal"), "s-", ms=3, label="frozen step-0 drafter (teacher-forced)")
    if any(r.get("oracle_tf_mal") is not None for r in records):
        a.plot(steps, get("oracle_tf_mal"), "D", ms=7, label="oracle drafter (teacher-forced, where measured)")
    a.set(title="mean accepted length (MAL)", xlabel="RL step")
    diff = get("live_minus_frozen_tf_mal", more)
    _series(ax[0][1], steps, diff, "live minus frozen MAL (teacher-forced, same rollouts)")
    ax[0][1].axhline(0.0, color="grey", lw=0.8)
    a = ax[0][2]
    a.plot(steps, get("rollout_tokens_per_s"), "o-", ms=3, label="measured (live drafter)")
    a.plot(steps, [frozen_tokens_per_s(r) or float("nan") for r in records], "s--", ms=3,
           label="frozen drafter (estimated)")
    a.set(title="rollout tokens/s", xlabel="RL step")
    _series(ax[1][0], steps, get("tokens_per_s_bought", more),
            "tokens/s the live drafter bought over the frozen one\n(estimated: decode time x live/frozen MAL)")
    ax[1][0].axhline(0.0, color="grey", lw=0.8)
    _series(ax[1][1], steps, get("reward_mean"), "reward (exact match)")
    a = ax[1][2]
    a.plot(steps, get("drafter_train_s"), "o-", ms=3, label="drafter train s")
    a.plot(steps, get("rl_step_s"), "o-", ms=3, label="RL step s")
    a.set(title="time per step", xlabel="RL step")
    for a in ax.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.suptitle(title)
    return fig


def _series(a, steps: list[int], ys: list[float], title: str, w: int = 8) -> None:
    """A noisy per-step series and its running mean."""
    a.plot(steps, ys, "o-", ms=3, alpha=0.35, label="per step")
    a.plot(steps, running_mean(ys, w), "-", lw=2, label=f"mean of the last {w} steps")
    a.set(title=title, xlabel="RL step")


def plot_run(records: list[dict], path: str | Path, title: str = "") -> Path:
    """report.png: run_figure."""
    import matplotlib.pyplot as plt

    fig = run_figure(records, title)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


SUMMARY_KEYS = ["reward_mean", "resp_len_mean", "rollout_tokens_per_s", "tokens_per_s_bought", "live_mal", "live_k",
                "live_tf_mal", "frozen_tf_mal", "oracle_tf_mal", "live_minus_frozen_tf_mal", "drafter_train_s",
                "swap_s", "rl_step_s", "policy_minus_drafter_version"]


def summary_table(records: list[dict]) -> str:
    """First / last / mean / last-quarter mean of the key per-step metrics (with derived's live-vs-frozen rows)."""
    records = [{**r, **d} for r, d in zip(records, derived(records))]
    rows = []
    for k in SUMMARY_KEYS:
        vals = _numbers(records, k)
        if vals:
            rows.append({"metric": k, "first": float(vals[0]), "last": float(vals[-1]),
                         "mean": float(sum(vals) / len(vals)), "last_quarter": float(_last_quarter_mean(vals))})
    return format_table(rows, ["metric", "first", "last", "mean", "last_quarter"])


def accuracy_change(before: dict | None, after: dict, n: int) -> dict:
    """Per accuracy in `after` (GRPO.evaluate on `n` fixed problems): the change in points and its standard error,
    binomial, the two evaluations taken as independent samples (they are fresh draws on the same problems, so
    this slightly over-estimates the error). Empty without `before`."""
    out = {}
    for k, b in after.items():
        if before and k in before and n > 0:
            a = before[k]
            out[k] = {"change_pts": 100 * (b - a), "se_pts": 100 * math.sqrt((a * (1 - a) + b * (1 - b)) / n)}
    return out


def eval_table(before: dict | None, after: dict) -> str:
    """Held-out accuracy (GRPO.evaluate) before and after a run, and the change."""
    before = before or {}
    rows = [{"metric": k, "before": before.get(k), "after": v, "change": v - before[k] if k in before else None}
            for k, v in after.items()]
    return format_table(rows, ["metric", "before", "after", "change"])


def _step_work(r: dict) -> tuple[float, float, float] | None:
    """(drafter work, RL step time, measurement time) of one step record; None where no drafter was trained."""
    if r.get("drafter_train_s") is None:
        return None
    return (r["drafter_train_s"] + (r.get("publish_s") or 0) + (r.get("capture_s") or 0), r["rl_step_s"],
            r.get("measure_s") or 0.0)


def step_overhead_pct(r: dict) -> float | None:
    """One step's drafter work as a % of its own RL time (overhead's per-step term); None where not trained."""
    wtm = _step_work(r)
    return None if wtm is None else 100 * wtm[0] / max(wtm[1] - wtm[0] - wtm[2], 1e-9)


def overhead(recs: list[dict]) -> dict:
    """Online training's time per RL step (capture hooks in the loss forward, drafter steps, estimate, publish) over
    the RL step's own time (rollout + policy update): rl_step_s less that work and less measure_s (the per-step
    live/frozen scoring, reported on its own as measure_pct). None where no step trained a drafter."""
    work = [wtm for wtm in map(_step_work, recs) if wtm is not None]
    own = sum(t - w - m for w, t, m in work)
    per_step = [p for p in map(step_overhead_pct, recs) if p is not None]
    return {"overhead_pct": 100 * sum(w for w, _, _ in work) / max(own, 1e-9) if work else None,
            "overhead_pct_mean_of_steps": statistics.fmean(per_step) if per_step else None,
            "overhead_pct_per_step": per_step,
            "measure_pct": 100 * sum(m for _, _, m in work) / max(own, 1e-9) if work else None}


class RunFolderError(ValueError):
    """A folder given to the comparison is not a run's (one line, naming it)."""


def load_run(path: str | Path) -> dict:
    """A run folder's records (metrics.jsonl), held-out evaluation (eval.json, if written) and recipe name."""
    path = Path(path)
    if not path.is_dir():
        raise RunFolderError(f"{path}: no such run folder")
    records = read_jsonl(path / "metrics.jsonl")
    if not records:
        raise RunFolderError(f"{path}: no step records (metrics.jsonl missing or empty): not a run folder, or a run "
                             "that has not finished a step")
    ev = path / "eval.json"
    recipe = None
    if (path / "config.yaml").is_file():
        from omegaconf import OmegaConf

        recipe = OmegaConf.load(path / "config.yaml").get("recipe")
    return {"name": path.name, "path": str(path), "records": records, "recipe": recipe,
            "eval": json.loads(ev.read_text()) if ev.is_file() else None}


def compare_rows(runs: list[dict]) -> list[dict]:
    """One row per run: last-quarter means of the per-step metrics, drafter overhead and held-out accuracy."""
    rows = []
    for run in runs:
        recs, ev = run["records"], run["eval"] or {}
        before, after = (ev.get("before") or {}), (ev.get("after") or {})
        ch = accuracy_change(before, after, ev.get("prompts", 0)).get("eval_sampled_acc", {}) if after else {}
        rows.append({"run": run["name"], "recipe": run["recipe"], "steps": len(recs),
                     **{k: _last_quarter_mean(_numbers(recs, k)) for k in ("reward_mean", "live_mal", "live_tf_mal",
                                                                       "frozen_tf_mal", "rollout_tokens_per_s")},
                     "overhead_pct": overhead(recs)["overhead_pct"],
                     "acc_before": before.get("eval_sampled_acc"), "acc_after": after.get("eval_sampled_acc"),
                     "acc_change_pts": ch.get("change_pts"), "acc_change_se": ch.get("se_pts")})
    return rows


COMPARE_COLS = ["run", "recipe", "steps", "reward_mean", "live_mal", "live_tf_mal", "frozen_tf_mal",
                "rollout_tokens_per_s", "overhead_pct", "acc_before", "acc_after", "acc_change_pts", "acc_change_se"]


def compare_figure(runs: list[dict], rows: list[dict]):
    """Runs over RL steps, one colour each: live (solid) and frozen (dashed) teacher-forced MAL, reward, rollout
    tokens/s and drafter overhead (running means of 8 steps); held-out sampled accuracy before and after (from
    compare_rows' rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(16, 9), layout="constrained")
    for i, run in enumerate(runs):
        recs, c = run["records"], f"C{i}"
        steps = [r["step"] for r in recs]
        get = lambda k: _col(recs, k)  # noqa: E731
        ax[0][0].plot(steps, get("live_tf_mal"), "-", color=c, label=f"{run['name']} live")
        ax[0][0].plot(steps, get("frozen_tf_mal"), "--", color=c, label=f"{run['name']} frozen step-0")
        ax[0][1].plot(steps, running_mean(get("reward_mean")), color=c, label=run["name"])
        ax[0][2].plot(steps, running_mean(get("rollout_tokens_per_s")), color=c, label=run["name"])
        per = [step_overhead_pct(r) for r in recs]
        ax[1][0].plot(steps, running_mean([float("nan") if p is None else p for p in per]), color=c, label=run["name"])
        ax[1][2].plot(steps, get("live_mal"), "o", ms=3, color=c, label=run["name"])
    x = range(len(rows))
    for j, (key, label) in enumerate((("acc_before", "before"), ("acc_after", "after"))):
        vals = [r[key] if r[key] is not None else float("nan") for r in rows]
        ax[1][1].bar([i + 0.4 * j for i in x], vals, width=0.4, label=label)
    ax[1][1].set_xticks([i + 0.2 for i in x], [r["run"] for r in rows])
    for a, title in zip(ax.flat, ("teacher-forced MAL: live (solid), frozen step-0 (dashed)", "reward (running mean)",
                                  "rollout tokens/s (running mean)", "drafter overhead, % of the RL step",
                                  "held-out accuracy, sampled", "engine MAL (live drafter)")):
        a.set(title=title, xlabel="" if a is ax[1][1] else "RL step")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    return fig


def compare_runs(paths: list[str], out: str | Path | None = None) -> tuple[str, Path]:
    """(the table, the PNG's path) comparing finished runs; the PNG goes to `out` (default: compare.png beside the
    first run folder)."""
    import matplotlib.pyplot as plt

    runs = [load_run(p) for p in paths]
    rows = compare_rows(runs)
    out = Path(out) if out else Path(paths[0]).resolve().parent / "compare.png"
    fig = compare_figure(runs, rows)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return format_table(rows, COMPARE_COLS), out


def cli(argv: list[str] | None = None) -> int:
    """`python -m drafttrain.report RUN [RUN ...] [out=PATH]`: the comparison's table and PNG; 2 on bad input."""
    args = sys.argv[1:] if argv is None else argv
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    paths = [a for a in args if not a.startswith("out=")]
    if not paths or "-h" in paths or "--help" in paths:
        print("usage: python -m drafttrain.report RUN_DIR [RUN_DIR ...] [out=compare.png]", file=sys.stderr)
        return 0 if paths else 2
    try:
        table, png = compare_runs(paths, outs[-1] if outs else None)
    except RunFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
