"""Drafter kinds beyond EAGLE-3 and the self-drafter in the vLLM engine, each through its vLLM form
(engines/vllm_forms.py): the draft model as vLLM's `draft_model`. The shared engine contract (tests/contract.py) on
warm pool engines, the same acceptance as the embedded engine, and hot-swaps read back through vLLM's kernels.
"""
from __future__ import annotations

import pytest

from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg
from tests.vllm.pool import vllm_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KINDS = {"draft_model": {"layers": 1}}


def fresh(policy, kind: str, seed: int = 1):
    return C.fresh_drafter(policy, seed=seed, kind=kind, **KINDS[kind])


@pytest.fixture(autouse=True)
def _vllm():
    pytest.importorskip("vllm")


@pytest.mark.parametrize("kind", list(KINDS))
def test_lossless_contract(pool, vpolicy, kind):
    d = fresh(vpolicy, kind)
    C.greedy_sd_equals_ar(pool.get, vpolicy, d, drafter_int8=False)
    pol = vllm_policy(vocab=5, seed=3, inter=64)
    C.exact_distribution(pool.get, pol, fresh(pol, kind, seed=2), SamplingParams(max_new_tokens=3, seed=41),
                         n_rows=3000, wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2)
    C.logprobs_match_teacher_forced(pool.get, vpolicy, d, SamplingParams(temperature=0.8, top_k=12,
                                                                          max_new_tokens=10, seed=1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_serving_and_swap_checks(pool, vpolicy, kind):
    d = fresh(vpolicy, kind)
    for check in (C.ragged_stops, C.max_new_tokens_exact, C.bad_prompts_raise):
        check(pool.get, vpolicy, d)
    C.swap_checks(pool.get, vpolicy, d)


@pytest.mark.parametrize("kind", list(KINDS))
def test_same_acceptance_as_embedded_and_swaps_land(monkeypatch, vpolicy, kind):
    """Greedy: vLLM accepts exactly what the embedded engine accepts with the same drafter. A policy update leaves the
    drafter stale until the new policy's drafter is pushed; a push that does not land is caught and rolled back."""
    d = fresh(vpolicy, kind)
    greedy, prompts = SamplingParams(temperature=0, max_new_tokens=24), C.RAGGED_PROMPTS
    ours = build_engine(engine_cfg(kind="torch", k=4, max_batch=8, max_len=128), vpolicy, d).generate(prompts, greedy)
    with build_engine(engine_cfg(kind="vllm", k=4, max_batch=8, max_len=128), vpolicy, d) as eng:
        assert eng.llm.llm_engine.vllm_config.speculative_config.method == kind
        got = eng.generate(prompts, greedy)
        assert got.tokens == ours.tokens == [C.hf_greedy(vpolicy, p, 24) for p in prompts]
        assert got.stats.mean_accepted_length == pytest.approx(ours.stats.mean_accepted_length, abs=1e-9)

        other = vllm_policy(seed=5)
        eng.update_policy(other)
        stale = eng.generate(prompts, greedy)
        new = fresh(other, kind).state_dict()
        eng.load_drafter(new, 1)
        again = eng.generate(prompts, greedy)
        assert again.tokens == stale.tokens == [C.hf_greedy(other, p, 24) for p in prompts]
        assert again.stats.mean_accepted_length > stale.stats.mean_accepted_length + 0.1, (
            stale.stats.to_dict(), again.stats.to_dict())

        monkeypatch.setattr(eng, "_push", lambda weights, draft: None)  # an update that does not land
        with pytest.raises(ValueError, match="did not land"):
            eng.load_drafter(d.state_dict(), 2)
        monkeypatch.undo()
        assert eng.drafter_version == 1
        assert eng.generate(prompts, greedy).stats.mean_accepted_length == pytest.approx(
            again.stats.mean_accepted_length, abs=1e-9)
