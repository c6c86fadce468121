"""The embedded engine beyond the contract (tests/test_contract.py runs that on both engines): the per-step timeline,
and LeanLlama's KV cache against full HF recomputation, seeding, policy refresh, and an oracle drafter (the
policy drafting for itself) that makes every draft accepted, so long accepted runs, stop tokens inside a run
and max_new_tokens cuts inside a run are exercised.
"""
from __future__ import annotations

import copy
import time
from collections import deque

import pytest
import torch
import torch.nn.functional as F

from drafttrain.drafters import Drafter, Reads
from drafttrain.engines import build_engine
from drafttrain.modeling import KVCache, LeanLlama, Rope, attend, keep_order, share_prompts, step_mask
from drafttrain.spec import SamplingParams, processed_probs
from tests import contract as C
from tests.conftest import engine_cfg, tiny_policy


@pytest.fixture(params=["torch"])
def make_engine(request):
    def make(policy, drafter=None, **kw):
        return build_engine(engine_cfg(kind=request.param, **kw), policy, drafter)

    return make


@pytest.fixture(scope="module")
def vocab5():
    pol = C.tiny_vocab_policy(vocab=5)
    return pol, C.fresh_drafter(pol, seed=2)


# ---- the per-step timeline -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [True, False])
def test_per_step_batch_and_tokens(make_engine, policy, drafter, speculative):
    # timeline.batch / timeline.tokens (benchmarks measure throughput at an active batch with them) add up: every
    # emitted token is in exactly one step, a step never emits more than its rows x (k+1), and the batch only shrinks
    eng = make_engine(policy, drafter)
    t0 = time.perf_counter()
    b = eng.generate(C.RAGGED_PROMPTS * 4, SamplingParams(max_new_tokens=20, stop_token_ids=(3, 7), seed=5),
                     speculative=speculative)
    assert len(b.timeline.batch) == len(b.timeline.tokens) == len(b.timeline.ends)
    # timeline.prefill_s: the prompt processing before the first decode step, the rest of wall_s is the decode steps
    assert 0 < b.timeline.prefill_s <= b.timeline.ends[0] - t0
    assert b.wall_s - b.timeline.prefill_s >= b.timeline.ends[-1] - b.timeline.ends[0]
    first = sum(1 for t in b.tokens if t)  # the prefill emits each row's first token
    assert sum(b.timeline.tokens) + first == b.num_tokens
    assert b.timeline.batch[0] == len(C.RAGGED_PROMPTS) * 4 - sum(len(t) == 1 for t in b.tokens)
    assert all(x >= y for x, y in zip(b.timeline.batch, b.timeline.batch[1:]))
    k1 = (eng.cfg.k + 1) if speculative else 1
    assert all(0 < t <= n * k1 for t, n in zip(b.timeline.tokens, b.timeline.batch))
    assert speculative == any(t > n for t, n in zip(b.timeline.tokens, b.timeline.batch))


def test_timeline_schedule_holds_every_step_of_its_generation(make_engine, policy, drafter):
    """The controller's trace keeps only its latest decisions (here 3); each generation's timeline still holds the
    decision of each of its own decode steps, and only its own."""
    eng = make_engine(policy, drafter, k=2)
    ctl = eng.controller()
    ctl.trace = deque(maxlen=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    first, second = (eng.generate(C.RAGGED_PROMPTS, params).timeline for _ in range(2))
    for tl in (first, second):
        assert len(tl.schedule) == len(tl.k) > 3
        assert [s["k"] if s["on"] else 0 for s in tl.schedule] == tl.k  # no step reached the end of the context
    steps = [s["step"] for s in first.schedule + second.schedule]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # one after another, none repeated or lost
    assert len(ctl.trace) == 3 and list(ctl.trace) == second.schedule[-3:]


# ---- torch-only: LeanLlama KV cache == full recomputation -----------------------------------------------------

@torch.no_grad()
def hf_logits_and_aux(policy, seq: list[int], aux_ids):
    out = policy(torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i][0] for i in aux_ids], -1)


def biased_policy(family: str, seed: int = 0, **bias):
    """A tiny policy with `bias` flags (attention_bias, mlp_bias) and large random biases: dropping one shows."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg_cls, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    m = cls(cfg_cls(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                    tie_word_embeddings=False, **bias)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
        m.lm_head.weight.mul_(8.0)
    return m


@pytest.mark.parametrize("family,bias", [("llama", "attention_bias"), ("llama", "mlp_bias"),
                                         ("qwen3", "attention_bias")])
def test_lean_forward_keeps_every_bias(family, bias):
    """o_proj and MLP biases (Llama's attention_bias / mlp_bias, Qwen3's attention_bias) are part of the forward,
    also after refresh() takes new weights in place (they were dropped: logits off by ~4 against HF)."""
    pol = biased_policy(family, **{bias: True})
    lean = LeanLlama(pol, 64)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    for _ in range(2):
        logits, _ = lean.forward(ids, torch.zeros(1, dtype=torch.long), lean.new_cache(1, 16))
        with torch.no_grad():
            torch.testing.assert_close(logits, pol(ids).logits, atol=1e-4, rtol=1e-4)
            for name, p in pol.named_parameters():  # an RL step moved every bias: refresh must follow
                if name.endswith("bias"):
                    p.add_(0.3)
        lean.refresh()


def test_unsupported_activation_fails_with_its_name():
    pol = tiny_policy()
    pol.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="policy.hidden_act: 'gelu'"):
        LeanLlama(pol, 64)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kv_cache_equals_full_recompute(policy, family):
    pol = policy if family == "llama" else C.family_policy(family)
    aux_ids = (0, 2, 3)
    lean = LeanLlama(pol, 64)
    # four rows: several tokens per row over >= 4 rows take attend's matmul kernel, the rest SDPA's
    prompts = [[4, 8, 15, 16, 23], [30], [7, 7, 1], [3, 1, 4, 1]]
    B, P = len(prompts), 5
    lens = torch.tensor([len(p) for p in prompts])
    toks = torch.full((B, P), 9)  # padding garbage the mask must hide
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p)
    cache = lean.new_cache(B, 64)
    logits, aux = lean.forward(toks, torch.zeros(B, dtype=torch.long), cache, aux_ids)
    seqs = [list(p) for p in prompts]
    for b in range(B):
        ref_l, ref_a = hf_logits_and_aux(pol, seqs[b], aux_ids)
        torch.testing.assert_close(logits[b, : lens[b]], ref_l, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux[b, : lens[b]], ref_a, atol=1e-4, rtol=1e-4)

    g = torch.Generator().manual_seed(0)
    pos = lens.clone()  # next position to write per row
    # verify-like steps of m tokens; keep only `keep` of them (the rest are rejected drafts left stale in the cache)
    for m, keep in ((3, 1), (4, 4), (1, 1), (5, 2), (2, 0), (3, 3)):
        new = torch.randint(0, pol.config.vocab_size, (B, m), generator=g)
        logits, aux = lean.forward(new, pos, cache, aux_ids)
        for b in range(B):
            full = seqs[b] + new[b].tolist()
            ref_l, ref_a = hf_logits_and_aux(pol, full, aux_ids)
            torch.testing.assert_close(logits[b], ref_l[-m:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(aux[b], ref_a[-m:], atol=1e-4, rtol=1e-4)
            seqs[b] += new[b, :keep].tolist()
        pos = pos + keep
    # dropping a row keeps the others intact
    cache.select_rows(torch.tensor([0, 2]))
    new = torch.randint(0, pol.config.vocab_size, (2, 2), generator=g)
    logits, _ = lean.forward(new, pos[[0, 2]], cache)
    for j, b in enumerate((0, 2)):
        ref_l, _ = hf_logits_and_aux(pol, seqs[b] + new[j].tolist(), aux_ids)
        torch.testing.assert_close(logits[j], ref_l[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("B,m", [(1, 1), (2, 3), (4, 1), (4, 3), (32, 1), (33, 2)])
def test_attend_kernels_match_sdpa(B, m):
    # attend picks SDPA or a matmul-softmax-matmul by shape; either must give SDPA's result under a ragged mask
    g = torch.Generator().manual_seed(B * 10 + m)
    cache = KVCache(1, B, 4, 40, 8)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    pos0 = torch.randint(0, 30, (B,), generator=g)
    length = int(pos0.max()) + m
    mask = step_mask(pos0, m, length)
    q = torch.randn(B, 4, m, 8, generator=g)
    want = F.scaled_dot_product_attention(q, cache.k[0][:, :, :length], cache.v[0][:, :, :length], attn_mask=mask)
    torch.testing.assert_close(attend(q, cache, 0, mask, length), want, atol=1e-5, rtol=1e-5)


def test_rope_tables_clamp_only_what_is_past_the_table():
    # `top` (a bound of the positions a caller already holds) skips the clamp; it must never skip a needed one
    rope = Rope.from_theta(8, 10000.0, 16)
    pos = torch.tensor([[3, 15, 16, 40]])  # two positions past the table: padding, read as the last entry
    cos, sin = rope.tables(pos)
    assert cos.shape == sin.shape == (1, 4, 1, 8)
    want = pos.clamp_max(15)[0]
    assert torch.equal(cos[0, :, 0], rope.cos[want]) and torch.equal(sin[0, :, 0, 4:], rope.sin[want, 4:])
    assert torch.equal(sin[0, :, 0, :4], -rope.sin[want, :4])  # rotate_half's sign, folded into the table
    for top in (40, 16):  # a bound at or past the table's end still clamps
        assert all(torch.equal(a, b) for a, b in zip(rope.tables(pos, top), (cos, sin)))
    inside = torch.tensor([[0, 7, 15]])
    assert all(torch.equal(a, b) for a, b in zip(rope.tables(inside, 15), rope.tables(inside)))


def test_lean_aux_ids_must_be_distinct_layers(policy):
    lean = LeanLlama(policy, 16)
    cache = lean.new_cache(1, 16)
    for bad in ((1, 1), (0, 9)):
        with pytest.raises(ValueError, match="aux_layer_ids"):
            lean.forward(torch.tensor([[1, 2]]), torch.zeros(1, dtype=torch.long), cache, bad)


# ---- torch-only: seeding and policy refresh ------------------------------------------------------------------

def test_seeded_generation_is_reproducible(make_engine, policy, drafter):
    eng = make_engine(policy, drafter)
    prompts = C.RAGGED_PROMPTS
    a = eng.generate(prompts, SamplingParams(max_new_tokens=12, seed=5))
    b = eng.generate(prompts, SamplingParams(max_new_tokens=12, seed=5))
    c = eng.generate(prompts, SamplingParams(max_new_tokens=12, seed=6))
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    d = eng.generate(prompts, SamplingParams(max_new_tokens=12))
    e = eng.generate(prompts, SamplingParams(max_new_tokens=12))
    assert d.tokens != e.tokens  # unseeded calls advance the engine's seed


@pytest.mark.parametrize("speculative", [True, False])
def test_more_prompts_than_max_batch_run_in_waves(make_engine, policy, drafter, speculative):
    """engine.max_batch caps the rows generated at once: more prompts run in waves, rows in order, each as it would
    alone (greedy), sampled log-probs the policy's, one seed one result; stats and timeline cover every wave."""
    prompts = C.RAGGED_PROMPTS * 2  # 10 rows, waves of 4 / 4 / 2
    eng = make_engine(policy, drafter, drafter_int8=False, max_batch=4)
    wide = make_engine(policy, drafter, drafter_int8=False)  # max_batch 128: one wave
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    got = eng.generate(prompts, greedy, speculative=speculative)
    assert got.tokens == wide.generate(prompts, greedy, speculative=speculative).tokens
    assert max(got.timeline.batch) <= 4 and got.timeline.batch.count(4) >= 2  # two full waves
    assert got.stats.verify_rows == sum(got.timeline.batch) and len(got.drafter_versions) == len(got.timeline.ends)
    assert sum(got.timeline.tokens) + len(prompts) == got.num_tokens  # each row's first token: its wave's prefill
    sampled = SamplingParams(max_new_tokens=8, seed=3)
    a, b = (eng.generate(prompts, sampled, speculative=speculative) for _ in range(2))
    assert a.tokens == b.tokens and a.finish_reasons == b.finish_reasons == ["length"] * len(prompts)
    assert a.tokens[:5] != a.tokens[5:]  # the waves draw on one generator, not each on the seed afresh
    for p, toks, lps in zip(prompts, a.tokens, a.logprobs):
        torch.testing.assert_close(torch.tensor(lps), C.teacher_forced_logprobs(policy, p, toks, sampled),
                                   atol=1e-4, rtol=0)


def test_update_policy_refreshes_weights(make_engine):
    pol = tiny_policy(seed=7)
    eng = make_engine(pol, C.fresh_drafter(pol))
    params = SamplingParams(temperature=0, max_new_tokens=10)
    before = eng.generate(C.RAGGED_PROMPTS, params).tokens
    other = tiny_policy(seed=8)
    with torch.no_grad():
        pol.load_state_dict(other.state_dict())  # in place, as an optimizer step would
    eng.update_policy()
    after = eng.generate(C.RAGGED_PROMPTS, params)
    assert after.tokens != before
    for p, got in zip(C.RAGGED_PROMPTS, after.tokens):
        assert got == C.hf_greedy(pol, p, 10)


# ---- torch-only: an oracle drafter (every draft accepted) -----------------------------------------------------

BOS = 1
ORACLE_PROMPTS = [[BOS] + p for p in C.RAGGED_PROMPTS]


class OracleState:
    def __init__(self, batch: int, prompts=None):
        # token 0 reaches the drafter only through prompts; without them, every prompt here starts with BOS
        first = [BOS] * batch if prompts is None else prompts[:, 0].tolist()
        self.seqs = [[t] for t in first]

    def select_rows(self, idx):
        self.seqs = [self.seqs[i] for i in idx.tolist()]


class OracleDrafter(torch.nn.Module, Drafter):
    """Drafts with the policy itself through HF forwards: q == p (up to float error), so every draft is
    accepted and long accepted runs reach the engine's commit logic."""

    kind = "oracle"
    follows_policy = False
    reads = Reads()

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def new_state(self, batch, max_len, prompts=None):
        return OracleState(batch, prompts)

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        toks, qs = [], []
        for b, seq in enumerate(st.seqs):
            s, n = int(start[b]), int(n_new[b])
            del seq[s + 1:]
            seq += new_ids[b, :n].tolist()
            assert len(seq) == s + n + 1
            ctx, dt, dq = list(seq), [], []
            for _ in range(k):
                q = processed_probs(self.policy(torch.tensor([ctx])).logits[0, -1], params)
                d = int(q.argmax()) if greedy_drafts else int(torch.multinomial(q, 1, generator=generator))
                ctx.append(d)
                dt.append(d)
                dq.append(q)
            toks.append(dt)
            qs.append(torch.stack(dq))
        return torch.tensor(toks), (None if greedy_drafts else torch.stack(qs))


def test_oracle_drafter_long_runs_stops_and_lengths(make_engine, policy):
    k, n = 4, 18
    eng = make_engine(policy, OracleDrafter(policy), k=k, drafter_int8=False)
    g = SamplingParams(temperature=0, max_new_tokens=n)
    ar = eng.generate(ORACLE_PROMPTS, g, speculative=False)
    sd = eng.generate(ORACLE_PROMPTS, g)
    assert sd.tokens == ar.tokens
    assert sd.stats.acceptance_rate > 0.9  # the oracle is (almost) always right
    assert sd.stats.mean_accepted_length == (n - 1) / -(-(n - 1) // (k + 1))  # each row's last step is cut at n
    assert sd.stats.target_forwards <= -(-(n - 1) // (k + 1)) + 1
    # a stop token emitted mid-run: the accepted drafts after it are dropped
    for row in ar.tokens:
        for cut in (2, 3, 7, 11):  # positions that fall inside accepted runs for k = 4
            stop = row[cut]
            if stop in row[:cut]:
                continue
            b = eng.generate(ORACLE_PROMPTS, SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=(stop,)))
            for r, got, why in zip(ar.tokens, b.tokens, b.finish_reasons):
                want = r[: r.index(stop) + 1] if stop in r else r
                assert got == want and why == ("stop" if stop in r else "length")
            # MAL counts the response only: not the drafts accepted past the stop token, no bonus token there
            assert b.stats.mean_accepted_length == sum(len(t) - 1 for t in b.tokens) / b.stats.verify_rows
    # max_new_tokens that cut a run of k+1 accepted tokens short
    for m in (2, 4, 6, 8):
        b = eng.generate(ORACLE_PROMPTS, SamplingParams(temperature=0, max_new_tokens=m))
        assert b.tokens == [r[:m] for r in ar.tokens]
        assert b.stats.mean_accepted_length == len(ORACLE_PROMPTS) * (m - 1) / b.stats.verify_rows
        assert [len(x) for x in b.logprobs] == [m] * len(ORACLE_PROMPTS)


def test_oracle_drafter_at_max_position(make_engine, policy):
    """All drafts accepted right up to the maximum position: SD emits exactly AR's tokens, none past the last
    position (a full accepted run must not carry a row beyond max_len)."""
    eng = make_engine(policy, OracleDrafter(policy), k=4, drafter_int8=False, max_len=24)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    prompts = [[BOS] + [4] * (16 + i) for i in range(5)] + [[BOS, 5, 9]]
    ar = eng.generate(prompts, params, speculative=False)
    sd = eng.generate(prompts, params)
    assert [len(t) for t in ar.tokens] == [24 - len(p) for p in prompts]
    assert sd.tokens == ar.tokens
    assert sd.finish_reasons == ar.finish_reasons == ["length"] * len(prompts)
    assert sd.stats.acceptance_rate > 0.9 and sd.stats.mean_accepted_length > 2


def test_oracle_drafter_sampled_is_lossless(make_engine, vocab5):
    pol, _ = vocab5
    params = SamplingParams(temperature=0.9, max_new_tokens=3, seed=21)
    eng = make_engine(pol, OracleDrafter(pol), k=2, drafter_int8=False)
    batch = eng.generate([[BOS, 2, 3]] * 600, params)
    assert batch.stats.acceptance_rate > 0.99
    idx = C.seq_index(batch.tokens, 5)
    assert C.chi2_pvalue(idx, C.exact_sequence_probs(pol, [BOS, 2, 3], 3, params)) > C.ALPHA
    for toks, lps in zip(batch.tokens[:20], batch.logprobs[:20]):
        ref = C.teacher_forced_logprobs(pol, [BOS, 2, 3], toks, params)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)


def test_steps_run_the_head_and_sampling_in_chunks_of_rows_and_stay_lossless(make_engine, vocab5, monkeypatch):
    """Where a step's [B, k+1, V] logits pass CHUNK elements (at a real vocabulary, from about 18 rows) the head,
    probs and rejection run on chunks of rows: a whole SD step at 128 rows and V = 151,936 peaked 1.4 GB above AR's
    (scripts/bench_scale.py's job part). Chunked, sampled SD still draws from the policy's distribution, and greedy
    SD gives what the unchunked step gives."""
    import drafttrain.engines.torch_engine as te

    pol, d = vocab5
    seen = []
    logits = LeanLlama.logits
    monkeypatch.setattr(LeanLlama, "logits", lambda self, h: seen.append(tuple(h.shape[:2])) or logits(self, h))
    eng = make_engine(pol, d, k=2, drafter_int8=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    whole = eng.generate([[BOS, 2, 3]] * 7, greedy).tokens
    assert max(b for b, m in seen) == 7  # one chunk at the default CHUNK
    monkeypatch.setattr(te, "CHUNK", 2 * 3 * 5)  # verify [rows, 3, 5]: 2 rows; prefill [rows, 1, 5]: 6 rows
    seen.clear()
    assert eng.generate([[BOS, 2, 3]] * 7, greedy).tokens == whole
    assert {m for b, m in seen} == {1, 3} and all(b <= 30 // (m * 5) for b, m in seen)
    params = SamplingParams(temperature=0.9, max_new_tokens=3, seed=23)
    batch = eng.generate([[BOS, 2, 3]] * 600, params)
    assert batch.stats.mean_accepted_length > 1  # rejection ran, not only AR steps
    idx = C.seq_index(batch.tokens, 5)
    assert C.chi2_pvalue(idx, C.exact_sequence_probs(pol, [BOS, 2, 3], 3, params)) > C.ALPHA


def test_engine_copies_the_drafter(make_engine, policy, drafter):
    """The engine serves its own copy: training the caller's drafter does not change what is served."""
    eng = make_engine(policy, drafter, drafter_int8=False)
    served = {k: v.clone() for k, v in eng.drafter.state_dict().items()}
    d2 = copy.deepcopy(drafter)
    eng2 = make_engine(policy, d2, drafter_int8=False)
    with torch.no_grad():
        d2.fc.weight.add_(1.0)
    assert torch.equal(eng2.drafter.state_dict()["fc.weight"], served["fc.weight"])
    assert eng2.drafter_version == 0


def test_packed_linear_matches_f_linear_and_repacks():
    """The oneDNN-prepacked linear the lean forward uses equals F.linear at every row count (one row, a verify
    pass, a batch), with a bias, and follows an in-place weight change once repacked."""
    from drafttrain.modeling import PackedLinear, linear

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = PackedLinear.wrap(w, b)
    for shape in [(1, 1, 64), (1, 5, 64), (7, 3, 64), (64, 64)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(linear(x, lin), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    w.mul_(-2.0)
    if isinstance(lin, PackedLinear):
        lin.repack()
    x = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close(linear(x, lin), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_pending_drafter_input_appends_in_place():
    """The drafter's pending input (positions verified while it did not run, e.g. AR steps with the toggle off):
    ragged appends land after each row's own count, a consumed buffer restarts at the new start, and appends
    within capacity write in place (a long AR stretch must not copy everything pending at every step)."""
    from drafttrain.drafters.pending import Pending

    p = Pending(torch.tensor([[1, 2, 0], [4, 0, 0]]), torch.arange(6.0).view(2, 3, 1), torch.tensor([2, 1]),
                 torch.tensor([0, 0]))
    p._grow(16)
    ptr = p.ids.data_ptr(), p.aux.data_ptr()
    p.append(torch.tensor([[7, 8], [9, 5]]), torch.tensor([[[10.0], [11.0]], [[12.0], [13.0]]]),
             torch.tensor([1, 2]), torch.tensor([5, 6]))
    ids, aux, n, start = p.view()
    assert ids.tolist() == [[1, 2, 7], [4, 9, 5]] and n.tolist() == [3, 3] and start.tolist() == [0, 0]
    assert aux[:, :, 0].tolist() == [[0.0, 1.0, 10.0], [3.0, 12.0, 13.0]]
    assert (p.ids.data_ptr(), p.aux.data_ptr()) == ptr  # written in place
    p.consumed()
    p.append(torch.tensor([[3, 3], [6, 6]]), torch.zeros(2, 2, 1), torch.tensor([2, 1]), torch.tensor([9, 7]))
    ids, _, n, start = p.view()
    assert ids[0].tolist() == [3, 3] and ids[1, 0] == 6 and n.tolist() == [2, 1] and start.tolist() == [9, 7]
    p.select_rows(torch.tensor([1]))
    assert p.view()[0].tolist() == [[6]] and p.width() == 1
    # one row left (its own path: slices): appends after its count; a consumed buffer restarts at the new start
    p.append(torch.tensor([[8, 9, 4]]), torch.tensor([[[1.0], [2.0], [3.0]]]), torch.tensor([2]), torch.tensor([11]))
    ids, aux, n, start = p.view()
    assert ids.tolist() == [[6, 8, 9]] and aux[0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert n.tolist() == [3] and start.tolist() == [7] and p.width() == 3
    p.consumed()
    p.append(torch.tensor([[5, 1]]), torch.zeros(1, 2, 1), torch.tensor([1]), torch.tensor([20]))
    ids, _, n, start = p.view()
    assert ids.tolist() == [[5]] and n.tolist() == [1] and start.tolist() == [20]
    for _ in range(20):  # past the capacity: grows, keeps what is pending
        p.append(torch.tensor([[2]]), torch.zeros(1, 1, 1), torch.tensor([1]), torch.tensor([0]))
    ids, _, n, start = p.view()
    assert ids.tolist() == [[5] + [2] * 20] and n.tolist() == [21] and start.tolist() == [20]


def test_kv_cache_select_rows_keeps_the_written_prefix(policy):
    """Dropping finished rows copies only the positions written so far; every entry a later step can read (those
    below `used`) survives for the kept rows, in their new order."""
    lean = LeanLlama(policy, 64)
    cache = lean.new_cache(3, 64)
    toks = torch.randint(0, lean.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    lean.forward(toks, torch.tensor([0, 2, 4]), cache)
    assert cache.used == 9 and all(torch.isfinite(t[:, :, :9]).all() for t in cache.k + cache.v)
    before = [t[:, :, :9].clone() for t in cache.k + cache.v]
    cache.select_rows(torch.tensor([2, 0]))
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape[0] == 2 and torch.equal(new[:, :, :9], old[[2, 0]])


def test_keep_order_moves_only_rows_past_the_new_end():
    # finished rows' places are filled by the kept rows past the new end, in order; every other kept row stays put
    assert keep_order(5, [1]).tolist() == [0, 4, 2, 3]
    assert keep_order(5, [4]).tolist() == [0, 1, 2, 3]  # the last row finished: nothing moves
    assert keep_order(6, [1, 3, 5]).tolist() == [0, 4, 2]
    assert keep_order(5, [0, 1]).tolist() == [3, 4, 2]
    assert keep_order(3, [0, 1, 2]).tolist() == []
    for n, done in ((7, [0, 2, 3]), (9, [8, 1, 4]), (4, [])):  # a permutation of the kept rows
        keep = keep_order(n, done).tolist()
        assert sorted(keep) == [j for j in range(n) if j not in done]
        assert sum(k != j for j, k in enumerate(keep)) == sum(1 for j in done if j < n - len(done))


def test_share_prompts_orders_distinct_prompts_first():
    order, src = share_prompts([[1, 2], [3], [1, 2], [4, 5], [3], [1, 2]])
    assert order == [0, 1, 3, 2, 4, 5] and src == [0, 1, 0]  # rows 3.. of that order repeat rows 0, 1, 0
    assert share_prompts([[1], [2]]) == ([0, 1], [])
    assert share_prompts([[7, 7]] * 3) == ([0, 1, 2], [0, 0])


@pytest.mark.parametrize("speculative", [True, False])
def test_repeated_prompts_share_one_prefill(make_engine, policy, drafter, speculative):
    """A GRPO batch holds G copies of each prompt: the prefill runs on the distinct prompts only, and every copy
    generates as if it had been prefilled alone (greedy outputs, and sampled log-probs against the policy)."""
    a, b, c = C.RAGGED_PROMPTS[:3]
    prompts = [a, b, a, c, b, a]
    eng = make_engine(policy, drafter, drafter_int8=False)
    rows = []
    fwd = eng.lean.forward
    eng.lean.forward = lambda toks, *args, **kw: rows.append(toks.shape[0]) or fwd(toks, *args, **kw)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    got = eng.generate(prompts, greedy, speculative=speculative)
    assert rows[0] == 3  # the prefill
    alone = {tuple(p): eng.generate([p], greedy, speculative=speculative).tokens[0] for p in (a, b, c)}
    assert got.tokens == [alone[tuple(p)] for p in prompts]
    sampled = SamplingParams(max_new_tokens=8, seed=3)
    batch = eng.generate(prompts, sampled, speculative=speculative)
    assert len({tuple(t) for t in batch.tokens}) > 3  # the copies of a prompt sample independently
    for p, toks, lps in zip(prompts, batch.tokens, batch.logprobs):
        torch.testing.assert_close(torch.tensor(lps), C.teacher_forced_logprobs(policy, p, toks, sampled),
                                   atol=1e-4, rtol=0)
