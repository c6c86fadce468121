"""A drafter kind added from outside the package, in this one file plus one registration: a bigram table that
always drafts the most likely next token after the last one. It reads nothing from the policy's forward, is
served by the embedded engine, passes the lossless contract, and is trained and published through the tracker.
Its registration brings its config section (drafter.toy_bigram, with a checked key) and its checkpoint save and
load; it survives a kill and resume of the tracker; the vLLM engine refuses it in one line naming the kind.
It inherits TrainableDrafter for the contract's optional methods (their defaults: it needs none of them)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from drafttrain.config import ConfigError, key_docs, load_recipe
from drafttrain.drafters.base import save_drafter
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

    def ttt_loss(self, aux, next_ids, targets, valid, steps: int, decay: float, query_frac: float = 1.0,
                 generator=None, first_ids=None, objective=ttt.KL):
        """The shared TTT loss over its own ttt_logits: every train.loss and train.positions come with it."""
        return ttt.ttt_loss(self, aux, next_ids, targets, valid, steps, decay, query_frac, generator,
                            first_ids=first_ids, objective=objective)


class _LastToken:
    def __init__(self, last: torch.Tensor):
        self.last = last

    def select_rows(self, idx: torch.Tensor) -> None:
        self.last = self.last[idx]


@dataclass
class ToySection:  # drafter.toy_bigram: the toy kind's settings
    init_scale: float = 1.0  # std of a fresh table's logits (> 0)


def toy_checks(section):
    return [(section.init_scale > 0, "init_scale", f"must be > 0, got {section.init_scale}")]


def fresh(cfg, policy):
    d = BigramDrafter(policy.config.vocab_size)
    with torch.no_grad():
        d.table.mul_(cfg.toy_bigram.init_scale)
    return d


def save(d, path, verifier=None, k=None, extra=None):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({"table": d.table.detach().contiguous()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"drafttrain": {"kind": BigramDrafter.kind, "k": k}}))
    return path


def load(cfg, policy):
    d = BigramDrafter(policy.config.vocab_size)
    d.load_state_dict(load_file(str(Path(cfg.path) / "model.safetensors")))
    return d


@pytest.fixture(autouse=True)
def registered():
    register_drafter(BigramDrafter.kind, fresh, load, save=save, section=ToySection, checks=toy_checks)
    yield
    DRAFTERS.pop(BigramDrafter.kind)


def _toy(policy, seed: int = 0, *over):
    cfg = load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", "drafter.path=null", *over])
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


def test_toy_config_section_is_read_checked_and_documented(policy):
    small, big = _toy(policy, 0, "drafter.toy_bigram.init_scale=0.01"), _toy(policy, 0)
    assert float(small.table.detach().abs().max()) < 0.1 < float(big.table.detach().abs().max())  # reached the kind
    for bad, key in (("drafter.toy_bigram.init_scale=-1", "drafter.toy_bigram.init_scale"),
                     ("drafter.toy_bigram.nope=1", "drafter.toy_bigram.nope")):
        with pytest.raises(ConfigError) as e:
            load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", "drafter.path=null", bad])
        assert key in str(e.value) and "\n" not in str(e.value)
    assert key_docs()["drafter.toy_bigram.init_scale"] == (1.0, "std of a fresh table's logits (> 0)")


def test_toy_checkpoint_saves_and_loads_and_another_kind_is_refused(policy, tmp_path):
    toy = _toy(policy, 3)
    save_drafter(BigramDrafter.kind, toy, tmp_path / "toy", k=4)
    cfg = load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", f"drafter.path={tmp_path / 'toy'}"])
    assert torch.equal(build_drafter(cfg.drafter, policy).table, toy.table)
    cfg.drafter.path = "checkpoints/eagle3"  # an EAGLE-3 checkpoint is not a toy one: one line naming the key
    with pytest.raises(ValueError, match="drafter.path: .* holds a eagle3 drafter, not drafter.kind=toy_bigram"):
        build_drafter(cfg.drafter, policy)


def test_toy_tracker_resumes_exactly_after_a_kill(policy, tmp_path):
    """Tracker A updates, saves (state_dict + save_training), then updates again; a fresh tracker B loads the save,
    serves A's saved version, and its next update ends where A's did."""
    cfg = load_recipe("eagle3_track", [f"drafter.kind={BigramDrafter.kind}", "drafter.path=null",
                                       "engine.drafter_int8=false", "online.publish_gate=false",
                                       "online.budget_frac=0", "online.holdout_frac=0", "train.batch_size=4",
                                       "online.steps_per_update=5", "train.lr=0.1"])
    prompts = [[1, 5, 6], [2, 7], [3, 3, 9, 4], [8, 1]]

    def tracker(seed):
        toy = _toy(policy, seed)
        engine = _make(policy, toy, drafter_int8=False)
        return DraftTracker(cfg, policy, [engine], toy, log=lambda m: None), engine

    def update(tr, engine, step, seed):
        ro = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=seed), speculative=False)
        seqs = [p + t for p, t in zip(prompts, ro.tokens)]
        ids = torch.tensor([s[:min(map(len, seqs))] for s in seqs])
        with tr.capture(policy, response_start=2):
            policy(input_ids=ids)
        return tr.on_policy_update(policy, step)

    a, ea = tracker(0)
    update(a, ea, 0, seed=0)
    state = a.state_dict()
    a.save_training(tmp_path)
    saved = ea.drafter.table.clone()
    update(a, ea, 1, seed=1)
    b, eb = tracker(7)  # a new process: another fresh drafter until the state is loaded
    b.load_state_dict(state, tmp_path)
    assert b.version == 1 and torch.equal(eb.drafter.table, saved)
    update(b, eb, 1, seed=1)
    assert b.version == a.version == 2
    assert torch.equal(b.drafter.table, a.drafter.table) and torch.equal(eb.drafter.table, ea.drafter.table)


def test_toy_kind_is_refused_by_the_vllm_engine_in_one_line(policy):
    with pytest.raises(ValueError) as e:
        build_engine(engine_cfg(kind="vllm"), policy, _toy(policy))
    assert "toy_bigram" in str(e.value) and "embedded engine" in str(e.value) and "\n" not in str(e.value)
