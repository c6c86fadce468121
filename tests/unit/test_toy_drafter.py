"""A drafter kind added from outside the package, in this one file plus one registration: a bigram table that
always drafts the most likely next token after the last one. It reads nothing from the policy's forward, is
served by the embedded engine, passes the lossless contract, and is trained and published through the tracker.
It inherits TrainableDrafter for the contract's optional methods (their defaults: it needs none of them)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from drafttrain.config import load_recipe
from drafttrain.drafters import DRAFTERS, Reads, TrainableDrafter, build_drafter, register_drafter, ttt
from drafttrain.engines import build_engine
from drafttrain.spec import SamplingParams
from drafttrain.tracking.tracker import DraftTracker
from tests import contract as C
from tests.conftest import engine_cfg


class BigramDrafter(nn.Module, TrainableDrafter):
    kind = "toy_bigram"
    follows_policy = False
    trains = True
    reads = Reads()  # token ids only: no hidden states

    def __init__(self, vocab: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab))  # [V, V] next-token logits after each token

    # ---- serving (Drafter) ----
    def new_state(self, batch: int, max_len: int, prompts=None):
        return _LastToken(torch.zeros(batch, dtype=torch.long) if prompts is None else prompts[:, 0].clone())

    @torch.no_grad()
    def propose(self, state, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        has = n_new > 0
        last = new_ids.gather(1, (n_new - 1).clamp_min(0).view(-1, 1)).squeeze(1)  # [B]
        state.last = torch.where(has, last, state.last)
        drafts, tok = [], state.last
        for _ in range(k):
            tok = self.table[tok].argmax(-1)
            drafts.append(tok)
        return torch.stack(drafts, 1), None  # one-hot drafts

    # ---- training (TrainableDrafter) ----
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.table.shape[0])

    def ttt_logits(self, aux, next_ids, steps: int, queries=None, first_ids=None) -> list[torch.Tensor]:
        pos = torch.arange(aux.shape[1]) if queries is None else queries
        return [self.table[next_ids[:, pos + i]] for i in range(steps)]  # step i at t is fed token_{t+1+i}

    def ttt_loss(self, aux, next_ids, target_probs, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None, objective=ttt.KL):
        """The shared TTT loss over its own ttt_logits: every train.loss and train.positions come with it."""
        return ttt.ttt_loss(self, aux, next_ids, target_probs, valid, steps, decay, query_frac, generator,
                            first_ids=first_ids, objective=objective)


class _LastToken:
    def __init__(self, last: torch.Tensor):
        self.last = last

    def select_rows(self, idx: torch.Tensor) -> None:
        self.last = self.last[idx]


@pytest.fixture(autouse=True)
def registered():
    register_drafter(BigramDrafter.kind, lambda cfg, policy: BigramDrafter(policy.config.vocab_size))
    yield
    DRAFTERS.pop(BigramDrafter.kind)


def _toy(policy, seed: int = 0):
    cfg = load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", "drafter.path=null"])
    torch.manual_seed(seed)
    return build_drafter(cfg.drafter, policy)


def _make(policy, drafter=None, **kw):
    return build_engine(engine_cfg(**kw), policy, drafter)


def test_toy_drafter_is_lossless_in_the_embedded_engine(policy):
    C.greedy_sd_equals_ar(_make, policy, _toy(policy), drafter_int8=True)
    pol = C.tiny_vocab_policy(vocab=5)
    C.exact_distribution(_make, pol, _toy(pol, seed=1), SamplingParams(max_new_tokens=3, seed=11), n_rows=3000,
                         wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2, drafter_int8=False)


def test_toy_drafter_is_trained_and_published_by_the_tracker(policy):
    toy = _toy(policy)
    engine = _make(policy, toy, drafter_int8=False)
    cfg = load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", "drafter.path=null",
                                       "engine.drafter_int8=false", "online.publish_gate=false",
                                       "online.budget_frac=0", "online.holdout_frac=0", "train.batch_size=4",
                                       "online.steps_per_update=20", "train.lr=0.1"])
    tracker = DraftTracker(cfg, policy, [engine], toy, log=lambda m: None)
    assert not tracker.self_drafter
    before = toy.table.detach().clone()
    prompts = [[1, 5, 6], [2, 7], [3, 3, 9, 4], [8, 1]]
    ro = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=0), speculative=False)
    seqs = [p + t for p, t in zip(prompts, ro.tokens)]
    ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
    with tracker.capture(policy, response_start=2):
        policy(input_ids=ids)
    first = tracker.measure()["live_tf_mal"]
    out = tracker.on_policy_update(policy, 0)
    assert out["drafter_steps"] == 20 and out["published"] and not out["rolled_back"]
    assert engine.drafter_version == 1 == tracker.version
    assert not torch.equal(toy.table.detach(), before)  # trained
    torch.testing.assert_close(engine.drafter.table, toy.table.detach())  # the engine serves the trained table
    assert out["expected_mal"] > first  # teacher-forced on the rows it trained on: it learnt them
