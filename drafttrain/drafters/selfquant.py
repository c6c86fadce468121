"""Self-drafter: a weight-quantized copy of the policy that drafts k tokens autoregressively over its own KV cache.
It cannot drift from the policy: after each policy update, `requantize(policy)` writes the new weights into the
existing quantized storage (same tensors, same data pointers). No trainer, no hidden states (follows_policy, reads
nothing).

    d = build_drafter(load_recipe("selfdraft_int8_track").drafter, policy)   # drafter.selfquant.quant=int8
    d.requantize(policy)                      # after an RL step: in place
    engine.load_drafter(policy.state_dict() or d.state_dict(), version)

Quantization: drafttrain/quant.py (drafter.selfquant.quant, .backend, .group_size).

state_dict() is the drafter form: the quantized storage itself (names like "0.qkv.q", "lm_head.scale", "embed"),
specific to (quant, backend, group_size); the tensors alias the live storage. load_state_dict accepts it (copied
in, exact) or a policy state_dict (HF names; requantized). Either way the write is in place, so a drafter must
not be updated while it drafts: the engine loads into a standby copy and swaps (in_place_update = True).

Simplifies on purpose: the forward is LeanLlama's (modeling.py; every matmul goes through modeling.linear), ragged
cache extension pads rows to the longest (stale padding entries are masked, then overwritten), on the policy's device.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from drafttrain.drafters.contract import Drafter, Reads
from drafttrain.drafters.weights import check_finite, check_tensors
from drafttrain.modeling import KVCache, LeanLlama, Rope, lean_parts, rms_norm
from drafttrain.quant import QuantLinear, check_backend, quant_linear
from drafttrain.spec import draft_chain


# ---- the drafter ------------------------------------------------------------------------------------------------

class _QuantLlama(LeanLlama):
    """LeanLlama's forward over quantized linears (no HF module kept, no fp32 copy of the linears)."""

    def __init__(self, cfg, inv_freq, rope_scaling, weights, packed):
        self.config = cfg
        self.n_layers, self.hidden, self.vocab_size = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_len = cfg.max_position_embeddings
        self.inv_freq, self.rope_scaling = inv_freq, rope_scaling
        self.rope = Rope(inv_freq, self.max_len, rope_scaling)
        self.weights, self.packed = weights, packed
        self.head = weights["lm_head"]
        self.device = weights["embed"].device  # the policy's: its caches and indices are made there

    def _norm(self, x, w, name):
        return rms_norm(x, w[name], self.eps)  # quantized linears: the norm weights stay separate (requantize)

    def ensure_rope(self, length: int) -> None:
        """Padding positions of a ragged extension may pass the last real one; grow the tables (rare)."""
        if length > self.rope.max_len:
            self.rope = Rope(self.inv_freq, 2 * length, self.rope_scaling)


class SelfQuantDrafter(nn.Module, Drafter):
    kind = "selfquant"
    follows_policy = True  # requantized from the policy at every update: no features, no training
    trains = False
    reads = Reads()  # nothing from the policy's forward
    in_place_update = True  # load_state_dict / requantize write the live storage: double-buffer it in an engine

    def __init__(self, policy, quant: str = "int8", backend: str = "ao", group_size: int = 64):
        super().__init__()
        cfg = policy.config
        sd = policy.state_dict()
        t = lean_parts(sd, cfg.num_hidden_layers)
        # names/shapes a policy state_dict must have (meta tensors: no memory, no reference to the policy)
        self._policy_keys = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in sd.items()}
        sizes = {k: (sum(w.shape[0] for w in v), v[0].shape[1]) for k, v in t.items() if _is_linear(k)}
        check_backend(quant, backend, group_size, sizes, t["embed"].device)
        self.quant, self.backend, self.group_size = quant, backend, group_size
        make = functools.partial(quant_linear, quant, backend)  # the form that runs on the policy's device
        fp32 = lambda x: x.detach().float().clone()  # noqa: E731
        weights = {"embed": fp32(t["embed"]), "norm": fp32(t["norm"]),
                   "lm_head": make(t["lm_head"], None, group_size)}
        packed = []
        for i in range(cfg.num_hidden_layers):
            w = {k: fp32(t[f"{i}.{k}"]) for k in ("ln1", "ln2", "q_norm", "k_norm") if f"{i}.{k}" in t}
            for k in ("qkv", "o", "gate_up", "down"):
                w[k] = make(t[f"{i}.{k}"], t.get(f"{i}.{k}_b"), group_size)
            packed.append(w)
        rot = policy.model.rotary_emb
        self.config = copy.deepcopy(cfg)
        self.body = _QuantLlama(self.config, rot.inv_freq.detach().clone(),
                                float(getattr(rot, "attention_scaling", 1.0)), weights, packed)

    # ---- weights: in place ----------------------------------------------------------------------------------------
    def _storage(self) -> dict[str, torch.Tensor]:
        """Name -> the live tensor: the drafter form (what state_dict returns and load_state_dict copies into)."""
        out = {}
        for name, t in self._items():
            if isinstance(t, QuantLinear):
                out.update({f"{name}.{k}": v for k, v in t.storage().items()})
            else:
                out[name] = t
        return out

    def _items(self):
        yield from self.body.weights.items()
        for i, w in enumerate(self.body.packed):
            yield from ((f"{i}.{k}", v) for k, v in w.items())

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return self._storage()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """A policy state_dict (HF names: requantized) or this drafter's own state_dict (copied); in place."""
        if "model.embed_tokens.weight" in state_dict:
            check_tensors(self._policy_keys, state_dict, "policy", finite=False)  # requantize checks that
            self.requantize(state_dict)
        else:
            store = self._storage()
            check_tensors(store, state_dict, "drafter-form", dtype=True,
                          hint="a different policy size, or a drafter built with other quant settings?")
            for name, t in self._items():
                if isinstance(t, QuantLinear):
                    t.load_({k: state_dict[f"{name}.{k}"] for k in t.storage()})
                else:
                    t.copy_(state_dict[name])
        return None

    @torch.no_grad()
    def requantize(self, policy) -> None:
        """Quantize the policy's current weights (a module or its state_dict) into the existing storage."""
        sd = policy if isinstance(policy, dict) else policy.state_dict()
        check_finite(sd)  # before any write
        t = lean_parts(sd, self.config.num_hidden_layers)
        for name, cur in self._items():
            if isinstance(cur, QuantLinear):
                cur.requantize_(t[name], t.get(f"{name}_b"))
            else:
                cur.copy_(t[name])

    # ---- inference: chain drafting over the drafter's own cache -------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "SelfQuantState":
        """prompts [B, P] right-padded: the drafter reads position 0 there (None: token 0, for timing only)."""
        first = (prompts[:, 0].clone() if prompts is not None
                 else torch.zeros(batch, dtype=torch.long, device=self.body.device))
        return SelfQuantState(self.body.new_cache(batch, max_len), first)

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Extend the cache with the n_new[b] tokens at positions start[b]+1 .. start[b]+n_new[b] (new_ids [B, m],
        right-padded; the first call also feeds position 0), then chain k drafts. aux is unused.
        A leading run of new tokens equal to the drafts this drafter fed at those positions last time (the accepted
        ones) is skipped: same token, position and context, so their cache entries are already right. A verify
        step then costs the drafter 1 token (2 when all k drafts were accepted) instead of n_new.
        Returns (draft tokens [B, k], draft probs [B, k, V] or None for one-hot greedy drafts)."""
        B = new_ids.shape[0]
        rows = torch.arange(B, device=new_ids.device)
        if st.first is not None:
            ids, pos0, last = torch.cat([st.first.view(B, 1), new_ids], 1), start, n_new  # [B, 1+m]
            st.first = None
        else:
            skip = st.cached_prefix(new_ids, n_new, start)  # [B]
            last = n_new - skip - 1
            cols = skip.view(B, 1) + torch.arange(int(last.max()) + 1, device=rows.device)
            cols = cols.clamp_max(new_ids.shape[1] - 1)
            ids, pos0 = new_ids.gather(1, cols), start + 1 + skip
        ids = ids[:, : int(last.max()) + 1]  # drop columns that are padding in every row
        m = ids.shape[1]
        pos = pos0 + last + 1  # [B] first chain position per row
        need = max(int(pos0.max()) + m, int(pos.max()) + k)
        st.ensure(need)
        self.body.ensure_rope(need)
        logits, _ = self.body.forward(ids, pos0, st.cache)  # [B, m, V]
        lg = logits[rows, last]  # [B, V] predicts position pos
        draft, q = draft_chain(lg, lambda d, i: self.body.forward(d.view(B, 1), pos + i, st.cache)[0][:, 0], k,
                               params, greedy_drafts, generator)
        st.fed, st.fed_pos = draft[:, : k - 1], pos  # drafts 1..k-1 sit in the cache at pos .. pos+k-2
        return draft, q


class SelfQuantState:
    """Per-generation state: the drafter's own KV cache (all layers); until the first propose, token 0; after each,
    the drafts it fed into the cache (fed [B, k-1] from position fed_pos [B])."""

    def __init__(self, cache: KVCache, first: torch.Tensor):
        self.cache, self.first = cache, first
        self.fed: torch.Tensor | None = None
        self.fed_pos: torch.Tensor | None = None

    def cached_prefix(self, new_ids: torch.Tensor, n_new: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """[B] how many leading new tokens (at most n_new - 1: the last one's logits are needed) the cache holds."""
        if self.fed is None or self.fed.shape[1] == 0:
            return torch.zeros_like(n_new)
        w = min(self.fed.shape[1], new_ids.shape[1])
        j = torch.arange(w, device=new_ids.device).view(1, w)
        same = (new_ids[:, :w] == self.fed[:, :w]) & (j < (n_new - 1).view(-1, 1)) & (
            start + 1 == self.fed_pos).view(-1, 1)
        return same.long().cumprod(1).sum(1)

    def ensure(self, length: int) -> None:
        c = self.cache
        if length > c.max_len:  # rare: ragged padding near the end of max_len
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], length - c.max_len, t.shape[3])], 2)  # noqa
            c.k, c.v, c.max_len = [pad(t) for t in c.k], [pad(t) for t in c.v], length

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.select_rows(idx)
        if self.first is not None:
            self.first = self.first[idx]
        if self.fed is not None:
            self.fed, self.fed_pos = self.fed[idx], self.fed_pos[idx]


def _is_linear(name: str) -> bool:
    return name == "lm_head" or name.split(".")[-1] in ("qkv", "o", "gate_up", "down")


def from_config(cfg, policy) -> SelfQuantDrafter:
    """The registry entry: cfg is a DrafterConfig (its selfquant section: quant, backend, group_size)."""
    return SelfQuantDrafter(policy, cfg.selfquant.quant, cfg.selfquant.backend, cfg.selfquant.group_size)


# ---- its config section: drafter.selfquant ----------------------------------------------------------------------
@dataclass
class Section:  # drafter.selfquant: the policy quantized into its own drafter
    quant: str = "int8"  # int8 (per-output-channel) | int4 (group-wise)
    backend: str = "ao"  # ao (torch fbgemm int8 / aten int4 CPU kernels) | bnb (bitsandbytes) | ref
    group_size: int = 64  # int4: in-features per scale (bnb: nf4 blocksize)


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.selfquant, message)."""
    return [(s.quant in ("int8", "int4"), "quant", f"must be int8 or int4, got {s.quant!r}"),
            (s.backend in ("ao", "bnb", "ref"), "backend", f"must be ao, bnb or ref, got {s.backend!r}"),
            (s.group_size >= 1, "group_size", f"must be >= 1, got {s.group_size}")]
