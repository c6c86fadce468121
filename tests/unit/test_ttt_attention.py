"""The TTT unroll's chunked attention (drafters/ttt_attention.py): the same loss, logits and gradients as the dense
form it replaced (kept here as the reference), with one chunk or several (checkpointed), and no T x T tensor on a
long row."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from drafttrain.config import Config
from drafttrain.drafters import build_drafter, chain
from drafttrain.drafters import ttt_attention as ta
from tests.conftest import dense_targets, tiny_policy


def dense_attention(q, k0, v0, ks, vs, queries=None):
    """The dense form ChainDrafter.ttt_logits ran before: a [T, T] mask and [B, Hq, S, T] scores per step."""
    T, rep = k0.shape[2], q.shape[1] // k0.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if queries is not None:
        causal = causal[queries]  # [S, T]
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)  # [B, Hq, T, D]
    ks, vs = [k.repeat_interleave(rep, 1) for k in ks], [v.repeat_interleave(rep, 1) for v in vs]  # [B, Hq, S, D]
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, Hq, S, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * kj).sum(-1) * scale).unsqueeze(-1) for kj in ks]  # each [B, Hq, S, 1]
    p = torch.cat([s0, *diag], -1).softmax(-1)
    o = p[..., :T] @ v0
    for j, vj in enumerate(vs):
        o = o + p[..., T + j:T + j + 1] * vj
    return o


def make_drafter(kind="eagle3", hidden=64, max_pos=256, seed=1):
    """A random chain drafter (GQA: 4 query heads over 2 KV heads), every weight moved off its init."""
    policy = tiny_policy(hidden=hidden, max_pos=max_pos)
    cfg = OmegaConf.structured(Config).drafter
    cfg.kind, cfg.path = kind, None
    torch.manual_seed(seed)
    d = build_drafter(cfg, policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    assert d.config.num_attention_heads > d.config.num_key_value_heads
    return d


def ttt_inputs(d, B, T, steps, seed=0):
    """(aux, next_ids, targets, valid) for ttt_loss, random."""
    c = d.config
    g = torch.Generator().manual_seed(seed)
    X = len(getattr(c, "aux_layer_ids", [0])) * c.hidden_size  # EAGLE-3: its aux layers; MTP: the final state
    aux = torch.randn(B, T, X, generator=g)
    ids = torch.randint(0, c.vocab_size, (B, T + steps - 1), generator=g)
    probs = torch.softmax(3 * torch.randn(B, T + steps, c.vocab_size, generator=g), -1)
    return aux, ids, dense_targets(probs), torch.ones(B, T + steps, dtype=torch.bool)


class Spy:
    """Counts torch.utils.checkpoint.checkpoint calls made by ttt_attention."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = ta.checkpoint

        def spy(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(ta, "checkpoint", spy)


def loss_and_grads(d, x, steps, query_frac, attention, monkeypatch):
    monkeypatch.setattr(chain, "ttt_attention", attention)
    d.zero_grad(set_to_none=True)
    loss, _ = d.ttt_loss(*x, steps, 0.8, query_frac=query_frac, generator=torch.Generator().manual_seed(3))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("query_frac", [1.0, 0.4])
@pytest.mark.parametrize("max_scores", [ta.MAX_SCORES, 700])
def test_same_loss_and_gradients_as_dense(monkeypatch, kind, steps, query_frac, max_scores):
    """max_scores=700 over B=2 rows of T=40 with 4 heads: 2 queries a chunk, ~20 checkpointed chunks a step."""
    d = make_drafter(kind)
    x = ttt_inputs(d, 2, 40, steps)
    ref_loss, ref = loss_and_grads(d, x, steps, query_frac, dense_attention, monkeypatch)
    spy = Spy(monkeypatch)
    loss, got = loss_and_grads(d, x, steps, query_frac, functools.partial(ta.ttt_attention, max_scores=max_scores),
                               monkeypatch)
    assert (spy.calls > steps) == (max_scores < ta.MAX_SCORES)  # several chunks: checkpointed; one: not
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert got.keys() == ref.keys() and len(got) == sum(p.requires_grad for p in d.parameters())
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def test_frozen_scores_same_gradients_as_dense(monkeypatch):
    """freeze_scores: q and k carry no gradient; the chunked, checkpointed form still trains v and the rest alike."""
    d = make_drafter()
    d.freeze_scores()
    x = ttt_inputs(d, 2, 30, 2)
    _, ref = loss_and_grads(d, x, 2, 0.5, dense_attention, monkeypatch)
    _, got = loss_and_grads(d, x, 2, 0.5, functools.partial(ta.ttt_attention, max_scores=500), monkeypatch)
    a = d.layers[0].self_attn
    assert a.q_proj.weight.grad is None and a.k_proj.weight.grad is None
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def test_no_grad_chunks_equal_dense_and_skip_checkpoint(monkeypatch):
    """The acceptance scorer's call (no_grad, queries from a start position on): the same logits, no checkpoint."""
    d = make_drafter().eval()
    aux, ids, _, _ = ttt_inputs(d, 3, 33, 3)
    spy = Spy(monkeypatch)
    for queries in (None, torch.arange(7, 33)):
        with torch.no_grad():
            monkeypatch.setattr(chain, "ttt_attention", dense_attention)
            ref = d.ttt_logits(aux, ids, 3, queries)
            monkeypatch.setattr(chain, "ttt_attention", functools.partial(ta.ttt_attention, max_scores=600))
            got = d.ttt_logits(aux, ids, 3, queries)
        for r, g in zip(ref, got):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert spy.calls == 0


class Largest(TorchDispatchMode):
    """The largest numel of any tensor an op produces while active (forward, backward, recompute)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(d, T, attention, monkeypatch, steps=2):
    monkeypatch.setattr(chain, "ttt_attention", attention)
    x = ttt_inputs(d, 1, T, steps)
    d.zero_grad(set_to_none=True)
    with Largest() as m:
        loss, _ = d.ttt_loss(*x, steps, 0.8)
        loss.backward()
    assert all(p.grad is not None for p in d.parameters() if p.requires_grad)
    return m.numel


def test_long_row_never_materializes_t_by_t(monkeypatch):
    """One row of T=4096, forward + backward: no tensor reaches T*T/8 elements (scores capped at 2**19 a chunk).
    The dense form does (its mask alone is T*T), shown at T=512 to keep the test short."""
    T = 4096
    d = make_drafter(max_pos=T + 8)
    spy = Spy(monkeypatch)
    chunked = functools.partial(ta.ttt_attention, max_scores=2 ** 19)
    assert largest_tensor(d, T, chunked, monkeypatch) < T * T // 8
    assert spy.calls > 2 * 2
    t = 512
    assert largest_tensor(d, t, dense_attention, monkeypatch) >= t * t // 8


def test_chunks_hold_at_most_max_scores(monkeypatch):
    """Every chunk's score tensor [B, Hq, C, Tc] stays within max_scores, and chunks read only the keys up to their
    last query."""
    seen = []
    real = ta._chunk

    def record(q, k0, v0, ks, vs, qpos):
        B, G, r, C, _ = q.shape
        seen.append((B * G * r * C * k0.shape[2], k0.shape[2], int(qpos[-1])))
        return real(q, k0, v0, ks, vs, qpos)

    monkeypatch.setattr(ta, "_chunk", record)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 20, 8, generator=g)
    k0, v0 = torch.randn(2, 2, 50, 8, generator=g), torch.randn(2, 2, 50, 8, generator=g)
    queries = torch.tensor(sorted(torch.randperm(50, generator=g)[:20].tolist()))
    ref = dense_attention(q, k0, v0, [], [], queries)
    got = ta.ttt_attention(q, k0, v0, [], [], queries, max_scores=1200)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert len(seen) == 7 and all(n <= 1200 and tc == last + 1 for n, tc, last in seen)
