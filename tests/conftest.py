"""Shared fixtures: tiny random policies (nanochat's mock-model idea) and drafters, no checkpoint needed."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda need a CUDA GPU: skipped where torch sees none (scripts/gpu_check.sh runs them on one)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def tiny_policy(vocab=32, hidden=64, layers=4, heads=4, kv_heads=2, inter=128, max_pos=256, seed=0, family="llama"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=max_pos,
              tie_word_embeddings=False)
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    m = cls[1](cls[0](**kw)).eval()
    # sharpen the output so sequences have structure (random init is near-uniform)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def qwen3_world(root, vocab: int, rows: int, chat_template: str | None = None, policy_dir: str = "qwen3"):
    """A user's world in `root`: a tiny random Qwen3 of `vocab` tokens saved with the shipped tokenizer (its stop and
    start tokens; a chat template if given) at root/policy_dir, and `rows` prompts in root/prompts.jsonl (columns
    question, answer). Returns root."""
    import json

    from drafttrain.policy import build_tokenizer, save_policy

    tok = build_tokenizer()
    tok.chat_template = chat_template
    pol = tiny_policy(vocab=vocab, hidden=64, layers=4, heads=4, kv_heads=2, inter=128, max_pos=256, family="qwen3")
    pol.config.bos_token_id, pol.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    pol.generation_config.eos_token_id = tok.eos_token_id
    save_policy(pol, tok, str(root / policy_dir))
    lines = [{"question": f"Q:{i:02d}*{1 + i % 4}=", "answer": str(i)} for i in range(rows)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return root


def dense_targets(probs: torch.Tensor):
    """Targets whose distributions are the given ones [B, N, V] (no zeros): hidden = log p under an identity head,
    so softmax(head . hidden) = p. For tests that pick the policy's distributions by hand."""
    from drafttrain.drafters import TargetHead, Targets

    return Targets(probs.clamp_min(1e-30).log(), TargetHead(torch.eye(probs.shape[-1]), clone=False))


def set_drafter_keys(cfg, **kw):
    """Set drafter settings on a DrafterConfig: a kind's own key (aux_layer_ids, quant, ...) in its section."""
    for k, v in kw.items():
        section = next((s for s in cfg if OmegaConf.is_dict(cfg[s]) and k in cfg[s]), None)  # drafter.<kind>
        setattr(cfg[section] if section else cfg, k, v)
    return cfg


def seq_logprobs(policy, prompt, response):
    """Log-probs of each response token from a forward on this one sequence alone (no padding)."""
    ids = torch.tensor([prompt + response])
    lp = policy(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:]  # [len(response)]


def load_script(name: str):
    """scripts/<name>.py as a module (registered in sys.modules: its dataclasses look their module up there)."""
    import importlib.util
    import sys

    from drafttrain.config import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def engine_cfg(**kw):
    cfg = OmegaConf.structured(Config).engine
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def make_engine():
    """make(policy, drafter=None, **engine_kw) -> an embedded engine (the contract suite's factory)."""
    from drafttrain.engines import build_engine

    def make(policy, drafter=None, **kw):
        return build_engine(engine_cfg(kind="torch", **kw), policy, drafter)

    return make


@pytest.fixture(scope="session")
def policy():
    return tiny_policy()


@pytest.fixture(scope="session")
def drafter(policy):
    from drafttrain.drafters import build_drafter

    cfg = OmegaConf.structured(Config).drafter
    cfg.path = None
    torch.manual_seed(1)
    return build_drafter(cfg, policy)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models are overhead-bound: one intra-op thread is faster and steadier on the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the vLLM engines' pool, session-wide (tests/vllm/ and tests/test_contract.py share its warm engines) ----------
@pytest.fixture(scope="session")
def pool():
    pytest.importorskip("vllm")
    from tests.vllm.pool import EnginePool, engine_processes

    p = EnginePool()
    yield p
    p.close()
    assert not engine_processes(), "engine processes left running after close()"


@pytest.fixture(scope="session")
def vpolicy():
    from tests.vllm.pool import vllm_policy

    return vllm_policy()


@pytest.fixture(scope="session")
def vdrafter(vpolicy):
    from tests import contract as C

    return C.fresh_drafter(vpolicy, seed=1)
