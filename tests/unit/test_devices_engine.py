"""One device, named where a tensor is born: the embedded engine and the drafters under the meta check.

Under tests/devcheck.models_on_cpu_tensors_on_meta() the models sit on the CPU and every tensor drafttrain makes
without naming a device lands on `meta`, so a CPU tensor that would meet a CUDA model on a GPU run fails here at once.
Each check runs the same call with and without the mode and asserts equal results (generate for every drafter kind,
sampled and greedy, and AR; each trainable kind's ttt_loss and its backward). The tests marked `cuda` run the
lossless contract on a GPU (skipped where there is none).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from drafttrain.drafters import TargetHead, Targets
from drafttrain.spec import SamplingParams
from tests import contract as C
from tests.conftest import tiny_policy
from tests.devcheck import models_on_cpu_tensors_on_meta

# (id, drafter keys, engine keys): every kind the embedded engine serves, its int8 form where it has one
KINDS = [
    ("eagle3", dict(kind="eagle3"), {}),
    ("eagle3_int8", dict(kind="eagle3"), dict(drafter_int8=True)),
    ("mtp", dict(kind="mtp"), {}),
    ("draft_model", dict(kind="draft_model", layers=1), {}),
    ("selfquant_int8", dict(kind="selfquant", quant="int8"), {}),
    ("selfquant_int4", dict(kind="selfquant", quant="int4", group_size=32), {}),
    ("suffix", dict(kind="suffix"), {}),
    ("auto", dict(kind="auto", kinds=["eagle3", "suffix"], paths=[None, None]), {}),
]
TRAINABLE = ["eagle3", "mtp", "draft_model"]
PROMPTS = [[5, 9, 3], [7], [11, 4, 8, 20, 1], [5, 9, 3]]  # ragged, one repeated (a shared prefill)
PARAMS = [SamplingParams(max_new_tokens=10, seed=3), SamplingParams(temperature=0, max_new_tokens=10),
          SamplingParams(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=10, seed=4)]


@pytest.fixture(scope="module")
def pol():
    return tiny_policy(vocab=32, hidden=32, layers=4, heads=2, kv_heads=1, inter=64)


def _same(a, b, exact: bool = True, greedy: bool = False):
    """exact=False: drafter.kind=auto, whose chooser picks members (or none) on measured step times: the same
    lengths, and the same tokens where the draws cannot change them (greedy)."""
    assert [len(t) for t in a.tokens] == [len(t) for t in b.tokens]
    if exact or greedy:
        assert a.tokens == b.tokens
        assert a.finish_reasons == b.finish_reasons
        torch.testing.assert_close(torch.tensor(sum(a.logprobs, [])), torch.tensor(sum(b.logprobs, [])))
    if exact:
        assert a.stats.to_dict() == b.stats.to_dict()


@pytest.mark.parametrize("name,dkw,ekw", KINDS, ids=[k[0] for k in KINDS])
def test_generate_names_every_device(make_engine, pol, name, dkw, ekw):
    """SD with each kind (sampled, greedy, top-k/top-p) and AR: nothing is made off the models' device, and the
    results are the ones the same calls give outside the mode (the suffix index learns from each generation: each
    engine runs the same sequence of calls; auto: see _same)."""
    plain = make_engine(pol, C.fresh_drafter(pol, **dkw), k=3, **ekw)
    checked = make_engine(pol, C.fresh_drafter(pol, **dkw), k=3, **ekw)
    for params in PARAMS:
        for speculative in (True, False):
            want = plain.generate(PROMPTS, params, speculative=speculative)
            with models_on_cpu_tensors_on_meta() as mode:
                got = checked.generate(PROMPTS, params, speculative=speculative)
            assert not mode.redirected, sorted(mode.redirected)
            _same(got, want, exact=name != "auto", greedy=params.greedy)
            if speculative and name != "auto":  # auto's chooser may serve no member (AR) where that is faster
                assert got.stats.drafted > 0


def test_toggle_calibration_names_every_device(make_engine, pol):
    """The toggle's calibration (schedule.py) times forwards on tensors it makes: they are the model's too."""
    eng = make_engine(pol, C.fresh_drafter(pol, kind="eagle3"), k=3, toggle=True)
    with models_on_cpu_tensors_on_meta() as mode:
        eng.generate(PROMPTS, PARAMS[0])
    assert not mode.redirected, sorted(mode.redirected)


@pytest.mark.parametrize("kind", TRAINABLE)
def test_ttt_loss_and_backward_name_every_device(make_engine, pol, kind):
    """Each trainable kind's training-side calls (ttt_loss and its backward, the teacher-forced draft logits the
    scorer reads): the same loss, gradients and logits as outside the mode."""
    from drafttrain.tracking import teacher_forced_features

    prompts, resp = C.rollouts(make_engine, pol, n=4, max_new=12)
    runs = []
    for meta in (False, True):
        d = C.fresh_drafter(pol, seed=1, kind=kind, **({"layers": 1} if kind == "draft_model" else {}))
        f = teacher_forced_features(pol, prompts, resp, d.reads, 2)
        targets = Targets(f["hidden"], TargetHead.of(pol))
        with models_on_cpu_tensors_on_meta() if meta else _nothing() as mode:
            loss, accs = d.ttt_loss(f["aux"], f["next_ids"], targets, f["valid"], 2, 0.8, first_ids=f["first_ids"])
            loss.backward()
            with torch.no_grad():
                logits = d.ttt_logits(f["aux"], f["next_ids"], 2, first_ids=f["first_ids"])
        if meta:
            assert not mode.redirected, sorted(mode.redirected)
        grads = [p.grad.clone() for p in d.parameters() if p.grad is not None]
        runs.append((loss.detach(), accs, grads, logits))
    (l0, a0, g0, x0), (l1, a1, g1, x1) = runs
    torch.testing.assert_close(l1, l0)
    assert a1 == a0 and len(g1) == len(g0) > 0
    for a, b in zip(g1 + list(x1), g0 + list(x0)):
        torch.testing.assert_close(a, b)


def test_expected_stats_name_every_device():
    """spec.expected_row_stats (the scorer's expected SpecStats from acceptance ratios) makes its tensors on r's."""
    from drafttrain.spec import expected_row_stats

    g = torch.Generator(device="cpu").manual_seed(0)
    r, valid = torch.rand(3, 9, 4, generator=g), torch.ones(3, 10, dtype=torch.bool)
    valid[1, 7:] = False
    want = expected_row_stats(r, valid, 4)
    with models_on_cpu_tensors_on_meta() as mode:
        got = expected_row_stats(r, valid, 4)
    assert not mode.redirected, sorted(mode.redirected)
    assert got[0].to_dict() == want[0].to_dict()
    torch.testing.assert_close(got[1], want[1], equal_nan=True)
    torch.testing.assert_close(got[2], want[2])


def test_rope_tables_move_with_the_drafter(pol):
    """The RoPE tables are module buffers (not state): .to() takes them along, the state_dict does not hold them."""
    for kind in ("eagle3", "mtp"):
        d = C.fresh_drafter(pol, kind=kind)
        assert not any("rope" in k for k in d.state_dict())
        d.to("meta")
        assert d.rope._cs.device.type == "meta" and d.rope.cos.device.type == "meta", kind


@pytest.mark.parametrize("kind", TRAINABLE)
def test_drafters_are_built_and_copied_onto_the_policys_device(pol, kind):
    """build_drafter with a policy on another device (meta here: shapes only) builds the drafter there; the engine's
    runtime copy lands on the engine's device, fused forms included."""
    from drafttrain.drafters.base import runtime_copy

    on_meta = copy.deepcopy(pol).to("meta")
    d = C.fresh_drafter(on_meta, kind=kind, **({"layers": 1} if kind == "draft_model" else {}))
    assert {t.device.type for t in (*d.parameters(), *d.buffers())} == {"meta"}
    rt = runtime_copy(C.fresh_drafter(pol, kind=kind, **({"layers": 1} if kind == "draft_model" else {})), False,
                      device="meta")
    held = [*rt.parameters(), *rt.buffers()] if kind != "draft_model" else list(rt.state_dict().values())
    assert held and {t.device.type for t in held} == {"meta"}


# ---- int8 / int4 forms where their kernels do not run ------------------------------------------------------------
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_ao_forms_run_weight_only_off_the_cpu(quant, caplog):
    """quant.backend_on decides by the device's type: on the CPU the ao kernels (fbgemm int8, aten's CPU int4), on a
    GPU the weight-only ref forms (int8/int4 weights, the matmul in the activation dtype), logged once; both within
    quantization error of the fp32 linear."""
    from drafttrain import quant as Q

    g = torch.Generator(device="cpu").manual_seed(0)
    w, b, x = (torch.randn(*s, generator=g) for s in ((64, 64), (64,), (5, 64)))
    ref = F.linear(x, w, b)
    cpu = Q.quant_linear(quant, "ao", [w[:32], w[32:]], b, 32)
    assert type(cpu) is {"int8": Q.AoInt8, "int4": Q.AoInt4}[quant]
    Q._once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="drafttrain.quant"):
        gpu = Q.quant_linear(quant, "ao", [w[:32], w[32:]], b, 32, device="cuda")  # as a policy on a GPU would
        Q.quant_linear(quant, "ao", [w], b, 32, device=torch.device("cuda", 1))
    assert type(gpu) is {"int8": Q.RefInt8, "int4": Q.RefInt4}[quant]
    assert len([r for r in caplog.records if "CPU-only" in r.getMessage()]) == 1  # one line, not one per linear
    assert Q.backend_on(quant, "bnb", "cuda") == "bnb" and Q.backend_on(quant, "ref", "cuda") == "ref"
    tol = {"int8": 0.02, "int4": 0.15}[quant]
    for lin in (cpu, gpu):
        assert float((lin(x) - ref).norm() / ref.norm()) < tol


def test_quantize_module_int8_keeps_full_precision_off_the_cpu(caplog):
    from drafttrain import quant as Q

    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert Q.quantize_module_int8(copy.deepcopy(m))[0].__class__ is not torch.nn.Linear  # ao dynamic int8 on CPU
    Q._once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="drafttrain.quant"):
        kept = Q.quantize_module_int8(m, device="cuda")
    assert kept is m and type(m[0]) is torch.nn.Linear and "full precision" in caplog.text


@pytest.mark.parametrize("dkw,ekw", [(dict(kind="selfquant", quant="int8"), {}),
                                     (dict(kind="selfquant", quant="int4", group_size=32), {}),
                                     (dict(kind="eagle3"), dict(drafter_int8=True))], ids=["int8", "int4", "eagle3"])
def test_gpu_forms_serve_lossless_sd(make_engine, pol, monkeypatch, dkw, ekw):
    """The forms a GPU run gets (backend_on pretending every device is cuda): the engine serves them, greedy SD
    equals AR, and the self-drafter drafts as well as with the CPU kernels (both quantize the same weights)."""
    from drafttrain import quant as Q

    params = SamplingParams(temperature=0, max_new_tokens=12)
    cpu = make_engine(pol, C.fresh_drafter(pol, **dkw), k=3, **ekw).generate(PROMPTS, params)
    real = Q.backend_on
    monkeypatch.setattr(Q, "backend_on", lambda q, b, dev: real(q, b, "cuda"))
    eng = make_engine(pol, C.fresh_drafter(pol, **dkw), k=3, **ekw)
    linears = eng.drafter.body.packed[0].values() if dkw["kind"] == "selfquant" else eng.drafter._fused.values()
    assert any(isinstance(v, (Q.RefInt8, Q.RefInt4)) for v in linears)
    sd = eng.generate(PROMPTS, params)
    assert sd.tokens == eng.generate(PROMPTS, params, speculative=False).tokens == cpu.tokens
    assert sd.stats.drafted > 0 and sd.stats.acceptance_rate >= 0.8 * cpu.stats.acceptance_rate


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- on a GPU ---------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name,dkw,ekw", KINDS, ids=[k[0] for k in KINDS])
def test_greedy_sd_equals_ar_on_cuda(make_engine, name, dkw, ekw):
    """Every kind on the GPU: its weights there, greedy SD == greedy AR == the policy's own greedy output."""
    pol = tiny_policy().cuda()
    d = C.fresh_drafter(pol, **({**dkw, "group_size": 64} if "group_size" in dkw else dkw))  # hidden 64
    assert {t.device.type for t in d.state_dict().values()} <= {pol.device.type}  # cuda
    eng = make_engine(pol, d, **ekw)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    sd = eng.generate(C.RAGGED_PROMPTS, params, speculative=True)
    ar = eng.generate(C.RAGGED_PROMPTS, params, speculative=False)
    assert sd.tokens == ar.tokens
    assert sd.stats.drafted > 0 or name == "auto"
    for p, got in zip(C.RAGGED_PROMPTS, ar.tokens):
        assert got == C.hf_greedy(pol, p, 16), f"prompt {p}"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "selfquant"])
def test_sd_is_lossless_on_cuda(make_engine, kind):
    """The chi-square contract (tests/contract.exact_distribution) on the GPU: SD samples against the exact
    distribution enumerated from the policy, a wrong temperature rejected. The self-drafter is quantized from the
    policy one update back (tests/unit/test_selfquant.py's set-up), so its drafts are rejected often enough."""
    base = C.tiny_vocab_policy(vocab=5)
    pol = copy.deepcopy(base).cuda()
    src = C.drifted(base, seed=5, scale=1.0).cuda() if kind == "selfquant" else pol
    d = C.fresh_drafter(src, seed=2, kind=kind, **{"draft_model": {"layers": 1}}.get(kind, {}))
    C.exact_distribution(make_engine, pol, d, SamplingParams(max_new_tokens=3, seed=11), n_rows=3000,
                         wrong=SamplingParams(temperature=0.7, max_new_tokens=3), k=2, drafter_int8=False)
