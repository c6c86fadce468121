"""Drafter kinds beyond EAGLE-3 and the self-drafter in the vLLM engine, each through its vLLM form
(engines/vllm_forms.py): the draft model as vLLM's `draft_model`, the MTP head as its `eagle` (EAGLE-1, the target's
LM head shared), the suffix drafter as a `custom_class` proposer (engines/vllm_suffix.py). The shared engine
contract (tests/contract.py) on warm pool engines, the same acceptance as the embedded engine, and hot-swaps read
back through vLLM's kernels.
"""
from __future__ import annotations

import pytest
import torch

from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import engine_cfg
from tests.vllm.pool import vllm_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KINDS = {"draft_model": {"layers": 1}, "mtp": {}, "suffix": {"max_ngram": 3, "min_ngram": 1}}
METHOD = {"draft_model": "draft_model", "mtp": "eagle"}
WEIGHTED = [k for k in KINDS if k != "suffix"]
ELSEWHERE = {"eagle3": "test_vllm_engine.py", "selfquant": "test_vllm_selfdraft.py"}  # kinds served by vLLM


def test_every_kind_with_a_vllm_form_is_served_in_these_tests():
    """The registry's kinds with a vLLM form: each runs here (KINDS) or in its own file; a new one fails this."""
    from drafttrain.drafters import DRAFTERS

    assert {k for k, e in DRAFTERS.items() if e.vllm is not None} == set(KINDS) | set(ELSEWHERE)


# weight noise: a drafter its own policy accepts more than another policy does (a fresh draft model is its policy's
# first layer already; a fresh MTP head drafts the policy's next token one position late, whatever its weights)
NOISE = {"draft_model": 0.0, "mtp": 0.05}


def fresh(policy, kind: str, seed: int = 1):
    return C.fresh_drafter(policy, seed=seed, kind=kind, **KINDS[kind])


def trained(policy, kind: str, seed: int):
    """A fresh drafter with its weights moved by NOISE[kind], as training would move them."""
    noise = NOISE[kind]
    d = fresh(policy, kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in d.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g) * noise)
    return d


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
    if kind in WEIGHTED:
        C.swap_checks(pool.get, vpolicy, d)


def test_suffix_drafts_what_the_embedded_one_drafts(vpolicy):
    """vLLM verifies a custom proposer's drafts as one-hot, so they are the index's most frequent continuations: the
    embedded drafter's with engine.draft_sampling=greedy. Greedy decoding accepts exactly the same there, in a first
    generation (siblings only) and a second (the first one's rollouts too). The same prompts once more, after two
    generations of other prompts have pushed theirs out of the history, draft their rollouts from the prompt cache
    in both engines (keyed by vLLM's prompt lengths there, by the embedded engine's stripped padding here); the
    recalled texts' ends differ (vLLM indexes a row's last tokens, and those past max_tokens; the embedded drafter
    stops at its last draft), so there the outputs must match and both must draft from the cache. A swap carries no
    weights."""
    greedy = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = [p for p in C.RAGGED_PROMPTS for _ in range(3)]  # 3 siblings per prompt
    other = [[p[0] + 1, *p[1:]] for p in prompts]
    batches = [prompts, prompts, other, other, prompts]
    cfg = dict(k=4, max_batch=16, max_len=128)
    ours = build_engine(engine_cfg(kind="torch", draft_sampling="greedy", **cfg), vpolicy, fresh(vpolicy, "suffix"))
    want = [ours.generate(b, greedy) for b in batches]
    with build_engine(engine_cfg(kind="vllm", **cfg), vpolicy, fresh(vpolicy, "suffix")) as eng:
        assert eng.llm.llm_engine.vllm_config.speculative_config.method == "custom_class"
        got = [eng.generate(b, greedy) for b in batches]
        for g, w in zip(got, want):
            assert g.tokens == w.tokens
        for g, w in zip(got[:2], want[:2]):
            assert g.stats.mean_accepted_length == pytest.approx(w.stats.mean_accepted_length, abs=1e-9)
        assert want[1].stats.mean_accepted_length > want[0].stats.mean_accepted_length + 0.5  # history drafts
        for run in (want, got):  # prompt-cache drafts, in both engines
            assert run[4].stats.mean_accepted_length > run[0].stats.mean_accepted_length + 0.5
        eng.load_drafter({}, 1)
        assert eng.drafter_version == 1
        with pytest.raises(ValueError, match="suffix drafter: takes no weights") as e:
            eng.load_drafter({"w": torch.zeros(2)}, 2)
        assert "\n" not in str(e.value) and eng.drafter_version == 1


@pytest.mark.parametrize("kind", WEIGHTED)
def test_same_acceptance_as_embedded_and_swaps_land(monkeypatch, pool, vpolicy, kind):
    """Greedy: vLLM accepts what the embedded engine accepts with the same drafter, before and after a policy update
    and a swap to the new policy's drafter; a push that does not land is caught and rolled back."""
    greedy, prompts = SamplingParams(temperature=0, max_new_tokens=24), C.RAGGED_PROMPTS

    def embedded(policy, d):
        return build_engine(engine_cfg(kind="torch", drafter_int8=False), policy, d).generate(prompts, greedy)

    d = trained(vpolicy, kind, seed=1)
    eng = pool.get(vpolicy, d)  # the contract tests' warm engine for this kind: its default config
    assert eng.llm.llm_engine.vllm_config.speculative_config.method == METHOD[kind]
    got, ours = eng.generate(prompts, greedy), embedded(vpolicy, d)
    assert got.tokens == ours.tokens == [C.hf_greedy(vpolicy, p, 24) for p in prompts]
    assert got.stats.mean_accepted_length == pytest.approx(ours.stats.mean_accepted_length, abs=0.03)

    other = vllm_policy(seed=5)
    eng.update_policy(other)
    stale = eng.generate(prompts, greedy)
    d2 = trained(other, kind, seed=2)
    eng.load_drafter(d2.state_dict(), 1)
    got, ours = eng.generate(prompts, greedy), embedded(other, d2)
    assert got.tokens == stale.tokens == ours.tokens == [C.hf_greedy(other, p, 24) for p in prompts]
    assert got.stats.mean_accepted_length == pytest.approx(ours.stats.mean_accepted_length, abs=0.03)
    assert abs(got.stats.mean_accepted_length - stale.stats.mean_accepted_length) > 0.05  # the swap mattered

    monkeypatch.setattr(eng, "_push", lambda weights, draft: None)  # an update that does not land
    with pytest.raises(ValueError, match="did not land"):
        eng.load_drafter(d.state_dict(), 2)
    monkeypatch.undo()
    assert eng.drafter_version == 1
    assert eng.generate(prompts, greedy).stats.mean_accepted_length == pytest.approx(
        got.stats.mean_accepted_length, abs=1e-9)


@pytest.mark.parametrize("kind", list(KINDS))
def test_drafter_of_another_vocabulary_refused_before_start(vpolicy, kind):
    from tests.vllm.pool import engine_processes

    before = {p.pid for p in engine_processes()}
    d = fresh(vllm_policy(vocab=48), kind)
    with pytest.raises(ValueError, match="^drafter vocab_size 48 != policy vocab_size 32$"):
        build_engine(engine_cfg(kind="vllm", k=4, max_batch=8, max_len=128), vpolicy, d)
    assert {p.pid for p in engine_processes()} <= before, "an engine was started"
