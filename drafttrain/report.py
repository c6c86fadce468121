"""Everything a run or a benchmark measures leaves through here: tables for the terminal and JSON files.
(The online job adds per-step JSONL + TensorBoard records and end-of-run plots on top of these.)"""
from __future__ import annotations

import json
import os
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


def plot_run(records: list[dict], path: str | Path, title: str = "") -> Path:
    """PNG: acceptance over RL steps (tracking vs frozen), reward, rollout tokens/s, drafter lag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    get = lambda k: [r.get(k) if r.get(k) is not None else float("nan") for r in records]  # noqa: E731
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    a = ax[0][0]
    a.plot(steps, get("live_mal"), "o-", label="tracking drafter (engine)")
    a.plot(steps, get("live_tf_mal"), "--", label="tracking drafter (teacher-forced)")
    a.plot(steps, get("frozen_tf_mal"), "s-", label="frozen step-0 drafter (teacher-forced)")
    a.set(title="mean accepted length", xlabel="RL step")
    a.legend(fontsize=8)
    reward, w = get("reward_mean"), 8  # one step's prompts vary in difficulty: the running mean shows the trend
    ax[0][1].plot(steps, reward, "o-", alpha=0.35, label="per step")
    ax[0][1].plot(steps, [sum(reward[max(0, i - w + 1): i + 1]) / len(reward[max(0, i - w + 1): i + 1])
                          for i in range(len(reward))], "-", lw=2, label=f"mean of the last {w} steps")
    ax[0][1].set(title="reward (exact match)", xlabel="RL step")
    ax[0][1].legend(fontsize=8)
    ax[1][0].plot(steps, get("rollout_tokens_per_s"), "o-")
    ax[1][0].set(title="rollout tokens/s", xlabel="RL step")
    ax[1][1].plot(steps, get("drafter_train_s"), "o-", label="drafter train s")
    ax[1][1].plot(steps, get("rl_step_s"), "o-", label="RL step s")
    ax[1][1].set(title="time per step", xlabel="RL step")
    ax[1][1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


SUMMARY_KEYS = ["reward_mean", "resp_len_mean", "rollout_tokens_per_s", "live_mal", "live_tf_mal", "frozen_tf_mal",
                "drafter_train_s", "swap_s", "rl_step_s", "policy_minus_drafter_version"]


def summary_table(records: list[dict]) -> str:
    """First / last / mean of the key per-step metrics."""
    rows = []
    for k in SUMMARY_KEYS:
        vals = [r[k] for r in records if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals:
            rows.append({"metric": k, "first": float(vals[0]), "last": float(vals[-1]),
                         "mean": float(sum(vals) / len(vals))})
    return format_table(rows, ["metric", "first", "last", "mean"])


def eval_table(before: dict | None, after: dict) -> str:
    """Held-out accuracy (GRPO.evaluate) before and after a run, and the change."""
    before = before or {}
    rows = [{"metric": k, "before": before.get(k), "after": v, "change": v - before[k] if k in before else None}
            for k, v in after.items()]
    return format_table(rows, ["metric", "before", "after", "change"])
