"""The suffix drafter (drafter.kind=suffix): siblings' and recent rollouts' text proposed, the index rebuilt per
generation, and SD with it lossless (the shared engine contract: greedy identity, the exact output distribution,
log-probs, ragged rows)."""
from __future__ import annotations

import pytest
import torch

from drafttrain.config import ConfigError, load_recipe
from drafttrain.drafters.suffix import SuffixDrafter
from drafttrain.spec import SamplingParams
from tests import contract as C

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


def feed(d, st, rows: list[list[int]], k: int = 3, greedy: bool = True):
    """propose with each row's tokens after position 0, all new (the engine's first call); greedy: the most frequent
    continuation, one-hot."""
    m = max(len(r) for r in rows) - 1
    ids = torch.zeros(len(rows), m, dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, :len(r) - 1] = torch.tensor(r[1:])
    n = torch.tensor([len(r) - 1 for r in rows])
    return d.propose(st, ids, None, n, torch.zeros(len(rows), dtype=torch.long), k, PARAMS, greedy,
                     torch.Generator().manual_seed(0))


def test_sibling_text_is_proposed():
    d = SuffixDrafter(32, max_ngram=4, min_ngram=2, history=1)
    st = d.new_state(2, 64, torch.tensor([[1, 2], [1, 2]]))
    drafts, q = feed(d, st, [[1, 2, 7, 8, 9, 10, 11], [1, 2, 7]])
    assert q is None  # greedy drafts: one-hot
    assert drafts[1].tolist() == [8, 9, 10]  # row 1 goes on as its sibling did after "2 7"
    # past the known text nothing matches: the row's last token (the row's own newest position is not a match)
    st = d.new_state(1, 64, torch.tensor([[3]]))
    drafts, _ = feed(d, st, [[3, 9, 10]], k=3)
    assert drafts[0].tolist() == [11, 11, 11]  # "9 10" from the last generation's row 0


def test_longest_suffix_wins_and_no_match_repeats_the_last_token():
    d = SuffixDrafter(32, max_ngram=3, min_ngram=1, history=0)
    st = d.new_state(1, 64, torch.tensor([[5]]))
    drafts, _ = feed(d, st, [[5, 1, 2, 3, 1, 4, 2, 3, 9, 4, 2, 3]], k=2)
    assert drafts[0].tolist() == [9, 4]  # "4 2 3" went on with "9" ("2 3" alone: with 1 as often)
    st = d.new_state(1, 64, torch.tensor([[1]]))
    assert feed(d, st, [[1, 5, 1, 5, 1, 6, 1]], k=1)[0][0].tolist() == [5]  # "1": 5 twice, 6 once
    d2 = SuffixDrafter(32, max_ngram=3, min_ngram=2, history=0)
    st = d2.new_state(1, 64, torch.tensor([[6]]))
    drafts, _ = feed(d2, st, [[6, 7]], k=2)
    assert drafts[0].tolist() == [7, 7]


def test_drafts_do_not_depend_on_the_order_of_rows():
    """Every row's new tokens are indexed before any row drafts, and ties go to the lowest id: the batch's order
    (the embedded engine's, or vLLM's, which differ) changes no draft. Before, the first row drafted without its
    later sibling's text and a tie went to the continuation indexed first."""
    rows = [[1, 2, 7, 8], [1, 2, 7, 9, 5], [1, 2, 7]]
    got = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        d = SuffixDrafter(32, max_ngram=3, min_ngram=2, history=0)
        st = d.new_state(3, 64, torch.tensor([[1]] * 3))
        drafts, _ = feed(d, st, [rows[i] for i in order], k=2)
        got.append({i: drafts[j].tolist() for j, i in enumerate(order)})
    assert got[0] == got[1] == got[2]
    assert got[0][2] == [8, 8]  # "2 7": 8 and 9 once each, the lower id wins; then "7 8" matches nothing ("8" repeats)


def test_index_rebuilt_per_generation_keeps_history_generations():
    d = SuffixDrafter(32, max_ngram=2, min_ngram=2, history=1)
    st = d.new_state(1, 64, torch.tensor([[1]]))
    feed(d, st, [[1, 20, 21, 22, 23]])
    st = d.new_state(1, 64, torch.tensor([[2]]))  # generation 2: generation 1 is within history=1
    assert feed(d, st, [[2, 20, 21]])[0][0].tolist() == [22, 23, 23]
    st = d.new_state(1, 64, torch.tensor([[3]]))  # generation 3: generation 1 dropped, 2 kept
    assert feed(d, st, [[3, 20, 21]])[0][0].tolist() == [21, 21, 21]  # generation 2's "20 21" has no continuation
    assert d.counts((2, 20)) and d.counts((1, 20)) is None and d.counts((21, 22)) is None


def brute_counts(texts, n0: int, n1: int, los=None) -> dict[tuple, dict[int, int]]:
    """Every n-gram (n0..n1) of the texts whose next token is known (ending at position los[i] or later in text i;
    default 0) -> its next tokens' counts."""
    out: dict[tuple, dict[int, int]] = {}
    for t, lo in zip(texts, los or [0] * len(texts)):
        for e in range(lo, len(t) - 1):
            for n in range(n0, min(n1, e + 1) + 1):
                c = out.setdefault(tuple(t[e - n + 1:e + 1]), {})
                c[t[e + 1]] = c.get(t[e + 1], 0) + 1
    return out


def test_the_trie_counts_exactly_the_kept_generations_and_frees_what_it_drops():
    """Over generations of random rows (history 1), with a synthetic timing call's re-written positions in between,
    the index holds exactly the kept rows' n-gram counts: every n-gram a brute-force count has, and no other context
    matches; dropping every generation leaves an empty trie (un-counted nodes are pruned)."""
    g = torch.Generator().manual_seed(0)
    d = SuffixDrafter(6, max_ngram=4, min_ngram=2, history=1, prompt_cache=0)  # the prompt cache: tested below
    kept = []
    for gen in range(4):
        rows = [torch.randint(0, 6, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
                for _ in range(5)]
        st = d.new_state(5, 64, torch.tensor([[r[0]] for r in rows]))
        feed(d, st, rows)
        if gen == 1:  # a timing call re-writes row 0 from position 1: it must un-count what it overwrites
            d.propose(st, torch.tensor([[3, 4]] * 5), None, torch.tensor([2] * 5), torch.zeros(5, dtype=torch.long),
                      2, PARAMS, True)
        kept = (kept + [[list(t) for t in st.rows]])[-2:]
        want = brute_counts([t for gen_rows in kept for t in gen_rows], 2, 4)
        for n in range(1, 6):
            for ctx in {tuple(t[i:i + n]) for gen_rows in kept for t in gen_rows for i in range(len(t) - n + 1)}:
                assert d.counts(ctx) == want.get(ctx), (gen, ctx)
    d.history = 0
    d.start_generation([])
    d.start_generation([])
    assert d.root == ({}, {})


def test_prompt_cache_brings_back_a_prompts_rollouts_past_the_history():
    """A prompt that comes back after its rollouts left the index (history 0: at once) drafts them again, as
    SPEC-RL reuses a prompt's earlier rollouts; without the cache nothing matches. They leave the index with the
    generation that counted them again, and a prompt pushed out of the cache (least recently used) is not recalled."""
    for cache, want in ((8, [22, 23, 24]), (0, [21, 21, 21])):
        d = SuffixDrafter(32, max_ngram=3, min_ngram=2, history=0, prompt_cache=cache)
        st = d.new_state(1, 64, torch.tensor([[1, 2, 0]]))  # right-padded: the key is [1, 2]
        feed(d, st, [[1, 2, 20, 21, 22, 23, 24]])
        st = d.new_state(1, 64, torch.tensor([[3, 4]]))  # another prompt: generation 1 leaves the index
        feed(d, st, [[3, 4, 9]])
        assert d.counts((20, 21)) is None
        st = d.new_state(2, 64, torch.tensor([[1, 2], [1, 2]]))  # the prompt comes back (two siblings: one recall)
        assert feed(d, st, [[1, 2, 20, 21], [1, 2]])[0][0].tolist() == want
        if cache:
            assert d.counts((20, 21)) == {22: 1}  # counted once, though two rows answer the prompt
            assert d.counts((1, 2)) == {20: 2}  # the row's own and the recalled one (from the prompt's last token)
    st = d.new_state(1, 64, torch.tensor([[5]]))
    assert d.counts((20, 21)) is None and d.counts((22, 23)) is None  # dropped with the generation that recalled them
    d = SuffixDrafter(32, max_ngram=3, min_ngram=2, history=0, prompt_cache=1)
    for prompt, row in (([1, 2], [1, 2, 20, 21, 22]), ([3, 4], [3, 4, 9]), ([1, 2], [1, 2, 20, 21])):
        st = d.new_state(1, 64, torch.tensor([prompt]))
        drafts = feed(d, st, [row])[0][0].tolist()
    assert drafts == [21, 21, 21]  # [3, 4] took the only place: [1, 2]'s rollouts are gone


def test_a_recalled_rollout_counts_from_the_prompts_end():
    """Recalled, a rollout counts the n-grams ending on its prompt's last token and after, with their full context
    (up to max_ngram tokens of the prompt), and none inside the prompt."""
    d = SuffixDrafter(32, max_ngram=3, min_ngram=1, history=0)
    prompt = [5, 6, 7, 8, 9]
    st = d.new_state(1, 64, torch.tensor([prompt]))
    feed(d, st, [prompt + [20, 21, 22]])
    st = d.new_state(1, 64, torch.tensor([[3]]))
    feed(d, st, [[3, 4]])
    st = d.new_state(1, 64, torch.tensor([prompt]))  # recalled here, before the row's own text is fed
    assert d.counts((7, 8, 9)) == {20: 1} and d.counts((9, 20, 21)) == {22: 1}
    assert d.counts((6, 7)) is None and d.counts((7,)) is None


def test_the_trie_counts_exactly_what_the_prompt_cache_recalls():
    """Random generations over a pool of prompts (history 1, a cache of 3 prompts: recalls and evictions): the index
    holds exactly the kept rows' counts plus the recalled texts' from the prompt's end on, and dropping every
    generation leaves an empty trie."""
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(1, 6, (n,), generator=g).tolist() for n in (2, 3, 5, 1, 4, 2)]
    d = SuffixDrafter(6, max_ngram=4, min_ngram=1, history=1, prompt_cache=3)
    recalls = 0
    for gen in range(16):
        prompts = [pool[int(i)] for i in torch.randint(0, 6, (2,), generator=g)]
        rows = [p + torch.randint(0, 6, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
                for p in prompts]
        P = max(len(p) for p in prompts)
        st = d.new_state(2, 64, torch.tensor([p + [0] * (P - len(p)) for p in prompts]))
        feed(d, st, rows)
        recalls += len(d.texts[-1].recalled) > 0
        texts = [t for x in d.texts for t in x.rows] + [t for x in d.texts for t, _ in x.recalled]
        los = [0] * sum(len(x.rows) for x in d.texts) + [lo for x in d.texts for _, lo in x.recalled]
        want = brute_counts(texts, 1, 4, los)
        for n in range(1, 6):
            for ctx in {tuple(t[i:i + n]) for t in texts for i in range(len(t) - n + 1)}:
                assert d.counts(ctx) == want.get(ctx), (gen, ctx)
    assert recalls >= 3 and len(d.cache) == 3
    d.history = 0
    d.start_generation([])
    d.start_generation([])
    assert d.root == ({}, {})


def test_sampled_drafts_come_with_the_continuation_frequencies():
    d = SuffixDrafter(8, max_ngram=1, min_ngram=1, history=0)
    st = d.new_state(1, 64, torch.tensor([[1]]))
    drafts, q = feed(d, st, [[1, 5, 1, 5, 1, 6, 1]], k=2, greedy=False)
    assert q.shape == (1, 2, 8) and torch.allclose(q.sum(-1), torch.ones(1, 2))
    assert torch.allclose(q[0, 0], torch.tensor([0, 0, 0, 0, 0, 2 / 3, 1 / 3, 0]))  # after "1": 5, 5, 6
    assert drafts[0, 0].item() in (5, 6) and q[0, 0, drafts[0, 0]] > 0 and q[0, 1, drafts[0, 1]] > 0


def test_no_weights():
    d = SuffixDrafter(32)
    assert d.state_dict() == {} and d.trains is False and d.follows_policy is False
    d.load_state_dict({})
    with pytest.raises(ValueError, match="suffix drafter: takes no weights"):
        d.load_state_dict({"fc.weight": torch.zeros(2)})


@pytest.mark.parametrize("override,key", [(["drafter.suffix.min_ngram=0"], "drafter.suffix.min_ngram"),
                                          (["drafter.suffix.max_ngram=1", "drafter.suffix.min_ngram=2"],
                                           "drafter.suffix.max_ngram"),
                                          (["drafter.suffix.history=-1"], "drafter.suffix.history"),
                                          (["drafter.suffix.prompt_cache=-1"], "drafter.suffix.prompt_cache"),
                                          (["drafter.path=checkpoints/eagle3"], "drafter.path"),
                                          (["drafter.suffix.bogus=1"], "drafter.suffix.bogus")])
def test_bad_settings_one_line(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_recipe("suffix_track", override)
    assert "\n" not in str(e.value)


# ---- lossless: the shared engine contract ---------------------------------------------------------------------

def test_greedy_sd_equals_ar(make_engine, policy):
    C.greedy_sd_equals_ar(make_engine, policy, SuffixDrafter(32, min_ngram=1), drafter_int8=False)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=3, seed=31),
                                    SamplingParams(temperature=0.7, top_k=3, max_new_tokens=3, seed=32)],
                         ids=["T1", "T0.7_topk3"])
def test_exact_distribution(make_engine, params):
    """3000 copies of one prompt: siblings' text drafts, sampled from their continuation frequencies (accepted and
    rejected both exercised); the samples match the policy's exact sequence distribution, and a wrong temperature
    is rejected."""
    pol = C.tiny_vocab_policy(vocab=5)
    C.exact_distribution(make_engine, pol, SuffixDrafter(5, max_ngram=3, min_ngram=1), params, n_rows=3000,
                         wrong=SamplingParams(temperature=1.3, max_new_tokens=3), k=2, drafter_int8=False)


def test_contract_ragged_lengths_logprobs(make_engine, policy):
    d = SuffixDrafter(32, min_ngram=1)
    C.serving_checks(make_engine, policy, d)


def test_earlier_rollouts_drafted_through_the_engine(make_engine, policy):
    """A second greedy generation of the same prompts drafts the first one's text: nearly every draft is accepted,
    its mean accepted length well above the first generation's."""
    eng = make_engine(policy, SuffixDrafter(32), k=3, drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    first = eng.generate(C.RAGGED_PROMPTS, params)
    again = eng.generate(C.RAGGED_PROMPTS, params)
    assert again.tokens == first.tokens
    assert again.stats.acceptance_rate > 0.8, again.stats.to_dict()  # a loop's latest occurrence may mislead
    assert again.stats.mean_accepted_length > first.stats.mean_accepted_length + 1


def test_a_prompt_revisited_past_the_history_drafts_its_earlier_rollouts(make_engine, policy):
    """Through the engine: prompts that come back after other prompts' generations (history 1) draft their first
    rollouts from the prompt cache (greedy: nearly all accepted); with the cache off they draft as if new."""
    params = SamplingParams(temperature=0, max_new_tokens=24)
    other = [[p[0] + 1, *p[1:]] for p in C.RAGGED_PROMPTS]
    mal = {}
    for cache in (4096, 0):
        eng = make_engine(policy, SuffixDrafter(32, history=1, prompt_cache=cache), k=3, drafter_int8=False)
        first = eng.generate(C.RAGGED_PROMPTS, params)
        for _ in range(2):
            eng.generate(other, params)
        again = eng.generate(C.RAGGED_PROMPTS, params)
        assert again.tokens == first.tokens
        mal[cache] = again.stats.mean_accepted_length
    assert mal[4096] > mal[0] + 1, mal


@pytest.mark.parametrize("toggle", [False, True], ids=["sd", "toggle"])
def test_every_row_is_indexed_whole_when_its_generation_ends(make_engine, policy, toggle):
    """The engine calls a drafter at SD steps only: a row's last tokens (its final step's, and any after AR steps of
    the toggle) were never indexed, so the history and the prompt cache held truncated rollouts. At the end of a
    generation the suffix drafter takes every row's whole text: the index counts exactly prompt + response of each
    row."""
    prompts = [p for p in C.RAGGED_PROMPTS for _ in range(2)]
    eng = make_engine(policy, SuffixDrafter(32, max_ngram=3, min_ngram=1, history=0), k=3, drafter_int8=False,
                      toggle=toggle)
    b = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3))
    d = eng.drafter
    texts = [p + r for p, r in zip(prompts, b.tokens)]
    assert sorted(map(tuple, d.texts[-1].rows)) == sorted(map(tuple, texts))
    want = brute_counts(texts, 1, 3)
    for ctx, c in want.items():
        assert d.counts(ctx) == c, ctx


def test_a_hot_swap_keeps_the_index_and_timing_leaves_it_alone(make_engine, policy):
    """A hot-swap builds the engine's drafter afresh from its template: the new copy takes over the index (history
    and prompt cache), so the next generation still drafts the last one's text (before, it started empty). The cost
    model's timing calls (no prompts) draft on a scratch index: no synthetic generation enters the live one."""
    from drafttrain.engines.schedule import measure_costs

    eng = make_engine(policy, SuffixDrafter(32, history=1), k=3, drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    first = eng.generate(C.RAGGED_PROMPTS, params)
    old = eng.drafter
    kept = [g.id for g in old.texts]
    measure_costs(eng, 4, [], 3, repeats=2)
    assert [g.id for g in old.texts] == kept
    eng.load_drafter({}, 1)
    assert eng.drafter is not old and eng.drafter.texts is old.texts and eng.drafter.cache is old.cache
    again = eng.generate(C.RAGGED_PROMPTS, params)
    assert again.tokens == first.tokens
    assert again.stats.mean_accepted_length > first.stats.mean_accepted_length + 1
