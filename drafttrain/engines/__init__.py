"""Rollout engines behind one contract: the embedded PyTorch engine and the vLLM adapter."""
from drafttrain.engines.base import RolloutBatch, RolloutEngine, StaleVersionError, build_engine

__all__ = ["RolloutBatch", "RolloutEngine", "StaleVersionError", "build_engine"]
