"""Rollout engines behind one contract: the embedded PyTorch engine and the vLLM adapter."""
from drafttrain.engines.base import EngineDied, RolloutBatch, RolloutEngine, StaleVersionError
from drafttrain.engines.torch_engine import TorchEngine


def _vllm(cfg, policy, drafter):
    # imported only when asked for: vLLM is an optional extra, and importing it (the worker module registers
    # its weight transport) is heavy in every process that imports drafttrain.engines
    from drafttrain.engines.vllm_engine import VllmEngine

    return VllmEngine(cfg, policy, drafter)


def _vllm_server(cfg, policy, drafter):
    from drafttrain.engines.vllm_server_engine import VllmServerEngine

    return VllmServerEngine(cfg, policy, drafter)


# engine.kind -> build(cfg, policy, drafter)
ENGINES = {"torch": TorchEngine, "vllm": _vllm, "vllm_server": _vllm_server}


def drafter_int8(cfg) -> bool:
    """Do the engines cfg builds draft with int8 linears? The embedded engine's engine.drafter_int8; vLLM runs the
    fp32 drafter."""
    return ENGINES.get(cfg.kind) is TorchEngine and bool(cfg.drafter_int8)


def build_engine(cfg, policy, drafter=None) -> RolloutEngine:
    """cfg: EngineConfig. policy: an HF causal LM (torch) or its checkpoint folder (vllm)."""
    if cfg.kind not in ENGINES:
        raise ValueError(f"engine.kind: unknown engine {cfg.kind!r} (known: {', '.join(ENGINES)})")
    return ENGINES[cfg.kind](cfg, policy, drafter)


def __getattr__(name: str):
    """VllmServer and attach (handles on engines a stack owns: vllm_server.py), imported when first asked for: their
    module imports vLLM's side (the worker module)."""
    if name in ("VllmServer", "attach"):
        from drafttrain.engines import vllm_server

        return getattr(vllm_server, name)
    raise AttributeError(f"module 'drafttrain.engines' has no attribute {name!r}")


__all__ = ["EngineDied", "RolloutBatch", "RolloutEngine", "StaleVersionError", "VllmServer", "attach", "build_engine",
           "drafter_int8"]
