"""The run's deliverable in a user's plain vllm.LLM, and drafttrain's vLLM plugin (engines/vllm_plugin.py).

The exported pair (python -m drafttrain.export's folder) loads in vllm.LLM as serve.json says: greedy SD equals greedy
AR, and at temperature 1 the sequences follow the policy's exact distribution (chi-square over every 3-token
sequence). That holds on CPU only with the plugin: the sampled test fails when it is disabled (VLLM_PLUGINS= pytest
...), and the control below shows plain vLLM-CPU sampling a wrong distribution without it. Each case runs vLLM in a
subprocess (tests/vllm/plain_llm.py) that finds the plugin through the entry point pyproject.toml declares, written
as package metadata on its path: what `pip install -e .` registers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import PROJECT_ROOT, load_recipe
from drafttrain.policy import build_tokenizer, save_policy
from drafttrain.spec import SamplingParams
from drafttrain.tracking.deliverable import export_run
from tests import contract as C
from tests.vllm.pool import vllm_policy

pytestmark = pytest.mark.vllm
ROWS = 3000


def trained_drafter(policy):
    """A fresh EAGLE-3 drafter trained a little on the policy's sampled rollouts: both SD paths (accept, reject) see
    enough rows."""
    from tests.vllm.test_vllm_engine import random_prompts, train_drafter

    prompts = random_prompts(96, seed=1)
    torch.manual_seed(0)
    with torch.no_grad():
        responses = [policy.generate(torch.tensor([p]), do_sample=True, max_new_tokens=24, min_new_tokens=24,
                                     pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return train_drafter(policy, C.fresh_drafter(policy, seed=1), prompts, responses, steps=150)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run folder's checkpoint (a vLLM-sized policy, a fresh EAGLE-3 drafter as the served one), exported."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("plugin")
    policy = vllm_policy()
    with torch.no_grad():  # peaked next-token distributions: vLLM's greedy drafts are accepted often enough
        policy.lm_head.weight.mul_(4.0)
    drafter = trained_drafter(policy)
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "engine.k=3"])
    ckpt = root / "run" / "ckpt" / "step-1"
    save_policy(policy, build_tokenizer(), str(ckpt / "policy"))
    torch.save({"step": 1, "config": OmegaConf.to_container(cfg, resolve=True),
                "tracker": {"good_weights": drafter.state_dict()}}, ckpt / "state.pt")
    (root / "run" / "ckpt" / "latest").write_text("step-1")
    export_run(root / "run", root / "export", log=lambda m: None)
    site = root / "site"  # the entry point as installed metadata: vLLM discovers plugins through importlib.metadata
    eps = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    info = site / "drafttrain-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: drafttrain\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{n} = {v}\n" for n, v in e.items())
                                                   for g, e in eps.items()))
    return policy, root / "export", site


def plain_vllm(exported, tmp_path, plugins: str | None) -> dict:
    """plain_llm.py's result; plugins: VLLM_PLUGINS for it (None: as in this environment)."""
    policy, out, site = exported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)]), "VLLM_CPU_KVCACHE_SPACE": "1"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    result = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-m", "tests.vllm.plain_llm", str(out), str(result), str(ROWS)], env=env,
                       cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(result.read_text())


def pvalue(policy, sampled) -> float:
    exact = C.exact_sequence_probs(policy, [1, 2, 3], 3, SamplingParams(temperature=1.0, max_new_tokens=3))
    try:
        return C.chi2_pvalue(C.seq_index(sampled, policy.config.vocab_size), exact)
    except AssertionError:  # a sequence of probability zero: not the policy's distribution
        return 0.0


def test_exported_pair_in_plain_vllm_is_exact(exported, tmp_path):
    """Greedy SD equals greedy AR; sampled SD follows the exact distribution (with the plugin, as installed)."""
    policy = exported[0]
    res = plain_vllm(exported, tmp_path, None)
    for p, got in zip(C.RAGGED_PROMPTS, res["greedy"]):
        assert got == C.hf_greedy(policy, p, 12), f"prompt {p}"
    m = res["metrics"]
    drafted, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    assert 0.1 * drafted < accepted < 0.95 * drafted, m  # both accept and reject paths exercised
    assert all(len(t) == 3 for t in res["sampled"])
    p = pvalue(policy, res["sampled"])
    assert p > C.ALPHA, f"plain vLLM's SD samples do not follow the policy's distribution (p={p:.2e})"


def test_without_the_plugin_vllm_cpu_samples_a_wrong_distribution(exported, tmp_path):
    """The control: the bug the plugin fixes is there (if vLLM fixes its CPU expand kernel, this fails and the
    plugin's expand fix can go)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expand-kernel bug is vLLM-CPU's")
    res = plain_vllm(exported, tmp_path, "")
    assert pvalue(exported[0], res["sampled"]) < 1e-6


def test_plugin_leaves_other_platforms_untouched(monkeypatch):
    vllm = pytest.importorskip("vllm")
    import vllm.platforms
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Kernel
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    from drafttrain.engines import vllm_plugin
    from drafttrain.engines.vllm_cpu import install_cpu_guards, on_cpu_platform

    class Gpu:
        def is_cpu(self):
            return False

        @classmethod
        def register_triton_kernel_overrides(cls):
            return None

    monkeypatch.setattr(vllm.platforms, "_current_platform", Gpu())
    before = (rs.expand_kernel, getattr(rs.expand_kernel, "_impl", None), tts.apply_top_k_only,
              Kernel.process_weights_for_onednn, Kernel.process_weights_for_sgl, Gpu.register_triton_kernel_overrides)
    vllm_plugin.register()
    assert not on_cpu_platform()
    assert install_cpu_guards() is False and install_cpu_guards(setup=True) is False  # the worker's two calls
    assert before == (rs.expand_kernel, getattr(rs.expand_kernel, "_impl", None), tts.apply_top_k_only,
                      Kernel.process_weights_for_onednn, Kernel.process_weights_for_sgl,
                      Gpu.register_triton_kernel_overrides)


def test_worker_guards_install_on_the_cpu_platform():
    """The CPU side of the test above: vLLM-CPU is this machine's platform, and the worker's guards go in."""
    pytest.importorskip("vllm")
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Kernel
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    from drafttrain.engines.vllm_cpu import install_cpu_guards, on_cpu_platform

    assert on_cpu_platform()
    install_cpu_guards(setup=True)
    assert getattr(tts.apply_top_k_only, "_drafttrain_guard", False)
    assert getattr(Kernel.process_weights_for_onednn, "_drafttrain_guard", False)
