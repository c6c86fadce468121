"""The RolloutEngine contract over running vLLM servers (engine.kind=vllm_server): the main job's rollouts on
servers started with `python -m drafttrain.serve POLICY --drafter DRAFTER` (here or on other machines).

    engine = VllmServerEngine(cfg.engine, policy, drafter)   # cfg.urls = ["http://10.0.0.5:8000", ...]
    batch = engine.generate(prompts, params)                  # rows split across the servers, sent concurrently
    engine.load_drafter(weights, version)                     # to every server (vllm_server.VllmServer handles)
    engine.update_policy(policy)                              # to every server, read back, prefix caches reset

The API key comes from DRAFTTRAIN_API_KEY (never from the config: the run writes its config to disk).
At start every server is checked against the policy and the drafter (VllmServer.bind: one-line ValueError), then
given this job's policy weights and its drafter as version 0, so a server left by an earlier run serves this one.
generate: one POST /v1/completions per row (token ids in, `return_token_ids` out; a per-row seed as
vllm_transfer.vllm_sampling derives it: one request with many prompts would give identical rows one seed), all rows
in flight at once; each server gets a contiguous share of the rows (a GRPO group stays on one server's prefix cache).
Log-probs: the servers' processed_logprobs (the launcher's --logprobs-mode); greedy rows report 0.0 as VllmEngine.
speculative=False switches drafting off in the servers' workers (dt_set_drafting), as VllmEngine does.
Approximate: SpecStats come from the difference of each server's Prometheus spec-decode counters across the batch
(verify steps, draft tokens, accepted tokens, accepted per position), not from per-row metrics: drafts past a row's
end count as drafted (VllmEngine drops them), another client's requests in the same window count too, and
target_forwards is the servers' engine steps (prefill steps included). The timeline is empty.
A server that does not answer during generate or update_policy raises EngineDied (the job rebuilds the engine once).
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from drafttrain.engines.base import (
    EngineDied,
    RolloutBatch,
    StaleVersionError,
    Timeline,
    check_prompts,
)
from drafttrain.engines.vllm_link import ServerDown
from drafttrain.engines.vllm_transfer import policy_state, policy_weights, read_back
from drafttrain.spec import SamplingParams, SpecStats

KEY_ENV = "DRAFTTRAIN_API_KEY"
# vLLM's Prometheus counters the batch's SpecStats are read from (summed over label sets)
_METRIC = re.compile(r'^vllm:(spec_decode_num_drafts|spec_decode_num_draft_tokens|spec_decode_num_accepted_tokens|'
                     r'spec_decode_num_accepted_tokens_per_pos|iteration_tokens_total)(?:_total|_count)?'
                     r'(?:\{([^}]*)\})? (\S+)$', re.MULTILINE)
_POS = re.compile(r'position="(\d+)"')


def _counters(text: str) -> dict:
    """{counter: value} and {"pos": {position: accepted}} from a /metrics page."""
    out: dict = {"pos": {}}
    for m in _METRIC.finditer(text):
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "iteration_tokens_total" and not m.group(0).split("{")[0].endswith("_count"):
            continue  # the histogram's buckets and sum; its _count is the engine's steps
        if name.endswith("_per_pos"):
            p = _POS.search(labels)
            if p:
                out["pos"][int(p.group(1))] = out["pos"].get(int(p.group(1)), 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    return out


def spec_from_counters(before: list[dict], after: list[dict], emitted: int) -> SpecStats:
    """The batch's SpecStats from the servers' counters before and after it. emitted: the response tokens after
    each row's first (the prefill's). Verify steps that drafted emit accepted + 1 each (capped at `emitted`); the
    response tokens left were emitted by steps that drafted nothing (one each)."""
    d = {n: sum(a.get(n, 0.0) - b.get(n, 0.0) for a, b in zip(after, before))
         for n in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                   "iteration_tokens_total")}
    width = max([max(a["pos"], default=-1) + 1 for a in after] + [0])
    acc_pp = [int(sum(a["pos"].get(i, 0.0) - b["pos"].get(i, 0.0) for a, b in zip(after, before)))
              for i in range(width)]
    steps, acc = int(d["spec_decode_num_drafts"]), int(d["spec_decode_num_accepted_tokens"])
    sd_emitted = min(acc + steps, emitted)
    ar = max(emitted - sd_emitted, 0)
    reached = [steps] + acc_pp[:-1] if width else []  # rows that tried draft i: those that accepted 0..i-1
    return SpecStats(drafted=int(d["spec_decode_num_draft_tokens"]), accepted=acc, verify_rows=steps + ar,
                     target_forwards=int(d["iteration_tokens_total"]), emitted=emitted, ar_rows=ar, ar_emitted=ar,
                     accepted_per_position=acc_pp, reached_per_position=reached)


def split_rows(n: int, parts: int) -> list[range]:
    """Contiguous, near-equal shares of n rows over `parts` servers (empty shares for the extra servers)."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (i < r))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def request_body(prompt: list[int], params: SamplingParams, row: int, vocab_size: int) -> dict:
    """One row's /v1/completions body: vllm_transfer.vllm_sampling's settings, token ids in and out."""
    seed = None if params.seed is None else (params.seed * 1_000_003 + row) % (2 ** 62)
    return {"prompt": [int(t) for t in prompt], "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature), "top_k": int(params.top_k), "top_p": float(params.top_p),
            "seed": seed, "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": [int(t) for t in params.stop_token_ids if 0 <= t < vocab_size]}


class VllmServerEngine:
    def __init__(self, cfg, policy, drafter=None, log=print):
        """cfg: EngineConfig (urls, k, max_len, max_batch). policy: an HF causal LM (its weights are pushed to every
        server) or its checkpoint folder (the servers' own weights are used). drafter: a drafter module, a drafter
        folder, or None (the servers then draft with what they serve; load_drafter is refused)."""
        from drafttrain.engines.vllm_server import VllmServer

        urls = [str(u) for u in (getattr(cfg, "urls", None) or [])]
        if not urls:
            raise ValueError("engine.urls: engine.kind=vllm_server needs the servers' URLs (python -m drafttrain.serve "
                             "starts one)")
        if not isinstance(cfg.k, int) or getattr(cfg, "toggle", False):
            raise ValueError(f"engine.k={cfg.k!r}, engine.toggle={getattr(cfg, 'toggle', False)}: servers draft "
                             f"the k they were started with (auto, ladder and toggle are the embedded engine's)")
        self.cfg, self.log = cfg, log
        self._lock = threading.RLock()
        self._local = threading.local()  # one HTTP session per thread and server
        self._module, config = self._policy(policy)
        self.vocab_size = int(config.vocab_size)
        self.max_len = min(int(cfg.max_len), int(getattr(config, "max_position_embeddings", cfg.max_len)))
        self.template = self._drafter(drafter)
        self._tied = bool(getattr(config, "tie_word_embeddings", False))
        self.handles: list = []
        self._version, self._drafting = 0, None
        self.last_swap_s = self.last_policy_update_s = 0.0
        try:
            for url in urls:
                h = VllmServer(url, api_key=os.environ.get(KEY_ENV), watch_s=0.0, log=log)
                self.handles.append(h)
                self._check(h, SimpleNamespace(config=config))
            if self._module is not None:
                self.update_policy(self._module)
            if self.template is not None:
                self._each(lambda h: h.reset_drafter(self.template.state_dict(), 0))
            for h in self.handles:  # watchers from here: the served drafter is this job's
                h.watch(5.0)
            self._set_drafting(True)
        except BaseException:
            self.close()
            raise

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _policy(self, policy):
        """(the module or None, its HF config)."""
        if isinstance(policy, (str, os.PathLike)):
            path = Path(policy)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"policy {path}: not an HF checkpoint folder (no config.json)")
            return None, SimpleNamespace(**json.loads((path / "config.json").read_text()))
        if not hasattr(policy, "state_dict") or not hasattr(policy, "config"):
            raise TypeError(f"policy: expected an HF checkpoint folder or an HF causal LM, got {type(policy).__name__}")
        sd = policy.state_dict()
        tied = bool(getattr(policy.config, "tie_word_embeddings", False))
        self._shapes = {n: tuple(t.shape) for n, t in sd.items() if not (tied and n == "lm_head.weight")}
        return policy, policy.config

    def _drafter(self, drafter):
        if drafter is None:
            return None
        if isinstance(drafter, (str, os.PathLike)):
            from drafttrain.drafters import speculators

            drafter = speculators.load_drafter(Path(drafter).resolve())
        return drafter

    def _check(self, h, policy) -> None:
        """Bind the handle (the policy's vocabulary and hidden size, the drafter's kind and shapes: one-line
        ValueError naming the server)."""
        h.bind(policy, self.template)
        if h.worker_info.get("k") not in (None, self.cfg.k):
            self.log(f"[drafttrain] {h.url} drafts k={h.worker_info['k']} (its --k), not engine.k={self.cfg.k}")

    def _each(self, fn) -> list:
        """fn(handle) on every server at once; a server that does not answer raises EngineDied."""
        with ThreadPoolExecutor(len(self.handles)) as pool:
            futures = [pool.submit(fn, h) for h in self.handles]
            try:
                return [f.result() for f in futures]
            except ServerDown as e:
                raise EngineDied(f"vllm_server: {e}") from None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the handles' watchers (the servers keep running: they are not this engine's); idempotent."""
        for h in self.handles:
            h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- drafter and policy ---------------------------------------------------------------------------------
    @property
    def drafter_version(self) -> int:
        return self._version

    def load_drafter(self, weights: dict, version: int) -> None:
        """Swap into every server (validated, pushed, read back, version stored in each worker)."""
        if self.template is None:
            raise ValueError("load_drafter: this engine was built without a drafter (build_engine(..., drafter=))")
        with self._lock:
            if version <= self._version:
                raise StaleVersionError(f"load_drafter: version {version} is not newer than the served version "
                                        f"{self._version}")
            t0 = time.perf_counter()
            self._each(lambda h: h.load_drafter(weights, version))
            down = [h.url for h in self.handles if h.drafter_version != version]
            if down:
                raise EngineDied(f"vllm_server: {', '.join(down)} did not take drafter v{version}")
            self._version, self.last_swap_s = version, time.perf_counter() - t0

    def update_policy(self, policy=None) -> None:
        """Push the policy's weights (a module, a state dict, or None: the module this engine was built with) to
        every server with vLLM's native weight update, read each back, reset the prefix caches."""
        sd = policy_state(self, policy)
        if not hasattr(self, "_shapes"):
            self._shapes = {n: tuple(t.shape) for n, t in sd.items() if not (self._tied and n == "lm_head.weight")}
        weights = policy_weights(sd, self._shapes, self._tied)

        def push(h):
            h.link.push(weights, draft=False)
            h.link.reset_prefix_cache()
            read_back(h, weights, draft=False, what=f"update_policy {h.url}")

        with self._lock:
            t0 = time.perf_counter()
            self._each(push)
            self.last_policy_update_s = time.perf_counter() - t0

    # ---- generation -----------------------------------------------------------------------------------------
    def _set_drafting(self, on: bool) -> None:
        if on != self._drafting:
            self._each(lambda h: (h.rpc("dt_set_drafting", on), h.link.reset_prefix_cache()))
            self._drafting = on

    def _session(self, h):
        sessions = self._local.__dict__.setdefault("sessions", {})
        if h.url not in sessions:
            import requests

            s = requests.Session()
            s.headers.update(h.link.session.headers)
            sessions[h.url] = s
        return sessions[h.url]

    def _row(self, h, body: dict) -> dict:
        import requests

        try:
            r = self._session(h).post(h.url + "/v1/completions", json=body, timeout=max(h.link.timeout_s, 600))
        except (requests.ConnectionError, requests.Timeout) as e:
            raise ServerDown(f"{h.url} does not answer ({type(e).__name__})") from None
        if r.status_code >= 400:
            raise RuntimeError(f"{h.url}/v1/completions: HTTP {r.status_code}: {r.text.strip()[:300]}")
        return r.json()["choices"][0]

    def generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True) -> RolloutBatch:
        check_prompts(prompts, self.max_len, self.vocab_size)
        with self._lock:
            t0 = time.perf_counter()
            self._set_drafting(bool(speculative))
            version = self._version
            shares = split_rows(len(prompts), len(self.handles))
            jobs = [(h, i) for h, rows in zip(self.handles, shares) for i in rows]
            before = self._each(lambda h: _counters(h.link.call("GET", "/metrics", timeout_s=30).text))
            with ThreadPoolExecutor(min(len(jobs), 4 * int(self.cfg.max_batch))) as pool:
                futures = [pool.submit(self._row, h, request_body(prompts[i], params, i, self.vocab_size))
                           for h, i in jobs]
                try:
                    choices = [f.result() for f in futures]
                except ServerDown as e:
                    raise EngineDied(f"vllm_server: {e}") from None
            after = self._each(lambda h: _counters(h.link.call("GET", "/metrics", timeout_s=30).text))
            toks, lps, reasons = _unpack(choices, params)
            emitted = sum(max(len(t) - 1, 0) for t in toks)
            stats = spec_from_counters(before, after, emitted)  # drafting off: no verify steps, all AR
            return RolloutBatch(toks, lps, stats, version, reasons, time.perf_counter() - t0, [version], Timeline())


def _unpack(choices: list[dict], params: SamplingParams):
    """(tokens, log-probs, finish reasons) of the rows' completions; NaN log-probs raise FloatingPointError."""
    toks, lps, reasons = [], [], []
    for c in choices:
        ids = [int(t) for t in c["token_ids"]]
        raw = (c.get("logprobs") or {}).get("token_logprobs") or []
        if len(raw) != len(ids):
            raise RuntimeError(f"generate: the server returned {len(raw)} log-probs for {len(ids)} tokens")
        if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in raw):
            raise FloatingPointError("generate: the policy produced NaN/inf logits (check the policy weights)")
        toks.append(ids)
        lps.append([0.0] * len(ids) if params.greedy else [float(x) for x in raw])
        reasons.append("stop" if c.get("finish_reason") == "stop" else "length")
    return toks, lps, reasons
