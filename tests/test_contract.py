"""The RolloutEngine contract (the checks in tests/contract.py), one test each, run on both engines by
parametrization: `torch` (the embedded engine) and `vllm` (marked vllm; its engines come warm from the session pool
in tests/conftest.py).

What differs per engine is the set-up, not the checks: vLLM-CPU runs head sizes 32 and up, so its policies are
tests/vllm/pool.vllm_policy's; every exact distribution on vLLM runs at k=2, so one warm engine serves them all; the
int8 drafter and greedy-draft cases and the Qwen2/Qwen3 family check are the embedded engine's only (vLLM runs the
fp32 drafter with its own draft sampling; contract.family_policy builds head_dim 16 policies).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg

VLLM = pytest.param("vllm", marks=pytest.mark.vllm)
BOTH = ["torch", VLLM]


@dataclass
class Setup:
    kind: str
    make: object  # make(policy, drafter=None, **engine_kw) -> engine
    policy: object
    drafter: object
    vocab5: tuple  # (policy, drafter) with a 5-token vocabulary: exact distributions over whole sequences


@pytest.fixture(scope="module")
def torch_vocab5():
    pol = C.tiny_vocab_policy(vocab=5)
    return pol, C.fresh_drafter(pol, seed=2)


@pytest.fixture(scope="module")
def vllm_vocab5():
    from tests.vllm.pool import vllm_policy

    pol = vllm_policy(vocab=5, seed=3, inter=64)
    return pol, C.fresh_drafter(pol, seed=2)


@pytest.fixture
def eng(request) -> Setup:
    get = request.getfixturevalue
    if request.param == "torch":
        def make(policy, drafter=None, **kw):
            return build_engine(engine_cfg(kind="torch", **kw), policy, drafter)

        return Setup("torch", make, get("policy"), get("drafter"), get("torch_vocab5"))
    pytest.importorskip("vllm")
    return Setup("vllm", get("pool").get, get("vpolicy"), get("vdrafter"), get("vllm_vocab5"))


def both():
    """Parametrize `eng` (indirect) over both engines."""
    return pytest.mark.parametrize("eng", BOTH, indirect=True)


def with_engine(names: str, rows: list):
    """Parametrize (eng, names...) over the rows given: cases that run on one engine only."""
    return pytest.mark.parametrize(f"eng,{names}", rows, indirect=["eng"])


# ---- greedy: SD equals AR equals HF generate ------------------------------------------------------------------
@with_engine("int8", [("torch", False), ("torch", True), pytest.param("vllm", False, marks=pytest.mark.vllm)])
def test_greedy_sd_equals_ar(eng, int8):
    C.greedy_sd_equals_ar(eng.make, eng.policy, eng.drafter, drafter_int8=int8)


@both()
def test_ar_equals_hf_generate(eng):
    C.ar_equals_hf_generate(eng.make, eng.policy)


# ---- sampling: the exact distribution over whole sequences (chi-square), and a perturbation it must catch ---------
EXACT = {  # name: (params, negative control, engine kwargs on the embedded engine; vLLM runs each at k=2)
    "T1": (SamplingParams(max_new_tokens=3, seed=11), SamplingParams(temperature=0.7, max_new_tokens=3), {"k": 2}),
    "T0.7": (SamplingParams(temperature=0.7, max_new_tokens=3, seed=12), SamplingParams(max_new_tokens=3), {"k": 3}),
    "topk3": (SamplingParams(top_k=3, max_new_tokens=3, seed=13), SamplingParams(max_new_tokens=3), {"k": 2}),
    "topp0.7_T1.3": (SamplingParams(temperature=1.3, top_p=0.7, max_new_tokens=3, seed=14),
                     SamplingParams(temperature=1.3, max_new_tokens=3), {"k": 2}),
    "greedy_drafts_T0.8_topk4": (SamplingParams(temperature=0.8, top_k=4, max_new_tokens=2, seed=15),
                                 SamplingParams(temperature=0.8, max_new_tokens=2),
                                 {"k": 2, "draft_sampling": "greedy", "min_accept": 0.03}),
    "int8_drafter": (SamplingParams(max_new_tokens=3, seed=16), SamplingParams(temperature=1.3, max_new_tokens=3),
                     {"k": 2, "drafter_int8": True}),
}
TORCH_ONLY = ("greedy_drafts_T0.8_topk4", "int8_drafter")


@with_engine("name", [("torch", n) for n in EXACT]
      + [pytest.param("vllm", n, marks=pytest.mark.vllm) for n in EXACT if n not in TORCH_ONLY])
def test_exact_distribution(eng, name):
    params, wrong, kw = EXACT[name]
    kw = {"drafter_int8": False, **kw} if eng.kind == "torch" else {"k": 2}
    C.exact_distribution(eng.make, *eng.vocab5, params, n_rows=3000, wrong=wrong, **kw)


@both()
def test_exact_distribution_rejects_perturbation(eng):
    C.exact_distribution_rejects_perturbation(eng.make, *eng.vocab5)


LOGPROB_PARAMS = {"T0.8_topk12": SamplingParams(temperature=0.8, top_k=12, max_new_tokens=14, seed=1),
                  "T1": SamplingParams(temperature=1.0, max_new_tokens=14, seed=2),
                  "T1.2_topp0.9": SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=14, seed=3)}


@both()
@pytest.mark.parametrize("params", list(LOGPROB_PARAMS.values()), ids=list(LOGPROB_PARAMS))
def test_logprobs_match_teacher_forced(eng, params):
    C.logprobs_match_teacher_forced(eng.make, eng.policy, eng.drafter, params)


# ---- lengths, stops, versions, bad input: each check with the engine's default policy and drafter -------------------
CHECKS = [C.ragged_stops, C.max_new_tokens_exact, C.load_drafter_versioned, C.load_drafter_refuses_bad_weights,
          C.bad_prompts_raise, C.nan_logits_raise]


@both()
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_contract_check(eng, check):
    check(eng.make, eng.policy, eng.drafter)


# vLLM fixes max_len when it starts: its max-position check runs on an engine of its own, built from folders
# (tests/vllm/test_vllm_engine.py::test_rows_finish_at_max_position_then_clean_exit_on_error)
@pytest.mark.parametrize("eng", ["torch"], indirect=True)
def test_rows_finish_independently_at_max_position(eng):
    C.rows_finish_independently_at_max_position(eng.make, eng.policy, eng.drafter)


@with_engine("family", [("torch", "qwen2"), ("torch", "qwen3")])
def test_family_greedy_sd_ar_hf(eng, family):
    C.family_greedy_sd_ar_hf(eng.make, family)
