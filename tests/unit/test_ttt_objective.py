"""The drafter loss aimed at acceptance (train.loss=tv | kl_tv) and the rejected-position draws (train.positions)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from drafttrain.drafters import TargetHead, Targets
from drafttrain.drafters.ttt import Objective, rejection, tv_loss
from drafttrain.train_config import check_train
from tests.conftest import dense_targets
from tests.unit.test_drafter import perturbed


def _inputs(d, B=2, T=9, steps=3, seed=0):
    c = d.config
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    next_ids = torch.randint(0, c.vocab_size, (B, T + steps - 1), generator=g)
    probs = torch.softmax(2 * torch.randn(B, T + steps, c.vocab_size, generator=g), -1)
    valid = torch.ones(B, T + steps, dtype=torch.bool)
    valid[1, T - 2:] = False  # a shorter second row
    return aux, next_ids, probs, valid


def test_tv_is_half_the_l1_distance_and_zero_at_the_target():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.3, 0.1, 0.4], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(tv_loss(p, q), 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(tv_loss(p, q), torch.tensor([0.4, 0.0]))  # by hand: |.3|+|.1|+|.4| over 2
    assert float(tv_loss(p, p).abs().max()) == 0.0


def test_tv_gradient_moves_q_toward_p_only_where_they_differ():
    """Per-position logits z [2, V]: at position 0 q = p already (zero gradient), at position 1 they differ: the
    gradient is not zero there, and a small step against it lowers the TV at 1 and leaves 0 where it was."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 6, generator=g)
    p = torch.stack([z[0].softmax(-1), torch.softmax(torch.randn(6, generator=g), -1)])
    z.requires_grad_(True)
    tv_loss(p, z.softmax(-1)).sum().backward()
    assert float(z.grad[0].abs().max()) < 1e-7
    assert float(z.grad[1].abs().max()) > 1e-3
    with torch.no_grad():
        before = tv_loss(p, z.softmax(-1))
        after = tv_loss(p, (z - 0.1 * z.grad).softmax(-1))
    assert float(after[1]) < float(before[1]) and abs(float(after[0] - before[0])) < 1e-6


@pytest.mark.parametrize("loss", ["tv", "kl_tv"])
def test_ttt_loss_through_the_unroll_is_the_decayed_mean_of_the_per_position_losses(drafter, loss):
    """The TV (and KL + w * TV) through the TTT unroll: step i's mean over valid positions of 1 - sum min(p, q),
    weighted decay**i, recomputed here from ttt_logits and the policy's distributions."""
    d = perturbed(drafter, 3)
    steps, decay, w = 3, 0.8, 0.7
    aux, next_ids, probs, valid = _inputs(d, steps=steps)
    T = aux.shape[1]
    got, _ = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, decay, objective=Objective(loss, w))
    kl, _ = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, decay)
    with torch.no_grad():
        logits = d.ttt_logits(aux, next_ids, steps)
    tv = sum(decay ** i * (tv_loss(probs[:, 1 + i:1 + i + T], lg.softmax(-1)) * valid[:, 1 + i:1 + i + T]).sum()
             / valid[:, 1 + i:1 + i + T].sum() for i, lg in enumerate(logits)) / sum(decay ** i for i in range(steps))
    want = tv if loss == "tv" else kl + w * tv
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=1e-5)
    assert 0.0 < float(tv) < 1.0


def test_hard_targets_tv_is_one_minus_the_rollout_tokens_probability(drafter):
    """MTP's hard loss under tv: 1 - q(x) for the rollout token x (the one-hot target's total variation)."""
    d = perturbed(drafter, 4)
    aux, next_ids, probs, valid = _inputs(d, steps=1)
    T = aux.shape[1]
    from drafttrain.drafters import ttt
    got, _ = ttt.ttt_loss(d, aux, next_ids, dense_targets(probs), valid, 1, 1.0, hard=True,
                          objective=Objective("tv"))
    with torch.no_grad():
        q = d.ttt_logits(aux, next_ids, 1)[0].softmax(-1)
    x = torch.cat([next_ids, next_ids.new_zeros(2, 1)], 1)[:, 1:1 + T]
    m = valid[:, 1:1 + T].float()
    want = ((1 - q.gather(-1, x.unsqueeze(-1)).squeeze(-1)) * m).sum() / m.sum()
    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-6)


def test_rejected_weights_equal_draws_in_proportion_to_the_rejection():
    """A fixed alpha vector and per-term losses: the rejected-weighted mean equals the mean loss of terms drawn in
    proportion to 1 - alpha. Checked against 20000 such draws (a z-test on their mean) and by a chi-square test that
    the draws were proportional; the uniform mean (what the weights replace) is far off, so the test can fail."""
    alpha = torch.tensor([0.95, 0.9, 0.5, 0.2, 0.7, 0.99])
    q = torch.stack([alpha, 1 - alpha], -1)  # a two-token vocab: p = (1, 0) is accepted with probability alpha
    p = torch.tensor([1.0, 0.0]).expand_as(q)
    m = torch.ones(len(alpha))
    r = rejection(p, q)
    w = r * m.sum() / (r * m).sum()  # ttt_loss's normalization: mean 1 over the valid terms
    torch.testing.assert_close(w, (1 - alpha) / (1 - alpha).mean())
    loss = torch.tensor([9.0, 1.2, 2.0, 0.3, 0.5, 4.0])
    weighted = float((loss * w).sum() / m.sum())
    g, n = torch.Generator().manual_seed(0), 20000
    drawn = torch.multinomial(1 - alpha, n, replacement=True, generator=g)
    counts = torch.bincount(drawn, minlength=len(alpha))
    assert chisquare(counts.tolist(), ((1 - alpha).double() / (1 - alpha).double().sum() * n).tolist()).pvalue > 1e-3
    mc = loss[drawn]
    assert abs(float(mc.mean()) - weighted) < 4 * float(mc.std()) / n ** 0.5
    assert abs(float(loss.mean()) - weighted) > 0.5


def test_rejected_positions_shift_the_loss_to_where_the_drafter_is_rejected(drafter):
    """The policy's distribution made the drafter's own at every target but a few (row, position) terms: under
    positions=rejected the loss (and its gradient) comes from those terms alone; uniform spreads it over all."""
    d = perturbed(drafter, 6)
    steps = 1
    aux, next_ids, _, valid = _inputs(d, steps=steps)
    valid[:] = True
    T = aux.shape[1]
    with torch.no_grad():
        q = d.ttt_logits(aux, next_ids, 1)[0].softmax(-1)  # [B, T, V]: position t scores target t+1
    probs = torch.full((2, T + steps, q.shape[-1]), 1.0 / q.shape[-1])
    probs[:, 1:T + 1] = q
    far = [(0, 2), (1, 6)]
    for b, t in far:
        probs[b, 1 + t] = q[b, t].flip(-1)  # far from q there
    obj = Objective(loss="tv", positions="rejected")
    got, _ = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, 1.0, objective=obj)
    tv_far = torch.stack([tv_loss(probs[b, 1 + t], q[b, t]) for b, t in far])
    # the weights: tv / mean tv over all 2T terms, the terms: tv -> sum tv^2 / sum tv over the 2T terms' mean
    want = (tv_far ** 2).sum() / tv_far.sum()
    torch.testing.assert_close(got.detach(), want, atol=1e-4, rtol=1e-4)
    uniform, _ = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, 1.0, objective=Objective(loss="tv"))
    torch.testing.assert_close(uniform.detach(), tv_far.sum() / (2 * T), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("section,key", [
    (dict(loss="l2"), "train.loss"),
    (dict(loss="kl_tv", tv_weight=-1.0), "train.tv_weight"),
    (dict(positions="worst"), "train.positions"),
])
def test_trainer_sections_that_skip_the_config_are_checked_in_one_line(section, key):
    """DrafterTrainer checks its section itself (scripts and probes build one without config.validate)."""
    with pytest.raises(ValueError) as e:
        check_train(SimpleNamespace(**section))
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "draft_model"])
def test_every_trainable_kind_trains_on_each_objective(make_engine, policy, kind):
    """EAGLE-3, MTP (hard targets: 1 - q(x)) and the draft model take every objective through their ttt_loss: a
    finite loss with gradient; tv in (0, 1); kl_tv = kl + w * tv above kl."""
    from tests import contract as C
    from drafttrain.tracking import teacher_forced_features

    d = C.fresh_drafter(policy, seed=1, kind=kind)
    prompts, resp = C.rollouts(make_engine, policy, n=4)
    f = teacher_forced_features(policy, prompts, resp, d.reads, 2)
    args = (f["aux"], f["next_ids"], Targets(f["hidden"], TargetHead.of(policy)), f["valid"], 2, 0.8)
    with torch.no_grad():
        kl, _ = d.ttt_loss(*args, first_ids=f["first_ids"])
    for obj in (Objective("tv"), Objective("kl_tv", 0.5), Objective("kl", positions="rejected")):
        d.zero_grad()
        loss, _ = d.ttt_loss(*args, first_ids=f["first_ids"], objective=obj)
        loss.backward()
        assert torch.isfinite(loss)
        assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in d.parameters())
        if obj.loss == "tv":
            assert 0.0 < float(loss.detach()) < 1.0
        if obj.loss == "kl_tv":
            assert float(loss.detach()) > float(kl)


def test_the_full_depth_draft_model_has_no_tv_and_no_kl_gradient_under_either_positions(make_engine, policy):
    """The policy as its own draft model: q = p everywhere, so the TV is 0, and the KL has no gradient, under uniform
    or rejected weights alike (they reweigh terms whose gradients are all 0). The TV's own subgradient does not
    vanish where q and p differ by rounding alone (|p - q| has a kink at 0), so it is not checked here."""
    from tests import contract as C
    from drafttrain.tracking import teacher_forced_features

    d = C.fresh_drafter(policy, seed=1, kind="draft_model", layers=policy.config.num_hidden_layers)
    prompts, resp = C.rollouts(make_engine, policy, n=4)
    f = teacher_forced_features(policy, prompts, resp, d.reads, 2)
    args = (f["aux"], f["next_ids"], Targets(f["hidden"], TargetHead.of(policy)), f["valid"], 2, 0.8)
    with torch.no_grad():
        tv, _ = d.ttt_loss(*args, first_ids=f["first_ids"], objective=Objective("tv"))
    assert abs(float(tv)) < 1e-4
    for obj in (Objective("kl"), Objective("kl", positions="rejected")):
        d.zero_grad()
        d.ttt_loss(*args, first_ids=f["first_ids"], objective=obj)[0].backward()
        assert max(float(p.grad.abs().max()) for p in d.parameters() if p.grad is not None) < 1e-3, obj
