"""Weight quantization: the one home of int8 / int4 linears, used by self-drafters and the engines.

Quantization of the linears (embeddings and norms stay fp32):
    int8   per-output-channel symmetric: q = round(w / s), s = max|w_row| / 127, q in [-127, 127]
    int4   group-wise symmetric along in-features (drafter.selfquant.group_size): s = max|w_group| / 7 rounded to bf16,
           q = round(w / s) in [-8, 7]   (bitsandbytes uses its own NF4 blocks of group_size instead)
Backends (drafter.selfquant.backend), each a small class below: __call__(x), requantize_(parts, b), load_(t), storage().
The ao and bnb int8 kernels also quantize activations per call (dynamic W8A8); ref and the int4 paths do not.
    ao   int8: fbgemm dynamic int8 (torch.ops.quantized.linear_dynamic; activations quantized per call, 7-bit as
              quantize_dynamic does). fbgemm's prepacked weight cannot be written in place: the in-place storage
              is the canonical q/scale, and every update re-prepacks from it (one new packed object per linear).
         int4: aten's CPU int4 kernel (_weight_int4pack_mm_for_cpu; bf16 activations), packed storage written in
              place. Needs group_size in {32, 64, 128, 256} and out-features divisible by 16.
    bnb  Linear8bitLt (int8, row-wise absmax of the fp16 weight) / Linear4bit nf4 (blocksize = group_size): the
         GPU path. On CPU with AVX512-BF16, Linear4bit repacks its weight for its CPU kernel; we do so once at
         build and requantize into that layout.
    ref  weight-only (int8/int4 in memory, dequantized into the activation dtype in the matmul): portable; on CPU
         an acceptance study, not a fast path. The ao kernels are CPU-only: elsewhere ao runs ref (backend_on).
quantize_module_int8(module): torch.ao dynamic int8 linears for a whole module (CPU; elsewhere full precision).
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafttrain.device import module_device
from drafttrain.modeling import PackedLinear, linear

_once = functools.lru_cache(maxsize=None)(logging.getLogger(__name__).warning)  # each message once per process
QUANTS = ("int8", "int4", "fp32")  # fp32: not quantized (ref only)
BACKENDS = ("ao", "bnb", "ref")
_AO_INT4_GROUPS = (32, 64, 128, 256)
_BNB_BLOCKS = (64, 128, 256, 512, 1024, 2048, 4096)


# ---- pure quantizers ------------------------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]); w ~ q * scale[:, None]."""
    s = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    return torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8), s.float()


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in [-8, 7], scale bf16 [N, K/group]); w ~ q * scale per group."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    s = (g.abs().amax(-1) / 7.0).clamp_min(1e-12).to(torch.bfloat16)  # [N, K/G]
    q = torch.round(g / s.float()[..., None]).clamp_(-8, 7)
    return q.reshape(N, K).to(torch.int8), s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] in [-8, 7] -> uint8 [N, K/2] (even column in the low nibble)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int8 [N, K] in [-8, 7]."""
    lo, hi = (p & 0xF).to(torch.int8) - 8, (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(p.shape[0], -1)


# ---- quantized linears: __call__(x [..., K]) -> [..., N]; requantize_/load_ write the storage in place ------------
# requantize_(parts, b): parts are row blocks of the weight (q|k|v, gate|up) quantized straight into their rows of the
# storage, a block of rows (about _CHUNK_ELEMS weights) at a time: no concatenated fp32 copy, only small temporaries (a
# large fresh allocation costs more in page faults than the quantization itself here), and few blocks for small
# weights (each block is a dozen tensor ops: per-op overhead dominated 128-row blocks of a 256-wide drafter).
_CHUNK_ELEMS = 1 << 18


class QuantLinear:
    bias: torch.Tensor | None

    def requantize_(self, parts: list[torch.Tensor], b: torch.Tensor | None = None) -> None:
        r0 = 0
        for w in parts:
            rows = max(1, _CHUNK_ELEMS // w.shape[1])
            for c in range(0, w.shape[0], rows):
                blk = w[c:c + rows].float()
                self._rows_(blk, r0 + c, r0 + c + blk.shape[0])
            r0 += w.shape[0]
        if self.bias is not None:
            self.bias.copy_(b)
        self._repack()

    def _rows_(self, w: torch.Tensor, r0: int, r1: int) -> None:
        raise NotImplementedError

    def storage(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_(self, t: dict[str, torch.Tensor]) -> None:
        """Copy drafter-form tensors (names/shapes/dtypes already validated) into the storage."""
        for name, dst in self.storage().items():
            dst.copy_(t[name])
        self._repack()

    def _repack(self) -> None:
        pass

    def _with_bias(self, s: dict) -> dict:
        return {**s, "bias": self.bias} if self.bias is not None else s


class RefInt8(QuantLinear):
    """Weight-only int8, dequantized in the matmul: y = (x @ q^T) * scale + b."""

    def __init__(self, parts, b, group):
        N, K, dev = sum(w.shape[0] for w in parts), parts[0].shape[1], parts[0].device
        self.q, self.scale = torch.empty(N, K, dtype=torch.int8, device=dev), torch.empty(N, device=dev)
        self.bias = None if b is None else torch.empty(N, device=dev)
        self.requantize_(parts, b)

    def _rows_(self, w, r0, r1):
        q, s = quantize_int8(w)
        self.q[r0:r1].copy_(q)
        self.scale[r0:r1].copy_(s)

    def storage(self):
        return self._with_bias({"q": self.q, "scale": self.scale})

    def __call__(self, x):
        y = F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias


class RefInt4(QuantLinear):
    """Weight-only int4 group-wise, dequantized per call: packed nibbles + bf16 group scales."""

    def __init__(self, parts, b, group):
        N, K, dev = sum(w.shape[0] for w in parts), parts[0].shape[1], parts[0].device
        self.group = group
        self.packed = torch.empty(N, K // 2, dtype=torch.uint8, device=dev)
        self.scale = torch.empty(N, K // group, dtype=torch.bfloat16, device=dev)
        self.bias = None if b is None else torch.empty(N, device=dev)
        self.requantize_(parts, b)

    def _rows_(self, w, r0, r1):
        q, s = quantize_int4(w, self.group)
        self.packed[r0:r1].copy_(pack_int4(q))
        self.scale[r0:r1].copy_(s)

    def storage(self):
        return self._with_bias({"packed": self.packed, "scale": self.scale})

    def dequantize(self) -> torch.Tensor:
        N = self.packed.shape[0]
        q = unpack_int4(self.packed).float().view(N, -1, self.group)
        return (q * self.scale.float()[..., None]).view(N, -1)

    def __call__(self, x):
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)


_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default  # the overload: skips the packet's per-call checks


class AoInt8(RefInt8):
    """fbgemm dynamic int8. Storage: canonical q/scale (in place); the prepacked weight is rebuilt from it."""

    def _repack(self):
        with warnings.catch_warnings():  # quantized tensor creation is deprecated upstream; fbgemm still needs it
            warnings.simplefilter("ignore")
            wq = torch._make_per_channel_quantized_tensor(  # fbgemm: CPU only (backend_on picks this class there)
                self.q, self.scale.double(), torch.zeros(len(self.scale), dtype=torch.long, device="cpu"), 0)
            self.packed = torch.ops.quantized.linear_prepack(wq, self.bias)

    def __call__(self, x):
        return _LINEAR_DYNAMIC(x, self.packed, True)  # reduce_range: as quantize_dynamic on x86


class AoInt4(QuantLinear):
    """aten's CPU int4 kernel: weight packed by _convert_weight_to_int4pack_for_cpu, scales/zeros [K/G, N, 2] bf16
    (dequant = (u - 8) * scale + 0, u = q + 8); both written in place. Its packing is row-separable in blocks of 64
    rows (checked against whole-matrix packing in the tests)."""

    def __init__(self, parts, b, group):
        N, K = sum(w.shape[0] for w in parts), parts[0].shape[1]
        self.group, self.N = group, N
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(  # CPU kernels: backend_on picks them there
            torch.zeros(N, K, dtype=torch.int32, device="cpu"), 1)
        self.sz = torch.zeros(K // group, N, 2, dtype=torch.bfloat16, device="cpu")
        self.bias = None if b is None else torch.empty(N, device="cpu")
        self.requantize_(parts, b)

    def requantize_(self, parts, b=None):
        for r0, blk in _row_blocks(parts, 64 if self.N % 64 == 0 else self.N):
            q, s = quantize_int4(blk.float(), self.group)
            self.packed[r0:r0 + len(blk)].copy_(
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1))
            self.sz[:, r0:r0 + len(blk), 0].copy_(s.t())
        if self.bias is not None:
            self.bias.copy_(b)

    def storage(self):
        return self._with_bias({"packed": self.packed, "sz": self.sz})

    def __call__(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed,
                                                       self.group, self.sz)
        y = y.float().view(*x.shape[:-1], self.N)
        return y if self.bias is None else y + self.bias


def _row_blocks(parts: list[torch.Tensor], step: int):
    """(row offset, [step, K] block) over the stacked parts; a block crossing a part boundary is concatenated."""
    N = sum(w.shape[0] for w in parts)
    bounds, r = [], 0
    for w in parts:
        bounds.append((r, w))
        r += w.shape[0]
    for r0 in range(0, N, step):
        r1 = min(r0 + step, N)
        pieces = [w[max(r0 - a, 0):min(r1 - a, len(w))] for a, w in bounds if a < r1 and a + len(w) > r0]
        yield r0, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _Bnb(QuantLinear):
    mod: nn.Module

    @property
    def bias(self):  # the module's own (a separate alias would not survive a deepcopy)
        return None if self.mod.bias is None else self.mod.bias.data

    def __call__(self, x):
        return self.mod(x)


class BnbInt8(_Bnb):
    """bitsandbytes Linear8bitLt (threshold 0: no fp16 outlier columns). Storage: its matmul state's CB (int8 [N, K])
    and SCB (row absmax [N]), quantized from the fp16 weight row by row as bitsandbytes does."""

    def __init__(self, parts, b, group):
        bnb = _import_bnb()
        w = torch.cat(parts)
        N, K = w.shape
        m = bnb.nn.Linear8bitLt(K, N, bias=b is not None, has_fp16_weights=False, threshold=0.0)
        m.weight = bnb.nn.Int8Params(w.detach().clone(), requires_grad=False, has_fp16_weights=False)
        if b is not None:
            m.bias = nn.Parameter(b.detach().clone().float(), requires_grad=False)
        self.mod = m.to(w.device).eval()
        with torch.no_grad():
            self.mod(torch.zeros(1, K, device=w.device))  # moves CB/SCB into the matmul state: the storage from now on

    def _rows_(self, w, r0, r1):
        cb, scb, _ = _import_bnb().functional.int8_vectorwise_quant(w.to(torch.float16))
        self.mod.state.CB[r0:r1].copy_(cb)
        self.mod.state.SCB[r0:r1].copy_(scb)

    def storage(self):
        return self._with_bias({"CB": self.mod.state.CB, "SCB": self.mod.state.SCB})


class BnbNf4(_Bnb):
    """bitsandbytes Linear4bit nf4, blocksize = group_size, fp32 compute, no double quantization. Storage: its
    packed weight and block absmax (in the CPU-kernel layout where bnb uses one). Quantized whole (the GPU path)."""

    def __init__(self, parts, b, group):
        bnb = _import_bnb()
        w = torch.cat(parts)
        N, K = w.shape
        self.group = group
        m = bnb.nn.Linear4bit(K, N, bias=b is not None, compute_dtype=torch.float32, compress_statistics=False,
                              quant_type="nf4")
        m.weight = bnb.nn.Params4bit(w.detach().clone(), requires_grad=False, quant_type="nf4", blocksize=group,
                                     compress_statistics=False)
        if b is not None:
            m.bias = nn.Parameter(b.detach().clone().float(), requires_grad=False)
        # bnb's CPU kernel repacks the weight at the first eval forward; it asserts N % 32 == 0 (else: train mode,
        # the generic dequantizing path)
        self.mod = m.to(w.device).train(N % 32 != 0)
        with torch.no_grad():
            self.mod(torch.zeros(1, K, device=w.device))
        self.cpu_packed = bool(getattr(self.mod.weight.quant_state, "packing_format_for_cpu", False))

    def requantize_(self, parts, b=None):
        qw, qs = _import_bnb().functional.quantize_4bit(torch.cat(parts).float(), blocksize=self.group,
                                                        compress_statistics=False, quant_type="nf4")
        if self.cpu_packed:
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu  # what Linear4bit.forward does

            qw, qs = _convert_weight_packed_for_cpu(qw, qs)
        self.mod.weight.data.copy_(qw.view(self.mod.weight.data.shape))
        self.mod.weight.quant_state.absmax.copy_(qs.absmax)
        if self.bias is not None:
            self.bias.copy_(b)

    def storage(self):
        return self._with_bias({"weight": self.mod.weight.data, "absmax": self.mod.weight.quant_state.absmax})


class Fp32Linear(QuantLinear):
    """Not quantized: the fp32 weight, prepacked for oneDNN (a trained draft model's runtime form without int8)."""

    def __init__(self, parts, b, group):
        N, K, dev = sum(w.shape[0] for w in parts), parts[0].shape[1], parts[0].device
        self.w, self.bias = torch.empty(N, K, device=dev), None if b is None else torch.empty(N, device=dev)
        self.requantize_(parts, b)

    def _rows_(self, w, r0, r1):
        self.w[r0:r1].copy_(w)

    def _repack(self):
        self._lin = PackedLinear.wrap(self.w, self.bias)

    def storage(self):
        return self._with_bias({"w": self.w})

    def __call__(self, x):
        return linear(x, self._lin)


LINEARS = {("fp32", "ref"): Fp32Linear,
           ("int8", "ref"): RefInt8, ("int4", "ref"): RefInt4, ("int8", "ao"): AoInt8, ("int4", "ao"): AoInt4,
           ("int8", "bnb"): BnbInt8, ("int4", "bnb"): BnbNf4}


def backend_on(quant: str, backend: str, device) -> str:
    """The backend that runs (quant, backend) on `device` (its type decides; the one place): the ao kernels are
    CPU-only, so elsewhere ao runs ref's weight-only forms (the matmul in the activation dtype), logged once."""
    where = torch.device(device).type
    if backend != "ao" or where == "cpu":
        return backend
    _once(f"drafttrain.quant: {quant} ao kernels are CPU-only; on {where} the {quant} linears run weight-only (ref)")
    return "ref"


def quant_linear(quant: str, backend: str, parts: list, b, group: int, device=None) -> QuantLinear:
    """The linear of the weight's row blocks `parts` (bias b) for (quant, backend), in the form that runs on `device`
    (default: the weight's)."""
    return LINEARS[(quant, backend_on(quant, backend, parts[0].device if device is None else device))](parts, b, group)


def _import_bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("drafter.selfquant.backend: bnb needs bitsandbytes, which is not installed "
                         "(pip install bitsandbytes; or drafter.selfquant.backend=ao|ref)") from None
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)  # a cast warning per matmul
    return bnb


def check_backend(quant: str, backend: str, group: int, sizes: dict[str, tuple[int, int]], device="cpu") -> None:
    """One-line ValueError naming the drafter.* field. sizes: linear name -> (out, in) features; device: where the
    linears will run (the backend that runs there is checked: backend_on)."""
    if quant not in QUANTS:
        raise ValueError(f"drafter.selfquant.quant: unknown quantization {quant!r} (known: {', '.join(QUANTS)})")
    if backend not in BACKENDS:
        raise ValueError(f"drafter.selfquant.backend: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    backend = backend_on(quant, backend, device) if quant != "fp32" else backend
    if quant == "fp32" and backend != "ref":
        raise ValueError(f"drafter.selfquant.backend: fp32 (not quantized) runs on backend ref, got {backend!r}")
    if backend == "bnb":
        _import_bnb()
    if backend == "ao" and quant == "int8" and not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        raise ValueError("drafter.selfquant.backend: ao int8 needs torch's fbgemm/x86 quantized engine, which this "
                         "torch build lacks (use drafter.selfquant.backend=ref)")
    if backend == "ao" and quant == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError("drafter.selfquant.backend: ao int4 needs aten._weight_int4pack_mm_for_cpu, which this "
                         "torch build lacks (use drafter.selfquant.backend=ref)")
    if quant != "int4":
        return
    if group < 1:
        raise ValueError(f"drafter.selfquant.group_size: must be >= 1, got {group}")
    for name, (n_out, n_in) in sizes.items():
        if n_in % group:
            raise ValueError(f"drafter.selfquant.group_size: {group} does not divide the in-features {n_in} of the "
                             f"policy's {name} (hidden/intermediate size)")
    if backend == "ao" and group not in _AO_INT4_GROUPS:
        raise ValueError(f"drafter.selfquant.group_size: ao int4 supports {list(_AO_INT4_GROUPS)}, got {group}")
    if backend == "ao":
        bad = next((n for n, (o, _) in sizes.items() if o % 16), None)
        if bad:
            raise ValueError(f"drafter.selfquant.backend: ao int4 needs out-features divisible by 16; the policy's "
                             f"{bad} has {sizes[bad][0]} (use drafter.selfquant.backend=ref)")
    if backend == "bnb" and group not in _BNB_BLOCKS:
        raise ValueError(f"drafter.selfquant.group_size: bnb nf4 blocksize must be one of {list(_BNB_BLOCKS)}, got "
                         f"{group}")


def quantize_module_int8(module: torch.nn.Module, device=None) -> torch.nn.Module:
    """torch.ao dynamic int8 linears (x86/fbgemm): several times cheaper than fp32 on CPU. Off the CPU (device: the
    module's by default) there is no such kernel: the module stays full precision, logged once."""
    from torch.ao.quantization import quantize_dynamic

    if (where := torch.device(device if device is not None else module_device(module)).type) != "cpu":
        _once(f"drafttrain.quant: torch.ao dynamic int8 is CPU-only; on {where} the drafter runs full precision")
        return module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)
