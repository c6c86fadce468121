"""Teacher-forced acceptance (tracking/acceptance.py) reports what the engine's SpecStats count, in expectation:
exact checks of the step recursion on hand-made acceptance ratios, and the engine against the estimate on the very
rollouts it generated (tiny random policy, many rows, sampled drafts at T=1)."""
from __future__ import annotations

import math

import pytest
import torch

from drafttrain.drafters import TargetHead
from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams, expected_spec_stats
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.capture import teacher_forced_features
from tests import contract as C
from tests.conftest import engine_cfg


def _valid(resp_lens: list[int], first: int, T: int, k: int) -> torch.Tensor:
    """valid [B, T+k] as build_features makes it: position j predicts response token j+1 - first."""
    j = torch.arange(T + k).view(1, -1)
    R = torch.tensor(resp_lens).view(-1, 1)
    return (j >= first - 1) & (j < first - 1 + R)


@pytest.mark.parametrize("R", [1, 2, 4, 5, 6, 11, 12])
def test_step_recursion_exact_at_the_ends(R):
    """Every draft accepted: ceil((R-1)/(k+1)) steps, the last one cut at the end of the response (no bonus);
    none accepted: R-1 steps of one token. Drafts past the end are never reached."""
    k, T, first = 4, 20, 3
    valid = _valid([R], first, T, k)
    st = expected_spec_stats(torch.ones(1, T, k), valid, k)
    assert st.verify_rows == pytest.approx(math.ceil((R - 1) / (k + 1)))
    assert st.emitted == R - 1 and st.accepted == pytest.approx(R - 1 - (R - 1) // (k + 1))  # full steps: +1 bonus
    assert all(a == pytest.approx(1.0) for a, r in zip(st.acceptance_per_position, st.reached_per_position) if r)
    st0 = expected_spec_stats(torch.zeros(1, T, k), valid, k)
    assert st0.verify_rows == pytest.approx(R - 1) and st0.reached_per_position == [R - 1] + [0] * (k - 1)


def test_step_recursion_matches_brute_force():
    """Random ratios: the recursion equals the expectation over every accept/reject pattern, enumerated."""
    k, T, first, R = 3, 9, 2, 8
    g = torch.Generator().manual_seed(0)
    r = torch.rand(1, T, k, generator=g)
    st = expected_spec_stats(r, _valid([R], first, T, k), k)

    def walk(s, p):  # expected [steps, reached[k], accepted[k]] of the steps from response token s on, given p
        out = torch.zeros(1 + 2 * k, dtype=torch.float64)
        if s >= R - 1:
            return out
        out[0] = p
        surv, left = p, R - 1 - s
        for j in range(min(k, left)):
            acc = surv * float(r[0, first - 1 + s, j])
            out[1 + j] += surv
            out[1 + k + j] += acc
            out += walk(s + j + 1, surv - acc)  # rejected at j: j + 1 tokens
            surv = acc
        return out + walk(s + min(k + 1, left), surv)  # every draft inside the response accepted

    want = walk(0, 1.0).tolist()
    assert st.verify_rows == pytest.approx(want[0])
    assert st.reached_per_position == pytest.approx(want[1:1 + k])
    assert st.accepted_per_position == pytest.approx(want[1 + k:])


def test_engine_agrees_with_teacher_forced_on_its_rollouts(policy):
    """1000 short rollouts, k=4, T=1, stop token: the engine's MAL and per-position acceptance match the estimate
    on the same sequences within sampling noise. Before the fix: engine 1.92 (drafts past the stop token and a
    bonus token there counted) vs 1.87 (the per-position average of chained sum min(p, q)), and draft 1 accepted
    0.50 vs 0.45; now 1.815 vs 1.804 (sd ~0.01)."""
    k, stop = 4, 2
    drafter = C.fresh_drafter(policy, seed=1)
    eng = build_engine(engine_cfg(k=k, drafter_int8=False), policy, drafter)
    prompts = [[1, 5, 9, 7]] * 1000
    b = eng.generate(prompts, SamplingParams(max_new_tokens=16, stop_token_ids=(stop,), seed=0))
    assert sum(r == "stop" for r in b.finish_reasons) > 300  # many rows end inside a step
    tf = teacher_forced_acceptance(drafter, teacher_forced_features(policy, prompts, b.tokens,
                                                                    drafter.aux_layer_ids, k), k, TargetHead.of(policy))
    st = b.stats
    assert tf["stats"].emitted == st.emitted
    assert abs(st.mean_accepted_length - tf["mal"]) < 0.04, (st.mean_accepted_length, tf["mal"])  # sd ~0.01
    for i, (a, n, e) in enumerate(zip(st.acceptance_per_position, st.reached_per_position,
                                      tf["acceptance_per_position"])):
        assert abs(a - e) <= 4 * math.sqrt(e * (1 - e) / n) + 1e-3, (i, a, e, n)


def test_scoring_in_length_chunks_equals_each_row_alone(policy):
    """A ragged batch (prompts of 2-9 tokens, responses of 0-40) scored at once pools exactly the counts of each
    row scored alone, unpadded, and gives each row its own MAL (the publish gate pairs them); and it computes few
    padded positions: the chains run from each chunk's first response position, over chunks cut to their longest
    row (the whole padded batch computed every position)."""
    k = 3
    drafter = C.fresh_drafter(policy, seed=2)
    g = torch.Generator().manual_seed(0)
    lens = [0, 1, 2, 40, 3, 5, 8, 13, 21, 30, 4, 6, 7, 9, 11, 12]
    prompts = [torch.randint(3, 30, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in lens]
    resps = [torch.randint(3, 30, (n,), generator=g).tolist() for n in lens]
    batch = teacher_forced_features(policy, prompts, resps, drafter.aux_layer_ids, k)
    calls = []
    real = drafter.ttt_hidden
    head = TargetHead.of(policy)

    def counting(aux, next_ids, steps, queries=None, first_ids=None):
        calls.append(aux.shape[0] * (aux.shape[1] if queries is None else len(queries)))
        return real(aux, next_ids, steps, queries, first_ids)

    drafter.ttt_hidden = counting
    scored = teacher_forced_acceptance(drafter, batch, k, head)
    whole = scored["stats"]
    computed = sum(calls)
    alone, row_mal = None, []
    for p, r in zip(prompts, resps):
        one = teacher_forced_acceptance(drafter, teacher_forced_features(policy, [p], [r], drafter.aux_layer_ids,
                                                                         k), k, head)
        st = one["stats"]
        alone = st if alone is None else alone.merge(st)
        row_mal.append(st.mean_accepted_length if st.verify_rows else math.nan)
    # each row's own MAL, in the batch's order (the chunks reorder rows by length); nan: no verify step (0-1 tokens)
    assert scored["row_mal"].tolist() == pytest.approx(row_mal, rel=1e-5, nan_ok=True)
    assert math.isnan(row_mal[0]) and math.isnan(row_mal[1]) and not any(math.isnan(x) for x in row_mal[2:])
    assert whole.emitted == alone.emitted == sum(max(n - 1, 0) for n in lens)
    assert whole.verify_rows == pytest.approx(alone.verify_rows, rel=1e-5)
    assert whole.accepted_per_position == pytest.approx(alone.accepted_per_position, rel=1e-4)
    assert whole.reached_per_position == pytest.approx(alone.reached_per_position, rel=1e-5)
    starts = sum(max(n - 1, 0) for n in lens)  # positions a verify step can start from
    assert computed <= 1.5 * starts + 4 * 40, (computed, starts, batch["aux"].shape)
