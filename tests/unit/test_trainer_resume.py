"""DrafterTrainer resume is exact with train.query_frac < 1: the query positions' generator is saved and restored,
under every train.loss and train.positions."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config
from drafttrain.tracking import DrafterTrainer, FeatureBuffer
from drafttrain.tracking.capture import teacher_forced_features

STEPS = 2


def _trainer(policy, query_frac, loss="kl", positions="uniform"):
    from drafttrain.drafters import TargetHead, build_drafter

    c = OmegaConf.structured(Config)
    c.drafter.path, c.drafter.ttt_steps, c.train.query_frac = None, STEPS, query_frac
    c.train.loss, c.train.positions = loss, positions
    torch.manual_seed(1)
    d = build_drafter(c.drafter, policy)
    return DrafterTrainer(d, c.train, c.drafter, buffer=FeatureBuffer(1 << 30, seed=0), head=TargetHead.of(policy))


def _batch(policy, drafter, n=4):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 32, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    resp = [torch.randint(4, 32, (8 + 2 * i,), generator=g).tolist() for i in range(n)]
    buf = FeatureBuffer(1 << 30)
    buf.add(teacher_forced_features(policy, prompts, resp, drafter.aux_layer_ids, STEPS))
    return buf.sample(n)


@pytest.mark.parametrize("loss,positions", [("kl", "uniform"), ("tv", "uniform"), ("kl_tv", "uniform"),
                                            ("kl", "rejected"), ("tv", "rejected")])
def test_resume_draws_the_same_query_positions(policy, tmp_path, loss, positions):
    tr = _trainer(policy, 0.25, loss, positions)
    batch = _batch(policy, tr.drafter)
    tr.step(batch)
    tr.save(tmp_path / "trainer.pt")
    tr.step(batch)  # the uninterrupted run's next update

    tr2 = _trainer(policy, 0.25, loss, positions)  # a fresh process: its generator starts from the seed
    tr2.load(tmp_path / "trainer.pt")
    tr2.step(batch)
    ref, got = tr.drafter.state_dict(), tr2.drafter.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    moved = _trainer(policy, 0.25, loss, positions).drafter.state_dict()  # the updates changed the drafter
    assert any(not torch.equal(ref[k], moved[k]) for k in ref)


def test_state_without_generator_still_loads(policy, tmp_path):
    tr = _trainer(policy, 0.25)
    tr.step(_batch(policy, tr.drafter))
    tr.save(tmp_path / "trainer.pt")
    state = torch.load(tmp_path / "trainer.pt", weights_only=False)
    del state["ttt_gen"]  # as written before the generator was saved
    torch.save(state, tmp_path / "old.pt")
    tr2 = _trainer(policy, 0.25)
    before = tr2.ttt.gen.get_state()
    tr2.load(tmp_path / "old.pt")
    assert tr2.step_count == 1 and torch.equal(tr2.ttt.gen.get_state(), before)
