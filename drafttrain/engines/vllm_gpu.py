"""What the vLLM engine (vllm_engine.py) does differently on a CUDA GPU, each choice in one function that CPU tests
call with a faked platform:

    llm_settings(vcfg, platform)   vllm.LLM arguments from engine.vllm.* on this platform (auto dtype, CUDA graphs,
                                   GPU share, sleep mode) and the weight transport (transfer_backend)
    transfer_backend(platform)     CUDA: vLLM's "ipc" backend (push_ipc); elsewhere drafttrain's own, through a file
                                   in /dev/shm (vllm_transfer.push_weights); push(engine, ...) takes the engine's
    SleepMode                      engine.sleep(level) / wake_up(): vLLM's sleep mode around the policy update, and
                                   after every wake the drafter re-pushed, read back and canaried at its version

The CUDA-only calls (push_ipc, SleepMode's llm.sleep / llm.wake_up) are small and have not yet been run on a GPU;
the logic around them runs here (tests/vllm/test_vllm_gpu.py fakes them).
"""
from __future__ import annotations

import base64
import logging
import os
import pickle

import torch

from drafttrain.engines.vllm_worker import TRANSFER_BACKEND
from drafttrain.vllm_config import check_vllm

IPC_BACKEND = "ipc"
CANARY_PROMPTS = [[1, 2, 3, 1, 2, 3], [3, 2, 1, 3, 2, 1]]  # within every vocabulary; the same probe each time
CANARY_MIN_RATIO = 0.5  # after a wake, acceptance below this share of the pre-sleep probe's: the drafter is broken
CANARY_MIN_RATE = 0.05  # judged only where the probe accepted at least this before the sleep (a few drafts: noise)


def current_platform():
    from vllm.platforms import current_platform

    return current_platform


def on_cuda(platform) -> bool:
    return bool(platform.is_cuda())


def transfer_backend(platform) -> str:
    """The weight transport the engine starts vLLM with: CUDA IPC on a CUDA GPU (no host round trip), else a
    safetensors file in /dev/shm read by the worker (drafttrain's "drafttrain_inline" backend)."""
    return IPC_BACKEND if on_cuda(platform) else TRANSFER_BACKEND


def llm_settings(vcfg, platform) -> tuple[dict, dict]:
    """(vllm.LLM arguments, environment for vLLM's processes) from engine.vllm.* (checked: one-line ValueError)."""
    check_vllm(vcfg)
    cuda = on_cuda(platform)
    eager = vcfg.enforce_eager
    kw = dict(dtype=vcfg.dtype if vcfg.dtype != "auto" else ("bfloat16" if cuda else "float32"),
              enforce_eager=bool(not cuda if eager is None else eager),
              weight_transfer_config={"backend": transfer_backend(platform)})
    env = {}
    if cuda:  # vLLM-CPU sizes its KV cache by VLLM_CPU_KVCACHE_SPACE and has no sleep mode
        kw.update(gpu_memory_utilization=float(vcfg.gpu_memory_utilization), enable_sleep_mode=vcfg.sleep > 0)
    if kw["weight_transfer_config"]["backend"] == IPC_BACKEND:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the worker unpickles the IPC handles (same host, our own)
    return kw, env


def push(engine, weights: dict, draft: bool) -> None:
    """One weight update session over the transport the engine started with (engine.transfer)."""
    from drafttrain.engines.vllm_transfer import push_weights

    (push_ipc if engine.transfer == IPC_BACKEND else push_weights)(engine, weights, draft)


# ---- CUDA IPC weight push (CUDA only; not yet run on a GPU) -------------------------------------------------------

class _RpcClient:
    """vLLM's VLLMWeightSyncClient protocol over the engine's collective_rpc (the vllm.LLM lives in this process)."""

    def __init__(self, engine, draft: bool):
        self.engine, self.draft = engine, draft

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.rpc("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.engine.rpc("start_draft_weight_update" if self.draft else "start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        info = dict(update_info)  # collective_rpc's msgpack cannot carry the handles' types: pickled, as vLLM's HTTP
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info.pop("ipc_handles"))).decode()
        self.engine.rpc("update_weights", info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.rpc("finish_weight_update")


def push_ipc(engine, weights: dict, draft: bool) -> None:
    """vLLM's IPC trainer engine: the worker maps each tensor's GPU memory (this process's copy on the current CUDA
    device) and loads it layerwise, in one start / update / finish session."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    device = torch.device("cuda", torch.cuda.current_device())
    source = [(n, t.detach().to(device)) for n, t in weights.items()]  # iterated once by the sender
    sender = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=_RpcClient(engine, draft),
                                                         source=source)
    sender.send_weights()


# ---- sleep mode ------------------------------------------------------------------------------------------------

class SleepMode:
    """engine.sleep / wake_up. `available`: vLLM runs on CUDA with enable_sleep_mode (engine.vllm.sleep=1); elsewhere
    sleep() is a no-op that returns False. `auto` (engine.vllm.sleep=1): the engine sleeps after each generate and
    wakes at its next call, so a training step between rollouts has the GPU memory vLLM held."""

    def __init__(self, engine, available: bool, auto: bool):
        self.engine, self.available, self.auto = engine, available, auto and available
        self.level = 0  # 0: awake
        self._before = None  # the canary's acceptance before the sleep

    def sleep(self, level: int) -> bool:
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 (weights kept in host memory) or 2 (dropped), got {level!r}")
        eng = self.engine
        if not self.available or self.level:
            return bool(self.level)
        if level == 2 and eng._module is None:
            raise ValueError("sleep: level 2 drops the policy's weights, and this engine was built from a checkpoint "
                             "folder (no module to push them back from); use level 1")
        self._before = self.canary() if getattr(eng, "_served", None) else None  # a weightless drafter: none to drop
        self.vllm_sleep(level)
        self.level = level
        return True

    def wake_up(self) -> None:
        """vLLM's wake-up; then the policy pushed back (level 2 dropped it: the module's current weights), the drafter
        re-pushed and read back at its version (vLLM's level-2 sleep drops a drafter's weights with no error), and a
        greedy canary that must keep at least CANARY_MIN_RATIO of the acceptance it had before the sleep (level 2
        may serve a newer policy: then acceptance may move, but not to about 0)."""
        if not self.level:
            return
        eng, level, self.level = self.engine, self.level, 0
        self.vllm_wake()
        eng.llm.reset_prefix_cache()  # the KV cache was dropped
        if level == 2:
            eng.update_policy()
        if not getattr(eng, "_served", None):  # no drafter, or one without weights (suffix)
            return
        from drafttrain.engines.vllm_transfer import read_back

        eng._push(eng._served, draft=True)
        read_back(eng, eng._served, draft=True, what="wake_up")
        after, before = self.canary(), self._before
        if before is not None and before >= CANARY_MIN_RATE and after < CANARY_MIN_RATIO * before:
            raise RuntimeError(f"wake_up: the drafter (version {eng.drafter_version}) accepts {after:.3f} of its "
                               f"drafts after the wake, {before:.3f} before the sleep, although it read back")

    def canary(self) -> float:
        """The acceptance rate of a short greedy SD generation of a fixed probe."""
        from drafttrain.spec import SamplingParams

        vocab = self.engine.vocab_size
        prompts = [[t % vocab for t in p] for p in CANARY_PROMPTS]
        batch = self.engine._generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
        return float(batch.stats.acceptance_rate)

    # the GPU-only calls (CUDA vLLM with enable_sleep_mode); a CPU test replaces these two
    def vllm_sleep(self, level: int) -> None:
        self.engine.llm.sleep(level=level)

    def vllm_wake(self) -> None:
        self.engine.llm.wake_up()


def warn_no_sleep(vcfg, available: bool) -> None:
    if vcfg.sleep and not available:
        logging.getLogger(__name__).warning("engine.vllm.sleep=%s: vLLM has no sleep mode on this platform (CUDA "
                                            "only); the engine stays awake", vcfg.sleep)


def apply_env(env: dict) -> None:
    for k, v in env.items():
        os.environ.setdefault(k, v)
