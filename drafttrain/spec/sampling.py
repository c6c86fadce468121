"""Sampling parameters and the one place that turns logits into the distribution AR sampling draws from.

Order is fixed: temperature, then top-k, then top-p (nucleus). temperature == 0 means greedy: a one-hot on the
argmax (ties go to the lowest token id, as torch.argmax does). Speculative decoding, AR decoding, log-probs and
acceptance estimates all call `processed_probs`, so the SD output distribution is exactly AR's by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN passed `< 0` and sampled zeros
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        stop = self.stop_token_ids
        if isinstance(stop, int):  # one stop token
            stop = (stop,)
        try:
            stop = tuple(int(t) for t in stop)
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (ints), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# elements of one vocabulary-wide block (rows x positions x V) that SD and the drafter targets handle at once: 64 MB
# in fp32. At a real vocabulary a decode step's [B, k+1, V] tensors pass it from about 18 rows (V = 151,936, k = 5)
CHUNK = 1 << 24


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits[..., V] -> probs[..., V] (float32): temperature, then top-k, then top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1] smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (so the top token is always kept)
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log(processed_probs), differentiable in `logits`: what the RL loss takes its current log-probs from, so
    that on fresh rollouts the ratio to the engine's log-probs is exactly 1. Temperature, then -inf outside the
    support processed_probs keeps (top-k, top-p), renormalized. Greedy (temperature 0) has no log-probs to train."""
    if params.greedy:
        raise ValueError("processed_logprobs: temperature 0 (greedy) samples no distribution to train on")
    x = logits.float()
    if params.temperature != 1.0:
        x = x / params.temperature
    if 0 < params.top_k < x.shape[-1] or params.top_p < 1.0:
        with torch.no_grad():
            keep = processed_probs(logits.detach(), params) > 0
        x = x.masked_fill(~keep, float("-inf"))
    return x.log_softmax(-1)


def race_noise(shape, generator: torch.Generator | None = None, device: torch.device | str | None = None
               ) -> torch.Tensor:
    """Exp(1) draws for `sample` on `device` (default: the generator's; the CPU without one), clamped away from 0:
    an Exp(1) draw of exactly 0 (probability ~2^-24) would otherwise turn a zero weight into 0/0 = NaN. A chain of
    k draws takes its noise in one call."""
    if device is None:
        device = generator.device if generator is not None else "cpu"
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(1e-30)


def sample(weights: torch.Tensor, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of weights [..., V] (non-negative, any scale), drawn with probability weights / sum:
    the exponential race argmax(w_v / E_v), E_v ~ Exp(1) iid, which is exact and costs 3 small ops (torch.multinomial
    costs more per call on this CPU, and it is called k+1 times per decode step). `noise`: E drawn beforehand
    (race_noise, weights' shape), fresh for this draw."""
    e = race_noise(weights.shape, generator, weights.device) if noise is None else noise
    return (weights / e).argmax(-1)


def draft_chain(logits: torch.Tensor, step, k: int, params: SamplingParams, greedy: bool,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's k chained draws. logits [B, V] give draw 0; step(d [B], i) feeds draw i and returns the logits
    [B, V] of draw i + 1. Greedy: argmax drafts, no probs. Sampled: drafts from processed_probs with their probs,
    the k draws' race noise taken in one call (each draw's own where the k of them would pass CHUNK elements: at a
    real vocabulary and batch, k x [B, V] of noise is hundreds of MB). Returns (drafts [B, k], probs [B, k, V] or
    None), the probs written in place (no stacked copy)."""
    B, V = logits.shape
    one_call = not greedy and k * B * V <= CHUNK
    noise = race_noise((k, B, V), generator, logits.device) if one_call else None
    toks, qs = [], None if greedy else logits.new_empty((B, k, V), dtype=torch.float32)
    for i in range(k):
        q = processed_probs(logits, params)  # [B, V]
        d = q.argmax(-1) if greedy else sample(q, generator, noise[i] if one_call else None)
        toks.append(d)
        if qs is not None:
            qs[:, i] = q
        del q
        if i + 1 < k:
            logits = step(d, i)
    return torch.stack(toks, 1), qs
