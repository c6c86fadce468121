#!/usr/bin/env bash
# Where the package index is: downloads into DIR (default gpu_wheels/) the pure-Python wheels that drafttrain imports
# at run time and that the offline GPU machine lacks (it has torch, transformers, accelerate, safetensors, numpy,
# scipy, pyyaml, tqdm, tensorboard, matplotlib, pandas, pyarrow, pytest): omegaconf, at constraints.txt's pin, which
# carries its own antlr4 runtime. scripts/gpu_check.sh unpacks them onto PYTHONPATH; nothing is installed.
#   bash scripts/gpu_wheels.sh gpu_wheels && bash scripts/gpu_check.sh     # the second on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu_wheels}
mkdir -p "$DIR"
pin() { grep -E "^$1==" constraints.txt; }
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
    --platform any -d "$DIR" "$(pin omegaconf)"
du -sh "$DIR"
