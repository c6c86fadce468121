"""Draft vocabularies (drafters/vocab.py, tracking/vocab.py): the most frequent tokens, chosen deterministically; a
fresh EAGLE-3 drafter on a vocabulary larger than 32,000 drafts over 32,000 of them and takes its map from rollout
counts, once; a checkpoint keeps its map; restrict_draft_vocab keeps the logits of the tokens it keeps; kinds without
a draft vocabulary ignore it."""
from __future__ import annotations

import pytest
import torch

from drafttrain.drafters import build_drafter
from drafttrain.drafters.base import save_drafter
from drafttrain.drafters.eagle3 import restrict_draft_vocab
from drafttrain.drafters.speculators import load_drafter
from drafttrain.drafters.vocab import DEFAULT_DRAFT_VOCAB, coverage, draft_vocab, token_counts
from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams
from drafttrain.tracking.vocab import vocab_from_rollouts
from tests.conftest import engine_cfg, tiny_policy
from tests.unit.test_drafter import drafter_cfg, perturbed, rand_prompts


def test_draft_vocab_takes_the_most_frequent_ascending():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 3, 0])
    assert draft_vocab(counts, 3).tolist() == [1, 3, 5]  # 9, 7, 5: ascending ids
    assert draft_vocab(counts, 8).tolist() == list(range(8))
    assert draft_vocab(counts, 3, keep=[7]).tolist() == [3, 5, 7]  # the stop token, never seen, still draftable


def test_draft_vocab_ties_and_unseen_tokens_go_to_the_lowest_id():
    counts = torch.tensor([0, 2, 0, 2, 2, 0])
    assert draft_vocab(counts, 2).tolist() == [1, 3]  # three tied at 2: the lowest ids
    assert draft_vocab(counts, 5).tolist() == [0, 1, 2, 3, 4]  # then the unseen, lowest first
    # a second row breaks the first row's ties (the prompts' counts after the responses')
    assert draft_vocab(torch.stack([counts, torch.tensor([0, 0, 9, 0, 1, 0])]), 2).tolist() == [1, 4]
    assert draft_vocab(torch.stack([counts, torch.tensor([0, 0, 9, 0, 1, 0])]), 4).tolist() == [1, 2, 3, 4]
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 4, (1000,), generator=g)  # many ties
    a, b = draft_vocab(big, 300), draft_vocab(big.clone(), 300)
    assert torch.equal(a, b) and len(a) == 300 and torch.equal(a, a.sort().values) and len(a.unique()) == 300
    assert int(big[a].min()) >= int(big[~torch.isin(torch.arange(1000), a)].max())  # nothing left is more frequent


@pytest.mark.parametrize("size, keep, match", [(0, (), "draft_vocab_size"), (9, (), "draft_vocab_size"),
                                               (1, (1, 2), "keep"), (2, (8,), "keep")])
def test_draft_vocab_bad_input_is_one_line(size, keep, match):
    with pytest.raises(ValueError, match=match) as e:
        draft_vocab(torch.ones(8, dtype=torch.long), size, keep)
    assert "\n" not in str(e.value)


def test_token_counts_and_coverage():
    c = token_counts([[1, 2, 2], [], [2, 4]], 6, torch.device("cpu"))
    assert c.tolist() == [0, 1, 3, 0, 1, 0] and c.device.type == "cpu"
    assert coverage(c, torch.tensor([2, 4])) == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        token_counts([[6]], 6)


@pytest.fixture(scope="module")
def big_policy():
    """A random policy with a vocabulary larger than the default draft vocabulary."""
    return tiny_policy(vocab=40000, hidden=32, layers=4, heads=4, kv_heads=2, inter=64)


def test_fresh_drafter_on_a_large_vocabulary_drafts_over_32000_tokens(big_policy):
    d = build_drafter(drafter_cfg(), big_policy)
    assert d.config.draft_vocab_size == DEFAULT_DRAFT_VOCAB == 32_000 and d.lm_head.weight.shape[0] == 32_000
    assert d.needs_draft_vocab()
    counts = torch.zeros(40000, dtype=torch.long)
    counts[39_000:] = 5  # a thousand frequent tokens at the top of the vocabulary
    ids = d.set_draft_vocab(counts, keep=[2])
    assert torch.equal(d.draft_ids(), ids) and len(ids) == 32_000
    assert bool(d.t2d[39_000:].all()) and bool(d.t2d[2]) and int(d.t2d.sum()) == 32_000 and d.d2t.any()
    assert not d.needs_draft_vocab() and d.set_draft_vocab(torch.ones(40000), keep=[2]) is None  # fixed once chosen
    assert torch.equal(d.draft_ids(), ids)
    assert build_drafter(drafter_cfg(draft_vocab_size=1000), big_policy).config.draft_vocab_size == 1000


def test_a_vocabulary_no_larger_than_32000_is_drafted_whole(policy):
    d = build_drafter(drafter_cfg(), policy)
    assert d.config.draft_vocab_size == policy.config.vocab_size and not d.needs_draft_vocab()
    assert d.set_draft_vocab(torch.arange(32)) is None and torch.equal(d.draft_ids(), torch.arange(32))


@pytest.mark.parametrize("kind", ["mtp", "draft_model", "suffix"])
def test_kinds_without_a_draft_vocabulary_ignore_it(policy, kind):
    d = build_drafter(drafter_cfg(kind=kind), policy)
    assert not d.needs_draft_vocab() and d.set_draft_vocab(torch.arange(32)) is None


def test_auto_passes_the_counts_to_its_eagle3_member(policy):
    cfg = drafter_cfg(kind="auto", draft_vocab_size=20)
    cfg.auto.kinds, cfg.auto.paths = ["eagle3", "suffix"], [None, None]
    d = build_drafter(cfg, policy)
    assert d.needs_draft_vocab()
    ids = d.set_draft_vocab(torch.arange(32))  # the higher the id, the more frequent
    assert ids.tolist() == list(range(12, 32)) and torch.equal(d.members["eagle3"].draft_ids(), ids)
    assert not d.needs_draft_vocab()


def test_a_chosen_map_round_trips_through_the_export_and_drafter_path(tmp_path, policy):
    d = build_drafter(drafter_cfg(draft_vocab_size=20), policy)
    d.set_draft_vocab(torch.arange(32).flip(0), keep=[31])  # the lowest ids most frequent, and the stop token
    d = perturbed(d)
    save_drafter("eagle3", d, tmp_path / "e3", verifier="policy", k=3)
    back = load_drafter(tmp_path / "e3")
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d) and not back.needs_draft_vocab()
    assert back.draft_ids().tolist() == [*range(19), 31]
    for name, t in d.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    cfg = drafter_cfg(draft_vocab_size=None)
    cfg.path = str(tmp_path / "e3")
    loaded = build_drafter(cfg, policy)  # drafter.path: the checkpoint's own map, not chosen again
    assert not loaded.needs_draft_vocab() and torch.equal(loaded.draft_ids(), back.draft_ids())


def test_restrict_draft_vocab_keeps_the_kept_tokens_logits(policy, drafter):
    d = perturbed(drafter, seed=3).eval()
    ids = torch.tensor([0, 2, 3, 5, 8, 13, 21, 31])
    r = restrict_draft_vocab(d, ids)
    assert r.config.draft_vocab_size == 8 and torch.equal(r.draft_ids(), ids) and not r.needs_draft_vocab()
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 6, len(d.aux_layer_ids) * d.config.hidden_size, generator=g)
    nxt = torch.randint(0, 32, (2, 7), generator=g)
    with torch.no_grad():
        full, part = d.ttt_logits(aux, nxt, 2), r.ttt_logits(aux, nxt, 2)
    for a, b in zip(full, part):
        torch.testing.assert_close(b, a[..., ids])
    again = restrict_draft_vocab(r, ids[1:])  # a restricted drafter restricts further
    assert torch.equal(again.draft_ids(), ids[1:])
    with pytest.raises(ValueError, match="draft_ids") as e:
        restrict_draft_vocab(r, torch.tensor([1, 2]))  # 1 is not among r's tokens
    assert "\n" not in str(e.value)


def test_restricted_drafter_greedy_sd_equals_ar(policy, drafter):
    r = restrict_draft_vocab(drafter, torch.arange(0, 32, 2))
    prompts = rand_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    sd = build_engine(engine_cfg(kind="torch", k=3), policy, r).generate(prompts, params, speculative=True)
    ar = build_engine(engine_cfg(kind="torch"), policy).generate(prompts, params, speculative=False)
    assert sd.tokens == ar.tokens and sd.stats.drafted > 0


class _Engine:
    """Returns fixed responses and records what it was asked."""

    def __init__(self, responses):
        self.responses, self.calls = responses, []

    def generate(self, prompts, params, speculative=True):
        from types import SimpleNamespace

        self.calls.append((len(prompts), speculative))
        return SimpleNamespace(tokens=self.responses[:len(prompts)])


def test_vocab_from_rollouts_counts_plain_responses_then_prompts(policy):
    d = build_drafter(drafter_cfg(draft_vocab_size=4), policy)
    eng = _Engine([[7, 7, 9], [7, 2]])
    note = vocab_from_rollouts(d, eng, [[[11, 12], [12]]], SamplingParams(), 32, keep=[2])
    assert eng.calls == [(2, False)]  # plain (AR) rollouts
    assert d.draft_ids().tolist() == [2, 7, 9, 12]  # the stop token, 7 and 9, then 12 (the prompts' most frequent)
    assert "4 of the policy's 32 tokens" in note and "100.00%" in note and "\n" not in note
    eng.calls.clear()
    assert vocab_from_rollouts(d, eng, [[[1]]], SamplingParams(), 32) is None and not eng.calls  # chosen already


@pytest.mark.parametrize("ids", [[], [1, 1, 2], [0, 1, 32], [-1, 0, 1]])
def test_a_bad_vocab_map_is_one_line_naming_draft_ids(policy, ids):
    d = build_drafter(drafter_cfg(draft_vocab_size=3), policy)
    with pytest.raises(ValueError, match=r"^draft_ids: must be 3 distinct token ids in \[0, 32\)") as e:
        d.set_vocab_map(torch.tensor(ids, dtype=torch.long))
    assert "\n" not in str(e.value) and d.needs_draft_vocab()  # nothing was set
