"""The self-drafter (drafter.kind=selfquant) in the vLLM engine: the int8 / int4 copy of the policy is exported as a
compressed-tensors checkpoint (W8A8 / W4A8, tensors taken from the drafter as they are), runs as vLLM's draft_model,
and follows the policy through load_drafter (requantized, pushed, read back through vLLM's quantized kernels).
Findings behind the format: docs/vllm_selfdraft.md.
"""
from __future__ import annotations

import copy

import pytest
import torch

from drafttrain.drafters.selfquant import SelfQuantDrafter
from drafttrain.engines import build_engine
from drafttrain.engines.vllm_selfdraft import vllm_tensors
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg
from tests.vllm.conftest import engine_processes, vllm_policy

pytestmark = pytest.mark.vllm

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line error: {msg!r}"
    return msg


@pytest.mark.parametrize("quant, group", [("int8", 64), ("int4", 32)])
def test_vllm_tensors_are_the_drafters_quantized_weights(vpolicy, quant, group):
    sd = vpolicy.state_dict()
    t = vllm_tensors(SelfQuantDrafter(vpolicy, quant, "ref", group))
    projs = [n for n in sd if n.endswith(".weight") and n.split(".")[-2] in PROJ]
    assert set(t) == set(sd) | {n + "_scale" for n in projs}
    for n in projs:
        q, s = t[n], t[n + "_scale"]  # w ~ q * s, s per row (int8) or per group of in-features (int4)
        N, K = sd[n].shape
        assert q.dtype == torch.int8 and q.shape == (N, K) and s.shape == (N, 1 if quant == "int8" else K // group)
        assert int(q.abs().max()) <= (127 if quant == "int8" else 8)
        s = s.repeat_interleave(K // s.shape[1], 1)
        assert bool(((q.float() * s - sd[n]).abs() <= s / 2 + 1e-7).all()), n  # rounded to the nearest level
    for n in set(sd) - set(projs):
        if n == "lm_head.weight":  # dequantized: fp32, close to the policy's
            assert t[n].dtype == torch.float32 and float((t[n] - sd[n]).abs().max()) < 0.2 * float(sd[n].abs().max())
        else:
            assert torch.equal(t[n], sd[n]), n
    # the ao backend stores the same quantization (int4: in aten's packed layout, read back exactly)
    ao = vllm_tensors(SelfQuantDrafter(vpolicy, quant, "ao", group))
    assert all(torch.equal(ao[n], t[n]) for n in t)


def test_nf4_self_drafter_refused_before_start(vpolicy):
    pytest.importorskip("vllm")
    pytest.importorskip("bitsandbytes")
    d = SelfQuantDrafter(vpolicy, "int4", "bnb", 64)
    before = {p.pid for p in engine_processes()}
    with pytest.raises(ValueError, match="NF4") as e:
        build_engine(engine_cfg(kind="vllm"), vpolicy, d)
    assert "drafter.backend=ao or ref" in one_line(e.value)
    assert {p.pid for p in engine_processes()} <= before, "an engine was started for an NF4 self-drafter"


@pytest.mark.slow
@pytest.mark.parametrize("quant, group", [("int8", 64), ("int4", 32)])
def test_self_drafter_runs_in_vllm_and_follows_the_policy(monkeypatch, quant, group):
    pytest.importorskip("vllm")
    before = {p.pid for p in engine_processes()}
    policy = vllm_policy()
    d = SelfQuantDrafter(policy, quant, "ao", group)
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    prompts = C.RAGGED_PROMPTS
    with build_engine(engine_cfg(kind="vllm", k=4, max_batch=8, max_len=128), policy, d) as eng:
        assert eng.llm.llm_engine.vllm_config.speculative_config.method == "draft_model"
        sd = eng.generate(prompts, greedy)
        assert sd.tokens == [C.hf_greedy(policy, p, 24) for p in prompts]  # lossless
        assert sd.stats.mean_accepted_length > 3.0, sd.stats.to_dict()  # k=4 drafts of a close copy
        sampled = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3))
        assert sampled.stats.acceptance_rate > 0.7, sampled.stats.to_dict()

        # an RL step changed the policy: the served drafter is stale until the requantized policy is pushed
        other = vllm_policy(seed=5)
        eng.update_policy(other)
        stale = eng.generate(prompts, greedy)
        eng.load_drafter(other.state_dict(), 1)  # policy form: requantized, pushed, read back
        assert eng.drafter_version == 1
        fresh = eng.generate(prompts, greedy)
        assert fresh.tokens == stale.tokens == [C.hf_greedy(other, p, 24) for p in prompts]
        assert fresh.stats.acceptance_rate > stale.stats.acceptance_rate + 0.3, (stale.stats.to_dict(),
                                                                                fresh.stats.to_dict())
        # drafter form (a rollback to the good weights) lands too: the old drafter's acceptance again
        eng.load_drafter(d.state_dict(), 2)
        again = eng.generate(prompts, greedy)
        assert again.stats.acceptance_rate == pytest.approx(stale.stats.acceptance_rate, abs=1e-9)

        # a push that does not land is caught by the read-back through vLLM's int8 kernel and rolled back
        new = SelfQuantDrafter(copy.deepcopy(other), quant, "ao", group).state_dict()
        monkeypatch.setattr(eng, "_push", lambda weights, draft: None)
        with pytest.raises(ValueError, match="did not land") as e:
            eng.load_drafter(new, 3)
        one_line(e.value)
        monkeypatch.undo()
        assert eng.drafter_version == 2
        eng.load_drafter(new, 3)
        assert eng.generate(prompts, greedy).stats.acceptance_rate == pytest.approx(
            fresh.stats.acceptance_rate, abs=1e-9)
    assert {p.pid for p in engine_processes()} <= before, "engine processes left running after close()"
