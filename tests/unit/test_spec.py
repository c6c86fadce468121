"""spec/: processed_probs, rejection_sample and SpecStats, with no model at all.

Losslessness is checked statistically: one batched rejection_sample call over ~200k rows that share the same
(p, q), then a chi-square test of the emitted tokens against the exact target distribution at significance 1e-3.
Negative controls show the same test rejects a wrong distribution (so it has power), and a mutant rejection
sampler that resamples from q instead of the residual is caught.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from drafttrain.spec import (SamplingParams, SpecStats, draft_chain, expected_acceptance, processed_probs,
                             rejection_sample, sample)

ALPHA = 1e-3  # "matches" means the chi-square p-value is above this
N = 200_000


# ---- helpers -----------------------------------------------------------------------------------------------

def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """samples [n] token ids, probs [V] exact distribution -> chi-square p-value.

    Tokens with zero probability must never appear (asserted); categories with expected count < 5 are pooled."""
    samples = samples.long().flatten()
    V = probs.numel()
    counts = torch.bincount(samples, minlength=V).double().numpy()
    p = probs.double().numpy()
    zero = p <= 0
    assert counts[zero].sum() == 0, f"sampled a zero-probability token: counts {counts[zero]}"
    n = counts.sum()
    exp = p * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & ~zero).any():
        obs_b.append(counts[~big & ~zero].sum())
        exp_b.append(exp[~big & ~zero].sum())
    exp_b = np.array(exp_b)
    exp_b *= n / exp_b.sum()  # guard float drift
    if len(obs_b) < 2:
        return 1.0
    return float(chisquare(obs_b, exp_b).pvalue)


def random_pq(V: int, k: int, seed: int, sharp: float = 1.5):
    """Random target logits [k+1, V] and draft logits [k, V] (correlated, so acceptance is neither 0 nor 1)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(k + 1, V, generator=g) * sharp
    lq = lp[:k] + torch.randn(k, V, generator=g) * sharp
    return lp, lq


def run_sd(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int, draft_dist: torch.Tensor | None = None):
    """p [k+1, V], q [k, V] shared by n rows; drafts drawn from q (or draft_dist) -> (tokens, num_accepted, d)."""
    k1, V = p.shape
    k = k1 - 1
    g = torch.Generator().manual_seed(seed)
    src = draft_dist if draft_dist is not None else q
    d = torch.multinomial(src, n, replacement=True, generator=g).T.contiguous()  # [n, k]
    P = p.unsqueeze(0).expand(n, k1, V)
    Q = None if q is None else q.unsqueeze(0).expand(n, k, V)
    tokens, na = rejection_sample(P, Q, d, generator=g)
    return tokens, na, d


def mutant_resample_from_q(target_probs, draft_probs, draft_tokens, generator):
    """A wrong sampler (the classic bug): on rejection draw from q_n instead of norm(max(0, p_n - q_n))."""
    B, k1, V = target_probs.shape
    k = k1 - 1
    d = draft_tokens.unsqueeze(-1)
    p_d = target_probs[:, :k].gather(-1, d).squeeze(-1)
    q_d = draft_probs.gather(-1, d).squeeze(-1)
    u = torch.rand(B, k, generator=generator)
    n = (u * q_d < p_d).long().cumprod(-1).sum(-1)
    q_ext = torch.cat([draft_probs, target_probs[:, k:]], 1)  # bonus still from p_k
    dist = q_ext.gather(1, n.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    first = torch.where(n > 0, draft_tokens[:, 0], last)
    return first, n


# ---- rejection_sample: losslessness --------------------------------------------------------------------------

PARAMS = {
    "T1": SamplingParams(),
    "T0.7": SamplingParams(temperature=0.7),
    "topk3": SamplingParams(top_k=3),
    "topp0.8": SamplingParams(top_p=0.8),
    "T0.7_topk5_topp0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_emitted_tokens_follow_target(name):
    params = PARAMS[name]
    V, k = 7, 3
    lp, lq = random_pq(V, k, seed=list(PARAMS).index(name))
    p, q = processed_probs(lp, params), processed_probs(lq, params)
    tokens, na, _ = run_sd(p, q, N, seed=1)
    # position 0 always emitted: ~ p_0
    assert chi2_pvalue(tokens[:, 0], p[0]) > ALPHA
    # position i is emitted iff drafts 0..i-1 were accepted; then it is a fresh SD step: ~ p_i
    for i in range(1, k + 1):
        rows = na >= i
        assert rows.sum() > 1000, "too few rows reach this position for a meaningful test"
        assert chi2_pvalue(tokens[rows, i], p[i]) > ALPHA, f"position {i}"


def test_sample_follows_the_weights():
    # the exponential race every engine and drafter draws with: exact for unnormalized weights, never a zero weight
    g = torch.Generator().manual_seed(7)
    w = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 2.0, 0.01, 0.0])  # sums to 6.51, not 1
    draws = sample(w.expand(N, -1), g)
    assert draws.shape == (N,)
    assert chi2_pvalue(draws, w / w.sum()) > ALPHA
    wrong = w.clone()
    wrong[4] = 0.55  # power: a distribution 10% off on one token is rejected on the same draws
    assert chi2_pvalue(draws, wrong / wrong.sum()) < ALPHA


def test_draft_chain_draws_each_position_afresh():
    # a drafter's k chained draws share one call's race noise: each position must still follow its own
    # distribution, independently of the others (noise reused across positions would repeat the draft)
    g = torch.Generator().manual_seed(11)
    n, k = 50_000, 3
    logits = torch.tensor([0.0, 1.0, -1.0, 0.5]).expand(n, -1)
    seen = []

    def step(d, i):
        seen.append(d)
        return logits * (i + 2)  # draw i + 1 sharper than draw i
    drafts, probs = draft_chain(logits, step, k, SamplingParams(temperature=1.0), False, g)
    assert drafts.shape == (n, k) and probs.shape == (n, k, 4)
    assert all(torch.equal(seen[i], drafts[:, i]) for i in range(k - 1))  # each step is fed the draft just drawn
    for i in range(k):
        p = (logits[0] * (i + 1)).softmax(-1)
        assert torch.allclose(probs[:, i], p.expand(n, -1))
        assert chi2_pvalue(drafts[:, i], p) > ALPHA, f"position {i}"
    p0, p1 = logits[0].softmax(-1), (2 * logits[0]).softmax(-1)
    assert binom_ok(int((drafts[:, 0] == drafts[:, 1]).sum()), n, float((p0 * p1).sum()))
    greedy, none = draft_chain(logits, step, k, SamplingParams(temperature=1.0), True, g)
    assert none is None and bool((greedy == 1).all())


def test_stop_token_follows_residual_or_bonus():
    """Token at the stop position n: ~ norm(max(0, p_n - q_n)) after a rejection, ~ p_k after k acceptances."""
    V, k = 6, 2
    lp, lq = random_pq(V, k, seed=7, sharp=1.0)
    p, q = lp.softmax(-1), lq.softmax(-1)
    tokens, na, _ = run_sd(p, q, N, seed=2)
    stop_tok = tokens.gather(1, na.view(-1, 1)).squeeze(1)
    for n in range(k):
        resid = (p[n] - q[n]).clamp_min(0)
        resid = resid / resid.sum()
        rows = na == n
        assert rows.sum() > 1000
        assert chi2_pvalue(stop_tok[rows], resid) > ALPHA, f"residual at n={n}"
        # negative control: the same samples are not distributed as p_n (the residual differs from p_n)
        assert chi2_pvalue(stop_tok[rows], p[n]) < 1e-6
    rows = na == k
    assert chi2_pvalue(stop_tok[rows], p[k]) > ALPHA


def test_chi2_rejects_wrong_distributions():
    """Negative controls: the chi-square test used above has power at these sample sizes."""
    V, k = 7, 2
    lp, lq = random_pq(V, k, seed=3)
    p, q = lp.softmax(-1), lq.softmax(-1)
    # (a) correct sampler, tested against q_0 and against a mildly perturbed p_0
    tokens, _, _ = run_sd(p, q, N, seed=4)
    assert chi2_pvalue(tokens[:, 0], q[0]) < 1e-6
    bumped = p[0].clone()
    i, j = bumped.argmax(), bumped.argmin()
    bumped[i] -= 0.02
    bumped[j] += 0.02
    assert chi2_pvalue(tokens[:, 0], bumped) < 1e-6
    # (b) mutant sampler that resamples from q instead of the residual: its first token is not ~ p_0
    g = torch.Generator().manual_seed(5)
    d = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()
    first, _ = mutant_resample_from_q(p.expand(N, k + 1, V), q.expand(N, k, V), d, g)
    assert chi2_pvalue(first, p[0]) < 1e-6
    # (c) misuse: drafts not drawn from the q passed in -> output is not p (losslessness needs d ~ q)
    wrong = torch.full_like(q, 1.0 / V)
    tokens, _, _ = run_sd(p, q, N, seed=6, draft_dist=wrong)
    assert chi2_pvalue(tokens[:, 0], p[0]) < 1e-6


def binom_ok(successes: int, n: int, prob: float, z: float = 5.0) -> bool:
    return abs(successes / n - prob) <= z * math.sqrt(max(prob * (1 - prob), 1e-12) / n)


@pytest.mark.parametrize("name", ["T1", "T0.7_topk5_topp0.9"])
def test_first_acceptance_rate_is_sum_min(name):
    params = PARAMS[name]
    V, k = 8, 3
    lp, lq = random_pq(V, k, seed=11)
    p, q = processed_probs(lp, params), processed_probs(lq, params)
    _, na, _ = run_sd(p, q, N, seed=12)
    alpha = float(torch.minimum(p[0], q[0]).sum())
    assert 0.1 < alpha < 0.95
    assert binom_ok(int((na >= 1).sum()), N, alpha)
    # expected_acceptance chained along positions predicts P(n >= i) for every i
    alphas = expected_acceptance(p[:k], q)  # [k]
    for i in range(1, k + 1):
        assert binom_ok(int((na >= i).sum()), N, float(alphas[:i].prod()))
    # SpecStats sees the same rate at position 0; position 1 conditional on reaching it is sum min(p_1, q_1)
    st = SpecStats()
    st.update(na, k)
    assert binom_ok(st.accepted_per_position[0], N, st.acceptance_per_position[0])
    assert binom_ok(st.accepted_per_position[0], N, alpha)
    alpha1 = float(torch.minimum(p[1], q[1]).sum())
    assert binom_ok(st.accepted_per_position[1], st.reached_per_position[1], alpha1)


def test_one_hot_drafts():
    """draft_probs=None (greedy drafter): acceptance of draft d is p(d); output still ~ p."""
    V, k = 6, 2
    lp, _ = random_pq(V, k, seed=21)
    p = lp.softmax(-1)
    g = torch.Generator().manual_seed(22)
    d = torch.randint(0, V, (N, k), generator=g)  # arbitrary drafts, one-hot q at each
    tokens, na = rejection_sample(p.expand(N, k + 1, V), None, d, generator=g)
    assert chi2_pvalue(tokens[:, 0], p[0]) > ALPHA
    assert chi2_pvalue(tokens[na >= 1, 1], p[1]) > ALPHA
    for v in range(V):
        rows = d[:, 0] == v
        assert binom_ok(int((na[rows] >= 1).sum()), int(rows.sum()), float(p[0, v]))
        # given draft v, the emitted first token is still ~ p_0 (accept v w.p. p(v), else residual p without v)
        assert chi2_pvalue(tokens[rows, 0], p[0]) > ALPHA
    # greedy drafts (argmax of p) under greedy target probs are always accepted
    pg = processed_probs(lp, SamplingParams(temperature=0))
    dg = pg[:k].argmax(-1).expand(8, k)
    tok, n = rejection_sample(pg.expand(8, k + 1, V), None, dg)
    assert (n == k).all() and (tok == pg.argmax(-1)).all()


# ---- rejection_sample: mechanics ----------------------------------------------------------------------------

def test_k0_is_plain_sampling():
    V = 7
    lp, _ = random_pq(V, 0, seed=31)
    p = lp.softmax(-1)  # [1, V]
    g = torch.Generator().manual_seed(32)
    tokens, na = rejection_sample(p.expand(N, 1, V), None, torch.zeros(N, 0, dtype=torch.long), generator=g)
    assert tokens.shape == (N, 1) and (na == 0).all() and (tokens >= 0).all()
    assert chi2_pvalue(tokens[:, 0], p[0]) > ALPHA
    tokens_q, _ = rejection_sample(p.expand(N, 1, V), torch.zeros(N, 0, V), torch.zeros(N, 0, dtype=torch.long),
                                   generator=g)
    assert chi2_pvalue(tokens_q[:, 0], p[0]) > ALPHA


def onehot(v: int, V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(v), V).float()


def test_mixed_num_accepted_and_padding():
    """Deterministic rows (one-hot targets) with num_accepted 3, 1, 0, 2 in one batch; -1 padding after n+1."""
    V, k = 5, 3
    d = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 0, 1], [0, 0, 0]])
    p = torch.stack([
        torch.stack([onehot(1, V), onehot(2, V), onehot(3, V), onehot(4, V)]),  # all accepted, bonus 4
        torch.stack([onehot(1, V), onehot(0, V), onehot(3, V), onehot(4, V)]),  # d_1 rejected -> 0
        torch.stack([onehot(2, V), onehot(0, V), onehot(1, V), onehot(4, V)]),  # d_0 rejected -> 2
        torch.stack([onehot(0, V), onehot(0, V), onehot(3, V), onehot(4, V)]),  # d_2 rejected -> 3
    ])
    for q in (None, torch.nn.functional.one_hot(d, V).float(), torch.full((4, k, V), 1.0 / V)):
        tokens, na = rejection_sample(p, q, d, generator=torch.Generator().manual_seed(0))
        assert na.tolist() == [3, 1, 0, 2]
        assert tokens.tolist() == [[1, 2, 3, 4], [1, 0, -1, -1], [2, -1, -1, -1], [0, 0, 3, -1]]
        assert tokens.dtype == torch.long


def test_rejection_sample_shape_errors():
    V, k, B = 5, 2, 3
    p = torch.full((B, k + 1, V), 1.0 / V)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(p, None, torch.zeros(B, k + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(p, None, torch.zeros(B + 1, k, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.full((B, k, V + 1), 0.1), torch.zeros(B, k, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.full((B, k + 1, V), 0.1), torch.zeros(B, k, dtype=torch.long))


def test_rejection_sample_seeded():
    V, k, B = 6, 3, 64
    lp, lq = random_pq(V, k, seed=41)
    p, q = lp.softmax(-1).expand(B, k + 1, V), lq.softmax(-1).expand(B, k, V)
    d = torch.multinomial(lq.softmax(-1), B, replacement=True, generator=torch.Generator().manual_seed(0)).T
    a = rejection_sample(p, q, d, torch.Generator().manual_seed(9))
    b = rejection_sample(p, q, d, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- processed_probs -----------------------------------------------------------------------------------------

def rand_logits(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_greedy_is_one_hot_argmax_with_low_tie_break():
    x = rand_logits((4, 3, 9))
    pr = processed_probs(x, SamplingParams(temperature=0))
    assert torch.equal(pr, torch.nn.functional.one_hot(x.argmax(-1), 9).float())
    tie = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert processed_probs(tie, SamplingParams(temperature=0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_keeps_exactly_k(k):
    V = 12
    x = rand_logits((50, V), seed=k)
    for T in (1.0, 0.5):
        pr = processed_probs(x, SamplingParams(temperature=T, top_k=k))
        assert ((pr > 0).sum(-1) == k).all()
        top = x.topk(k, -1).indices
        assert (pr.gather(-1, top) > 0).all()
        # kept tokens keep their relative tempered weights
        ref = torch.zeros_like(x).scatter(-1, top, (x.gather(-1, top) / T).softmax(-1))
        assert torch.allclose(pr, ref, atol=1e-6)
    assert torch.allclose(processed_probs(x, SamplingParams(top_k=V)), x.softmax(-1), atol=1e-6)
    assert torch.allclose(processed_probs(x, SamplingParams(top_k=V + 5)), x.softmax(-1), atol=1e-6)


def nucleus_ref(logits: torch.Tensor, T: float, top_p: float) -> torch.Tensor:
    """Reference: the smallest set of most-likely tokens whose (tempered) mass reaches top_p, renormalised."""
    probs = (logits.double() / T).softmax(-1).numpy()
    out = np.zeros_like(probs)
    for r in range(probs.shape[0]):
        order = np.argsort(-probs[r], kind="stable")
        mass, kept = 0.0, []
        for t in order:
            kept.append(t)
            mass += probs[r, t]
            if mass >= top_p:
                break
        out[r, kept] = probs[r, kept] / probs[r, kept].sum()
    return torch.from_numpy(out).float()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("T", [1.0, 0.6])
def test_top_p_keeps_minimal_nucleus(top_p, T):
    x = rand_logits((200, 10), seed=int(top_p * 100))
    pr = processed_probs(x, SamplingParams(temperature=T, top_p=top_p))
    ref = nucleus_ref(x, T, top_p)
    assert torch.equal(pr > 0, ref > 0)
    assert torch.allclose(pr, ref, atol=1e-5)
    # minimality: dropping the smallest kept token leaves mass < top_p
    full = (x / T).softmax(-1)
    kept_mass = (full * (pr > 0)).sum(-1)
    smallest = torch.where(pr > 0, full, torch.full_like(full, 2.0)).min(-1).values
    assert (kept_mass >= top_p - 1e-6).all()
    assert (kept_mass - smallest < top_p).all()


def test_top_k_then_top_p():
    x = rand_logits((100, 10), seed=5)
    pr = processed_probs(x, SamplingParams(temperature=0.8, top_k=4, top_p=0.7))
    masked = x.masked_fill(x < x.topk(4, -1).values[..., -1:], float("-inf"))
    assert torch.allclose(pr, nucleus_ref(masked, 0.8, 0.7), atol=1e-5)
    assert ((pr > 0).sum(-1) <= 4).all()


def test_temperature_limit_is_greedy():
    x = rand_logits((30, 9), seed=3)
    onehot_ = processed_probs(x, SamplingParams(temperature=0))
    maxes = []
    for T in (2.0, 1.0, 0.5, 0.1, 0.01):
        maxes.append(processed_probs(x, SamplingParams(temperature=T)).max(-1).values)
    for a, b in zip(maxes, maxes[1:]):
        assert (b >= a - 1e-6).all()  # sharper as T falls
    assert torch.allclose(processed_probs(x, SamplingParams(temperature=1e-3)), onehot_, atol=1e-4)
    assert torch.allclose(processed_probs(x, SamplingParams(temperature=1.0)), x.softmax(-1), atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.3, top_k=2),
                                    SamplingParams(top_p=0.4), SamplingParams(temperature=2.0, top_k=5, top_p=0.9),
                                    SamplingParams(temperature=0)])
def test_processed_probs_is_a_distribution(params):
    x = rand_logits((3, 5, 11), seed=9).to(torch.bfloat16)
    pr = processed_probs(x, params)
    assert pr.shape == x.shape and pr.dtype == torch.float32
    assert (pr >= 0).all()
    assert torch.allclose(pr.sum(-1), torch.ones(3, 5), atol=1e-5)


@pytest.mark.parametrize("name", list(PARAMS))
def test_processed_logprobs_is_the_log_of_processed_probs(name):
    """The RL loss's log-probs: log(processed_probs) on its support, -inf off it, with gradients to the logits."""
    from drafttrain.spec import processed_logprobs

    params = PARAMS[name]
    logits = torch.randn(3, 7, 20, generator=torch.Generator().manual_seed(1), requires_grad=True)
    lp = processed_logprobs(logits, params)
    p = processed_probs(logits.detach(), params)
    on = p > 0
    torch.testing.assert_close(lp[on].exp(), p[on], atol=1e-6, rtol=1e-5)
    assert torch.isneginf(lp[~on]).all()
    lp.masked_fill(~on, 0.0).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="temperature 0"):
        processed_logprobs(logits, SamplingParams(temperature=0.0))


def test_sampling_params_validation():
    # NaN temperature passed `< 0` and generated all-zero tokens with NaN log-probs; a bare int as stop ids raised a
    # TypeError naming no field
    for kw in ({"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_k": -1},
               {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": float("nan")}, {"max_new_tokens": 0},
               {"stop_token_ids": ["eos"]}, {"stop_token_ids": None}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=2).stop_token_ids == (2,)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


# ---- SpecStats -----------------------------------------------------------------------------------------------

def test_spec_stats_update():
    st = SpecStats()
    st.update(torch.tensor([0, 1, 3, 3]), k=3)
    assert (st.drafted, st.accepted, st.verify_rows, st.target_forwards) == (12, 7, 4, 1)
    # accepted draft i: rows with n > i; reached draft i: rows with n >= i
    assert st.accepted_per_position == [3, 2, 2]
    assert st.reached_per_position == [4, 3, 2]
    assert st.acceptance_per_position == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert st.mean_accepted_length == pytest.approx(1 + 7 / 4)
    assert st.acceptance_rate == pytest.approx(7 / 12)
    st.update(torch.tensor([2, 0]), k=2)
    assert (st.drafted, st.accepted, st.verify_rows, st.target_forwards) == (16, 9, 6, 2)
    assert st.accepted_per_position == [4, 3, 2] and st.reached_per_position == [6, 4, 2]
    assert st.mean_accepted_length == pytest.approx(1 + 9 / 6)
    st.update(torch.tensor([0, 0, 0]), k=0)  # an AR step (the toggle's): verify rows, nothing drafted
    assert (st.drafted, st.accepted, st.verify_rows, st.target_forwards) == (16, 9, 9, 3)
    assert (st.ar_rows, st.ar_emitted, st.emitted) == (3, 3, 18)
    # MAL is the drafter's: the AR step's one token per row says nothing of it (it read 18 / 9 = 2.0)
    assert st.mean_accepted_length == pytest.approx(1 + 9 / 6)
    d = st.to_dict()
    assert d["mean_accepted_length"] == pytest.approx(2.5) and d["acceptance_per_position"][1] == pytest.approx(0.75)
    ar = SpecStats()
    ar.update(torch.tensor([0, 0]), k=0)
    assert ar.mean_accepted_length == 1.0  # AR alone


def test_spec_stats_counts_only_the_response():
    """A step cut by a stop token or the length limit emits only the tokens up to the cut: no bonus token, and
    drafts past the cut are neither drafted nor reached. MAL = emitted tokens per verify step."""
    st = SpecStats()
    # rows: not cut (2 accepted, 3 emitted); stop on accepted draft 1 (2 emitted, drafts 2.. dropped even though
    # the verify pass accepted 3); stop on the resampled token (1 accepted + it = 2 emitted: not a cut)
    st.update(torch.tensor([2, 3, 1]), k=4, emitted=torch.tensor([3, 2, 2]))
    assert (st.drafted, st.accepted, st.emitted, st.verify_rows) == (4 + 2 + 4, 2 + 2 + 1, 7, 3)
    assert st.reached_per_position == [3, 3, 1, 0] and st.accepted_per_position == [3, 2, 0, 0]
    assert st.mean_accepted_length == pytest.approx(7 / 3)
    # all k drafts accepted and the last one is the stop token: k tokens, no bonus
    st2 = SpecStats()
    st2.update(torch.tensor([3]), k=3, emitted=torch.tensor([3]))
    assert (st2.drafted, st2.accepted, st2.mean_accepted_length) == (3, 3, 3.0)
    assert st2.acceptance_per_position == [1.0, 1.0, 1.0]


def test_spec_stats_merge_and_empty():
    assert SpecStats().mean_accepted_length == 0.0 and SpecStats().acceptance_rate == 0.0
    a, b = SpecStats(), SpecStats()
    a.update(torch.tensor([1, 0]), k=1)
    b.update(torch.tensor([4, 2, 0]), k=4)
    b.update(torch.tensor([1]), k=0)
    m = a.merge(b)
    both = SpecStats()
    for na, k in ((torch.tensor([1, 0]), 1), (torch.tensor([4, 2, 0]), 4), (torch.tensor([1]), 0)):
        both.update(na, k)
    assert m.to_dict() == both.to_dict()
    assert m.accepted_per_position == both.accepted_per_position == [3, 2, 1, 1]
    assert m.reached_per_position == [5, 2, 2, 1]
    assert (m.drafted, m.accepted, m.verify_rows, m.target_forwards) == (14, 7, 6, 3)
    # merge does not mutate its inputs
    assert a.accepted_per_position == [1] and a.verify_rows == 2
    assert b.merge(SpecStats()).to_dict() == b.to_dict()


def test_spec_stats_from_steps_equals_an_update_per_step():
    """from_steps counts in tensor ops what one update per (row, step) counts: steps of varying k, AR steps (k = 0),
    rows cut by their end inside their accepted drafts (drafts past it neither drafted nor reached), steps that
    keep nothing, and no steps at all."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        N = int(torch.randint(0, 40, (), generator=gen))
        k = torch.tensor([0, 1, 2, 3, 5], device="cpu")[torch.randint(0, 5, (N,), generator=gen)]  # [N]
        n = (torch.rand(N, generator=gen) * (k + 1)).long()  # [N] accepted, 0..k
        # emitted: n + 1, or a cut at 0..n (a stop token or the length limit inside the accepted drafts)
        cut = (torch.rand(N, generator=gen) * (n + 1)).long()
        em = torch.where(torch.rand(N, generator=gen) < 0.3, cut, n + 1)
        ref = SpecStats()
        for j in range(N):
            ref.update(n[j:j + 1], int(k[j]), em[j:j + 1])
        got = SpecStats.from_steps(n, k, em)
        for f in ("drafted", "accepted", "verify_rows", "target_forwards", "emitted", "ar_rows", "ar_emitted",
                  "accepted_per_position", "reached_per_position"):
            assert getattr(got, f) == getattr(ref, f), (trial, f, getattr(got, f), getattr(ref, f))
    st = SpecStats.from_steps(torch.tensor([2, 1]), torch.tensor([3, 0]), torch.tensor([1, 1]), target_forwards=1)
    assert st.target_forwards == 1 and (st.drafted, st.accepted, st.reached_per_position) == (1, 1, [1, 0, 0])
