"""The RolloutEngine contract suite: plain functions that take an engine factory, so every engine runs the same
checks (tests/test_contract.py runs each on both engines, by parametrization).

    make_engine(policy, drafter=None, **engine_kw) -> RolloutEngine
        policy: an HF causal LM module; engine_kw: EngineConfig fields (k, drafter_int8, draft_sampling, ...)

What is checked: greedy SD == AR == HF generate; the exact output distribution (enumerated on a tiny vocabulary,
chi-square at 1e-3, with negative controls); log-probs == teacher-forced policy log-probs; ragged batches, stop
tokens and max_new_tokens; versioned, validated drafter loads; bad input errors; Qwen2/Qwen3 policies.
"""
from __future__ import annotations

import copy
import itertools

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy.stats import chisquare

from drafttrain.config import Config
from drafttrain.drafters import build_drafter
from drafttrain.engines import StaleVersionError
from drafttrain.spec import SamplingParams, processed_probs

ALPHA = 1e-3
RAGGED_PROMPTS = [[5, 9, 3], [7], [11, 4, 8, 20, 1, 30, 2, 17, 6], [3, 3, 3, 3], [25, 12]]


# ---- helpers -------------------------------------------------------------------------------------------------

def fresh_drafter(policy, seed: int = 1, **drafter_kw):
    from tests.conftest import set_drafter_keys

    cfg = OmegaConf.structured(Config).drafter
    cfg.path = None
    set_drafter_keys(cfg, **drafter_kw)
    torch.manual_seed(seed)
    return build_drafter(cfg, policy)


def tiny_vocab_policy(vocab: int = 5, seed: int = 3):
    from tests.conftest import tiny_policy

    return tiny_policy(vocab=vocab, hidden=32, layers=4, heads=2, kv_heads=1, inter=64, seed=seed)


@torch.no_grad()
def hf_greedy(policy, prompt: list[int], n: int) -> list[int]:
    # eos_token_id=None as a keyword (a GenerationConfig object would be merged with the model's eos)
    out = policy.generate(torch.tensor([prompt], device=policy.device), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced_logprobs(policy, prompt: list[int], response: list[int], params: SamplingParams) -> torch.Tensor:
    """log processed_probs of each response token from one full HF forward over prompt + response."""
    ids = torch.tensor([prompt + response], device=policy.device)
    logits = policy(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response)].cpu()  # [n, V]
    return processed_probs(logits, params).gather(-1, torch.tensor(response).view(-1, 1)).squeeze(-1).log()


@torch.no_grad()
def exact_sequence_probs(policy, prompt: list[int], n: int, params: SamplingParams) -> torch.Tensor:
    """Probability of every length-n response (index = base-V number, first token most significant) [V**n],
    from teacher-forced forwards: prod_i processed_probs(policy(prompt + s[:i]))[s_i]."""
    V = policy.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # [V**n, n]
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    logits = policy(ids.to(policy.device)).logits[:, len(prompt) - 1: len(prompt) - 1 + n].cpu()  # [V**n, n, V]
    pr = processed_probs(logits, params).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [V**n, n]
    return pr.double().prod(-1)


def seq_index(tokens: list[list[int]], V: int) -> np.ndarray:
    t = np.array(tokens)
    return (t * (V ** np.arange(t.shape[1] - 1, -1, -1))).sum(1)


def chi2_pvalue(idx: np.ndarray, probs: torch.Tensor) -> float:
    """idx [n] category ids, probs [C] exact; zero-probability categories must be empty; expected < 5 pooled."""
    p = probs.double().numpy()
    p = p / p.sum()
    counts = np.bincount(idx, minlength=len(p)).astype(float)
    zero = p <= 1e-12
    assert counts[zero].sum() == 0, f"sampled {int(counts[zero].sum())} zero-probability sequences"
    exp = p * counts.sum()
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    rest = ~big & ~zero
    if rest.any():
        obs_b.append(counts[rest].sum())
        exp_b.append(exp[rest].sum())
    return float(chisquare(obs_b, np.array(exp_b) * counts.sum() / sum(exp_b)).pvalue)


def sd_sequences(make_engine, policy, drafter, prompt, params, n_rows: int, **engine_kw):
    eng = make_engine(policy, drafter, **engine_kw)
    batch = eng.generate([list(prompt)] * n_rows, params, speculative=True)
    assert all(len(t) == params.max_new_tokens for t in batch.tokens)
    return batch


# ---- greedy equivalence -------------------------------------------------------------------------------------

def greedy_sd_equals_ar(make_engine, policy, drafter, drafter_int8: bool, n: int = 24):
    eng = make_engine(policy, drafter, drafter_int8=drafter_int8)
    params = SamplingParams(temperature=0, max_new_tokens=n)
    sd = eng.generate(RAGGED_PROMPTS, params, speculative=True)
    ar = eng.generate(RAGGED_PROMPTS, params, speculative=False)
    assert sd.tokens == ar.tokens
    assert all(len(t) == n for t in sd.tokens) and sd.finish_reasons == ["length"] * len(RAGGED_PROMPTS)
    assert sd.stats.drafted > 0 and ar.stats.drafted == 0
    assert ar.stats.mean_accepted_length == 1.0
    assert sd.stats.target_forwards <= ar.stats.target_forwards
    # greedy: every emitted token has processed probability 1
    assert np.allclose(np.concatenate(sd.logprobs), 0.0) and np.allclose(np.concatenate(ar.logprobs), 0.0)


def ar_equals_hf_generate(make_engine, policy, n: int = 20):
    eng = make_engine(policy, None)
    ar = eng.generate(RAGGED_PROMPTS, SamplingParams(temperature=0, max_new_tokens=n), speculative=False)
    for p, got in zip(RAGGED_PROMPTS, ar.tokens):
        assert got == hf_greedy(policy, p, n), f"prompt {p}"


# ---- exact output distribution --------------------------------------------------------------------------------

def exact_distribution(make_engine, policy, drafter, params: SamplingParams, n_rows: int = 3000,
                       wrong: SamplingParams | None = None, min_accept: float = 0.1, **engine_kw) -> float:
    """Chi-square of SD samples (n_rows copies of one prompt) against the enumerated exact distribution.
    `wrong`: a negative control; the same samples tested against that distribution must be rejected."""
    prompt = [1, 2, 3]
    V = policy.config.vocab_size
    batch = sd_sequences(make_engine, policy, drafter, prompt, params, n_rows, **engine_kw)
    assert batch.stats.accepted > min_accept * batch.stats.drafted, "accept path barely exercised"
    assert batch.stats.accepted < 0.95 * batch.stats.drafted, "reject path barely exercised"
    idx = seq_index(batch.tokens, V)
    pval = chi2_pvalue(idx, exact_sequence_probs(policy, prompt, params.max_new_tokens, params))
    assert pval > ALPHA, f"SD samples do not match the exact distribution (p={pval:.2e})"
    if wrong is not None:
        bad = exact_sequence_probs(policy, prompt, params.max_new_tokens, wrong)
        try:
            pbad = chi2_pvalue(idx, bad)
        except AssertionError:  # a sample outside the wrong distribution's support: rejected outright
            pbad = 0.0
        assert pbad < 1e-6, f"negative control not rejected (p={pbad:.2e})"
    return pval


def exact_distribution_rejects_perturbation(make_engine, policy, drafter, n_rows: int = 3000):
    """Negative control on the engine's own samples: moving 30% of the top sequence's mass elsewhere (about
    2% of the total) is detected."""
    prompt, params = [1, 2, 3], SamplingParams(max_new_tokens=3, seed=5)
    batch = sd_sequences(make_engine, policy, drafter, prompt, params, n_rows, k=2)
    idx = seq_index(batch.tokens, policy.config.vocab_size)
    exact = exact_sequence_probs(policy, prompt, 3, params)
    assert chi2_pvalue(idx, exact) > ALPHA
    pert = exact.clone()
    top, low = int(exact.argmax()), int(exact.argmin())
    shift = 0.3 * float(exact[top])
    pert[top] -= shift
    pert[low] += shift
    assert chi2_pvalue(idx, pert) < 1e-6


# ---- log-probs ---------------------------------------------------------------------------------------------------

def logprobs_match_teacher_forced(make_engine, policy, drafter, params: SamplingParams):
    eng = make_engine(policy, drafter, drafter_int8=False)
    for speculative in (True, False):
        batch = eng.generate(RAGGED_PROMPTS, params, speculative=speculative)
        for p, toks, lps in zip(RAGGED_PROMPTS, batch.tokens, batch.logprobs):
            assert len(lps) == len(toks) == params.max_new_tokens
            ref = teacher_forced_logprobs(policy, p, toks, params)
            assert torch.isfinite(ref).all()
            torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)
        if speculative:
            assert batch.stats.accepted > 0


# ---- ragged batches, stops, lengths ----------------------------------------------------------------------------

def ragged_stops(make_engine, policy, drafter, n: int = 16):
    """A row ends at its first stop token (included), the others run to max_new_tokens; each row equals the
    no-stop greedy output cut at its first stop token."""
    eng = make_engine(policy, drafter)
    free = eng.generate(RAGGED_PROMPTS, SamplingParams(temperature=0, max_new_tokens=n), speculative=False).tokens
    # a stop token that some rows emit (not at their first step) and some never do
    cands = [t for t in range(policy.config.vocab_size)
             if 0 < sum(t in r for r in free) < len(free) and all(r.index(t) > 0 for r in free if t in r)]
    assert cands, "no usable stop token in the greedy outputs"
    stop = cands[0]
    for speculative in (True, False):
        params = SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=(stop, 10 ** 6))
        b = eng.generate(RAGGED_PROMPTS, params, speculative=speculative)
        for r, got, why, lps in zip(free, b.tokens, b.finish_reasons, b.logprobs):
            if stop in r:
                assert got == r[: r.index(stop) + 1] and why == "stop"
            else:
                assert got == r and why == "length"
            assert len(lps) == len(got)
    # sampled rows obey the same rules: the stop token only at the end, else exactly max_new_tokens
    b = eng.generate(RAGGED_PROMPTS * 8, SamplingParams(max_new_tokens=n, stop_token_ids=(stop,), seed=3))
    for got, why in zip(b.tokens, b.finish_reasons):
        assert stop not in got[:-1]
        assert (why == "stop" and got[-1] == stop) or (why == "length" and len(got) == n and got[-1] != stop)
    assert "stop" in b.finish_reasons


def max_new_tokens_exact(make_engine, policy, drafter):
    eng = make_engine(policy, drafter, k=4)
    for n in (1, 2, 3, 5, 9):
        for params in (SamplingParams(temperature=0, max_new_tokens=n), SamplingParams(max_new_tokens=n, seed=n)):
            b = eng.generate(RAGGED_PROMPTS, params)
            assert [len(t) for t in b.tokens] == [n] * len(RAGGED_PROMPTS)
            assert [len(t) for t in b.logprobs] == [n] * len(RAGGED_PROMPTS)
            assert b.finish_reasons == ["length"] * len(RAGGED_PROMPTS)
            assert all(0 <= t < policy.config.vocab_size for row in b.tokens for t in row)


def rows_finish_independently_at_max_position(make_engine, policy, drafter, max_len: int = 24):
    """A row that reaches the maximum position ends there ("length"); the other rows still get max_new_tokens."""
    long_p, short_p, n = [4] * (max_len - 6), [5, 9, 3], 10
    for d in (None, drafter):
        eng = make_engine(policy, d, max_len=max_len)
        for speculative in (True, False):
            b = eng.generate([long_p, short_p, long_p[:-3]], SamplingParams(temperature=0, max_new_tokens=n),
                             speculative=speculative)
            # positions 0 .. max_len-1 exist: a prompt of length P leaves room for max_len - P tokens
            assert [len(t) for t in b.tokens] == [6, n, 9]
            assert b.finish_reasons == ["length"] * 3
            assert b.tokens[1] == hf_greedy(policy, short_p, n)
            assert b.tokens[0] == hf_greedy(policy, long_p, 6)


# ---- drafter hot-swap ---------------------------------------------------------------------------------------------

def load_drafter_versioned(make_engine, policy, drafter):
    eng = make_engine(policy, drafter, drafter_int8=False)
    assert eng.drafter_version == 0
    w = {k: v.clone() for k, v in drafter.state_dict().items()}
    for v in (0, -1):
        try:
            eng.load_drafter(w, v)
        except StaleVersionError as e:
            assert str(v) in str(e)
        else:
            raise AssertionError(f"version {v} accepted while serving 0")
    eng.load_drafter(w, 1)
    assert eng.drafter_version == 1
    for v in (1, 0):
        try:
            eng.load_drafter(w, v)
        except StaleVersionError:
            pass
        else:
            raise AssertionError(f"version {v} accepted while serving 1")
    eng.load_drafter(w, 7)  # versions need not be consecutive
    assert eng.drafter_version == 7
    b = eng.generate(RAGGED_PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=4))
    assert b.drafter_version == 7 and set(b.drafter_versions) == {7}


def load_drafter_refuses_bad_weights(make_engine, policy, drafter, same_stats: bool = True):
    """Wrong shapes, NaNs, missing/unexpected tensors: ValueError naming the tensor; the old version keeps serving
    (same version, same deterministic greedy acceptance stats; same_stats=False: a drafter whose choices depend on
    what it saw before, drafter.kind=auto's chooser, keeps the same output and version)."""
    eng = make_engine(policy, drafter, drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    before = eng.generate(RAGGED_PROMPTS, params)
    good = {k: v.clone() for k, v in drafter.state_dict().items()}
    # EAGLE-3's names, else the kind's own: its first, second and last matrices, its last tensor
    mats = [k for k, v in good.items() if v.dim() == 2 and v.is_floating_point()]
    shape_n, nan_n, inf_n, miss_n = (("fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "norm.weight")
                                     if "norm.weight" in good else (mats[0], mats[1], mats[-1], sorted(good)[-1]))
    bad_shape = dict(good)
    bad_shape[shape_n] = torch.zeros(good[shape_n].shape[0], good[shape_n].shape[1] + 1)
    nan = dict(good)
    nan[nan_n] = good[nan_n].clone()
    nan[nan_n][0, 0] = float("nan")
    inf = dict(good)
    inf[inf_n] = good[inf_n].clone()
    inf[inf_n][1, 2] = float("inf")
    missing = {k: v for k, v in good.items() if k != miss_n}
    extra = dict(good, **{"bogus.weight": torch.zeros(2)})
    for weights, named in ((bad_shape, shape_n), (nan, nan_n), (inf, inf_n), (missing, miss_n),
                           (extra, "bogus.weight")):
        try:
            eng.load_drafter(weights, 1)
        except StaleVersionError:
            raise
        except ValueError as e:
            assert named in str(e) and "\n" not in str(e), str(e)
        else:
            raise AssertionError(f"bad weights ({named}) accepted")
        assert eng.drafter_version == 0
    after = eng.generate(RAGGED_PROMPTS, params)
    assert after.drafter_version == 0
    assert after.tokens == before.tokens
    assert after.stats.to_dict() == before.stats.to_dict() or not same_stats
    eng.load_drafter(good, 1)  # a refused load does not burn the version number
    assert eng.drafter_version == 1


# ---- bad input -------------------------------------------------------------------------------------------------

def bad_prompts_raise(make_engine, policy, drafter):
    eng = make_engine(policy, drafter)
    max_pos = policy.config.max_position_embeddings
    params = SamplingParams(max_new_tokens=4)
    for prompts in ([[1] * (max_pos + 10)], [[1, 2], [3] * max_pos], [[]], [], [[1, policy.config.vocab_size]],
                    [[-1, 2]]):
        try:
            eng.generate(prompts, params)
        except ValueError as e:
            assert "\n" not in str(e), f"multi-line error: {e}"
            if prompts and len(prompts[-1]) >= max_pos:
                assert "maximum position" in str(e) and str(max_pos) in str(e)
        else:
            raise AssertionError(f"prompts {str(prompts)[:40]} accepted")
    # the engine still works afterwards
    assert len(eng.generate([[1, 2]], params).tokens[0]) == 4


def nan_logits_raise(make_engine, policy, drafter):
    broken = copy.deepcopy(policy)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    for speculative in (True, False):
        eng = make_engine(broken, drafter)
        try:
            eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), speculative=speculative)
        except FloatingPointError as e:
            assert "NaN" in str(e)
        else:
            raise AssertionError("NaN logits were sampled from")
    assert torch.isfinite(policy.model.layers[1].mlp.down_proj.weight).all()  # the original is untouched


# ---- model families --------------------------------------------------------------------------------------------

def family_policy(family: str):
    """A tiny Qwen2 (random qkv biases) or Qwen3 (random q/k norms) policy: the family-specific weights are made
    non-trivial so an engine that ignores them fails."""
    from tests.conftest import tiny_policy

    pol = tiny_policy(family=family, seed=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in pol.model.layers:
            a = layer.self_attn
            if family == "qwen2":
                for lin in (a.q_proj, a.k_proj, a.v_proj):
                    lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.5)
            if family == "qwen3":
                for norm in (a.q_norm, a.k_norm):
                    norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g) * 0.5)
    return pol


def family_greedy_sd_ar_hf(make_engine, family: str, n: int = 16):
    pol = family_policy(family)
    eng = make_engine(pol, fresh_drafter(pol), drafter_int8=False)
    params = SamplingParams(temperature=0, max_new_tokens=n)
    sd = eng.generate(RAGGED_PROMPTS, params, speculative=True)
    ar = eng.generate(RAGGED_PROMPTS, params, speculative=False)
    assert sd.tokens == ar.tokens
    for p, got in zip(RAGGED_PROMPTS, ar.tokens):
        assert got == hf_greedy(pol, p, n), f"{family} prompt {p}"
    # sampled log-probs match the HF forward too
    sp = SamplingParams(temperature=0.9, max_new_tokens=n, seed=2)
    b = eng.generate(RAGGED_PROMPTS, sp)
    for p, toks, lps in zip(RAGGED_PROMPTS, b.tokens, b.logprobs):
        torch.testing.assert_close(torch.tensor(lps), teacher_forced_logprobs(pol, p, toks, sp), atol=1e-4, rtol=0)


# ---- a trainable kind learns online ----------------------------------------------------------------------------

def rollouts(make_engine, policy, n: int = 12, seed: int = 0, max_new: int = 24):
    prompts = [[1 + (i * 7) % 29, 3 + i % 5, 2 + (i * 3) % 11] for i in range(n)]
    b = make_engine(policy).generate(prompts, SamplingParams(max_new_tokens=max_new, seed=seed), speculative=False)
    return prompts, b.tokens


def drifted(policy, seed: int = 7, scale: float = 0.6):
    """The policy after it moved: every matrix perturbed (a stand-in for RL updates, for this unit test only)."""
    pol = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in pol.parameters():
            if w.dim() == 2:
                w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return pol


def learns_on_drifted_policy(make_engine, policy, drafter, steps: int = 40, k: int = 3, rows: int = 40):
    """Features of the drifted policy's own rollouts: the stale drafter's loss falls and its teacher-forced MAL on
    held-out rollouts of the drifted policy rises."""
    from drafttrain.config import load_recipe
    from drafttrain.drafters import TargetHead
    from drafttrain.drafters.base import runtime_copy
    from drafttrain.tracking import DrafterTrainer, FeatureBuffer, teacher_forced_features
    from drafttrain.tracking.acceptance import teacher_forced_acceptance

    new = drifted(policy)
    prompts, resp = rollouts(make_engine, new, n=rows + 8, seed=1)
    train = teacher_forced_features(new, prompts[:rows], resp[:rows], drafter.reads, k)
    held = teacher_forced_features(new, prompts[rows:], resp[rows:], drafter.reads, k)
    buf = FeatureBuffer(1 << 30, seed=0)
    buf.add(train)
    cfg = load_recipe("eagle3_track")
    cfg.train.lr, cfg.train.query_frac, cfg.train.batch_size = 3e-3, 1.0, 8
    head = TargetHead.of(new)
    tr = DrafterTrainer(drafter, cfg.train, cfg.drafter, buffer=buf, head=head)
    before = teacher_forced_acceptance(runtime_copy(drafter, int8=False), held, k, head)["mal"]
    losses = [tr.step(buf.sample(8))["loss"] for _ in range(steps)]
    after = teacher_forced_acceptance(runtime_copy(drafter, int8=False), held, k, head)["mal"]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses  # the soft loss keeps the policy entropy
    assert after > before + 0.1, (before, after)


# ---- one drafter through the checks above (the per-kind test files) -----------------------------------------------

def serving_checks(make_engine, policy, drafter):
    """Ragged stops, exact max_new_tokens, rows ending at the maximum position, log-probs of the policy's (top-k 12,
    T 0.8), bad prompts refused: what every drafter kind must serve alike."""
    ragged_stops(make_engine, policy, drafter)
    max_new_tokens_exact(make_engine, policy, drafter)
    rows_finish_independently_at_max_position(make_engine, policy, drafter)
    logprobs_match_teacher_forced(make_engine, policy, drafter, SamplingParams(temperature=0.8, top_k=12,
                                                                               max_new_tokens=10, seed=1))
    bad_prompts_raise(make_engine, policy, drafter)


def swap_checks(make_engine, policy, drafter, same_stats: bool = True):
    """A kind with weights: versioned loads, and bad weights refused with the old version still serving."""
    load_drafter_versioned(make_engine, policy, drafter)
    load_drafter_refuses_bad_weights(make_engine, policy, drafter, same_stats)


def ttt_matches_chain(d, aux, next_ids, steps: int, want: list, tol: float) -> None:
    """A one-layer chain drafter (chain.py): step i of its training-time test at position t (want[i][:, t]) equals
    the chain-drafting step at t+i over a cache holding the policy-derived positions <= t."""
    B, T = aux.shape[:2]
    for t in range(T):
        st = d.new_state(B, T + steps)
        lg, h = d._cached_step(st, d._embed(next_ids[:, : t + 1]), d._fc(aux[:, : t + 1]),
                               torch.zeros(B, dtype=torch.long))  # outputs at the last position, t
        torch.testing.assert_close(lg, want[0][:, t], atol=tol, rtol=tol)
        for i in range(1, steps):
            lg, h = d._cached_step(st, d._embed(next_ids[:, t + i]).unsqueeze(1), h.unsqueeze(1),
                                   torch.full((B,), t + i))
            torch.testing.assert_close(lg, want[i][:, t], atol=tol, rtol=tol)
