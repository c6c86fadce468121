"""A roofline simulator of drafttrain at scale: the cost of AR and SD decode steps, rollouts with a long tail, and the
RL step around them (training, drafter training, weight sync, sync or async). Pure math: no model, no engine.

    forward(B, t, ctx) = max(bytes / (HBM bandwidth x mbu), FLOPs / (peak x mfu)) + overhead
    bytes  = weights read (MoE: the non-expert weights + the distinct experts the B*t tokens touch, per layer)
             + KV cache read (B rows x ctx tokens) + KV written (B x t)
    FLOPs  = 2 x active params x B t + 4 x layers x q-width x ctx x B t          (matmuls; attention QK^T and AV)
    SD step = k drafter forwards (t = 1) + one verify forward (t = k + 1) + sd_overhead (+ a stack's per-row costs)
    L(k)    = 1 + sum_{i<k} prod_{j<=i} a_j                    (expected tokens per SD step; a_j conditional)

A rollout runs as many rows at once as their KV caches fit in HBM (less the weights; a self-drafter adds a quantized
copy and a KV cache of its own), the rest queued; rows finish at their lengths, so the active batch shrinks (the long
tail), and each stretch between two finishes costs (its tokens) x (step time / tokens per step) of the mode chosen
there. A tensor-parallel replica of tp GPUs has tp x the bandwidth, FLOPs and HBM of one; its all-reduces go into
the per-forward overhead.
Simplifications, on purpose: uniform MoE routing; the drafter's fc over the aux states is priced at every draft
step; a row's last SD step is not cut; prefill is one compute-bound pass; no CPU/scheduler stalls beyond overhead.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Callable, Optional

from drafttrain.spec.expected import expected_tokens


@dataclass(frozen=True)
class Gpu:
    hbm_bytes_s: float  # HBM bandwidth, bytes/s
    flops_s: float  # peak dense BF16 tensor FLOP/s (without sparsity)
    link_bytes_s: float  # NVLink bandwidth per direction, bytes/s (weight sync inside a node)
    hbm_bytes: float  # HBM capacity, bytes


# Vendor datasheets, per GPU (SXM / HGX parts; NVLink totals both directions, half of it is used here):
#   A100 SXM4   80 GB HBM2e  2.039 TB/s    312 TFLOPS dense BF16 (624 with sparsity)   NVLink 600 GB/s
#   H100 SXM    80 GB HBM3   3.35 TB/s     989 TFLOPS dense BF16 (1,979 sparse)        NVLink 900 GB/s
#   H200 SXM   141 GB HBM3e  4.8 TB/s      989 TFLOPS dense BF16                       NVLink 900 GB/s
#   B200 (HGX) 180 GB HBM3e  8 TB/s       2.25 PFLOPS dense BF16 (4.5 sparse)         NVLink 5 1.8 TB/s
#   GB200 NVL72 186 GB (13.4 TB / 72) HBM3e 8 TB/s, 2.5 PFLOPS dense BF16            NVLink 5 1.8 TB/s
GPUS = {
    "A100": Gpu(2.039e12, 312e12, 300e9, 80e9),
    "H100": Gpu(3.35e12, 989e12, 450e9, 80e9),
    "H200": Gpu(4.8e12, 989e12, 450e9, 141e9),
    "B200": Gpu(8.0e12, 2.25e15, 900e9, 180e9),
    "GB200": Gpu(8.0e12, 2.5e15, 900e9, 186e9),
}


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or one expert's width in an MoE
    vocab: int
    experts: int = 0  # 0: dense
    active_experts: int = 0
    head_intermediate: int = 0  # the EAGLE-3 head's dense MLP width (0: intermediate)

    # counts computed once per model (cached_property: a frozen dataclass's fields stay as they are); the simulator
    # asks for them millions of times per run
    @cached_property
    def attn_params(self) -> int:  # q, o: hidden x heads*head_dim; k, v: hidden x kv_heads*head_dim (per layer)
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @cached_property
    def expert_params(self) -> int:  # gate, up, down of one expert (or the dense MLP), per layer
        return 3 * self.hidden * self.intermediate

    @cached_property
    def _params(self) -> tuple[int, int]:
        """(all, active) parameters: params(False), params(True)."""
        def count(n):
            return self.layers * (self.attn_params + n * self.expert_params) + 2 * self.vocab * self.hidden
        return count(max(self.experts, 1)), count(self.active_experts if self.experts else 1)

    def params(self, active: bool = False) -> int:
        """All parameters (active=True: those one token uses; lm_head and embedding included, untied)."""
        return self._params[1 if active else 0]

    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes


# Public configs: Llama-3-8B, Llama-3-70B, Qwen3-235B-A22B (94 layers, 128 experts of width 1536, 8 active). The MoE's
# EAGLE-3 head is a dense layer with an MLP of width 12288 (an assumption: Qwen3-8B's width).
MODELS = {
    "8b": Model(32, 4096, 32, 8, 128, 14336, 128256),
    "70b": Model(80, 8192, 64, 8, 128, 28672, 128256),
    "235b_a22b": Model(94, 4096, 64, 4, 128, 1536, 151936, experts=128, active_experts=8, head_intermediate=12288),
}

DRAFT_VOCAB = 32000  # EAGLE-3's reduced draft vocabulary (its lm_head rows)
DRAFT_MODEL_LAYERS = 1  # drafter.draft_model.layers, as shipped
# The suffix drafter drafts on the host (its n-gram index, pure Python): no GPU forward. Per row and drafted token,
# measured here (bench/drafters.json's suffix drafting cost; bench/NOTES.md, Simulator), kept as it is at scale
SUFFIX_ROW_S = 8e-6
WEIGHT_BYTES = {"bf16": 2.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2 / 64}  # + a bf16 scale per group (128 / 64)


def expected_distinct_experts(n_tokens: float, experts: int, active: int) -> float:
    """E[distinct experts] that n tokens touch in one layer, each picking `active` of `experts` uniformly:
    E (1 - (1 - a/E)^n). n = 1 gives a; n large gives E."""
    return experts * (1.0 - (1.0 - active / experts) ** n_tokens)


def uniform_curve(length: float, k: int, k_max: int) -> list[float]:
    """The constant per-position acceptance a with L(k) = length (bisection), repeated over k_max positions."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid] * k, k) < length else (lo, mid)
    return [lo] * k_max


def roofline_s(n_bytes: float, flops: float, gpu: Gpu, n_gpus: int = 1, mbu: float = 1.0, mfu: float = 1.0,
               overhead_s: float = 0.0) -> float:
    """max(memory time, compute time) + a fixed overhead, for work spread evenly over n_gpus."""
    return max(n_bytes / (gpu.hbm_bytes_s * mbu * n_gpus), flops / (gpu.flops_s * mfu * n_gpus)) + overhead_s


def policy_forward(m: Model, batch: float, t: float, ctx: float, wbytes: float = 2.0) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward of the policy (or its quantized copy): batch rows of t new tokens at ctx."""
    n = batch * t
    experts = expected_distinct_experts(n, m.experts, m.active_experts) if m.experts else 1
    weights = m.layers * (m.attn_params + experts * m.expert_params) + m.vocab * m.hidden  # + lm_head
    kv = m.kv_bytes_per_token() * batch * (ctx + t)
    flops = 2 * (m.params(active=True) - m.vocab * m.hidden) * n + 4 * m.layers * m.heads * m.head_dim * ctx * n
    return weights * wbytes + kv, flops


def eagle3_params(m: Model) -> int:
    """The EAGLE-3 head: fc [H, 3H], one decoder layer whose q/k/v read its 2H input (o and the MLP on H), and the
    draft lm_head [32000, H] (the embedding is the policy's)."""
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    return 3 * h * h + (2 * h * (q + 2 * kv) + q * h) + 3 * h * (m.head_intermediate or m.intermediate) \
        + DRAFT_VOCAB * h


def eagle3_forward(m: Model, batch: float, ctx: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one EAGLE-3 draft step: its bf16 weights and its one-layer KV cache, read once."""
    kv = 2 * m.kv_heads * m.head_dim * 2.0 * batch * (ctx + 1)
    flops = 2 * eagle3_params(m) * batch + 4 * m.heads * m.head_dim * ctx * batch
    return eagle3_params(m) * 2.0 + kv, flops


def mtp_params(m: Model) -> int:
    """The MTP head's own weights: fc [H, 2H] and one dense decoder layer (its MLP of the EAGLE-3 head's width). Its
    LM head is the policy's (shared: read at every draft step, not stored twice)."""
    return 2 * m.hidden * m.hidden + m.attn_params + 3 * m.hidden * (m.head_intermediate or m.intermediate)


def mtp_forward(m: Model, batch: float, ctx: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one MTP draft step: its weights and the shared LM head, its one-layer KV cache."""
    w = mtp_params(m) + m.vocab * m.hidden
    kv = 2 * m.kv_heads * m.head_dim * 2.0 * batch * (ctx + 1)
    return w * 2.0 + kv, 2 * w * batch + 4 * m.heads * m.head_dim * ctx * batch


@lru_cache(maxsize=None)
def draft_model(m: Model, layers: int = DRAFT_MODEL_LAYERS) -> Model:
    """The draft model: the policy's shape cut to its first `layers` decoder layers (own embedding and LM head)."""
    return replace(m, layers=layers)


@dataclass(frozen=True)
class DraftShape:
    """A drafter kind to the simulator: one drafted token per row costs the roofline of forward(model, batch, ctx) ->
    (bytes, FLOPs) over layers(model) (None: host_row_s per row on the host); memory(model) -> (weights, KV/token)."""

    forward: Optional[Callable]
    layers: Callable
    memory: Callable
    host_row_s: float = 0.0


# The kinds with a shape of their own; any other name is a self-drafter: a copy of the policy at WEIGHT_BYTES[name]
SHAPES = {  # EAGLE-3 and MTP: one layer's weights and KV cache; the draft model: all its own
    "eagle3": DraftShape(eagle3_forward, lambda m: 1,
                         lambda m: (2.0 * eagle3_params(m), m.kv_bytes_per_token() / m.layers)),
    "mtp": DraftShape(mtp_forward, lambda m: 1, lambda m: (2.0 * mtp_params(m), m.kv_bytes_per_token() / m.layers)),
    "draft_model": DraftShape(lambda m, b, ctx: policy_forward(draft_model(m), b, 1, ctx),
                              lambda m: draft_model(m).layers,
                              lambda m: (2.0 * draft_model(m).params(), draft_model(m).kv_bytes_per_token())),
    "suffix": DraftShape(None, lambda m: 0, lambda m: (0.0, 0.0), SUFFIX_ROW_S),  # host memory only
}


@dataclass(frozen=True)
class Replica:
    """One rollout engine replica: a model on tp GPUs, with achievable fractions of the roofline."""

    model: Model
    gpu: Gpu
    tp: int = 1
    mbu: float = 0.8  # achieved / peak HBM bandwidth in decode
    mfu: float = 0.6  # achieved / peak FLOPs in decode and verify GEMMs
    overhead_s: float = 4e-4  # per forward: launch, sampling, scheduling
    allreduce_s: float = 8e-6  # per all-reduce (2 per layer) when tp > 1
    sd_overhead_s: float = 4e-4  # per SD step: rejection sampling, draft bookkeeping
    row_s: tuple = (0.0, 0.0, 0.0)  # per row and forward (decode, draft, verify): a stack's CPU-side cost

    def _t(self, n_bytes, flops, layers) -> float:
        comm = 2 * layers * self.allreduce_s if self.tp > 1 else 0.0
        return roofline_s(n_bytes, flops, self.gpu, self.tp, self.mbu, self.mfu, self.overhead_s + comm)

    def forward_s(self, batch: float, t: float, ctx: float) -> float:
        """The policy's forward: a decode step (t = 1) or a verify pass (t = k + 1)."""
        row = self.row_s[0] if t == 1 else self.row_s[2]
        return self._t(*policy_forward(self.model, batch, t, ctx), self.model.layers) + row * batch

    def draft_s(self, kind: str, batch: float, ctx: float) -> float:
        """One drafted token for every row: an EAGLE-3 or MTP head step, a draft model's forward, the suffix
        index's host-side lookup, or a forward of the int8/int4 policy copy."""
        shape, m = SHAPES.get(kind), self.model
        if shape is None:  # a self-drafter
            cost = self._t(*policy_forward(m, batch, 1, ctx, WEIGHT_BYTES[kind]), m.layers)
        elif shape.forward is None:
            cost = shape.host_row_s * batch
        else:
            cost = self._t(*shape.forward(m, batch, ctx), shape.layers(m))
        return cost + self.row_s[1] * batch

    def sd_step_s(self, kind: str, batch: float, k: int, ctx: float) -> float:
        return self.sd_steps_s(kind, batch, [k], ctx)[0]

    def sd_steps_s(self, kind: str, batch: float, ks, ctx: float) -> list[float]:
        """sd_step_s at each k of ks (the drafting cost per token computed once)."""
        d = self.draft_s(kind, batch, ctx)
        return [k * d + self.forward_s(batch, k + 1, ctx) + self.sd_overhead_s for k in ks]

    def speedup(self, kind: str, acc: list[float], batch: float, k: int, ctx: float) -> float:
        """SD over AR per token: L(k) x T_ar / T_sd = L / (k r + v), r and v the draft and verify costs in AR steps."""
        return expected_tokens(acc, k) * self.forward_s(batch, 1, ctx) / self.sd_step_s(kind, batch, k, ctx)


def toggle_on(speedup: float, threshold: float = 1.05) -> bool:
    """The EfficientRollout / drafttrain toggle: speculate only where the predicted speed-up reaches the threshold."""
    return speedup >= threshold


def ladder_k(acc: list[float], ladder=(2, 4, 6, 8), up: float = 0.94, down: float = 0.85) -> int:
    """The rung the EfficientRollout ladder settles on under a steady acceptance curve: it climbs while the accepted
    fraction (L(k) - 1) / k of the drafts is >= up, and stays at the bottom when it is <= down."""
    i = 0
    while i + 1 < len(ladder) and (expected_tokens(acc, ladder[i]) - 1) / ladder[i] >= up:
        i += 1
    return ladder[i]


def lognormal_lengths(n: int, mean: float, sigma: float, cap: int) -> list[int]:
    """n response lengths: the (i + 1/2)/n quantiles of a lognormal of this mean and sigma, cut at cap."""
    mu = math.log(mean) - sigma * sigma / 2
    nd = statistics.NormalDist()
    return sorted(min(cap, max(1, round(math.exp(mu + sigma * nd.inv_cdf((i + 0.5) / n))))) for i in range(n))


def sigma_from_mean_p90(mean: float, p90: float) -> float:
    """The lognormal sigma whose p90 / mean ratio is this one: p90/mean = exp(z90 s - s^2/2) (the smaller root)."""
    z = statistics.NormalDist().inv_cdf(0.9)
    c = math.log(min(max(p90 / mean, 1.0), math.exp(z * z / 2)))
    return z - math.sqrt(max(z * z - 2 * c, 0.0))


@dataclass(frozen=True)
class Mode:
    """How a rollout decodes. kinds: the drafters it may use ({} = AR), each with its acceptance curve; k: an int,
    "auto" (argmax of the speed-up over 1..k_max) or "ladder"; toggle: SD only where toggle_on; several kinds = the
    drafter chooser (the fastest per stretch of active batch)."""

    kinds: dict  # kind -> acceptance per position
    k: int | str = 5
    toggle: bool = False
    k_max: int = 8
    threshold: float = 1.05
    shared_kv: bool = False  # self-drafters attend to the policy's KV cache (EfficientRollout's), not their own
    ladder: tuple = (2, 4, 6, 8)  # the k ladder for k="ladder"

    def plan(self, rep: Replica, batch: float, ctx: float) -> tuple[float, bool]:
        """(seconds per token, SD used) at this active batch and context."""
        ar = rep.forward_s(batch, 1, ctx)
        steps = []
        for kind, acc in self.kinds.items():
            if self.k == "auto":
                ks = range(1, self.k_max + 1)
            else:
                ks = [ladder_k(acc, self.ladder) if self.k == "ladder" else self.k]
            steps += [t / expected_tokens(acc, k) for k, t in zip(ks, rep.sd_steps_s(kind, batch, ks, ctx))]
        if not steps:
            return ar, False
        sd = min(steps)
        if self.toggle and not toggle_on(ar / sd, self.threshold):
            return ar, False
        return sd, True


def rollout_s(rep: Replica, lengths: list[int], prompt_len: int, mode: Mode, max_rows: int | None = None,
              chunk: int = 512) -> dict:
    """Wall time of one replica's rollout of rows of these response lengths: one prefill pass, then decode. At most
    max_rows run at once (the KV cache's capacity); the rest wait in a queue (in a fixed shuffled order: lengths are
    unknown in advance) and take the slots of rows that finish. Between two events (a row finishes, or `chunk`
    tokens pass) the active batch is constant and each token costs the mode's seconds per token there.
    Returns seconds, the share of decode tokens generated under SD, and the concurrency used."""
    order = list(lengths)
    random.Random(0).shuffle(order)
    cap = max(1, min(len(order), max_rows or len(order)))
    total = rep._t(0.0, 2 * rep.model.params(active=True) * len(order) * prompt_len, rep.model.layers)  # prefill
    active, queue = [[n, 0] for n in order[:cap]], order[cap:]  # [tokens left, tokens generated]
    done = 0  # tokens the active rows generated so far (ints: their mean is exact)
    sd_tok = all_tok = 0.0
    while active:
        batch = len(active)
        step = min(chunk, min(r[0] for r in active))
        per_tok, sd = mode.plan(rep, batch, prompt_len + done / batch + step / 2)
        total += step * per_tok
        all_tok += step * batch
        sd_tok += step * batch * sd
        for r in active:
            r[0], r[1] = r[0] - step, r[1] + step
        done += step * batch
        kept = [r for r in active if r[0] > 0]
        done -= sum(r[1] for r in active if r[0] <= 0)
        active = kept
        while queue and len(active) < cap:
            active.append([queue.pop(), 0])
    return {"seconds": total, "sd_share": sd_tok / max(all_tok, 1.0), "concurrency": cap}


def kv_rows(rep: Replica, kinds, ctx: float, mem_util: float = 0.9, shared_kv: bool = False) -> int:
    """Rows whose KV cache fits the replica at ctx tokens each: mem_util of HBM, less the policy's bf16 weights and
    the drafters' (a self-drafter adds a quantized copy and, unless shared_kv, a whole KV cache of its own, as
    drafttrain's does; EAGLE-3 and MTP one layer's; a draft model its layers'; the suffix index none)."""
    m = rep.model
    free = rep.gpu.hbm_bytes * rep.tp * mem_util - m.params() * 2.0
    per_tok = m.kv_bytes_per_token()
    for kind in kinds:
        shape = SHAPES.get(kind)
        if shape is None:  # a self-drafter: a quantized copy, and a KV cache of its own unless shared
            w, kv = m.params() * WEIGHT_BYTES[kind], 0.0 if shared_kv else m.kv_bytes_per_token()
        else:
            w, kv = shape.memory(m)
        free -= w
        per_tok += kv
    return max(0, int(free // (per_tok * ctx)))


@dataclass(frozen=True)
class Workload:
    """An RL step's batch and cluster: rows = prompts x group, split evenly over the rollout replicas."""

    n_gpus: int
    prompts: int
    group: int
    prompt_len: int
    mean_len: float
    max_len: int
    train_mfu: float = 0.35  # policy training (fwd + bwd) and log-prob recompute, at this MFU over all GPUs
    logprob_passes: int = 1  # forward passes re-scoring the rollouts (old policy; 2 with a reference model)
    train_forwards: float = 3.0  # a training pass in forwards (fwd + bwd = 3; 4 with activation checkpointing)
    mem_util: float = 0.9  # share of HBM the rollout engine may take (vLLM's gpu_memory_utilization)

    def rows_per_replica(self, tp: int) -> int:
        return max(1, self.prompts * self.group * tp // self.n_gpus)


def rl_step(rep: Replica, wl: Workload, mode: Mode, sigma: float, drafter_budget: float = 0.0,
            requant: tuple = ()) -> dict:
    """One RL step: the rollout (one replica's, at most kv_rows at once; the replicas run in parallel), training at
    (train_forwards + logprob_passes) forward FLOPs per token (2N each, + causal attention), drafter training
    (drafter_budget x the rest of the sync step: drafttrain's time bank), weight sync (each GPU receives its shard),
    each self-drafter's requantize (read bf16, write the quantized copy). Sync: the sum; async: the rollout of step t+1
    overlaps training of step t, step = max(rollout, train + drafter) + sync."""
    m = rep.model
    lengths = lognormal_lengths(wl.rows_per_replica(rep.tp), wl.mean_len, sigma, wl.max_len)
    cap = kv_rows(rep, mode.kinds, wl.prompt_len + statistics.fmean(lengths), wl.mem_util, mode.shared_kv)
    if cap < 1:
        raise ValueError(f"the {m.params() / 1e9:.0f}B policy and its drafters leave no room for a KV cache on "
                         f"{rep.tp} GPU(s)")
    roll = rollout_s(rep, lengths, wl.prompt_len, mode, max_rows=cap)
    tokens = wl.prompts * wl.group * (wl.prompt_len + statistics.fmean(lengths))
    ctx = wl.prompt_len + statistics.fmean(lengths)  # causal attention: ctx/2 keys per token on average
    per_tok = 2 * m.params(active=True) + 4 * m.layers * m.heads * m.head_dim * ctx / 2  # forward FLOPs per token
    flops = (wl.train_forwards + wl.logprob_passes) * per_tok * tokens
    train = flops / (rep.gpu.flops_s * wl.train_mfu * wl.n_gpus)
    sync = m.params() * 2.0 / rep.tp / rep.gpu.link_bytes_s
    for kind in requant:
        sync += m.params() * (2.0 + WEIGHT_BYTES[kind]) / rep.tp / rep.gpu.hbm_bytes_s
    drafter = drafter_budget * (roll["seconds"] + train + sync)
    return {"rollout_s": roll["seconds"], "sd_share": roll["sd_share"], "concurrency": roll["concurrency"],
            "train_s": train, "drafter_s": drafter,
            "sync_s": sync, "step_sync_s": roll["seconds"] + train + drafter + sync,
            "step_async_s": max(roll["seconds"], train + drafter) + sync}

