"""How a handle (vllm_server.py) reaches a vLLM engine drafttrain did not start: over a server's HTTP routes
(HttpLink) or a user's vllm.LLM in this process (LocalLink). Both offer the same few calls:

    link.rpc(method, *args)       a drafttrain worker method (vllm_worker.py) on the engine's worker
    link.push(weights, draft)     vLLM's native update session: start_[draft_]weight_update -> update_weights ->
                                  finish_weight_update, over drafttrain's transport (a safetensors file in /dev/shm
                                  for an engine on this host, the bytes base64-encoded in the request otherwise)
    link.reset_prefix_cache()
    link.spec_counters()          (drafts, accepted draft tokens) from vLLM's spec-decode counters, or None
    link.alive()                  whether it answers now

An HttpLink call that gets no answer raises ServerDown; one refused for its key raises PermissionError; any other
failure status a RuntimeError carrying the server's message (one line).
"""
from __future__ import annotations

import base64
import json
import os
import urllib.parse
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# vLLM's spec-decode counters (Prometheus): verify steps and accepted draft tokens, summed over requests
DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"


class ServerDown(ConnectionError):
    """The server does not answer (refused, timed out, reset)."""


def shm_dir() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def _safetensors(weights: dict) -> bytes:
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").contiguous() for n, t in weights.items()})


class HttpLink:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0):
        import requests

        self.url = url.rstrip("/")
        host = urllib.parse.urlparse(self.url).hostname
        if not host:
            raise ValueError(f"url: {url!r} is not an http(s) URL")
        self.local = host in LOCAL_HOSTS and shm_dir() is not None  # the server reads files of this host
        self.timeout_s = timeout_s
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, verb: str, path: str, body=None, timeout_s: float | None = None, params=None):
        import requests

        try:
            r = self.session.request(verb, self.url + path, json=body, params=params,
                                     timeout=timeout_s or self.timeout_s)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise ServerDown(f"{self.url} does not answer ({type(e).__name__})") from None
        if r.status_code == 401:
            raise PermissionError(f"{self.url} refused {path}: 401 (missing or wrong API key)")
        if r.status_code >= 400:
            try:
                msg = r.json()
                msg = msg.get("error") or msg.get("detail") or msg.get("message") or msg
                msg = msg.get("message", msg) if isinstance(msg, dict) else msg
            except ValueError:
                msg = r.text
            raise RuntimeError(f"{self.url}{path}: HTTP {r.status_code}: {str(msg).strip().splitlines()[0][:300]}")
        return r

    def alive(self) -> bool:
        try:
            return self.call("GET", "/health", timeout_s=5).status_code == 200
        except (ServerDown, RuntimeError):
            return False

    def rpc(self, method: str, *args):
        """A worker method over /collective_rpc (string arguments, JSON results); dt_probe's bytes travel base64."""
        if method == "dt_probe":
            return base64.b64decode(self.rpc("dt_probe_b64", json.dumps(args[0]), json.dumps(args[1]))["b64"])
        r = self.call("POST", "/collective_rpc", {"method": method, "args": [str(a) for a in args]})
        if not r.content:
            return None
        results = r.json()["results"]
        if isinstance(results[0], str) and results[0].startswith("Method ") and "not implemented" in results[0]:
            raise NotImplementedError(results[0])
        return results[0]

    def push(self, weights: dict, draft: bool) -> None:
        """One update session; generation is held (pause mode keep: requests in flight wait, then resume with the
        new weights) so no step runs on half-loaded layers."""
        blob = _safetensors(weights)
        path = None
        if self.local:
            path = shm_dir() / f"drafttrain-push-{os.getpid()}-{id(self)}.safetensors"
            path.write_bytes(blob)
        info = {"path": str(path)} if path is not None else {"b64": base64.b64encode(blob).decode()}
        self.call("POST", "/pause", params={"mode": "keep"})
        try:
            self.call("POST", "/start_draft_weight_update" if draft else "/start_weight_update")
            try:
                self.call("POST", "/update_weights", {"update_info": info})
            finally:
                self.call("POST", "/finish_weight_update", {})
        finally:
            self.call("POST", "/resume")
            if path is not None:
                path.unlink(missing_ok=True)

    def reset_prefix_cache(self) -> None:
        self.call("POST", "/reset_prefix_cache")

    def spec_counters(self) -> tuple[float, float] | None:
        found = {}
        for line in self.call("GET", "/metrics", timeout_s=10).text.splitlines():
            name = line.partition("{")[0] if "{" in line else line.partition(" ")[0]
            if name in (DRAFTS + "_total", ACCEPTED + "_total"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if not found:
            return None
        return found.get(DRAFTS + "_total", 0.0), found.get(ACCEPTED + "_total", 0.0)


class LocalLink:
    """A user's vllm.LLM in this process (TRL's colocate engine, any script's): the same calls through its
    collective_rpc; pushes go through a file in /dev/shm (or a temporary folder)."""

    local = True

    def __init__(self, llm):
        import tempfile

        self.llm, self.url = llm, f"vllm.LLM@{id(llm):x}"
        self.shm = shm_dir() or Path(tempfile.gettempdir())  # where push_weights writes the update

    def alive(self) -> bool:
        return True

    def rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    def push(self, weights: dict, draft: bool) -> None:
        from drafttrain.engines.vllm_transfer import push_weights

        push_weights(self, weights, draft)  # the in-process engine's own path: a file in self.shm

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def spec_counters(self) -> tuple[float, float] | None:
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # noqa: BLE001 - an LLM built with disable_log_stats keeps none
            return None
        got = {m.name: float(getattr(m, "value", 0.0)) for m in metrics if m.name in (DRAFTS, ACCEPTED)}
        return (got[DRAFTS], got.get(ACCEPTED, 0.0)) if DRAFTS in got else None

