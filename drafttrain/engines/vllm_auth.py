"""Who may push: an ASGI middleware for a vLLM server that takes drafter or policy pushes.

    python -m vllm.entrypoints.openai.api_server ... --middleware drafttrain.engines.vllm_auth.RequireKey

vLLM's --api-key guards only its inference routes (/v1, /v2, /inference, /cohere). The routes a weight push uses
(/start_draft_weight_update, /update_weights, /finish_weight_update, /collective_rpc, /pause, /sleep: mounted with
VLLM_SERVER_DEV_MODE=1) answer anyone who reaches the port, and a push is as powerful as replacing the model. This
middleware asks for the key on every route but the two a monitor reads (/health, /metrics): `Authorization: Bearer
KEY`, where KEY is the server's VLLM_API_KEY (what --api-key also reads, so one key guards both) or
DRAFTTRAIN_API_KEY. A server started with neither refuses every guarded route: it fails closed.
"""
from __future__ import annotations

import hmac
import json
import os

OPEN = ("/health", "/metrics")  # read by monitors and load balancers; they change nothing


def server_keys() -> list[str]:
    """The keys this server accepts: VLLM_API_KEY and DRAFTTRAIN_API_KEY, where set."""
    return [k for k in (os.environ.get("VLLM_API_KEY"), os.environ.get("DRAFTTRAIN_API_KEY")) if k]


class RequireKey:
    """Pure ASGI middleware (vLLM's --middleware adds it as app.add_middleware(RequireKey))."""

    def __init__(self, app) -> None:
        self.app = app
        self.keys = [k.encode() for k in server_keys()]

    def _allowed(self, scope) -> bool:
        if scope.get("method") == "OPTIONS" or scope["path"].removeprefix(scope.get("root_path", "")) in OPEN:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(token, k) for k in self.keys)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        why = "missing or wrong API key" if self.keys else "this server has no API key (set VLLM_API_KEY)"
        body = json.dumps({"error": f"Unauthorized: {why}"}).encode()
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
