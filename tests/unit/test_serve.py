"""The launcher (python -m drafttrain.serve) without starting a server: the line it runs is the README's plain line,
the drafter folder decides method and k, bad input is one line; the key middleware guards every route but /health
and /metrics, and fails closed without a key. Real servers: tests/vllm/test_vllm_server.py."""
from __future__ import annotations

import re
import stat
import subprocess
import sys

import pytest

from drafttrain import serve
from drafttrain.config import PROJECT_ROOT as ROOT


def test_print_is_the_readme_plain_line():
    out = subprocess.run([sys.executable, "-m", "drafttrain.serve", "checkpoints/policy", "--drafter",
                          "checkpoints/eagle3", "--print"], cwd=ROOT, capture_output=True, text=True, check=True)
    block = re.search(r"```bash\n(VLLM_SERVER_DEV_MODE=1 .*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    readme = " ".join(block.replace("\\\n", " ").split())
    printed = out.stdout.strip().splitlines()[-1].replace(str(ROOT), "/abs")
    assert printed == readme


@pytest.mark.parametrize("kind,method", [("eagle3", "eagle3"), ("mtp", "eagle"), ("draft_model", "draft_model")])
def test_drafter_folder_gives_method_and_k(kind, method):
    spec = serve.drafter_spec(ROOT / "checkpoints" / kind)
    assert spec == {"method": method, "model": str(ROOT / "checkpoints" / kind), "num_speculative_tokens": 5}
    assert serve.drafter_spec(ROOT / "checkpoints" / kind, k=3)["num_speculative_tokens"] == 3


def test_bad_input_is_one_line(tmp_path):
    def run(*args):
        r = subprocess.run([sys.executable, "-m", "drafttrain.serve", *args], cwd=ROOT, capture_output=True,
                           text=True)
        return r.returncode, r.stderr.strip().splitlines()

    rc, err = run(str(tmp_path), "--print")
    assert rc == 2 and err[-1].startswith(f"error: POLICY: {tmp_path} is not an HF checkpoint folder")
    rc, err = run("checkpoints/policy", "--drafter", str(tmp_path), "--print")
    assert rc == 2 and err[-1] == f"error: --drafter: {tmp_path} is not a drafter folder (no config.json)"
    (tmp_path / "config.json").write_text('{"drafttrain": {"kind": "eagle3"}}')
    rc, err = run("checkpoints/policy", "--drafter", str(tmp_path), "--print")
    assert rc == 2 and err[-1] == f"error: --k: {tmp_path} does not say how many tokens to draft; pass --k N"


def test_a_new_key_is_written_for_the_owner_only(tmp_path, monkeypatch):
    for var in ("DRAFTTRAIN_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    key, where = serve.resolve_key(None, tmp_path / "k" / "serve.key")
    assert len(key) >= 24 and (tmp_path / "k" / "serve.key").read_text().strip() == key
    assert stat.S_IMODE((tmp_path / "k" / "serve.key").stat().st_mode) == 0o600 and "new" in where
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert serve.resolve_key(None, tmp_path / "x.key") == ("from-env", "VLLM_API_KEY")
    assert serve.resolve_key("given", tmp_path / "x.key") == ("given", "--api-key")


def test_export_prints_the_launcher_line(tmp_path):
    line = serve.serve_line(tmp_path / "policy", tmp_path / "drafter", 4)
    assert line == f"python -m drafttrain.serve {tmp_path / 'policy'} --drafter {tmp_path / 'drafter'} --k 4"


def _client(monkeypatch, key):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from drafttrain.engines.vllm_auth import RequireKey

    for var in ("DRAFTTRAIN_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    if key:
        monkeypatch.setenv("VLLM_API_KEY", key)
    ok = lambda request: PlainTextResponse("ok")
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in
                            ("/health", "/metrics", "/update_weights", "/collective_rpc", "/v1/completions")])
    app.add_middleware(RequireKey)
    return TestClient(app)


def test_middleware_guards_every_route_but_health_and_metrics(monkeypatch):
    c = _client(monkeypatch, "k1")
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    for path in ("/update_weights", "/collective_rpc", "/v1/completions"):
        assert c.post(path).status_code == 401
        assert c.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post(path, headers={"Authorization": "Bearer k1"}).status_code == 200


def test_middleware_without_a_key_fails_closed(monkeypatch):
    c = _client(monkeypatch, None)
    r = c.post("/update_weights", headers={"Authorization": "Bearer "})
    assert r.status_code == 401 and "no API key" in r.json()["error"]
    assert c.get("/health").status_code == 200


class CountingEngine:
    """An engine the tracker never generates with (a handle on a stack's server): versions and its own counters."""

    def __init__(self):
        self.drafter_version, self.loaded, self.counts = 0, [], {}

    def load_drafter(self, weights, version):
        self.loaded.append(version)
        self.drafter_version = version

    def spec_since_swap(self, version):
        return self.counts.get(version)


@pytest.mark.parametrize("canary", ["inline", "probe"])
def test_publisher_judges_servers_on_their_counters(canary):
    import torch

    from drafttrain.config import load_recipe
    from drafttrain.spec import SamplingParams
    from drafttrain.tracking.hotswap import Publisher

    cfg = load_recipe("eagle3_track", [f"online.canary={canary}"]).online
    engines = [CountingEngine(), CountingEngine()]
    pub = Publisher(engines, {"w": torch.zeros(2)}, cfg, log=lambda s: None)
    rec = pub.publish({"w": torch.ones(2)}, expected_mal=4.0, probe_prompts=[[1, 2]], params=SamplingParams())
    assert rec["published"] and [e.loaded for e in engines] == [[1], [1]] and pub.pending is not None
    engines[0].counts[1] = (1.05, 20.0)
    assert pub.settle() == {}  # 20 verify steps: too few to judge
    engines[1].counts[1] = (1.1, 20.0)
    verdict = pub.settle()  # 40 steps at MAL ~1.08 < 1 + 0.5 * (4 - 1): rolled back on both
    assert verdict["rolled_back"] and [e.loaded for e in engines] == [[1, 2], [1, 2]]
    assert torch.equal(pub.served()[0]["w"], torch.zeros(2))
    rec = pub.publish({"w": torch.ones(2)}, expected_mal=4.0)
    for e in engines:
        e.counts[3] = (4.2, 40.0)
    assert pub.settle()["rolled_back"] is False and pub.pending is None and pub.good_version == 3
