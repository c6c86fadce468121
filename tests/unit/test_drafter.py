"""EAGLE-3 drafter: TTT training helps acceptance, the speculators export round-trips, mismatches fail clearly,
and a reduced draft vocabulary stays lossless."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from drafttrain.drafters import build_drafter, check_compatible
from drafttrain.drafters.weights import check_finite
from drafttrain.engines import build_engine
from drafttrain.export import load_drafter, save_drafter
from drafttrain.modeling import LeanLlama
from drafttrain.spec import SamplingParams, processed_probs
from tests import contract as C
from tests.conftest import dense_targets, engine_cfg, set_drafter_keys, tiny_policy


def drafter_cfg(**kw):
    from omegaconf import OmegaConf

    from drafttrain.config import Config

    cfg = OmegaConf.structured(Config).drafter
    cfg.path = None
    set_drafter_keys(cfg, **kw)
    return cfg


def rand_prompts(n: int, seed: int, vocab: int = 32, length: int = 4) -> list[list[int]]:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def features(policy, seqs: torch.Tensor, aux_ids, steps: int):
    """Teacher-forced TTT inputs for equal-length sequences [B, N]: (aux [B, T, A*H], next_ids [B, T+steps-1],
    targets (the policy's distributions at the N positions), valid [B, N]) with T = N - steps."""
    B, N = seqs.shape
    lean = LeanLlama(policy, N)
    logits, aux = lean.forward(seqs, torch.zeros(B, dtype=torch.long), lean.new_cache(B, N), tuple(aux_ids))
    T = N - steps
    return (aux[:, :T], seqs[:, 1:T + steps], dense_targets(processed_probs(logits, SamplingParams())),
            torch.ones(B, N, dtype=bool))


# ---- training ----------------------------------------------------------------------------------------------------

def test_ttt_training_lowers_loss_and_raises_acceptance(policy, drafter):
    steps, decay = 3, 0.8
    ar = build_engine(engine_cfg(drafter_int8=False), policy, None)

    def rollouts(n, seed):
        prompts = rand_prompts(n, seed)
        b = ar.generate(prompts, SamplingParams(max_new_tokens=28, seed=seed), speculative=False)
        return torch.tensor([p + t for p, t in zip(prompts, b.tokens)])  # [n, 32] the policy's own sequences

    train = features(policy, rollouts(64, 0), drafter.aux_layer_ids, steps)
    held = features(policy, rollouts(32, 1), drafter.aux_layer_ids, steps)
    # aux layer id i is HF hidden_states[i] (the policy layer's input)
    with torch.no_grad():
        hs = policy(rollouts(2, 2), output_hidden_states=True).hidden_states
    lean_aux = features(policy, rollouts(2, 2), drafter.aux_layer_ids, steps)[0]
    torch.testing.assert_close(lean_aux, torch.cat([hs[i] for i in drafter.aux_layer_ids], -1)[:, :lean_aux.shape[1]],
                               atol=1e-4, rtol=1e-4)

    trained = copy.deepcopy(drafter)
    with torch.no_grad():
        loss0, acc0 = trained.ttt_loss(*held, steps, decay)
    opt = torch.optim.Adam([p for p in trained.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(80):
        loss, _ = trained.ttt_loss(*train, steps, decay)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.3
    assert torch.equal(trained.embed_tokens.weight, drafter.embed_tokens.weight)  # frozen
    with torch.no_grad():
        loss1, acc1 = trained.ttt_loss(*held, steps, decay)
    assert float(loss1) < float(loss0) - 0.3  # generalizes to held-out rollouts
    assert all(b > a + 0.2 for a, b in zip(acc0, acc1)), (acc0, acc1)

    prompts = rand_prompts(16, 3)
    for params in (SamplingParams(temperature=0, max_new_tokens=32), SamplingParams(max_new_tokens=32, seed=4)):
        mal = {}
        for name, d in (("fresh", drafter), ("trained", trained)):
            b = build_engine(engine_cfg(drafter_int8=False), policy, d).generate(prompts, params)
            mal[name] = b.stats.mean_accepted_length
        assert mal["trained"] > mal["fresh"] + 0.5, mal


def test_ttt_logits_match_chain_drafting(drafter):
    """Training-time test unrolls exactly what inference does: step i at position t equals the chain-drafting step
    at position t+i over a cache holding the step-0 (policy-derived) positions <= t."""
    d = perturbed(drafter, seed=9)
    c = d.config
    B, T, steps = 2, 7, 3
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    next_ids = torch.randint(0, c.vocab_size, (B, T + steps - 1), generator=g)  # next_ids[:, t] = token_{t+1}
    with torch.no_grad():
        C.ttt_matches_chain(d, aux, next_ids, steps, d.ttt_logits(aux, next_ids, steps), tol=1e-5)


def test_ttt_loss_alignment(drafter):
    """With one-hot targets at the real next tokens, step i at position t is scored on token_{t+2+i}."""
    d = perturbed(drafter, seed=10)
    c = d.config
    B, T, steps, decay = 2, 6, 3, 0.5
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, c.vocab_size, (B, T + steps + 1), generator=g)  # tokens x_0 .. x_{T+steps}
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    next_ids = x[:, 1:T + steps]  # token_{t+1}
    target = torch.nn.functional.one_hot(x[:, 1:], c.vocab_size).float()  # [B, T+steps, V]: position s -> x_{s+1}
    valid = torch.ones(B, T + steps, dtype=torch.bool)
    valid[1, T + steps - 2:] = False  # row 1 ends early
    with torch.no_grad():
        loss, _ = d.ttt_loss(aux, next_ids, dense_targets(target), valid, steps, decay)
        outs = d.ttt_logits(aux, next_ids, steps)
    want, wsum = 0.0, 0.0
    for i in range(steps):
        nll = -outs[i].log_softmax(-1).gather(-1, x[:, 2 + i:2 + i + T].unsqueeze(-1)).squeeze(-1)  # [B, T]
        m = valid[:, 1 + i:1 + i + T].float()
        want += decay ** i * float((nll * m).sum() / m.sum())
        wsum += decay ** i
    assert float(loss) == pytest.approx(want / wsum, rel=1e-5)


# ---- export / load ------------------------------------------------------------------------------------------------

def new_positions(c, B: int, m: int, g: torch.Generator):
    """Random propose inputs for a drafter config: token ids [B, m] and policy aux states [B, m, A*H]."""
    return (torch.randint(0, c.vocab_size, (B, m), generator=g),
            torch.randn(B, m, len(c.aux_layer_ids) * c.hidden_size, generator=g))


def perturbed(drafter, seed=0):
    """A copy with every tensor (norms and the vocab map included) moved off its init, so a round trip that drops
    or renames any of them is caught."""
    d = copy.deepcopy(drafter)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return d


def propose_once(d, seed=0, greedy=False):
    g = torch.Generator().manual_seed(seed)
    c = d.config
    B, m, k = 3, 5, 4
    st = d.new_state(B, 32)
    ids = torch.randint(0, c.vocab_size, (B, m), generator=g)
    aux = torch.randn(B, m, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    n_new, start = torch.tensor([5, 2, 4]), torch.tensor([0, 3, 1])
    return d.propose(st, ids, aux, n_new, start, k, SamplingParams(temperature=0.9), greedy, g)


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_export_round_trip(tmp_path, policy, drafter, draft_vocab):
    if draft_vocab is None:
        d = perturbed(drafter)
    else:
        d = perturbed(build_drafter(drafter_cfg(draft_vocab_size=draft_vocab), policy))
        d.set_vocab_map(torch.randperm(32, generator=torch.Generator().manual_seed(0))[:draft_vocab])
    out = save_drafter(d, tmp_path / "eagle3", verifier="checkpoints/policy", k=3)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("speculators_model_type", "transformer_layer_config", "speculators_config", "draft_vocab_size",
                "eagle_aux_hidden_state_layer_ids"):
        assert key in cfg, key
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(d.aux_layer_ids)
    assert cfg["draft_vocab_size"] == d.config.draft_vocab_size
    t = cfg["transformer_layer_config"]
    assert (t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]) == (policy.config.hidden_size, 32, 1)
    assert cfg["draft_vocab_size"] == (draft_vocab or 32)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "checkpoints/policy"

    loaded = load_drafter(out)
    a, b = d.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert "norm.weight" in a and "layers.0.hidden_norm.weight" in a  # the speculators names
    assert loaded.aux_layer_ids == d.aux_layer_ids
    for greedy in (True, False):
        (t1, q1), (t2, q2) = propose_once(d, 1, greedy), propose_once(loaded, 1, greedy)
        assert torch.equal(t1, t2)
        assert (q1 is None and q2 is None) if greedy else torch.equal(q1, q2)
    # a re-save over an existing checkpoint replaces it atomically
    d2 = perturbed(drafter, seed=5)
    save_drafter(d2, out)
    assert torch.equal(load_drafter(out).state_dict()["fc.weight"], d2.state_dict()["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3"]  # no temp folders left behind


def test_load_speculators_checkpoint_without_drafttrain_block(tmp_path, drafter):
    """A checkpoint written elsewhere (only the speculators keys) loads from its speculators config."""
    d = perturbed(drafter, seed=2)
    out = save_drafter(d, tmp_path / "ext")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafttrain"]
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = load_drafter(out)
    for k, v in d.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert loaded.config.rope_theta == d.config.rope_theta
    assert loaded.config.head_dim == d.config.head_dim
    t1, q1 = propose_once(d, 3)
    t2, q2 = propose_once(loaded, 3)
    assert torch.equal(t1, t2) and torch.equal(q1, q2)


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual"),
    (lambda c: c["transformer_layer_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "rope type"),
])
def test_foreign_checkpoint_with_an_unsupported_setting_fails(tmp_path, drafter, edit, key):
    """A speculators checkpoint whose forward differs from this drafter's (norm_before_residual: the residual is
    the normed hidden; another activation or rope type) is refused with one line, not loaded into a drafter that
    computes something else."""
    out = save_drafter(drafter, tmp_path / "ext")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafttrain"]
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key) as e:
        load_drafter(out)
    assert "\n" not in str(e.value)


def test_speculators_checkpoint_builds_for_its_policy(tmp_path, policy):
    """An external speculators checkpoint does not record the target's depth; aux ids that leave out the last layer
    (vLLM's default (2, n//2, n-3) always does) must still load for the policy they fit."""
    d = perturbed(build_drafter(drafter_cfg(aux_layer_ids=[0, 2]), policy), seed=6)
    out = save_drafter(d, tmp_path / "ext")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafttrain"]
    (out / "config.json").write_text(json.dumps(cfg))
    got = build_drafter(drafter_cfg(path=str(out)), policy)
    assert got.aux_layer_ids == (0, 2)
    assert got.config.target_num_layers == policy.config.num_hidden_layers
    for k, v in d.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    with pytest.raises(ValueError, match="aux_layer_ids"):  # still refused where the ids do not fit
        build_drafter(drafter_cfg(path=str(out)), tiny_policy(layers=2))


def test_build_drafter_from_path(tmp_path, policy, drafter):
    d = perturbed(drafter, seed=3)
    save_drafter(d, tmp_path / "ok")
    got = build_drafter(drafter_cfg(path=str(tmp_path / "ok")), policy)
    assert torch.equal(got.state_dict()["fc.weight"], d.state_dict()["fc.weight"])


# ---- mismatches fail clearly ------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("aux_layer_ids", [0, 1, 2]), ("draft_vocab_size", 16),
                                       ("intermediate_size", 64)])
def test_recipe_shape_that_contradicts_the_checkpoint_fails(tmp_path, policy, drafter, key, value):
    """drafter.path set and a drafter shape key the checkpoint does not have: a one-line error naming the key (it
    used to be ignored silently, the checkpoint's shape winning); the checkpoint's own value is accepted."""
    save_drafter(drafter, tmp_path / "ok")
    with pytest.raises(ValueError, match=f"drafter.eagle3.{key}") as e:
        build_drafter(drafter_cfg(path=str(tmp_path / "ok"), **{key: value}), policy)
    assert "\n" not in str(e.value)
    same = list(drafter.aux_layer_ids) if key == "aux_layer_ids" else getattr(drafter.config, key)
    build_drafter(drafter_cfg(path=str(tmp_path / "ok"), **{key: same}), policy)


def test_policy_drafter_mismatch(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "d")
    cases = [
        (tiny_policy(hidden=32, inter=64), "hidden_size"),
        (tiny_policy(vocab=40), "vocab_size"),
        (tiny_policy(layers=3), "aux_layer_ids"),
        (tiny_policy(layers=5), "aux_layer_ids"),  # ids fit, but the drafter was built for a 4-layer policy
    ]
    for other, field in cases:
        with pytest.raises(ValueError, match=field):
            check_compatible(drafter, other)
        with pytest.raises(ValueError, match=field):
            build_drafter(drafter_cfg(path=str(tmp_path / "d")), other)
        # handed to an engine directly, or left behind by a policy update: the same one line, not a torch error at
        # the first SD step
        with pytest.raises(ValueError, match=field):
            build_engine(engine_cfg(), other, drafter)
        eng = build_engine(engine_cfg(), tiny_policy(), drafter)
        with pytest.raises(ValueError, match=field):
            eng.update_policy(other)


@pytest.mark.parametrize("kind", ["mtp", "draft_model", "suffix"])
def test_other_kinds_for_another_vocabulary_refused_at_build(kind):
    """The draft model and the suffix drafter carry no config of sizes: a draft model over another vocabulary
    failed at the first SD step (IndexError: index out of range in self), a suffix drafter with a draft_probs shape
    error. Now one line at build, and at a policy update, as EAGLE-3's."""
    d = C.fresh_drafter(tiny_policy(vocab=48), kind=kind)
    with pytest.raises(ValueError, match="^drafter vocab_size 48 != policy vocab_size 32$"):
        build_engine(engine_cfg(), tiny_policy(vocab=32), d)
    eng = build_engine(engine_cfg(), tiny_policy(vocab=48), d)
    with pytest.raises(ValueError, match="^drafter vocab_size 48 != policy vocab_size 32$"):
        eng.update_policy(tiny_policy(vocab=32))


def test_engine_refuses_a_nonfinite_drafter_at_build(drafter):
    """No corrupt drafter reaches an engine: load_drafter refused NaN weights, the one an engine was built with
    was taken as it came."""
    bad = perturbed(drafter, seed=3)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight has NaN or inf"):
        build_engine(engine_cfg(), tiny_policy(), bad)


@pytest.mark.parametrize("aux", [[0, 9], [1, 1, 2], [3, 1], [-1, 2]])
def test_bad_aux_layer_ids(policy, aux):
    with pytest.raises(ValueError, match=r"drafter\.eagle3\.aux_layer_ids"):
        build_drafter(drafter_cfg(aux_layer_ids=aux), policy)


def test_bad_draft_vocab_size(policy):
    for v in (33, -1):
        with pytest.raises(ValueError, match=r"drafter\.eagle3\.draft_vocab_size"):
            build_drafter(drafter_cfg(draft_vocab_size=v), policy)


def test_missing_checkpoint_path(tmp_path, policy):
    missing = tmp_path / "no_such_drafter"
    with pytest.raises(FileNotFoundError, match="no_such_drafter"):
        build_drafter(drafter_cfg(path=str(missing)), policy)
    with pytest.raises(FileNotFoundError, match="checkpoints/not_here"):
        build_drafter(drafter_cfg(path="checkpoints/not_here"), policy)
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="half"):
        load_drafter(half)


def test_unknown_drafter_kind(policy):
    with pytest.raises(ValueError, match="drafter.kind"):
        build_drafter(drafter_cfg(kind="medusa"), policy)


# ---- reduced draft vocabulary -------------------------------------------------------------------------------------

def test_small_draft_vocab_greedy_sd_equals_ar(policy):
    d = build_drafter(drafter_cfg(draft_vocab_size=12), policy)
    ids = torch.tensor([3, 0, 31, 10, 14, 27, 2, 5, 8, 20, 21, 7])  # unsorted on purpose
    d.set_vocab_map(ids)
    assert torch.equal(d.draft_ids(), ids.sort().values)
    assert int(d.t2d.sum()) == 12 and bool(d.t2d[31]) and not bool(d.t2d[1])
    for greedy in (True, False):
        toks, q = propose_once(d, 4, greedy)
        assert torch.isin(toks, ids).all()
        if q is not None:
            outside = torch.ones(32, dtype=torch.bool)
            outside[ids] = False
            assert (q[..., outside] == 0).all()
    for int8 in (False, True):
        eng = build_engine(engine_cfg(drafter_int8=int8), policy, d)
        params = SamplingParams(temperature=0, max_new_tokens=20)
        sd, ar = eng.generate(C.RAGGED_PROMPTS, params), eng.generate(C.RAGGED_PROMPTS, params, speculative=False)
        assert sd.tokens == ar.tokens and sd.stats.drafted > 0


def test_small_draft_vocab_is_lossless():
    """Draft probabilities are zero outside the draft vocabulary; the output distribution is still exact."""
    pol = C.tiny_vocab_policy(vocab=5)
    d = build_drafter(drafter_cfg(draft_vocab_size=3), pol)
    d.set_vocab_map(torch.tensor([0, 2, 4]))

    def make_engine(policy, drafter=None, **kw):
        return build_engine(engine_cfg(**kw), policy, drafter)

    C.exact_distribution(make_engine, pol, d, SamplingParams(max_new_tokens=3, seed=8), n_rows=3000,
                         wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2, drafter_int8=False)


@pytest.mark.parametrize("int8", [False, True])
def test_fused_inference_form_drafts_as_the_modules_do(drafter, int8):
    """The engine's runtime form (q|k|v and gate|up fused, prepacked fp32 or int8 linears) proposes what the
    training modules propose: the same draft distributions (fp32 to float tolerance; int8 close)."""
    d = perturbed(drafter, seed=4)
    f = copy.deepcopy(d).fuse_for_inference(int8=int8)
    c = d.config
    B, m, k = 3, 5, 4
    g = torch.Generator().manual_seed(0)
    ids, aux = new_positions(c, B, m, g)
    n_new, start = torch.tensor([5, 2, 4]), torch.tensor([0, 3, 1])
    params = SamplingParams(temperature=1.0)
    out = [x.propose(x.new_state(B, 32), ids, aux, n_new, start, k, params, False, torch.Generator().manual_seed(1))
           for x in (d, f)]
    tol = 0.05 if int8 else 1e-4
    torch.testing.assert_close(out[1][1][:, 0], out[0][1][:, 0], atol=tol, rtol=0)  # first draft: same input
    if not int8:  # same tokens drawn, so every later position is comparable too
        assert torch.equal(out[0][0], out[1][0])
        torch.testing.assert_close(out[1][1], out[0][1], atol=1e-4, rtol=0)
    assert f.state_dict().keys() == d.state_dict().keys()  # the fused form adds no tensors to the layout


@pytest.mark.parametrize("fused", [False, True])
def test_ragged_catch_up_drafts_as_each_row_alone(drafter, fused):
    """A batched propose whose rows catch up on different numbers of new positions (padded to the longest, only the
    last real position's output used) drafts what each row drafts on its own, unpadded."""
    d = perturbed(drafter, seed=11)
    if fused:
        d = d.fuse_for_inference(int8=False)
    c = d.config
    B, m, k = 3, 6, 4
    g = torch.Generator().manual_seed(3)
    ids, aux = new_positions(c, B, m, g)
    n_new, start = torch.tensor([6, 2, 4]), torch.tensor([0, 5, 2])
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        # earlier positions of each row, so the catch-up attends over a real prefix
        pre_ids, pre_aux = new_positions(c, B, 5, g)
        st = d.new_state(B, 32)
        d.propose(st, pre_ids, pre_aux, start.clamp_min(1), torch.zeros(B, dtype=torch.long), 1, params, True)
        toks, q = d.propose(st, ids, aux, n_new, start, k, params, True)
        for b in range(B):
            st1 = d.new_state(1, 32)
            s = int(start[b].clamp_min(1))
            d.propose(st1, pre_ids[b:b + 1, :s], pre_aux[b:b + 1, :s], torch.tensor([s]),
                      torch.zeros(1, dtype=torch.long), 1, params, True)
            n = int(n_new[b])
            t1, _ = d.propose(st1, ids[b:b + 1, :n], aux[b:b + 1, :n], n_new[b:b + 1], start[b:b + 1], k, params, True)
            assert torch.equal(t1[0], toks[b]), b


def _ttt_inputs(d, B: int, T: int, steps: int, seed: int):
    """(generator, aux [B, T, A*H], next_ids [B, T+steps-1]): random TTT inputs for drafter d."""
    c = d.config
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    return g, aux, torch.randint(0, c.vocab_size, (B, T + steps - 1), generator=g)


def test_ttt_queries_equal_the_full_result_there(drafter):
    """ttt_logits at a subset of query positions (cheaper online steps) is the full result at those positions, for
    every TTT step; ttt_loss with query_frac < 1 trains (finite, with gradients into every trained tensor)."""
    d = perturbed(drafter, seed=12)
    B, T, steps = 2, 9, 3
    g, aux, next_ids = _ttt_inputs(d, B, T, steps, seed=4)
    S = torch.tensor([0, 3, 4, 8])
    with torch.no_grad():
        full = d.ttt_logits(aux, next_ids, steps)
        sub = d.ttt_logits(aux, next_ids, steps, S)
    for f, s in zip(full, sub):
        torch.testing.assert_close(s, f[:, S], atol=1e-5, rtol=1e-5)
    probs = torch.softmax(torch.randn(B, T + steps, d.config.vocab_size, generator=g), -1)
    valid = torch.ones(B, T + steps, dtype=torch.bool)
    loss, accs = d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, 0.8, query_frac=0.4, generator=g)
    loss.backward()
    assert torch.isfinite(loss) and len(accs) == steps
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters() if p.requires_grad)



def test_ttt_queries_project_q_at_the_queries_only(drafter):
    """With queries, step 0 projects q for the S query positions alone (k and v still over every position: the
    queries attend to all of them); before, q ran over all B x T positions and was then cut (~9% of a step)."""
    d = perturbed(drafter, seed=13)
    B, T, steps = 2, 9, 3
    _, aux, next_ids = _ttt_inputs(d, B, T, steps, seed=5)
    S = torch.tensor([1, 4, 8])
    rows = {"q": [], "k": []}
    a = d.layers[0].self_attn
    hooks = [a.q_proj.register_forward_hook(lambda m, i, o: rows["q"].append(o.shape[1])),
             a.k_proj.register_forward_hook(lambda m, i, o: rows["k"].append(o.shape[1]))]
    with torch.no_grad():
        d.ttt_logits(aux, next_ids, steps, S)
    for h in hooks:
        h.remove()
    assert rows["q"] == [len(S)] * steps and rows["k"] == [T] + [len(S)] * (steps - 1)

def test_ttt_queries_are_drawn_among_response_positions(drafter):
    """query_frac=0.5 over rows whose responses start at column 5 and 6 (prompt before, padding after column 11):
    every query is a chain start that drafts a response token (its step-0 target valid in some row), half of them.
    Drawn over all T, ~half the queries were prompt or padding and added nothing to the loss."""
    d = perturbed(drafter, seed=13)
    B, T, steps = 2, 16, 3
    g, aux, next_ids = _ttt_inputs(d, B, T, steps, seed=5)
    probs = torch.softmax(torch.randn(B, T + steps, d.config.vocab_size, generator=g), -1)
    valid = torch.zeros(B, T + steps, dtype=torch.bool)
    valid[0, 5:10], valid[1, 6:12] = True, True  # step-0 targets at t+1: chain starts t = 4..10
    seen = []
    real = d.ttt_hidden

    def record(aux_, ids_, steps_, queries=None, first_ids=None):
        seen.append(queries)
        return real(aux_, ids_, steps_, queries)

    d.ttt_hidden = record
    for _ in range(20):
        d.ttt_loss(aux, next_ids, dense_targets(probs), valid, steps, 0.8, query_frac=0.5, generator=g)
    assert all(len(S) == 4 and set(S.tolist()) <= set(range(4, 11)) for S in seen), seen
    assert set(torch.cat(seen).tolist()) == set(range(4, 11))


def test_ttt_logits_in_the_runtime_form_equal_the_training_form(drafter):
    """Teacher-forced scoring runs ttt_logits on the engine's runtime form (fuse_for_inference: fused, norms folded,
    prepacked fp32 or int8): fp32 gives the training form's logits, int8 close to them, at every TTT step."""
    import copy

    d = perturbed(drafter, seed=14).eval()
    B, T, steps = 2, 12, 3
    g, aux, next_ids = _ttt_inputs(d, B, T, steps, seed=6)
    S = torch.tensor([1, 5, 11])
    with torch.no_grad():
        ref = d.ttt_logits(aux, next_ids, steps, S)
        fp32 = copy.deepcopy(d).fuse_for_inference(False).ttt_logits(aux, next_ids, steps, S)
        int8 = copy.deepcopy(d).fuse_for_inference(True).ttt_logits(aux, next_ids, steps, S)
    for r, f, q in zip(ref, fp32, int8):
        torch.testing.assert_close(f, r, atol=1e-4, rtol=1e-4)
        assert (q - r).abs().max() < 0.1 * r.abs().max()


def test_finite_check_refuses_nan_and_inf_only():
    """check_finite sums each tensor: a finite fp16 tensor whose sum overflows (1024 x 128 x 0.6 > 65504) is still
    finite and loads; NaN or inf anywhere is refused, naming the tensor."""
    big = torch.full((1024, 128), 0.6, dtype=torch.float16)
    assert not torch.isfinite(big.sum())  # the overflow the check must see through
    check_finite({"fc.weight": big})
    for bad in (float("nan"), float("inf")):
        w = big.clone()
        w[3, 7] = bad
        with pytest.raises(ValueError, match="fc.weight has NaN or inf"):
            check_finite({"fc.weight": w})


def test_a_kind_brings_its_load_and_vllm_form_or_is_refused_in_one_line(policy):
    """The registry, not the engines or export, knows what a kind can do: one that loads no checkpoint refuses
    drafter.path, one without a vLLM form is refused by name; the shipped kinds' forms are vLLM's methods."""
    from drafttrain.drafters.base import DRAFTERS
    from drafttrain.engines.vllm_forms import form_of

    assert DRAFTERS["eagle3"].load is not None and DRAFTERS["selfquant"].load is None
    with pytest.raises(ValueError, match="drafter.path: must be null for drafter.kind=selfquant") as e:
        build_drafter(set_drafter_keys(drafter_cfg(kind="selfquant"), path="checkpoints/eagle3"), policy)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="drafter.kind: 'toy' has no vLLM form") as e:
        form_of("toy")
    assert "\n" not in str(e.value)
    assert form_of("eagle3").method == "eagle3" and DRAFTERS["auto"].vllm is None
    assert form_of("selfquant").method == "draft_model"
