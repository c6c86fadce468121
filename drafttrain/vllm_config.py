"""The vLLM engine's own settings (engine.vllm.*) and their checks. Part of the run configuration (config.py nests
VllmConfig at EngineConfig.vllm); a field's trailing `# ...` comment is its key's doc there too. The vLLM engine
checks the same fields itself (it is also built from sections that did not pass config.validate), and resolves
`auto` / null for the platform it runs on (engines/vllm_gpu.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DTYPES = ("auto", "bfloat16", "float16", "float32")
SLEEP_LEVELS = (0, 1)


@dataclass
class VllmConfig:
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on the CPU) | bfloat16 | float16 | float32
    enforce_eager: Optional[bool] = None  # null: false on CUDA (CUDA graphs), true on the CPU; true: no graphs
    gpu_memory_utilization: float = 0.5  # CUDA: share of the GPU vLLM may take, in (0, 1]; training gets the rest
    # 1: vLLM's sleep mode (level 1, CUDA) frees its GPU memory after each generate and wakes at the next call,
    # re-pushing and reading back the drafter (rl.mode=sync co-locates training and rollouts on one GPU)
    sleep: int = 0  # co-location: 0 (off: a fixed gpu_memory_utilization share) | 1 (sleep between rollouts)


def vllm_checks(v) -> list[tuple[bool, str, str]]:
    """(ok, key, message) of engine.vllm.*; v: the section (a missing field reads as its default)."""
    get = lambda name: getattr(v, name, getattr(VllmConfig, name))  # noqa: E731
    util, eager = get("gpu_memory_utilization"), get("enforce_eager")
    return [
        (get("dtype") in DTYPES, "engine.vllm.dtype", f"must be one of {', '.join(DTYPES)}, got {get('dtype')!r}"),
        (eager is None or isinstance(eager, bool), "engine.vllm.enforce_eager",
         f"must be true, false or null (per platform), got {eager!r}"),
        (isinstance(util, (int, float)) and not isinstance(util, bool) and 0 < util <= 1,
         "engine.vllm.gpu_memory_utilization", f"must be in (0, 1], got {util!r}"),
        (get("sleep") in SLEEP_LEVELS and not isinstance(get("sleep"), bool), "engine.vllm.sleep",
         f"must be 0 (off) or 1 (level-1 sleep between rollouts), got {get('sleep')!r}"),
    ]


def check_vllm(v) -> None:
    """The first failing check as a one-line ValueError naming its key."""
    for ok, key, msg in vllm_checks(v):
        if not ok:
            raise ValueError(f"{key}: {msg}")
