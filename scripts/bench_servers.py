"""Publishing into vLLM servers an RL stack owns: how long a drafter push to several servers takes (all at once, as the
tracker pushes, and one server after another), and acceptance on a server after a push against engine.kind=vllm with
the same drafter and prompts. Starts its own servers with the launcher (python -m drafttrain.serve) on 127.0.0.1.
Prints a table, writes bench/servers.json.

    python scripts/bench_servers.py                                  # 2 servers, 10 pushes, 64 prompts, T=1 and greedy
    python scripts/bench_servers.py servers=2 pushes=10 n_prompts=64 max_new_tokens=96
"""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import requests
import torch

from drafttrain.config import PROJECT_ROOT, load_recipe, script_config
from drafttrain.device import now
from drafttrain.report import format_table, write_json

DEFAULTS = dict(servers=2, pushes=10, n_prompts=64, max_new_tokens=96, temperatures=[1.0, 0.0], seed=0,
                out="bench/servers.json", start_timeout_s=900)
KEY = "bench-servers-key"
POLICY, EAGLE = PROJECT_ROOT / "checkpoints" / "policy", PROJECT_ROOT / "checkpoints" / "eagle3"


def start_servers(n: int, timeout_s: float) -> list[tuple[subprocess.Popen, str]]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "DRAFTTRAIN_API_KEY": KEY, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        p = subprocess.Popen([sys.executable, "-m", "drafttrain.serve", str(POLICY), "--drafter", str(EAGLE), "--port",
                              str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        out.append((p, f"http://127.0.0.1:{port}"))
    t0 = time.time()
    for p, url in out:
        while True:
            if p.poll() is not None or time.time() - t0 > timeout_s:
                raise RuntimeError(f"{url} did not start")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(1)
    return out


def server_mal(handle, prompts, temperature: float, max_new_tokens: int, version: int) -> float:
    """Mean accepted length on the server's own counters over one batch of the stack's requests. Rows run to
    max_new_tokens on both sides (ignore_eos): the counters also count drafts accepted past a stop token, which the
    engine's SpecStats drop, so rows that end early would read higher on the server for that alone."""
    auth = {"Authorization": f"Bearer {KEY}"}
    model = requests.get(handle.url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    before = handle.link.spec_counters()
    rows = [{"model": model, "prompt": [p], "max_tokens": max_new_tokens, "temperature": temperature,
             "seed": 1000 + i, "ignore_eos": True} for i, p in enumerate(prompts)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(rows)) as ex:  # one request per row: a seed each, one engine batch
        list(ex.map(lambda b: requests.post(handle.url + "/v1/completions", json=b, headers=auth,
                                            timeout=600).raise_for_status(), rows))
    after = handle.link.spec_counters()
    return 1.0 + (after[1] - before[1]) / max(after[0] - before[0], 1.0)


def engine_mal(prompts, temperature: float, max_new_tokens: int) -> float:
    from drafttrain.drafters import speculators
    from drafttrain.engines import build_engine
    from drafttrain.spec import SamplingParams

    # greedy drafts, as the launcher's servers draft (vLLM's default)
    cfg = load_recipe("eagle3_track", ["engine.kind=vllm", f"engine.max_batch={len(prompts)}",
                                       "engine.draft_sampling=greedy"])
    with build_engine(cfg.engine, str(POLICY), speculators.load_drafter(EAGLE)) as engine:
        batch = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=0))
    return batch.stats.mean_accepted_length


def main(argv=None) -> int:
    cfg = script_config(DEFAULTS, sys.argv[1:] if argv is None else argv)
    from drafttrain.drafters import speculators
    from drafttrain.engines.vllm_server import VllmServer
    from drafttrain.policy import (
        build_tokenizer,
        encode_prompt,
        load_policy,
        make_prompts,
    )
    from drafttrain.tracking.hotswap import Publisher

    policy, _ = load_policy(str(POLICY), "vllm")
    drafter = speculators.load_drafter(EAGLE)
    tok = build_tokenizer()
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(cfg.n_prompts, cfg.seed)]
    t0 = time.time()
    procs = start_servers(cfg.servers, cfg.start_timeout_s)
    start_s = time.time() - t0
    try:
        handles = [VllmServer(url, api_key=KEY, policy=policy, drafter=drafter, watch_s=0, log=lambda s: None)
                   for _, url in procs]
        good = drafter.state_dict()
        pub = Publisher(handles, good, load_recipe("eagle3_track").online, log=lambda s: None)
        together, apart, version = [], [], pub.version
        for i in range(cfg.pushes):  # a slightly different drafter each time: every push moves real bytes
            w = {n: (t + 1e-6 * (i + 1) if t.is_floating_point() else t) for n, t in good.items()}
            together.append(pub._load_all(w, version := version + 1))
            t1, version = now(), version + 1
            for h in handles:
                h.load_drafter(w, version)
            apart.append(now() - t1)
        pub._load_all(good, version + 1)
        rows = []
        for temp in cfg.temperatures:
            srv = statistics.mean(server_mal(h, prompts, temp, cfg.max_new_tokens, h.drafter_version)
                                  for h in handles)
            eng = engine_mal(prompts, temp, cfg.max_new_tokens)
            rows.append({"temperature": temp, "server_mal": srv, "engine_vllm_mal": eng, "ratio": srv / eng})
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    push = {"servers": cfg.servers, "pushes": cfg.pushes, "drafter_mb": sum(t.numel() * t.element_size()
                                                                            for t in good.values()) / 2 ** 20,
            "together_median_s": statistics.median(together), "together_max_s": max(together),
            "one_after_another_median_s": statistics.median(apart), "server_start_s": start_s}
    print(format_table([push], list(push)))
    print(format_table(rows, list(rows[0])))
    from omegaconf import OmegaConf

    write_json({"config": OmegaConf.to_container(cfg), "push": push, "acceptance": rows, "torch": torch.__version__},
               cfg.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
