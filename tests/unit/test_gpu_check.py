"""scripts/gpu_check.py (decode step measured vs the simulator's roofline) and scripts/gpu_check.sh, where no GPU is
(its --cpu run: tests/integration/test_gpu_check_cpu.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from drafttrain.simulate import GPUS, Replica
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
gc = load_script("gpu_check")


def test_device_names_map_to_the_simulator_gpus():
    assert gc.gpu_name("NVIDIA H200") == "H200"
    assert gc.gpu_name("NVIDIA H100 80GB HBM3") == "H100"
    assert gc.gpu_name("NVIDIA GB200") == "GB200"  # not B200, which its name also contains
    with pytest.raises(ValueError, match="gpu"):
        gc.gpu_name("NVIDIA GeForce RTX 4090")


def test_measured_rows_carry_the_simulators_cost(tmp_path):
    cfg = gc.GpuCheckConfig(model="tiny", backend="torch", device="cpu", gpu="H100", batches=[1, 2], ctx=16,
                            new_tokens=2, repeats=1, out=str(tmp_path / "g.json"))
    res = gc.main(cfg)
    assert json.loads((tmp_path / "g.json").read_text()) == res
    rep = Replica(gc.TINY, GPUS["H100"])
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["simulated_s"] == pytest.approx(rep.forward_s(r["batch"], 1, 16))
        assert r["measured_s"] > 0 and r["measured_over_simulated"] == pytest.approx(r["measured_s"] / r["simulated_s"])


@pytest.mark.parametrize("field,value", [("model", "13b"), ("backend", "tensorrt"), ("gpu", "TPU")])
def test_bad_settings_name_the_field(tmp_path, field, value):
    cfg = gc.GpuCheckConfig(model="tiny", backend="torch", device="cpu", gpu="H100", batches=[1], ctx=8,
                            new_tokens=1, repeats=1, out=str(tmp_path / "g.json"))
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=f"^{field}:"):
        gc.main(cfg)
    assert not (tmp_path / "g.json").exists()


def test_shell_script_parses_and_refuses_without_a_gpu(tmp_path):
    sh = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(sh)]).returncode == 0
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the refusal is for machines without a GPU")
    r = subprocess.run(["bash", str(sh), str(tmp_path / "out.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no CUDA GPU" in r.stdout
    assert not (tmp_path / "out.json").exists()  # nothing installed, nothing written


def test_every_path_the_shell_script_runs_exists():
    """Each script and test file gpu_check.sh names is in the repository (it named tests/vllm/test_vllm_contract.py,
    gone since the contract moved to tests/test_contract.py: on a GPU its contract stage would have failed)."""
    import re
    import shlex

    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    steps = [shlex.split(line)[3:] for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) >= 4
    paths = [a for cmd in steps for a in cmd if re.fullmatch(r"[\w/.-]+\.(py|yaml|txt)", a)]
    assert any(a.startswith("tests/") for a in paths)
    missing = [a for a in paths if not (ROOT / a).exists()]
    assert not missing, missing


STAGES = ["smoke", "cuda_tests", "bench_e2e", "decode_8b", "contract", "bench_rollout"]


def step_lines() -> list[list[str]]:
    import shlex

    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("step ")]


def test_stages_fit_one_device_command():
    """The stages, in order, whose timeouts add to at most 540 s (one device command may run 600 s)."""
    steps = step_lines()
    assert [s[0] for s in steps] == STAGES
    assert sum(int(s[1]) for s in steps) <= 540


def test_nothing_is_installed_on_the_gpu_machine():
    """The machine's CUDA torch stays: the script never runs pip install (nor pip at all: wheels are unpacked), and
    runs drafttrain from the repository (no pip install -e); gpu_wheels.sh downloads pure-Python wheels only."""
    import re

    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    code = "\n".join(line.split("#")[0] for line in text.splitlines())
    assert not re.search(r"\bpip\b", code), "gpu_check.sh calls pip"
    assert "run.device=$DEV" in code and 'PYTHONPATH="$PWD' in code
    wheels = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_wheels.sh")]).returncode == 0
    assert "pip download" in wheels and "pip install" not in wheels
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--platform any"):
        assert flag in wheels, flag
    assert "pin omegaconf" in wheels and "omegaconf==" in (ROOT / "constraints.txt").read_text()
