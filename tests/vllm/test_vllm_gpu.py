"""The vLLM engine's GPU side (engines/vllm_gpu.py), tested here on the CPU: engine.vllm.* resolved per platform (a
faked CUDA platform), the choice of weight transport (CUDA IPC vs the /dev/shm file) and the IPC client's wire format,
the read-back's dtype-fitted tolerance, and sleep mode: a no-op on vLLM-CPU, and around it (its two GPU-only calls
faked) the re-push, read-back and canary of the drafter after every wake, with the drafter's version kept. The
test marked `cuda` runs the real thing on a CUDA GPU with vLLM installed (skipped elsewhere).
"""
from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from drafttrain.spec import SamplingParams
from drafttrain.vllm_config import VllmConfig
from tests import contract as C
from tests.conftest import engine_cfg

pytestmark = pytest.mark.vllm


class Platform:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda(self):
        return self.cuda

    def is_cpu(self):
        return not self.cuda


# ---- settings and transport: one function each, the platform faked ------------------------------------------

def test_llm_settings_per_platform():
    from drafttrain.engines.vllm_gpu import current_platform, llm_settings, transfer_backend
    from drafttrain.engines.vllm_worker import TRANSFER_BACKEND

    cpu, env = llm_settings(VllmConfig(), Platform(cuda=False))
    assert cpu == {"dtype": "float32", "enforce_eager": True, "weight_transfer_config": {"backend": TRANSFER_BACKEND}}
    assert env == {}  # no GPU share, no sleep mode, no pickled handles on the CPU
    gpu, env = llm_settings(VllmConfig(), Platform(cuda=True))
    assert gpu == {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.5,
                   "enable_sleep_mode": False, "weight_transfer_config": {"backend": "ipc"}}
    assert env == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    gpu, _ = llm_settings(VllmConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, sleep=1),
                          Platform(cuda=True))
    assert (gpu["dtype"], gpu["enforce_eager"], gpu["gpu_memory_utilization"], gpu["enable_sleep_mode"]) == (
        "float32", True, 0.3, True)
    assert transfer_backend(Platform(cuda=False)) == TRANSFER_BACKEND and transfer_backend(Platform(cuda=True)) == "ipc"
    assert transfer_backend(current_platform()) == TRANSFER_BACKEND  # this machine: vLLM-CPU, the /dev/shm path
    with pytest.raises(ValueError, match=r"^engine.vllm.gpu_memory_utilization: must be in \(0, 1\], got 1.5$"):
        llm_settings(VllmConfig(gpu_memory_utilization=1.5), Platform(cuda=True))


def test_bad_vllm_key_refused_before_any_engine_process(vpolicy, vdrafter):
    from drafttrain.engines import build_engine
    from tests.vllm.pool import engine_processes

    before = {p.pid for p in engine_processes()}
    cfg = engine_cfg(kind="vllm")
    cfg.vllm.gpu_memory_utilization = 0.0  # as a section built without load_recipe could carry
    with pytest.raises(ValueError, match=r"^engine.vllm.gpu_memory_utilization: must be in \(0, 1\]") as e:
        build_engine(cfg, vpolicy, vdrafter)
    assert "\n" not in str(e.value)
    assert {p.pid for p in engine_processes()} <= before


def test_push_takes_the_engines_transport(monkeypatch, tmp_path):
    """A CUDA engine's pushes go through vLLM's IPC sender, a CPU engine's through a file in shm."""
    from drafttrain.engines import vllm_gpu

    calls = []
    monkeypatch.setattr(vllm_gpu, "push_ipc", lambda engine, weights, draft: calls.append(("ipc", draft)))
    rpc = lambda method, *args: calls.append((method, *(sorted(a) for a in args)))  # noqa: E731
    vllm_gpu.push(SimpleNamespace(transfer="ipc", rpc=rpc, shm=tmp_path), {"w": torch.ones(2)}, draft=True)
    assert calls == [("ipc", True)]
    calls.clear()
    vllm_gpu.push(SimpleNamespace(transfer="drafttrain_inline", rpc=rpc, shm=tmp_path), {"w": torch.ones(2)}, True)
    assert calls == [("start_draft_weight_update",), ("update_weights", ["path"]), ("finish_weight_update",)]


def test_ipc_client_sends_what_vllms_ipc_worker_parses(monkeypatch):
    """The CUDA path's wire format, checked on the CPU: the handles go pickled (collective_rpc's msgpack cannot carry
    their types), and vLLM's IPC update info takes them back in the worker's environment."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from drafttrain.engines.vllm_gpu import _RpcClient

    sent = []
    engine = SimpleNamespace(rpc=lambda method, *args: sent.append((method, args)))
    client = _RpcClient(engine, draft=True)
    client.start_weight_update()
    handles = [{"GPU-0": (1, (2, 3), "args")}]
    client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]], "ipc_handles": handles})
    client.finish_weight_update()
    assert [m for m, _ in sent] == ["start_draft_weight_update", "update_weights", "finish_weight_update"]
    info = sent[1][1][0]
    assert "ipc_handles" not in info and pickle.loads(__import__("base64").b64decode(info["ipc_handles_pickled"]))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # llm_settings' env on CUDA
    assert IPCWeightTransferUpdateInfo(**info).ipc_handles == handles


# ---- the read-back's tolerance fits the served dtype ---------------------------------------------------------

class _Worker:
    """The worker extension's dt_probe over a stand-in model that holds what was sent in `dtype`."""

    def __init__(self, weights: dict, dtype: torch.dtype):
        from drafttrain.engines.vllm_worker import DrafttrainWorkerExtension

        self.model = torch.nn.Module()
        for name, t in weights.items():
            mod_name, _, pname = name.rpartition(".")
            if not hasattr(self.model, mod_name):
                self.model.add_module(mod_name, torch.nn.Module())
            self.model.get_submodule(mod_name).register_parameter(pname, torch.nn.Parameter(t.to(dtype)))
        self.model_runner = SimpleNamespace(device=torch.device("cpu"))
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
        self.dt_probe = DrafttrainWorkerExtension.dt_probe.__get__(self)

    def get_model(self):
        return self.model


def test_read_back_tolerance_fits_the_dtype():
    from drafttrain.engines.vllm_transfer import read_back

    g = torch.Generator().manual_seed(0)
    sent = {"embed.weight": torch.randn(48, 64, generator=g), "norm.weight": 1 + 0.1 * torch.randn(64, generator=g)}
    worker = _Worker(sent, torch.bfloat16)  # a bf16 model holds the fp32 weights rounded
    def engine(dtype: str):
        return SimpleNamespace(worker_info={"dtype": dtype}, rpc=lambda method, *args: worker.dt_probe(*args))
    read_back(engine("bfloat16"), sent, draft=False, what="update_policy")
    with pytest.raises(ValueError, match="did not land"):  # fp32's tolerance: bf16 rounding reads as a failed push
        read_back(engine("float32"), sent, draft=False, what="update_policy")
    moved = {n: t * 1.05 for n, t in sent.items()}  # a push that did not land, in bf16
    with pytest.raises(ValueError, match="update_policy: read-back of embed.weight does not match"):
        read_back(engine("bfloat16"), moved, draft=False, what="update_policy")


# ---- sleep mode on a running engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(vpolicy, vdrafter):
    """A drafter trained on the policy's rollouts: greedy acceptance well above 0 (what a dropped drafter loses)."""
    from tests.vllm.test_vllm_engine import random_prompts, train_drafter

    prompts = random_prompts(96, seed=1)
    with torch.no_grad():
        rollouts = [vpolicy.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                     pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return train_drafter(vpolicy, vdrafter, prompts, rollouts, steps=60)


GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


def test_sleep_is_a_no_op_on_the_cpu(make_engine, vpolicy, vdrafter):
    eng = make_engine(vpolicy, vdrafter)
    before = eng.generate(C.RAGGED_PROMPTS, GREEDY)
    assert eng.sleep(1) is False and not eng.sleeping  # vLLM-CPU has no sleep mode: documented no-op
    eng.wake_up()
    after = eng.generate(C.RAGGED_PROMPTS, GREEDY)
    assert after.tokens == before.tokens and after.stats.to_dict() == before.stats.to_dict()
    with pytest.raises(ValueError, match="^sleep: level must be 1") as e:
        eng.sleep(3)
    assert "\n" not in str(e.value)


def fake_sleep_mode(monkeypatch, eng, drop_policy=None):
    """Sleep mode as CUDA vLLM runs it, its two GPU-only calls faked: the wake drops the drafter's weights in the
    worker (zeros, as vLLM's level-2 sleep leaves them) and, after a level-2 sleep given `drop_policy`, overwrites the
    policy's."""
    calls = []
    monkeypatch.setattr(eng._sleep, "available", True)
    monkeypatch.setattr(eng._sleep, "vllm_sleep", lambda level: calls.append(("sleep", level)))

    def wake():
        calls.append(("wake",))
        eng._push({n: torch.zeros_like(t) for n, t in eng._served.items()}, draft=True)
        if drop_policy is not None and [c for c in calls if c[0] == "sleep"][-1] == ("sleep", 2):
            eng._push(drop_policy, draft=False)

    monkeypatch.setattr(eng._sleep, "vllm_wake", wake)
    return calls


def test_wake_re_pushes_the_dropped_drafter(make_engine, vpolicy, vdrafter, trained, monkeypatch):
    eng = make_engine(vpolicy, vdrafter)
    eng.load_drafter(trained.state_dict(), 1)
    before = eng.generate(C.RAGGED_PROMPTS, GREEDY)
    assert before.stats.acceptance_rate > 0.3, before.stats.to_dict()
    calls = fake_sleep_mode(monkeypatch, eng)
    eng._sleep.vllm_wake()  # what a wake without the re-push serves: acceptance falls to about 0, no error
    dropped = eng._generate(C.RAGGED_PROMPTS, GREEDY)
    assert dropped.tokens == before.tokens and dropped.stats.acceptance_rate < 0.5 * before.stats.acceptance_rate
    eng._push(eng._served, draft=True)

    calls.clear()
    assert eng.sleep(1) is True and eng.sleeping
    after = eng.generate(C.RAGGED_PROMPTS, GREEDY)  # wakes first: re-pushed, read back, canaried
    assert calls == [("sleep", 1), ("wake",)] and not eng.sleeping
    assert eng.drafter_version == 1 and after.drafter_version == 1
    assert after.tokens == before.tokens and after.stats.to_dict() == before.stats.to_dict()


def test_wake_whose_drafter_does_not_come_back_is_refused(make_engine, vpolicy, vdrafter, trained, monkeypatch):
    """A re-push that does not land fails the read-back; one that reads back but does not draft fails the canary."""
    from drafttrain.engines import vllm_transfer

    eng = make_engine(vpolicy, vdrafter)
    eng.load_drafter(trained.state_dict(), 1)
    fake_sleep_mode(monkeypatch, eng)
    eng.sleep(1)
    with monkeypatch.context() as m:
        m.setattr(eng, "_push", lambda weights, draft: None)  # the wake's own zeros land: the fake calls it first
        m.setattr(eng._sleep, "vllm_wake", lambda: vllm_transfer.push_weights(
            eng, {n: torch.zeros_like(t) for n, t in eng._served.items()}, True))
        with pytest.raises(ValueError, match="^wake_up: read-back of .* did not land"):
            eng.wake_up()
    eng._push(eng._served, draft=True)
    eng.sleep(1)
    with monkeypatch.context() as m:
        m.setattr(eng, "_push", lambda weights, draft: None)
        m.setattr(eng._sleep, "vllm_wake", lambda: vllm_transfer.push_weights(
            eng, {n: torch.zeros_like(t) for n, t in eng._served.items()}, True))
        m.setattr(vllm_transfer, "read_back", lambda *a, **k: None)  # a read-back that missed it
        with pytest.raises(RuntimeError, match=r"^wake_up: the drafter \(version 1\) accepts") as e:
            eng.wake_up()
    assert "\n" not in str(e.value)


def test_sleep_after_each_generate_and_level_2(make_engine, vpolicy, vdrafter, trained, monkeypatch):
    """engine.vllm.sleep=1: asleep after each generate, awake for the next call (a swap here, at its new version).
    Level 2 also drops the policy's weights: the wake pushes the module's back."""
    eng = make_engine(vpolicy, vdrafter)
    before = eng.generate(C.RAGGED_PROMPTS, GREEDY)
    other = C.fresh_drafter(vpolicy, seed=5).state_dict()
    scrambled = {n: torch.randn_like(t) for n, t in vpolicy.state_dict().items() if n != "lm_head.weight"}
    calls = fake_sleep_mode(monkeypatch, eng, drop_policy=scrambled)
    monkeypatch.setattr(eng._sleep, "auto", True)
    eng.generate(C.RAGGED_PROMPTS, GREEDY)
    assert eng.sleeping and calls == [("sleep", 1)]
    eng.load_drafter(trained.state_dict(), 1)  # woken (the served drafter re-pushed), then swapped
    assert calls == [("sleep", 1), ("wake",)] and eng.drafter_version == 1 and not eng.sleeping
    monkeypatch.setattr(eng._sleep, "auto", False)
    eng.load_drafter(other, 2)
    assert eng.sleep(2) is True
    after = eng.generate(C.RAGGED_PROMPTS, GREEDY)
    assert calls[-2:] == [("sleep", 2), ("wake",)] and eng.drafter_version == 2
    assert after.tokens == before.tokens  # the policy is the module's again, not the scrambled weights


# ---- on a CUDA GPU ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_push_read_back_and_sleep_round_trip(vpolicy, vdrafter, trained):
    """CUDA vLLM (bf16, CUDA graphs, IPC pushes, sleep mode): load_drafter and update_policy read back, and a
    level-1 and a level-2 sleep / wake keep the drafter's acceptance and the outputs."""
    pytest.importorskip("vllm")
    from drafttrain.engines.vllm_engine import VllmEngine

    cfg = engine_cfg(kind="vllm", k=3, max_len=64, max_batch=8)
    cfg.vllm.sleep, cfg.vllm.gpu_memory_utilization = 1, 0.3
    with VllmEngine(cfg, vpolicy, vdrafter) as eng:
        assert eng.transfer == "ipc" and eng.worker_info["dtype"] == "bfloat16"
        eng.load_drafter(trained.state_dict(), 1)
        eng.update_policy(vpolicy)
        before = eng.generate(C.RAGGED_PROMPTS, GREEDY)
        assert eng.sleeping  # engine.vllm.sleep=1: asleep after each generate
        for level in (1, 2):
            eng.wake_up()
            assert eng.sleep(level) is True
            after = eng.generate(C.RAGGED_PROMPTS, GREEDY)
            assert eng.drafter_version == 1 and after.tokens == before.tokens
            assert after.stats.acceptance_rate >= 0.5 * before.stats.acceptance_rate
