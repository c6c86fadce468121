"""Every command the project tells a user to run, at its smallest size: the list tests/integration/test_smoke.py runs.

documented_commands() reads what the project advertises: README.md (fenced bash blocks, inline `python ...`,
`accelerate launch ...`, `... key=value` and bare `key=value` spans, the last two being the main job's options), the
recipes' header comments, and the docstrings of scripts/*.py and of the main job. normalize() reduces a command to its
head (environment, launcher and its flags, script or module) and its option keys. A smoke entry covers a documented
command when the heads are equal, the entry sets every documented key, and it keeps every documented value that
names a mode (a word such as `true`, `auto`, `vllm`, a recipe): numbers, lists and paths may shrink to the smallest
size. A new documented command or option with no covering entry fails test_every_documented_command_is_smoke_run.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from drafttrain.config import PROJECT_ROOT

MAIN = "accelerate launch drafttrain/online.py"  # how the README launches the main job: `...` and bare options
TWO_PROC = "accelerate launch --config_file recipes/accelerate/ddp2.yaml"
ZERO2 = "accelerate launch --config_file recipes/accelerate/zero2.yaml"
CMD_START = re.compile(r"(?:[A-Z_]+=\S+ )*(?:accelerate launch|torchrun|python3? |bash )")
WORD = re.compile(r"[A-Za-z_][\w.-]*")  # a value that names a mode or a recipe (true, auto, vllm, eagle3_track)


# ---- what the project documents --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    head: str  # "ENV=1 launcher --flags target"
    options: tuple[tuple[str, str], ...]  # (key, value) in order; flags such as --help as (flag, "")
    source: str = ""

    def __str__(self) -> str:
        return " ".join([self.head, *(f"{k}={v}" if v else k for k, v in self.options)])


def normalize(text: str, source: str = "") -> Command | None:
    """One command line -> Command; None for text that is not a command (prose in backticks)."""
    text = text.replace("\\\n", " ").strip()
    try:
        toks = shlex.split(text)
    except ValueError:
        return None
    toks = [t for t in toks if t not in ("[key=value", "...]")]  # the docstrings' placeholder for more options
    if not toks:
        return None
    if toks[0] == "...":  # the README's "... recipe=eagle3_track rl.steps=10": the main job's command, elided
        toks = MAIN.split() + toks[1:]
    elif all(_option(t) for t in toks):  # a bare main-job option: `engine.kind=vllm`
        toks = MAIN.split() + toks
    head, i = [], 0
    while i < len(toks) and re.fullmatch(r"[A-Z_]+=\S*", toks[i]):
        head.append(toks[i])
        i += 1
    if i == len(toks) or not re.fullmatch(r"accelerate|torchrun|python3?|bash", toks[i]):
        return None
    while i < len(toks):  # the launcher and its flags, up to the script or module
        head.append(toks[i])
        i += 1
        if head[-1].endswith((".py", ".sh")) or head[-2:-1] == ["-m"]:
            break
    opts = []
    for t in toks[i:]:
        if _option(t):
            k, v = t.split("=", 1)
            opts.append((k, v))
        elif t.startswith("-"):
            opts.append((t, ""))
    return Command(" ".join(head), tuple(opts), source)


def _option(tok: str) -> bool:
    return re.fullmatch(r"[a-z_][\w.]*=\S*", tok) is not None


def _command_lines(line: str) -> list[str]:
    """The commands on one line of a docstring or comment: each from a command start to `#`, `(` or the end."""
    starts = [m.start() for m in CMD_START.finditer(line)]
    out = []
    for a, b in zip(starts, starts[1:] + [len(line)]):
        out.append(re.split(r"\s#|\s\(|\)", line[a:b])[0].strip())
    return out


def readme_commands(text: str, source: str = "README.md") -> list[Command]:
    cmds: list[str] = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            cmds += [c.strip() for c in re.split(r"&&|;|\|\|", line) if c.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if CMD_START.match(span) or span.startswith("... ") or all(_option(t) for t in span.split()):
            cmds += [c.strip() for c in span.split("&&")]
    return [c for c in (normalize(x, source) for x in cmds) if c is not None]


def docstring_commands(text: str, source: str) -> list[Command]:
    out = []
    for line in text.splitlines():
        line = line.lstrip("# ").strip()
        out += [c for c in (normalize(x, source) for x in _command_lines(line)) if c is not None]
    return out


def documented_commands(root: Path = PROJECT_ROOT) -> list[Command]:
    import ast

    cmds = readme_commands((root / "README.md").read_text())
    for recipe in sorted((root / "recipes").glob("*.yaml")):
        header = []
        for line in recipe.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        cmds += docstring_commands("\n".join(header), f"recipes/{recipe.name}")
    for py in [*sorted((root / "scripts").glob("*.py")), root / "drafttrain" / "online.py"]:
        doc = ast.get_docstring(ast.parse(py.read_text())) or ""
        cmds += docstring_commands(doc, str(py.relative_to(root)))
    return cmds


def covers(entry: Command, doc: Command) -> bool:
    """The entry runs the documented command: same head, every documented key, every documented mode word kept."""
    got = dict(entry.options)
    return entry.head == doc.head and all(
        k in got and (got[k] == v or not WORD.fullmatch(v)) for k, v in doc.options)


# ---- what each smoke run must write ----------------------------------------------------------------------------
def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class RunDir:
    """A main-job run folder: config.yaml, metrics.jsonl with one record per step, the checkpoint, report.png,
    eval.json (before and after), tb/ events when tensorboard is on, and the trainer's state of `processes`."""
    path: str
    steps: int
    eval: bool = True
    tb: bool = False
    processes: int = 1  # > 1: the checkpoint's trainer state says so (one process running alone would say 1)
    trainer: bool = True  # self-drafters have no trainer state
    options: str = ""  # the command's key=value options ({tmp}: the tmp folder): config.yaml must hold each

    def check(self, tmp: Path, out: str) -> None:
        import torch
        from omegaconf import OmegaConf

        d = tmp / self.path
        cfg = OmegaConf.load(d / "config.yaml")
        opts = self.options.format(tmp=tmp).split()
        want = OmegaConf.from_dotlist(opts)
        for k in (o.split("=")[0] for o in opts):
            assert OmegaConf.select(cfg, k) == OmegaConf.select(want, k), (k, OmegaConf.select(cfg, k))
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == list(range(self.steps)), [r["step"] for r in recs]
        assert all(_finite(r["reward_mean"]) and _finite(r["rl_step_s"]) and r["live_mal"] >= 1.0 for r in recs)
        last = d / "ckpt" / (d / "ckpt" / "latest").read_text().strip()
        assert last.name == f"step-{self.steps}" and (last / "state.pt").is_file() and (last / "policy").is_dir()
        if self.trainer:
            assert torch.load(last / "trainer.pt", weights_only=False)["world"] == self.processes
        assert (d / "report.png").stat().st_size > 0
        if self.eval:
            ev = json.loads((d / "eval.json").read_text())
            assert all(0 <= ev[w][f"eval_{m}_acc"] <= 1 for w in ("before", "after") for m in ("sampled", "greedy"))
        assert self.tb == any((d / "tb").glob("events.*"))


@dataclass(frozen=True)
class Json:
    """A JSON file with these keys, each holding a finite number (or, for a list key, a non-empty list)."""
    path: str
    numbers: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()

    def check(self, tmp: Path, out: str) -> dict:
        js = json.loads((tmp / self.path).read_text())
        bad = [k for k in self.numbers if not _finite(js.get(k))] + [k for k in self.lists if not js.get(k)]
        assert not bad, f"{self.path}: {bad}"
        return js


@dataclass(frozen=True)
class LossRows(Json):
    """bench_loss' JSON: one row per arm, every number finite (the online ones for online_arms alone, the offline
    one for offline_arms alone), and the summary's numbers."""

    def check(self, tmp: Path, out: str) -> dict:
        js = json.loads((tmp / self.path).read_text())
        assert all(js.get(k) for k in self.lists), f"{self.path}: {self.lists}"
        bad = [k for k in self.numbers if not _finite(js["summary"].get(k))]
        assert not bad, f"{self.path} summary: {bad}"
        assert [r["arm"] for r in js["rows"]] == js["arms"] and len(js["per_seed"]) == len(js["arms"]) * 2
        online = ("live_mal", "tracking_over_frozen", "tracking_over_oracle")
        for row in js["rows"]:
            assert _finite(row["step_ms"]), row
            assert _finite(row["offline_mal"]) if row["arm"] in js["offline_arms"] else row["offline_mal"] is None, row
            assert all(_finite(row[k]) if row["arm"] in js["online_arms"] else row[k] is None for k in online), row
        return js


@dataclass(frozen=True)
class DrafterRows(Json):
    """bench_drafters' JSON: each trainable kind's tracking row with its unbounded run beside it (track_ceiling)."""

    def check(self, tmp: Path, out: str) -> dict:
        js = super().check(tmp, out)
        for row in js["tracking"]:
            assert all(_finite(row[k]) for k in ("live_over_frozen", "ceiling_live_over_frozen", "live_over_ceiling"))
            assert abs(row["live_over_ceiling"] * row["ceiling_live_over_frozen"] - row["live_over_frozen"]) < 1e-9
            assert row["ceiling_run"] != row["run"]
            cfg = (Path(row["ceiling_run"]) / "config.yaml").read_text()
            assert "budget_frac: 0.0" in cfg, cfg  # the ceiling is the run with no time budget
        return js


@dataclass(frozen=True)
class VllmRows(Json):
    """bench_rollout's JSON with its engine=vllm rows (AR and SD at each vllm batch) and swap/update latencies."""

    def check(self, tmp: Path, out: str) -> dict:
        js = super().check(tmp, out)
        rows = {(r["mode"], r["batch"]): r for r in js["rows"] if r["engine"] == "vllm"}
        assert set(rows) == {("ar", 1), ("sd", 1)}, set(rows)
        assert all(_finite(r["tokens_per_s"]) and _finite(r["vs_embedded_ar"]) for r in rows.values())
        assert rows[("sd", 1)]["mean_accepted_length"] > 1.0  # the shipped drafter drafts in vLLM too
        assert all(_finite(js["vllm"][k]) for k in ("sd_over_ar_batch1", "swap_ms_median", "policy_update_ms_median"))
        return js


@dataclass(frozen=True)
class File:
    """A non-empty file (a plot) or folder of files (a checkpoint) under the test's tmp folder."""
    path: str
    holds: tuple[str, ...] = ()

    def check(self, tmp: Path, out: str) -> None:
        p = tmp / self.path
        for name in self.holds:
            assert (p / name).stat().st_size > 0, p / name
        if not self.holds:
            assert p.stat().st_size > 0, p


@dataclass(frozen=True)
class Prints:
    """The command's output (stdout + stderr) holds each of these strings."""
    texts: tuple[str, ...]

    def check(self, tmp: Path, out: str) -> None:
        missing = [t for t in self.texts if t not in out]
        assert not missing, f"output lacks {missing}"


# ---- the list ---------------------------------------------------------------------------------------------------
# Scripts run with threads=1 (the tests run with OMP_NUM_THREADS=1): on a shared 2-core machine, two torch threads per
# process slowed the tiny model's steps many times over.
@dataclass(frozen=True)
class Smoke:
    id: str
    cmd: str  # run by bash from the project root; {tmp} is the test's tmp folder
    expect: tuple = ()
    slow: bool = True
    vllm: bool = False
    timeout: int = 600


@dataclass(frozen=True)
class NotRun:
    """A documented command the smoke suite does not run, and why."""
    cmd: str
    why: str


# The main job at its smallest: 1-2 RL steps of 2 prompts x 2 samples, short responses, a tiny held-out eval; the
# engine sized for those 4 rows (a toggle or auto k calibrates its cost model at each batch size up to max_batch)
TINY_RL = ("rl.steps=1 rl.prompts_per_step=2 rl.group_size=2 rl.micro_batch=4 engine.max_batch=4 "
           "sampling.max_new_tokens=16 "
           "rl.eval_prompts=2 online.steps_per_update=2 online.measure_rows=4 online.canary_prompts=2 "
           "online.canary_max_new_tokens=8 train.batch_size=4 run.tensorboard=false")
RUN = "run.out_dir={tmp}/run"


def _main_job(id: str, head: str, opts: str, steps: int = 1, trainer: bool = True, processes: int = 1,
              tb: bool = False, vllm: bool = False) -> Smoke:
    tiny = TINY_RL.replace("rl.steps=1", f"rl.steps={steps}").replace("run.tensorboard=false", f"run.tensorboard={tb}")
    opts = f"{opts} {tiny} {RUN}"
    run = RunDir("run", steps, tb=tb, trainer=trainer, processes=processes, options=opts)
    return Smoke(id, f"{head} {opts}", (run,), vllm=vllm)


SMOKE: list[Smoke] = [
    # the main job: every recipe, both entry points, the documented options, 2 processes, vLLM, --help
    _main_job("eagle3_track", MAIN, "recipe=eagle3_track", tb=True),
    _main_job("eagle3_frozen", MAIN, "recipe=eagle3_frozen"),
    _main_job("selfdraft_int8_track", MAIN, "recipe=selfdraft_int8_track", trainer=False),
    _main_job("selfdraft_int4_track", MAIN, "recipe=selfdraft_int4_track", trainer=False),
    _main_job("suffix_track", MAIN, "recipe=suffix_track", trainer=False),
    _main_job("draft_model_track", MAIN, "recipe=draft_model_track"),
    _main_job("mtp_track", MAIN, "recipe=mtp_track"),
    _main_job("auto_track", MAIN, "recipe=auto_track", trainer=False),
    _main_job("module_entry", "python -m drafttrain.online", "recipe=eagle3_track", steps=2),
    _main_job("online_options", MAIN, "recipe=eagle3_track engine.k=auto online.budget_frac=0 online.canary=probe "
              "online.measure_every=1 rl.eval_decode=ar online.capture_rows=all train.positions=rejected "
              "train.loss=kl_tv", steps=2),
    _main_job("two_processes", f"{TWO_PROC} drafttrain/online.py", "recipe=eagle3_track", processes=2),
    _main_job("one_process_config", "accelerate launch --config_file recipes/accelerate/one_process.yaml "
              "drafttrain/online.py", "recipe=eagle3_track"),
    _main_job("vllm_engine", MAIN, "recipe=eagle3_track engine.kind=vllm", vllm=True),
    _main_job("vllm_draft_model", MAIN, "recipe=draft_model_track engine.kind=vllm", vllm=True),
    _main_job("vllm_mtp", MAIN, "recipe=mtp_track engine.kind=vllm", vllm=True),
    _main_job("vllm_suffix", MAIN, "recipe=suffix_track engine.kind=vllm engine.k=4", trainer=False, vllm=True),
    # the final behaviour of the main job's --help (usage naming recipe= and the config sections)
    Smoke("help", "python -m drafttrain.online --help", (Prints(("recipe=", "rl.steps", "engine.kind")),), slow=False),
    Smoke("help_under_accelerate", "accelerate launch drafttrain/online.py --help",
          (Prints(("recipe=", "rl.steps", "engine.kind")),)),
    # the README's troubleshooting line: -q drops accelerate's traceback after the job's one-line refusal
    Smoke("quiet_launch", "accelerate launch -q drafttrain/online.py recipe=eagle3_track rl.steps=1 rl.clip_eps=-1 "
          "run.out_dir={tmp}/run || test $? -eq 1", (Prints(("error: rl.clip_eps",)),)),
    # scripts: each with every documented option, outputs in {tmp} (never the committed bench/*.json or checkpoints/)
    Smoke("make_policy", "python scripts/make_policy.py check_p=0 out={tmp}/p steps=2 eval_n=2 threads=1",
          (File("p", ("config.json", "model.safetensors", "tokenizer.json", "task_eval.json")),)),
    Smoke("make_policy_second_stage", "python scripts/make_policy.py init=checkpoints/policy out={tmp}/p2 steps=2 "
          "lr=1e-3 warmup=10 seed=1 eval_n=2 threads=1",
          (File("p2", ("config.json", "model.safetensors", "tokenizer.json", "task_eval.json")),)),
    Smoke("pretrain_drafter", "python scripts/pretrain_drafter.py threads=1 prompts=8 epochs=1 out={tmp}/e3 "
          "train.lr=1e-3 drafter.ttt_steps=2 chunk=8 warmup=1 eval_prompts=2 sampling.max_new_tokens=16 "
          "train.batch_size=4 train.loss=kl_tv train.positions=rejected",
          (File("e3", ("config.json", "model.safetensors")),)),
    Smoke("pretrain_drafter_mtp", "python scripts/pretrain_drafter.py drafter.kind=mtp threads=1 prompts=8 epochs=1 "
          "out={tmp}/m chunk=8 warmup=1 eval_prompts=2 sampling.max_new_tokens=16 train.batch_size=4",
          (File("m", ("config.json", "model.safetensors")),)),
    Smoke("pretrain_drafter_draft_model", "python scripts/pretrain_drafter.py drafter.kind=draft_model threads=1 "
          "prompts=8 epochs=1 out={tmp}/d chunk=8 warmup=1 eval_prompts=2 sampling.max_new_tokens=16 "
          "train.batch_size=4", (File("d", ("config.json", "model.safetensors")),)),
    Smoke("bench_drafters", "python scripts/bench_drafters.py kinds=[mtp,suffix] repeats=1 warmup=1 tracking=true "
          "track_steps=1 track_overrides=[rl.eval_prompts=2,rl.prompts_per_step=2,rl.group_size=2,"
          "sampling.max_new_tokens=16] prompts=2 group=2 batches=[1,2] max_new_tokens=16 threads=1 "
          "out={tmp}/d.json",
          (DrafterRows("d.json", ("auto_over_best", "suffix_speedup_over_ar"), ("kinds", "tracking")),)),
    Smoke("pretrain_drafter_two_processes", f"{TWO_PROC} scripts/pretrain_drafter.py threads=1 prompts=8 epochs=1 "
          "out={tmp}/e3 chunk=4 warmup=1 eval_prompts=2 sampling.max_new_tokens=16 train.batch_size=4",
          (File("e3", ("config.json", "model.safetensors")),)),
    Smoke("bench_rollout_vllm", "python scripts/bench_rollout.py vllm=true batches=[1] n_prompts=2 max_new_tokens=16 "
          "overrides=[engine.k=5] vllm_batches=[1] vllm_swaps=2 mal_ks=[4] mal_batch=2 threads=1 out={tmp}/r.json",
          (VllmRows("r.json", ("alpha", "theory_speedup", "measured_speedup"), ("rows",)),), vllm=True),
    Smoke("bench_longtail", "python scripts/bench_longtail.py prompts=2 group=2 sweep_batches=[1,2] "
          "drafters=[eagle3,selfquant_int8,selfquant_int4] overrides=[engine.max_batch=4] "
          "repeats=1 sweep_repeats=1 sweep_min_batches=1 sweep_rows=2 max_new_tokens=16 sweep_tokens=16 "
          "threads=1 out={tmp}/l.json",
          (Json("l.json", ("ar_wall_s", "ceiling_wall_s"), ("rows", "sweep", "trace")), File("l_trace.png"))),
    Smoke("bench_longtail_auto", "python scripts/bench_longtail.py prompts=2 group=2 sweep_batches=[1,2] "
          "drafters=[suffix,auto] overrides=[engine.max_batch=4] repeats=1 sweep_repeats=1 sweep_min_batches=1 "
          "sweep_rows=2 max_new_tokens=16 sweep_tokens=16 threads=1 out={tmp}/l.json",
          (Json("l.json", ("ar_wall_s",), ("auto_trace",)), File("l_trace.png"))),
    Smoke("bench_selfquant", "python scripts/bench_selfquant.py policy=checkpoints/policy variants=[int8/ao,int4/ao] "
          "mal_prompts=2 mal_batch=2 batches=[1] repeats=1 requant_repeats=1 max_new_tokens=16 threads=1 "
          "out={tmp}/s.json",
          (Json("s.json", (), ("requantize", "cost", "mal")),)),
    Smoke("bench_tracking", "python scripts/bench_tracking.py seeds=[0,1] oracle_steps=2 oracle_rollouts=4 "
          "eval_rollouts=4 decay_prompts=4 max_new_tokens=16 run_dir={tmp}/run out={tmp}/t.json "
          "overrides=[rl.steps=2,rl.prompts_per_step=2,rl.group_size=2,sampling.max_new_tokens=16,rl.eval_prompts=4,"
          "run.tensorboard=false,online.canary_max_new_tokens=8]",
          (Json("t.json", ("tracking_over_frozen", "tracking_over_oracle", "frozen_decay_pct", "overhead_pct"),
                ("seeds", "per_seed")),)),
    Smoke("bench_loss", "python scripts/bench_loss.py seeds=[0,1] arms=[kl:uniform,tv:rejected,kl_tv:uniform] "
          "online_arms=[kl:uniform,tv:rejected] offline_arms=[kl:uniform,kl_tv:uniform] online=true "
          "offline=true step_cost=true parallel=2 offline_prompts=8 offline_epochs=1 offline_eval=2 offline_k=3 "
          "offline_overrides=[chunk=8,warmup=1,train.batch_size=4] oracle_steps=2 oracle_rollouts=4 eval_rollouts=4 "
          "max_new_tokens=16 step_batches=2 step_repeats=2 run_dir={tmp}/run out={tmp}/l.json "
          "overrides=[rl.steps=2,rl.prompts_per_step=2,rl.group_size=2,sampling.max_new_tokens=16,"
          "online.canary_max_new_tokens=8]",
          (LossRows("l.json", ("offline_mal_gain_pct", "online_mal_gain_pct", "best_tracking_over_oracle",
                               "step_cost_ratio"), ("rows", "per_seed", "summary")),)),
    Smoke("bench_scale", "python scripts/bench_scale.py parts=[capture,step,job] vocabs=[512] hiddens=[64] "
          "capture_batch=2 capture_len=16 step_vocab=512 step_hidden=64 step_lens=[32] step_rows=2 job_vocab=512 "
          "job_rows=[8] job_steps=1 job_new_tokens=8 long_rows=[] repeats=1 threads=1 out={tmp}/s.json",
          (Json("s.json", (), ("capture", "step", "job")),)),
    Smoke("bench_e2e", "python scripts/bench_e2e.py seeds=[0] arms=[ar,tracking] run_dir={tmp}/run out={tmp}/e.json "
          "plot={tmp}/e.png overrides=[rl.steps=2,rl.prompts_per_step=2,rl.group_size=2,sampling.max_new_tokens=16,"
          "rl.eval_prompts=4,online.canary_max_new_tokens=8]",
          (Json("e.json", (), ("summary", "runs", "seeds")), File("e.png"))),
    Smoke("simulate", "python scripts/simulate.py gpus=[H100,B200] out={tmp}/sim.json plot={tmp}/sim.png",
          (Json("sim.json", (), ("reproduction", "projection")), File("sim.png"))),
    Smoke("simulate_curves", "python scripts/simulate.py gpus=[H200] live_acceptance=[0.8,0.7,0.6] "
          "frozen_acceptance=[0.6,0.5,0.4] out={tmp}/sim.json plot={tmp}/sim.png",
          (Json("sim.json", (), ("reproduction", "projection")),), slow=False),
    Smoke("gpu_check_plumbing", "python scripts/gpu_check.py model=tiny backend=torch device=cpu gpu=H100 "
          "batches=[1] ctx=16 new_tokens=2 repeats=1 out={tmp}/g.json", (Json("g.json", (), ("rows",)),), slow=False),
    Smoke("check_acceptance", "python scripts/check_acceptance.py rollouts=2 seed=3 max_new_tokens=16 "
          "overrides=[engine.drafter_int8=true] out={tmp}/a.json", (Json("a.json"),)),
]

NOT_RUN: list[NotRun] = [
    NotRun("bash scripts/install.sh", "CI runs it before the tests (.ci/run)"),
    NotRun(f"{ZERO2} drafttrain/online.py recipe=eagle3_track", "run at test size, killed and resumed, by "
           "tests/integration/test_two_processes.py"),
    NotRun(f"{ZERO2} scripts/pretrain_drafter.py threads=1", "run at test size, stopped and resumed, by "
           "tests/integration/test_deepspeed.py"),
    NotRun("python -m pytest -q", "the test suite itself"),
    NotRun("python scripts/bench_e2e.py resummarize=true", "reads a finished run's bench/e2e.json and run folders; "
           "tests/unit/test_bench_e2e.py runs it on run folders it builds"),
    NotRun("python scripts/gpu_check.py", "needs a CUDA GPU (vLLM on the 8B shape); CI has none"),
    NotRun("python scripts/gpu_check.py backend=torch batches=[1,16] out=/tmp/gpu_check.json", "needs a CUDA GPU"),
    NotRun("bash scripts/gpu_check.sh", "needs a CUDA GPU; tests/unit/test_gpu_check.py checks its stages, their "
           "timeouts and its refusal without a GPU, tests/integration/test_gpu_check_cpu.py runs its --cpu mode"),
    NotRun("bash scripts/gpu_check.sh --cpu out.json", "run by tests/integration/test_gpu_check_cpu.py (every stage at "
           "smoke size, pip and python shimmed to refuse installing torch or vllm)"),
    NotRun("bash scripts/gpu_wheels.sh gpu_wheels", "downloads from the package index; tests/unit/test_gpu_check.py "
           "checks what it asks pip for"),
    # the README's "Your own model": both need the user's checkpoint and prompts
    NotRun("python scripts/pretrain_drafter.py policy.path=/models/my-qwen3 data.path=/data/prompts.jsonl "
           "reward.fn=my_rewards:score out=/models/my-qwen3-eagle3 cache=/data/features",
           "needs the user's model and data: tests/integration/test_own_model.py runs it with these keys on a tiny "
           "Qwen3, a JSONL and a reward module in tests/"),
    NotRun(f"{MAIN} recipe=eagle3_track policy.path=/models/my-qwen3 data.path=/data/prompts.jsonl "
           "reward.fn=my_rewards:score drafter.path=/models/my-qwen3-eagle3",
           "needs the user's model and data: tests/integration/test_own_model.py runs the main job with these keys"),
    NotRun("python -m drafttrain.export RUN_DIR [--step N] OUT", "needs a finished run: tests/unit/test_deliverable.py "
           "runs the same entry point on run folders (every run's end also writes the export)"),
    NotRun("python -m drafttrain.staleness --drafter checkpoints/eagle3 runs/eagle3_track",
           "needs a finished run: tests/unit/test_staleness.py runs the same entry point on a run folder"),
    NotRun("python -m drafttrain.staleness --drafter my_eagle3 ckpt/step-0 ckpt/step-100 ckpt/step-200 --data "
           "prompts.jsonl --catch-up 60 --out staleness", "needs the user's checkpoints and prompts: "
           "tests/unit/test_staleness.py runs it on policy folders with --catch-up and --out"),
    NotRun("python -m drafttrain.serve checkpoints/policy --drafter checkpoints/eagle3", "a server that runs until "
           "stopped: tests/vllm/test_vllm_server.py starts it as the README shows it (with --port) and pushes to it"),
    NotRun("python -m drafttrain.serve runs/eagle3_track/export/policy --drafter runs/eagle3_track/export/drafter "
           "--k 5", "needs a finished run; a server: tests/vllm/test_vllm_server.py starts the line an export prints"),
    NotRun("VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY=\"$VLLM_API_KEY\" python -m vllm.entrypoints.openai.api_server "
           "--model /abs/checkpoints/policy --host 127.0.0.1 --port 8000 --middleware "
           "drafttrain.engines.vllm_auth.RequireKey --logprobs-mode processed_logprobs --speculative-config "
           "'{\"method\": \"eagle3\", \"model\": \"/abs/checkpoints/eagle3\", \"num_speculative_tokens\": 5}' "
           "--dtype float32 --enforce-eager", "a server; what `python -m drafttrain.serve --print` prints and the "
           "launcher runs: tests/unit/test_serve.py checks the README's line against --print"),
    NotRun(f"{MAIN} recipe=eagle3_track engine.kind=vllm_server engine.urls=[http://127.0.0.1:8000,"
           "http://127.0.0.1:8001]", "needs running servers: tests/vllm/test_vllm_server.py runs the main job on two "
           "launcher servers and compares it with engine.kind=vllm"),
    NotRun("python scripts/bench_servers.py", "starts two vLLM servers (minutes on 2 cores): "
           "tests/vllm/test_vllm_server.py runs the same pushes, canary and acceptance reads on real servers"),
    NotRun("python scripts/bench_servers.py servers=2 pushes=10 n_prompts=64 max_new_tokens=96", "as above"),
    NotRun("python -m drafttrain.report runs/eagle3_track runs/eagle3_frozen",
           "needs two finished runs: tests/unit/test_report_compare.py runs the same entry point on run folders"),
]


def entries() -> list[tuple[str, Command]]:
    """(id, normalized command) for every smoke entry and every command not run."""
    out = [(s.id, normalize(s.cmd)) for s in SMOKE]
    return out + [(n.cmd, normalize(n.cmd)) for n in NOT_RUN]


def uncovered(docs: list[Command]) -> list[Command]:
    """The documented commands that no entry covers."""
    mine = [c for _, c in entries()]
    return [d for d in docs if not any(covers(e, d) for e in mine)]
