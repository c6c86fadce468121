"""The RolloutEngine contract suite (tests/contract.py) on the vLLM engine, with the vLLM-specific choices: engines
come warm from the session pool (conftest.py), policies have head_dim 32 (vLLM-CPU's smallest), every exact
distribution runs at k=2 so one engine serves them all, the int8 drafter cases do not apply (vLLM runs the fp32
drafter), and the Qwen2/Qwen3 family check is left out (contract.family_policy builds head_dim 16 policies).
"""
from __future__ import annotations

import pytest

from drafttrain.engines.vllm_engine import VllmEngine
from drafttrain.export import save_drafter
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg
from tests.vllm.conftest import ARView, engine_processes, vllm_policy

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vocab5():
    pol = vllm_policy(vocab=5, seed=3, inter=64)
    return pol, C.fresh_drafter(pol, seed=2)


def test_greedy_sd_equals_ar(make_engine, vpolicy, vdrafter):
    C.greedy_sd_equals_ar(make_engine, vpolicy, vdrafter, drafter_int8=False)


def test_ar_equals_hf_generate(make_engine, vpolicy):
    C.ar_equals_hf_generate(make_engine, vpolicy)


EXACT = {  # name: (params, negative control); all at k=2
    "T1": (SamplingParams(max_new_tokens=3, seed=11), SamplingParams(temperature=0.7, max_new_tokens=3)),
    "T0.7": (SamplingParams(temperature=0.7, max_new_tokens=3, seed=12), SamplingParams(max_new_tokens=3)),
    "topk3": (SamplingParams(top_k=3, max_new_tokens=3, seed=13), SamplingParams(max_new_tokens=3)),
    "topp0.7_T1.3": (SamplingParams(temperature=1.3, top_p=0.7, max_new_tokens=3, seed=14),
                     SamplingParams(temperature=1.3, max_new_tokens=3)),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_distribution(make_engine, vocab5, name):
    params, wrong = EXACT[name]
    C.exact_distribution(make_engine, *vocab5, params, n_rows=3000, wrong=wrong, k=2)


def test_exact_distribution_rejects_perturbation(make_engine, vocab5):
    C.exact_distribution_rejects_perturbation(make_engine, *vocab5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=12, max_new_tokens=14, seed=1),
                                    SamplingParams(temperature=1.0, max_new_tokens=14, seed=2),
                                    SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=14, seed=3)],
                         ids=["T0.8_topk12", "T1", "T1.2_topp0.9"])
def test_logprobs_match_teacher_forced(make_engine, vpolicy, vdrafter, params):
    C.logprobs_match_teacher_forced(make_engine, vpolicy, vdrafter, params)


def test_ragged_stops(make_engine, vpolicy, vdrafter):
    C.ragged_stops(make_engine, vpolicy, vdrafter)


def test_max_new_tokens_exact(make_engine, vpolicy, vdrafter):
    C.max_new_tokens_exact(make_engine, vpolicy, vdrafter)


def test_load_drafter_versioned(make_engine, vpolicy, vdrafter):
    C.load_drafter_versioned(make_engine, vpolicy, vdrafter)


def test_load_drafter_refuses_bad_weights(make_engine, vpolicy, vdrafter):
    C.load_drafter_refuses_bad_weights(make_engine, vpolicy, vdrafter)


def test_bad_prompts_raise(make_engine, vpolicy, vdrafter):
    C.bad_prompts_raise(make_engine, vpolicy, vdrafter)


def test_nan_logits_raise(make_engine, vpolicy, vdrafter):
    C.nan_logits_raise(make_engine, vpolicy, vdrafter)


def test_rows_finish_at_max_position_then_clean_exit_on_error(tmp_path, vpolicy, vdrafter):
    """The contract's max-position check on its own engine (max_len is fixed at start), built from folders (an
    HF checkpoint and a speculators export) and run inside `with`: an exception escaping the block shuts vLLM
    down and leaves no engine process behind."""
    vpolicy.save_pretrained(str(tmp_path / "policy"))
    save_drafter(vdrafter, tmp_path / "eagle3", verifier=tmp_path / "policy", k=4)
    before = {p.pid for p in engine_processes()}
    with pytest.raises(KeyError, match="escapes"):
        with VllmEngine(engine_cfg(kind="vllm", max_len=24), str(tmp_path / "policy"),
                        str(tmp_path / "eagle3")) as eng:
            ours = {p.pid for p in engine_processes()} - before
            assert ours, "no engine process seen"

            def make(policy, drafter=None, max_len=None, **kw):
                assert max_len == 24 and policy is vpolicy
                if drafter is None:
                    return ARView(eng)
                eng.reset_drafter(drafter.state_dict())
                return eng

            C.rows_finish_independently_at_max_position(make, vpolicy, vdrafter)
            raise KeyError("an error escapes the block")
    assert not ours & {p.pid for p in engine_processes()}
