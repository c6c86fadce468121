"""drafttrain's vLLM general plugin: the vLLM-CPU fixes (vllm_cpu.py) in any vllm.LLM or `vllm serve` of an
environment with drafttrain installed, not only in drafttrain's own engine.

vLLM calls every `vllm.general_plugins` entry point (pyproject.toml: drafttrain = this module's register) in each
process it starts; VLLM_PLUGINS, a comma-separated list of names, selects which (VLLM_PLUGINS= loads none).
On every platform register() puts drafttrain's worker methods on vLLM's workers and registers its weight transport
(vllm_worker.py: what the engine and the handles on servers and users' vllm.LLM call). On the CPU platform it also
installs the W8A8 and top-k guards and the expand-kernel fix; each still acts only where it sees the failure.

Why the wrap: a worker loads plugins before the platform registers its C++ stand-ins for Triton kernels
(register_triton_kernel_overrides), and the broken expand kernel is one of them, so the fix runs after that call.
"""
from __future__ import annotations

from drafttrain.engines.vllm_cpu import fix_cpu_expand_kernel, install_cpu_guards, on_cpu_platform


def register() -> None:
    """The entry point vLLM calls (any number of times per process: each step is idempotent)."""
    from vllm import platforms

    from drafttrain.engines.vllm_worker import add_worker_methods  # the import registers the weight transport

    add_worker_methods()
    if not on_cpu_platform():
        return
    install_cpu_guards(setup=True)  # the expand-kernel fix where the stand-ins are already in place
    cls = type(platforms.current_platform)
    original = cls.register_triton_kernel_overrides
    if getattr(original, "_drafttrain_fix", False):
        return

    def register_triton_kernel_overrides(klass) -> None:
        original()
        fix_cpu_expand_kernel()

    register_triton_kernel_overrides._drafttrain_fix = True
    cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
