#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, runs drafttrain from this folder as it is (no pip install: the
# machine's CUDA torch and transformers stay) and writes every stage's result into one JSON file, rewritten as each
# stage ends (a killed run still leaves what finished):
#   smoke          import, then 2 RL steps of the main job on the GPU (recipe eagle3_track, small sizes)
#   cuda_tests     the tests marked cuda
#   bench_e2e      the user's number: AR against tracking, one seed (rollout share, speed-up over AR, same-batches)
#   decode_8b      the 8B decode step (torch, random weights) against the simulator's roofline (scripts/gpu_check.py)
#   contract, bench_rollout   the vLLM engine's contract tests and bench_rollout's vLLM rows, where vllm imports
#   bash scripts/gpu_check.sh [OUT.json]          # default gpu_check.json
#   bash scripts/gpu_check.sh --cpu OUT.json      # the same stages on the CPU at smoke size (CI; vLLM stages skipped)
# E2E_STEPS=N: bench_e2e's RL steps per arm on the GPU (default 6, a guess at what fits its 225 s; not timed on a GPU)
# An offline machine without omegaconf takes it from the wheels scripts/gpu_wheels.sh downloaded where the package
# index is (GPU_WHEELS, default gpu_wheels/), unpacked into a folder put on PYTHONPATH: nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; shift; fi
OUT=${1:-gpu_check.json}
TMP=$(mktemp -d)
DEV=cuda
if [ "$MODE" = gpu ]; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$TMP/gpu.txt" 2>&1 \
        || { echo "error: no CUDA GPU (nvidia-smi failed)"; exit 2; }
    # the main job's sizes on the GPU: bench_e2e takes as many steps as fit its stage
    E2E="rl.steps=${E2E_STEPS:-6},rl.eval_prompts=32"
    DECODE="model=8b gpu=auto"
else
    DEV=cpu
    echo "cpu (--cpu: smoke sizes)" > "$TMP/gpu.txt"
    E2E="rl.steps=2,rl.prompts_per_step=2,rl.group_size=2,sampling.max_new_tokens=16,rl.eval_prompts=4"
    E2E="$E2E,online.canary_max_new_tokens=8"
    DECODE="model=tiny gpu=H100 batches=[1] ctx=16 new_tokens=2 repeats=1"
fi
SITE=""
if ! python -c "import omegaconf" 2>/dev/null; then  # the offline GPU machine: the pure-Python wheels it lacks
    WHEELS=${GPU_WHEELS:-gpu_wheels}
    ls "$WHEELS"/*.whl > /dev/null 2>&1 \
        || { echo "error: omegaconf is missing and $WHEELS/ holds no wheels (bash scripts/gpu_wheels.sh $WHEELS" \
                  "where the package index is)"; exit 2; }
    SITE="$TMP/site"
    for w in "$WHEELS"/*.whl; do python -m zipfile -e "$w" "$SITE" || exit 2; done
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
declare -A SKIP=()
if [ "$MODE" = cpu ]; then
    SKIP[contract]="--cpu: the vLLM tests run in CI's own vllm tier"
    SKIP[bench_rollout]="--cpu: the vLLM tests run in CI's own vllm tier"
elif ! python -c "import vllm" > "$TMP/vllm.txt" 2>&1; then
    SKIP[contract]="vllm does not import here: $(tail -n 1 "$TMP/vllm.txt")"
    SKIP[bench_rollout]=${SKIP[contract]}
fi
# the main job at a small size: 2 prompts x 2 samples, short responses, a tiny held-out evaluation
SMOKE="rl.prompts_per_step=2 rl.group_size=2 rl.micro_batch=4 engine.max_batch=4 sampling.max_new_tokens=32"
SMOKE="$SMOKE rl.eval_prompts=4 online.steps_per_update=2 online.measure_rows=4 online.canary_prompts=2"
SMOKE="$SMOKE online.canary_max_new_tokens=8 train.batch_size=4 run.tensorboard=false"

report() {  # gpu_check.json from the stages so far (TMP/stages.txt) and their outputs
python - "$TMP" "$OUT" "$MODE" <<'PY'
import json, sys
from pathlib import Path
tmp, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
stages = {}
for line in (tmp / "stages.txt").read_text().splitlines():
    name, rc, secs, limit, skipped = (line.split(" ", 4) + [""])[:5]
    log = tmp / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.is_file() else []
    stages[name] = {"rc": None if rc == "-" else int(rc), "wall_s": int(secs), "limit_s": int(limit),
                    "skipped": skipped or None, "log_tail": tail}
res = {"mode": mode, "gpu": (tmp / "gpu.txt").read_text().strip(), "stages": stages,
       "limits_s": sum(s["limit_s"] for s in stages.values())}
run = tmp / "smoke" / "metrics.jsonl"
if run.is_file():
    recs = [json.loads(x) for x in run.read_text().splitlines()]
    res["smoke"] = {"steps": len(recs), "rl_step_s": [r["rl_step_s"] for r in recs],
                    "live_mal": [r.get("live_mal") for r in recs]}
e2e = tmp / "e2e.json"
if e2e.is_file():
    summary = json.loads(e2e.read_text())["summary"]
    res["e2e"] = {arm: {k: s.get(k) for k in ("rl_wall_s", "rollout_share", "speedup_over_ar",
                                               "rollout_speedup_same_batches", "speedup_same_batches")}
                  for arm, s in summary.items()}
for key in ("decode_8b", "rollout"):
    if (tmp / f"{key}.json").is_file():
        res[key] = json.loads((tmp / f"{key}.json").read_text())
res["ok"] = all(s["rc"] == 0 or s["skipped"] for s in stages.values())
out.write_text(json.dumps(res, indent=1) + "\n")
PY
}
step() {  # step NAME TIMEOUT_S CMD...: run one stage (or record its skip), keep its exit status, wall time, log tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    if [ -n "${SKIP[$name]:-}" ]; then
        echo "$name - 0 $limit ${SKIP[$name]}" >> "$TMP/stages.txt"
        echo "[gpu_check] $name: skipped (${SKIP[$name]})"
    else
        timeout -k 5 "$limit" "$@" > "$TMP/$name.log" 2>&1  # the stage's process group: its children too
        rc=$?
        if [ "$name" = cuda_tests ] && [ $rc = 5 ]; then  # pytest: no test carries the cuda marker
            echo "$name - $((SECONDS - t0)) $limit no test is marked cuda" >> "$TMP/stages.txt"
        else
            echo "$name $rc $((SECONDS - t0)) $limit" >> "$TMP/stages.txt"
        fi
        echo "[gpu_check] $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
        tail -n 5 "$TMP/$name.log"
    fi
    report
}
step smoke 75 python -m drafttrain.online recipe=eagle3_track rl.steps=2 $SMOKE run.device=$DEV "run.out_dir=$TMP/smoke"
step cuda_tests 60 python -m pytest -q -m cuda tests/ -p no:cacheprovider
step bench_e2e 225 python scripts/bench_e2e.py seeds=[0] arms=[ar,tracking] "overrides=[$E2E,run.device=$DEV]" "run_dir=$TMP/e2e" "out=$TMP/e2e.json" "plot=$TMP/e2e.png"
step decode_8b 60 python scripts/gpu_check.py $DECODE backend=torch device=$DEV "out=$TMP/decode_8b.json"
step contract 70 python -m pytest -q -x -m vllm tests/test_contract.py -p no:cacheprovider
step bench_rollout 50 python scripts/bench_rollout.py vllm=true batches=[1,16] n_prompts=32 max_new_tokens=128 vllm_batches=[1,16] "out=$TMP/rollout.json"
python - "$OUT" <<'PY'
import json, sys
stages = json.load(open(sys.argv[1]))["stages"]
bad = [k for k, s in stages.items() if not (s["rc"] == 0 or s["skipped"])]
print("all stages passed" if not bad else "FAILED: " + ", ".join(bad), "->", sys.argv[1])
sys.exit(1 if bad else 0)
PY
