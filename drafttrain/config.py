"""Validated run configuration: OmegaConf structured configs (dataclasses), YAML recipes, `key=value` overrides.

    cfg = load_recipe("eagle3_track", ["rl.steps=5", "engine.kind=vllm"])

A recipe name resolves to recipes/<name>.yaml of the installed copy; a path to a .yaml file is used as given.
Unknown keys and wrong types fail at load time with a one-line `ConfigError` naming the key. Relative paths
(policy.path, drafter.path, data.path, run.out_dir, a recipe's .yaml path) resolve against the working directory;
one into the shipped assets (checkpoints/..., recipes/...) that the working directory does not hold resolves to
the installed copy's, so the defaults work from any folder (resolve_path).
A field's trailing `# ...` comment is its key's one-line doc (key_docs): the main job's --help prints it.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafttrain import drafter_config
from drafttrain.drafter_config import DrafterConfig, drafter_checks
from drafttrain.device import valid_spec
from drafttrain.drafters.base import DRAFTERS
from drafttrain.paths import PROJECT_ROOT, SHIPPED, resolve_path  # noqa: F401 (re-exported)
from drafttrain.train_config import TrainConfig, train_checks
from drafttrain.vllm_config import VllmConfig, vllm_checks

RECIPES_DIR = PROJECT_ROOT / "recipes"


class ConfigError(ValueError):
    """A recipe or override that does not validate; the message names the key."""


@dataclass
class PolicyConfig:
    path: str = "checkpoints/policy"  # HF checkpoint folder (config.json, model.safetensors, tokenizer.json)


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # rollout sampling temperature (0 = greedy)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with this much mass (1 = off)
    max_new_tokens: int = 496  # response length cap per rollout (the longest check fits)


@dataclass
class EngineConfig:
    kind: str = "torch"  # torch (embedded) | vllm (in this process) | vllm_server (running servers: engine.urls)
    speculative: bool = True  # false: plain autoregressive rollouts and evaluation (the AR baseline)
    k: Any = 4  # draft tokens per verify step: an int, "auto" (max predicted speed-up) or "ladder"
    k_max: int = 8  # k=auto searches 1..k_max
    toggle: bool = False  # run SD only where the calibrated cost model predicts >= toggle_threshold
    toggle_threshold: float = 1.05  # predicted SD speed-up at or above which the toggle turns SD on
    toggle_hysteresis: float = 0.05  # SD stays on until the prediction falls this far below the threshold
    ladder: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8])  # k=ladder rungs
    ladder_up: float = 0.94  # (L-1)/k at or above: one rung up (two decisions in a row)
    ladder_down: float = 0.85  # (L-1)/k below: one rung down
    max_batch: int = 128  # most rows the engine generates at once (more prompts: waves, or vLLM's queue)
    max_len: int = 512  # positions per row: must fit the longest prompt + sampling.max_new_tokens
    draft_sampling: str = "sample"  # sample (draw from the drafter's q) | greedy (one-hot argmax drafts)
    drafter_int8: bool = True  # run the drafter's linears with torch.ao dynamic int8 (only affects acceptance)
    seed: int = 0  # the engine's sampling seed
    vllm: VllmConfig = field(default_factory=VllmConfig)  # engine.kind=vllm: dtype, CUDA graphs, GPU share, sleep
    # engine.kind=vllm_server: the servers (python -m drafttrain.serve); the API key: env DRAFTTRAIN_API_KEY
    urls: list[str] = field(default_factory=list)  # http(s)://host:port of each server the rollouts run on


@dataclass
class OnlineConfig:
    track: bool = True  # false: the drafter is never updated (the frozen baseline)
    mode: str = "sync"  # sync: train between RL steps | async: train in the background during rollouts
    buffer_mb: float = 64.0  # feature buffer cap (reduced precision)
    # cpu: host memory (pinned on a GPU run, copied to the device without blocking); device: run.device's memory
    buffer_device: str = "cpu"  # cpu | device: where the feature buffer's records live
    # draws favour recent policies: a record v policy versions older than the newest weighs 0.5^(v / half_life)
    buffer_half_life: Optional[float] = 2.0  # in policy versions; null = uniform draws
    steps_per_update: int = 16  # at most this many drafter optimizer steps per RL step
    # an update's fixed work (estimate, gate, publish) costs about two drafter steps: larger updates publish later
    min_steps_per_update: int = 1  # sync: an update waits until the bank covers this many whole batches
    time_budget_s: float = 10.0  # sync mode: hard cap on drafter work per RL step
    budget_frac: float = 0.05  # sync: drafter work / RL step time, on average (0 = no cap)
    # paid from the time bank: more rows detect a smaller gain (the bound's half-width falls as 1/sqrt(rows))
    estimate_rows: int = 8  # held-out rows the estimate after each update scores (the gate's rows)
    # paired row by row (tracking/gate.py): the one-sided lower bound at gate_confidence of the mean per-row MAL
    # difference must exceed gate_margin on >= gate_min_rows rows; worse: train on from the serving weights
    publish_gate: bool = True  # publish an update only if it beats the serving drafter (paired, with a bound)
    gate_confidence: float = 0.9  # equal drafters are published in at most 1 - gate_confidence of the decisions
    gate_margin: float = 0.0  # in MAL: the lower bound must exceed it
    gate_min_rows: int = 8  # fewer paired rows than this: no publish
    # the estimate is taken on these: the gate and the canary judge the new weights on rollouts they did not train on
    holdout_frac: float = 0.0625  # share of captured rollouts kept out of training, in [0, 1)
    # capture costs per row (features, buffer): rows never trained on need not be captured
    capture_frac: float = 1.0  # share of the other rollouts captured for training, in (0, 1]
    # graded: the rows the policy update forwards anyway (nonzero advantage); all: also the others, whose no-grad
    # forward runs for the drafter alone and is paid from its time bank
    capture_rows: str = "graded"  # graded | all (embedded GRPO host; every row at a measured step, as reporting)
    # a random sample; costs about one policy forward per drafter over them
    measure_rows: int = 32  # rows per RL step of the live/frozen drafter scoring (reporting)
    # reporting, not tracking: at step 0, every measure_every steps and the last; benchmarks needing the series: 1
    measure_every: int = 5  # RL steps between live/frozen drafter scorings (1 = every step)
    # inline: the first rollout batch after a swap; probe: a short SD generation on recent prompts after the swap
    canary: str = "inline"  # inline | probe: how a new drafter version is checked after a swap
    canary_prompts: int = 4  # canary=probe: prompts per probe
    canary_max_new_tokens: int = 48  # canary=probe: tokens per probe row
    canary_min_ratio: float = 0.5  # roll back if engine (MAL-1) < ratio * trainer-estimated (MAL-1)


@dataclass
class RLConfig:
    # 60 x 16 x 8 = 7680 rollouts, a few minutes on the 2-core CPU: the shipped policy learns to stop taking the
    # wrong rule, and its held-out sampled accuracy and its text move with it (bench/NOTES.md, issue 18)
    steps: int = 60  # RL steps in the run
    prompts_per_step: int = 16  # prompts per RL step (per process)
    group_size: int = 8  # G samples per prompt
    lr: float = 2e-4  # policy AdamW learning rate
    clip_eps: float = 0.2  # PPO ratio clip: ratios outside [1 - eps, 1 + eps] are clipped (> 0)
    micro_batch: int = 16  # sequences per policy forward/backward, at most
    # a micro-batch is padded to its longest sequence: a long-tailed batch's few long rows go in small micro-batches
    micro_tokens: int = 2048  # padded tokens (sequences x the longest) per policy forward/backward, at most
    mode: str = "sync"  # sync: generate then train | async: generate step t+1 with the step-t policy
    prompt_seed: int = 1  # seed of the training prompts
    # held-out check of the policy before and after the run: this many fixed problems (eval_seed), scored sampled
    # (sampling.temperature) and greedy through the rollout engine; 0 = off
    eval_prompts: int = 512  # held-out problems scored before and after the run (0 = off)
    eval_seed: int = 999  # held-out problems' seed (training: prompt_seed * 1_000_003 + 101 * step + rank)
    # lossless either way: at the evaluation's batch (engine.max_batch rows) plain decoding is the faster here
    eval_decode: str = "ar"  # ar: the evaluation decodes without the drafter | rollout: as the rollouts decode
    # a collapsed policy: every row's reward 0, or every response cut at sampling.max_new_tokens, step after step
    collapse_steps: int = 3  # steps in a row of a collapse sign before a one-line warning (0 = off)
    truncated_reward: Optional[float] = 0.0  # reward of a row cut unfinished at the token cap (null: as scored)


@dataclass
class DataConfig:  # read by drafttrain/data.py
    path: Optional[str] = None  # prompts: a .jsonl/.json/.parquet/.csv file or a save_to_disk folder; null = the task
    prompt_field: str = "prompt"  # the prompts' column
    answer_field: Optional[str] = "answer"  # reference answers' column (the default reward's; unused with reward.fn)
    chat_template: Optional[bool] = None  # prompts in the tokenizer's chat template; null = where it has one
    split: str = "train"  # the split of data.path to read
    eval_size: int = 256  # rows held out of training (a fixed draw) for eval.json


@dataclass
class RewardConfig:
    fn: Optional[str] = None  # module:function, fn(prompt, response, row) -> float; null = exact match


@dataclass
class RunConfig:
    out_dir: str = "runs/${recipe}"  # where the run writes; a rerun into it resumes
    seed: int = 0  # torch seed (+ process index)
    # auto: cuda (each process its local GPU) when torch sees one, else cpu; every model, buffer and cache lives there
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    resume: bool = True  # continue from out_dir's checkpoint when there is one
    tensorboard: bool = True  # also write TensorBoard events under out_dir/tb
    checkpoint_every: int = 1  # write a checkpoint every N RL steps (also after the last, and when stopped by a signal)
    keep_checkpoints: int = 2  # how many of the newest checkpoints are kept (older ones go once a new one is complete)


@dataclass
class Config:
    recipe: str = "custom"  # the recipe's name (set from the file name)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).strip().splitlines()[0]
    return f"{key}: {msg}" if key else msg


def recipe_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        path = resolve_path(name_or_path)
    else:
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")))
        raise ConfigError(f"recipe: no recipe file {path} (known recipes: {known})")
    return path


def load_recipe(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """recipe YAML + `key=value` overrides -> validated Config (a typed OmegaConf DictConfig)."""
    path = recipe_path(name_or_path)
    schema = OmegaConf.structured(Config)
    drafter_config.with_sections(schema.drafter)  # kinds registered after import bring their sections too
    try:
        data = OmegaConf.load(path)
    except Exception as e:  # malformed YAML
        raise ConfigError(f"recipe {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"recipe {path}: must be a mapping of sections, got {type(data).__name__}")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r}: expected key=value")
    empty = [o for o in overrides if not o.split("=", 1)[1].strip()]
    if empty:  # OmegaConf reads `key=` as null: for drafter.path that silently meant a fresh random drafter
        key = empty[0].split("=", 1)[0].strip()
        doc = key_docs().get(key, (None, ""))[1]
        raise ConfigError(f"{key}: empty value in {empty[0]!r}; give a value, or write {key}=null explicitly"
                          + (f" ({doc})" if doc else ""))
    try:
        cfg = OmegaConf.merge(schema, data, OmegaConf.from_dotlist(list(overrides)))
        if "recipe" not in data and not any(o.startswith("recipe=") for o in overrides):
            cfg.recipe = path.stem
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"recipe {path.stem}: {_one_line(e)}") from None
    validate(cfg)
    return cfg  # type: ignore[return-value]


def validate(cfg: Config) -> None:
    """Checks that types alone cannot express; each error names its key."""
    for ok, key, msg in [*_engine_online_checks(cfg), *_rl_train_checks(cfg), *train_checks(cfg.train),
                         *drafter_checks(cfg.drafter), *vllm_checks(cfg.engine.vllm)]:
        if not ok:
            raise ConfigError(f"{key}: {msg}")


def _engine_online_checks(cfg: Config) -> list[tuple[bool, str, str]]:
    """(ok, key, message) of engine.*, sampling.* and online.* (and rl.mode)."""
    return [
        (cfg.engine.kind in ("torch", "vllm", "vllm_server"), "engine.kind",
         f"must be torch, vllm or vllm_server, got {cfg.engine.kind!r}"),
        ((len(cfg.engine.urls) > 0 or cfg.engine.kind not in ("vllm_server",)) and all(str(u).startswith(
            ("http://", "https://")) for u in cfg.engine.urls), "engine.urls", f"engine.kind=vllm_server needs its "
         f"servers' http(s) URLs (engine.urls=[http://HOST:PORT,...]), got {list(cfg.engine.urls)}"),
        (cfg.engine.k in ("auto", "ladder") or (isinstance(cfg.engine.k, int) and not isinstance(cfg.engine.k, bool)
                                                 and cfg.engine.k >= 1), "engine.k",
         f"must be an int >= 1, auto or ladder, got {cfg.engine.k!r}"),
        (cfg.engine.k_max >= 1, "engine.k_max", f"must be >= 1, got {cfg.engine.k_max}"),
        (len(cfg.engine.ladder) > 0 and min(cfg.engine.ladder) >= 1, "engine.ladder",
         f"must be a non-empty list of ints >= 1, got {list(cfg.engine.ladder)}"),
        (cfg.engine.max_batch >= 1, "engine.max_batch", f"must be >= 1, got {cfg.engine.max_batch}"),
        (cfg.engine.max_len >= 2, "engine.max_len", f"must be >= 2 (prompt + response), got {cfg.engine.max_len}"),
        (cfg.engine.draft_sampling in ("sample", "greedy"), "engine.draft_sampling",
         f"must be sample or greedy, got {cfg.engine.draft_sampling!r}"),
        (math.isfinite(cfg.sampling.temperature) and cfg.sampling.temperature >= 0, "sampling.temperature",
         f"must be a finite number >= 0, got {cfg.sampling.temperature}"),
        (0 < cfg.sampling.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {cfg.sampling.top_p}"),
        (cfg.sampling.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 = off), got {cfg.sampling.top_k}"),
        (cfg.sampling.max_new_tokens >= 1, "sampling.max_new_tokens",
         f"must be >= 1, got {cfg.sampling.max_new_tokens}"),
        (cfg.online.mode in ("sync", "async"), "online.mode", f"must be sync or async, got {cfg.online.mode!r}"),
        (cfg.online.canary in ("inline", "probe"), "online.canary",
         f"must be inline or probe, got {cfg.online.canary!r}"),
        (cfg.online.budget_frac >= 0, "online.budget_frac", f"must be >= 0, got {cfg.online.budget_frac}"),
        (cfg.online.estimate_rows >= 1, "online.estimate_rows", f"must be >= 1, got {cfg.online.estimate_rows}"),
        (0.5 <= cfg.online.gate_confidence < 1, "online.gate_confidence",
         f"must be in [0.5, 1), got {cfg.online.gate_confidence}"),
        (math.isfinite(cfg.online.gate_margin) and cfg.online.gate_margin >= 0, "online.gate_margin",
         f"must be a finite number >= 0, got {cfg.online.gate_margin}"),
        (cfg.online.gate_min_rows >= 2, "online.gate_min_rows",
         f"must be >= 2 (a paired bound needs a spread), got {cfg.online.gate_min_rows}"),
        (0 <= cfg.online.holdout_frac < 1, "online.holdout_frac", f"must be in [0, 1), got {cfg.online.holdout_frac}"),
        (0 < cfg.online.capture_frac <= 1, "online.capture_frac", f"must be in (0, 1], got {cfg.online.capture_frac}"),
        (cfg.online.capture_rows in ("all", "graded"), "online.capture_rows",
         f"must be all or graded, got {cfg.online.capture_rows!r}"),
        (cfg.online.measure_rows >= 1, "online.measure_rows", f"must be >= 1, got {cfg.online.measure_rows}"),
        (cfg.online.measure_every >= 1, "online.measure_every", f"must be >= 1, got {cfg.online.measure_every}"),
        (cfg.rl.mode in ("sync", "async"), "rl.mode", f"must be sync or async, got {cfg.rl.mode!r}"),
        (cfg.online.buffer_device in ("cpu", "device"), "online.buffer_device",
         f"must be cpu or device, got {cfg.online.buffer_device!r}"),
        (cfg.online.buffer_mb > 0, "online.buffer_mb", f"must be > 0, got {cfg.online.buffer_mb}"),
        (cfg.online.buffer_half_life is None or cfg.online.buffer_half_life > 0, "online.buffer_half_life",
         f"must be > 0 or null (uniform), got {cfg.online.buffer_half_life}"),
    ]


def _rl_train_checks(cfg: Config) -> list[tuple[bool, str, str]]:
    """(ok, key, message) of rl.*, the drafter's TTT, policy, run and data (train.*: train_config.py)."""
    return [
        (cfg.rl.eval_prompts >= 0, "rl.eval_prompts", f"must be >= 0, got {cfg.rl.eval_prompts}"),
        (cfg.rl.eval_decode in ("ar", "rollout"), "rl.eval_decode",
         f"must be ar or rollout, got {cfg.rl.eval_decode!r}"),
        (cfg.rl.collapse_steps >= 0, "rl.collapse_steps", f"must be >= 0 (0 = off), got {cfg.rl.collapse_steps}"),
        (cfg.rl.truncated_reward is None or math.isfinite(cfg.rl.truncated_reward), "rl.truncated_reward",
         f"must be a finite number or null (as scored), got {cfg.rl.truncated_reward}"),
        (cfg.rl.group_size >= 2, "rl.group_size",
         f"must be >= 2 (group-normalized advantages), got {cfg.rl.group_size}"),
        (cfg.drafter.ttt_steps >= 1, "drafter.ttt_steps", f"must be >= 1, got {cfg.drafter.ttt_steps}"),
        # step i weighs ttt_decay**i; a negative decay can make the weights sum to 0 (a -inf loss)
        (cfg.drafter.ttt_decay > 0, "drafter.ttt_decay", f"must be > 0, got {cfg.drafter.ttt_decay}"),
        (cfg.online.steps_per_update >= 1, "online.steps_per_update",
         f"must be >= 1, got {cfg.online.steps_per_update}"),
        (1 <= cfg.online.min_steps_per_update <= cfg.online.steps_per_update, "online.min_steps_per_update",
         f"must be in [1, online.steps_per_update = {cfg.online.steps_per_update}], got "
         f"{cfg.online.min_steps_per_update}"),
        (cfg.online.time_budget_s > 0, "online.time_budget_s", f"must be > 0, got {cfg.online.time_budget_s}"),
        (cfg.online.canary_prompts >= 1, "online.canary_prompts", f"must be >= 1, got {cfg.online.canary_prompts}"),
        (cfg.online.canary_max_new_tokens >= 1, "online.canary_max_new_tokens",
         f"must be >= 1, got {cfg.online.canary_max_new_tokens}"),
        (cfg.rl.steps >= 0, "rl.steps", f"must be >= 0, got {cfg.rl.steps}"),
        (cfg.rl.prompts_per_step >= 1, "rl.prompts_per_step", f"must be >= 1, got {cfg.rl.prompts_per_step}"),
        (cfg.rl.micro_batch >= 1, "rl.micro_batch", f"must be >= 1, got {cfg.rl.micro_batch}"),
        (cfg.rl.micro_tokens >= 1, "rl.micro_tokens", f"must be >= 1, got {cfg.rl.micro_tokens}"),
        (cfg.rl.lr > 0, "rl.lr", f"must be > 0, got {cfg.rl.lr}"),
        (cfg.policy.path.strip() != "", "policy.path", "is empty: give the policy's checkpoint folder"),
        (cfg.run.out_dir.strip() != "", "run.out_dir", "is empty: give the folder the run writes to"),
        (valid_spec(cfg.run.device), "run.device", f"must be auto, cpu, cuda or cuda:N, got {cfg.run.device!r}"),
        (cfg.run.checkpoint_every >= 1, "run.checkpoint_every", f"must be >= 1, got {cfg.run.checkpoint_every}"),
        (cfg.run.keep_checkpoints >= 1, "run.keep_checkpoints", f"must be >= 1, got {cfg.run.keep_checkpoints}"),
        (cfg.rl.clip_eps > 0, "rl.clip_eps", f"must be > 0, got {cfg.rl.clip_eps}"),
        (cfg.data.eval_size >= 1, "data.eval_size", f"must be >= 1, got {cfg.data.eval_size}"),
        (cfg.online.canary_min_ratio >= 0, "online.canary_min_ratio",
         f"must be >= 0, got {cfg.online.canary_min_ratio}"),
    ]

def key_docs() -> dict[str, tuple[Any, str]]:
    """Every config key -> (default, one-line doc). The doc is the trailing `# ...` comment of the key's dataclass
    field, read from the class that declares it (this file, train_config.py, drafter_config.py or a drafter kind's
    section: the one source of the docs); the default is the field's."""
    out: dict[str, tuple[Any, str]] = {}

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                owner = next(c for c in type(obj).__mro__ if f.name in c.__dict__.get("__annotations__", {}))
                out[prefix + f.name] = (value, _field_docs(owner).get(f.name, ""))

    walk(Config(), "")
    built = {f.name for f in dataclasses.fields(DrafterConfig)}
    for kind, k in DRAFTERS.items():  # kinds registered after DrafterConfig was built
        if k.section is not None and kind not in built:
            walk(k.section(), f"drafter.{kind}.")
    return out


def _field_docs(cls) -> dict[str, str]:
    """A dataclass's own fields -> the trailing comment on each field's last line."""
    src = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    trailing = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    return {f.target.id: trailing.get(f.end_lineno, "")  # a comment on its last line trails it
            for f in ast.parse(src).body[0].body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}


def save_config(cfg: Config, out_dir: str | Path) -> Path:
    """Write the resolved config beside a run's outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def sampling_params(sampling, **extra):
    """The sampling.* section as SamplingParams; extra fields override it."""
    from drafttrain.spec import SamplingParams

    s = sampling
    kw = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    return SamplingParams(**{**kw, **extra})


def script_config(defaults: dict, argv: list[str] | None = None) -> DictConfig:
    """A script's `key=value` command line over its defaults; an unknown key or a bad type fails naming it."""
    import sys

    base = OmegaConf.create(defaults)
    OmegaConf.set_struct(base, True)
    args = sys.argv[1:] if argv is None else argv
    bad = [a for a in args if "=" not in a]
    if bad:
        raise SystemExit(f"error: argument {bad[0]!r}: expected key=value")
    try:
        return OmegaConf.merge(base, OmegaConf.from_dotlist(args))
    except OmegaConfBaseException as e:
        raise SystemExit(f"error: {_one_line(e)}") from None


def max_draft_len(engine_cfg) -> int:
    """The longest draft the engine config can ask for (fixed k, auto's k_max, or the ladder's top rung)."""
    k = engine_cfg.k
    return k if isinstance(k, int) else (engine_cfg.k_max if k == "auto" else max(engine_cfg.ladder))
