"""train.score_grad=false: the attention scores are constants in drafter training (q_proj, k_proj frozen, no
gradient into the layer's input through them); the forward is unchanged."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.tracking import DrafterTrainer, FeatureBuffer
from drafttrain.tracking.capture import teacher_forced_features


def _cfg(kind="eagle3", score_grad=False):
    c = OmegaConf.structured(Config)
    c.drafter.kind, c.drafter.path, c.drafter.ttt_steps = kind, None, 2
    c.train.score_grad, c.train.query_frac, c.train.lr = score_grad, 0.5, 1e-2
    return c


def _loaded(c):
    """c's drafter settings as for a drafter loaded from drafter.path (the trainer reads only that it is set)."""
    d = c.drafter.copy()
    d.path = "checkpoints/eagle3"
    return d


def _batch(policy, drafter, n=4):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 32, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    resp = [torch.randint(4, 32, (8 + 2 * i,), generator=g).tolist() for i in range(n)]
    buf = FeatureBuffer(1 << 30)
    buf.add(teacher_forced_features(policy, prompts, resp, drafter.reads, 2))
    return buf.sample(n)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_frozen_scores_train_everything_but_q_and_k(policy, kind):
    c = _cfg(kind)
    torch.manual_seed(1)
    d = build_drafter(c.drafter, policy)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    tr = DrafterTrainer(d, c.train, _loaded(c), head=TargetHead.of(policy))
    a = d.layers[0].self_attn
    assert not any(p is a.q_proj.weight or p is a.k_proj.weight for p in tr.params)
    batch = _batch(policy, d)
    for _ in range(2):
        out = tr.step(batch)
        assert not out["nonfinite"]
    after = d.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    qk = {k for k in before if "q_proj" in k or "k_proj" in k}
    assert qk and not moved & qk
    assert {k for k in before if "v_proj" in k or "o_proj" in k or k.startswith("fc")} <= moved


def test_frozen_scores_carry_no_gradient_and_keep_the_forward(policy):
    c = _cfg()
    torch.manual_seed(2)
    d = build_drafter(c.drafter, policy)
    b = _batch(policy, d)
    args = (b["aux"], b["next_ids"], 2, torch.tensor([2, 5, 7]))
    a = d.layers[0].self_attn
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad)) for m in (a.q_proj, a.k_proj)]
    ref = d.ttt_logits(*args)
    assert seen and all(seen)  # before: the scores pass gradient
    seen.clear()
    d.freeze_scores()
    got = d.ttt_logits(*args)
    assert seen and not any(seen)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    for h in hooks:
        h.remove()


def test_kinds_without_attention_scores_train_as_usual(policy):
    """A draft model (no chain layer) under a recipe that holds the scores constant: every weight still trains (the
    recipe's setting once refused it, so eagle3_track with drafter.kind=draft_model did not start)."""
    c = _cfg("draft_model")
    torch.manual_seed(4)
    d = build_drafter(c.drafter, policy)
    tr = DrafterTrainer(d, c.train, _loaded(c), head=TargetHead.of(policy))
    assert len(tr.params) == len([p for p in d.parameters() if p.requires_grad]) > 0


def test_a_fresh_drafter_trains_its_attention_whatever_score_grad_says(policy):
    """drafter.path null: a fresh drafter, whose attention would stay at its random init if frozen."""
    c = _cfg()
    torch.manual_seed(3)
    d = build_drafter(c.drafter, policy)
    tr = DrafterTrainer(d, c.train, c.drafter, head=TargetHead.of(policy))
    a = d.layers[0].self_attn
    assert d.score_grad and any(p is a.q_proj.weight for p in tr.params)
    q0 = a.q_proj.weight.detach().clone()
    tr.step(_batch(policy, d))
    assert not torch.equal(q0, a.q_proj.weight)
