"""The drafter's targets recomputed from the policy's final hidden state (drafters/targets.py), against the dense
full-vocabulary distributions the features used to store: the same numbers, the same loss and gradients, in one
piece or in chunks of positions."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config
from drafttrain.drafters import TargetHead, Targets, build_drafter, targets as targets_mod
from drafttrain.drafters.ttt import Objective
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.capture import teacher_forced_features
from tests.conftest import tiny_policy

STEPS = 3


@pytest.fixture(scope="module")
def world():
    """A tiny policy (vocabulary 40), a fresh EAGLE-3 drafter over a draft vocabulary of its 24 most frequent tokens
    (not the identity map), and features of random rollouts."""
    policy = tiny_policy(vocab=40, hidden=32, layers=4, heads=4, kv_heads=2, inter=64, seed=3)
    cfg = OmegaConf.structured(Config).drafter
    cfg.path, cfg.ttt_steps = None, STEPS
    cfg.eagle3.draft_vocab_size = 24
    torch.manual_seed(5)
    d = build_drafter(cfg, policy)
    g = torch.Generator().manual_seed(0)
    d.set_vocab_map(torch.randperm(40, generator=g)[:24])
    prompts = [torch.randint(0, 40, (3 + i % 3,), generator=g).tolist() for i in range(5)]
    resp = [torch.randint(0, 40, (7 + 3 * i,), generator=g).tolist() for i in range(5)]
    f = teacher_forced_features(policy, prompts, resp, d.reads, STEPS + 2)
    return policy, d, f


def dense(policy, f) -> torch.Tensor:
    """[B, T+s, V]: what build_features stored before, softmax of the full logits, zero past the rows."""
    with torch.no_grad():
        p = policy.get_output_embeddings()(f["hidden"]).softmax(-1) * (f["hidden"].abs().sum(-1, keepdim=True) > 0)
    pad = f["valid"].shape[1] - p.shape[1]
    return torch.cat([p, p.new_zeros(p.shape[0], pad, p.shape[2])], 1)


def old_loss(drafter, f, target_probs, objective, query_frac=1.0, gen=None, hard=False):
    """The dense loss as it was computed before targets were recomputed (the reference)."""
    from drafttrain.drafters.ttt import query_positions, tv_loss

    aux, next_ids, valid = f["aux"], f["next_ids"], f["valid"]
    T, ids = aux.shape[1], drafter.draft_ids()
    S = query_positions(valid, T, query_frac, gen)
    logits = drafter.ttt_logits(aux, next_ids, STEPS, S)
    nxt = torch.cat([next_ids, next_ids.new_zeros(next_ids.shape[0], 1)], 1)
    use_kl, use_tv = objective.loss in ("kl", "kl_tv"), objective.loss in ("tv", "kl_tv")
    weigh = objective.positions == "rejected"
    tv_w = 1.0 if objective.loss == "tv" else float(objective.tv_weight)
    total, wsum, decay = 0.0, 0.0, 0.8
    for i, lg in enumerate(logits):
        at = slice(1 + i, 1 + i + T) if S is None else 1 + i + S
        m = valid[:, at].float()
        lp = lg.log_softmax(-1)
        q = lp.exp()
        p = target_probs[:, at].float()[..., ids]
        if hard:
            t2d = torch.full((target_probs.shape[-1],), -1, dtype=torch.long)
            t2d[ids] = torch.arange(len(ids))
            d = t2d[nxt[:, at]]
            m = m * (d >= 0).float()
            lpx = lp.gather(-1, d.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            per = (-lpx if use_kl else 0.0) + (tv_w * (1.0 - lpx.exp()) if use_tv else 0.0)
        else:
            per = 0.0
            if use_kl:
                per = -((p / p.sum(-1, keepdim=True).clamp_min(1e-8)) * lp).sum(-1)
            if use_tv:
                per = per + tv_w * tv_loss(p, q)
        w = m
        if weigh:
            r = tv_loss(p, q).detach().clamp_min(0.0)
            w = m * r * m.sum().clamp_min(1.0) / (r * m).sum().clamp_min(1e-12)
        total = total + (decay ** i) * (per * w).sum() / m.sum().clamp_min(1.0)
        wsum += decay ** i
    return total / wsum


def test_targets_are_the_full_softmax_restricted_to_the_draft_vocabulary(world, monkeypatch):
    policy, d, f = world
    head, ids = TargetHead.of(policy), d.draft_ids()
    full = dense(policy, f)  # [B, T+s, V]
    T = f["hidden"].shape[1]
    at = torch.arange(1, T)
    for chunk in (targets_mod.CHUNK, 7):  # one piece, and chunks of a few positions
        monkeypatch.setattr(targets_mod, "CHUNK", chunk)
        t = Targets(f["hidden"], head)
        real = f["valid"][:, at]  # padding positions are masked wherever targets are read
        p = full[:, at][..., ids]
        torch.testing.assert_close(t.probs(at, ids)[real], p[real], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(t.draft_probs(at, ids)[real], (p / p.sum(-1, keepdim=True))[real], atol=1e-6,
                                   rtol=1e-5)
        x = f["next_ids"][:, at]
        px = full[:, at].gather(-1, x.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(t.token_probs(at, x)[real], px[real], atol=1e-6, rtol=1e-5)
    assert real.sum() > 40 and (t.probs(at, ids)[real].sum(-1) < 1 - 1e-3).any()  # not renormalized


@pytest.mark.parametrize("loss, positions", [("kl", "uniform"), ("tv", "uniform"), ("kl_tv", "rejected")])
@pytest.mark.parametrize("chunk", [None, 50])
def test_loss_and_gradients_equal_the_dense_targets(world, monkeypatch, loss, positions, chunk):
    """The new loss (targets recomputed, head and loss in chunks of positions, each recomputed in the backward when
    there are several) equals the loss on stored dense distributions, value and every gradient."""
    policy, d, f = world
    if chunk is not None:
        monkeypatch.setattr(targets_mod, "CHUNK", chunk)
    obj = Objective(loss=loss, tv_weight=0.5, positions=positions)
    d.zero_grad()
    new, _ = d.ttt_loss(f["aux"], f["next_ids"], Targets(f["hidden"], TargetHead.of(policy)), f["valid"], STEPS,
                        0.8, query_frac=0.5, generator=torch.Generator().manual_seed(1), objective=obj)
    new.backward()
    g_new = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    ref = old_loss(d, f, dense(policy, f), obj, query_frac=0.5, gen=torch.Generator().manual_seed(1))
    ref.backward()
    g_ref = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-5)
    assert g_new.keys() == g_ref.keys() and g_new
    for n in g_ref:
        torch.testing.assert_close(g_new[n], g_ref[n], atol=1e-6, rtol=1e-4, msg=n)


def test_mtp_hard_targets_equal_the_dense_loss(world, monkeypatch):
    policy, _, f = world
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path, cfg.ttt_steps = "mtp", None, STEPS
    torch.manual_seed(2)
    m = build_drafter(cfg, policy)
    monkeypatch.setattr(targets_mod, "CHUNK", 60)
    obj = Objective(loss="kl", positions="rejected")
    fm = teacher_forced_features(policy, [[1, 2, 3]] * 2, [[4, 5, 6, 7, 8, 9]] * 2, m.reads, STEPS + 2)
    new, _ = m.ttt_loss(fm["aux"], fm["next_ids"], Targets(fm["hidden"], TargetHead.of(policy)), fm["valid"],
                        STEPS, 0.8, objective=obj)
    ref = old_loss(m, fm, dense(policy, fm), obj, hard=True)
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-5)


def test_acceptance_is_the_same_in_chunks(world, monkeypatch):
    """Teacher-forced acceptance reads q(x) and p(x) a chunk of positions at a time: the chunk size changes
    nothing."""
    policy, d, f = world
    head = TargetHead.of(policy)
    one = teacher_forced_acceptance(d, f, STEPS, head)
    monkeypatch.setattr(targets_mod, "CHUNK", 30)
    many = teacher_forced_acceptance(d, f, STEPS, head)
    assert math.isclose(one["mal"], many["mal"], rel_tol=1e-6) and one["mal"] > 1.0
    torch.testing.assert_close(one["row_mal"], many["row_mal"])


def test_head_rows_are_cached_per_vocabulary(world):
    policy, d, _ = world
    head = TargetHead.of(policy)
    ids = d.draft_ids()
    a, b = head.rows(ids, "cpu"), head.rows(ids.clone(), "cpu")
    assert a is b and a.shape == (24, 32)  # the same rows, gathered once
    assert head.rows(torch.arange(40), "cpu") is head.rows(None, "cpu")  # the whole vocabulary: no gather
    policy.get_output_embeddings().weight.data.add_(1.0)
    try:
        assert not torch.equal(head.weight, policy.get_output_embeddings().weight)  # a snapshot, not a view
    finally:
        policy.get_output_embeddings().weight.data.sub_(1.0)
