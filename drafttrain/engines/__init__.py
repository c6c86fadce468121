"""Rollout engines behind one contract: the embedded PyTorch engine and the vLLM adapter."""
from drafttrain.engines.base import EngineDied, RolloutBatch, RolloutEngine, StaleVersionError
from drafttrain.engines.torch_engine import TorchEngine


def build_engine(cfg, policy, drafter=None) -> RolloutEngine:
    """cfg: EngineConfig. policy: an HF causal LM (torch) or its checkpoint folder (vllm)."""
    if cfg.kind == "torch":
        return TorchEngine(cfg, policy, drafter)
    if cfg.kind == "vllm":
        # imported only when asked for: vLLM is an optional extra, and importing it (the worker module registers
        # its weight transport) is heavy in every process that imports drafttrain.engines
        from drafttrain.engines.vllm_engine import VllmEngine

        return VllmEngine(cfg, policy, drafter)
    raise ValueError(f"engine.kind: unknown engine {cfg.kind!r} (known: torch, vllm)")


__all__ = ["EngineDied", "RolloutBatch", "RolloutEngine", "StaleVersionError", "build_engine"]
