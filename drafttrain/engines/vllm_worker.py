"""The worker side of the vLLM engine (drafttrain/engines/vllm_engine.py): code that runs inside vLLM's worker
process, loaded there by vLLM itself (parallel_config.worker_extension_cls names DrafttrainWorkerExtension; the
import registers the weight transport). Nothing here is called directly by the trainer process.

    DrafttrainWorkerExtension   collective_rpc methods: dt_setup, dt_probe, dt_zero_kv_cache, dt_set_drafting,
                                dt_drafter_call; and for handles on engines drafttrain did not start (a server, a
                                user's vllm.LLM: vllm_server.py) dt_info, dt_enable_transfer, dt_probe_b64,
                                dt_drafter_version, which take strings and return JSON (collective_rpc over HTTP)
    add_worker_methods()        the plugin (vllm_plugin.py) puts those methods on every vLLM worker, so no
                                worker_extension_cls is needed and a stack's own extension (TRL's) still fits
    InlineWeightTransferEngine  backend "drafttrain_inline" for vLLM's native start/update/finish weight update
    probe(t, scale)             the read-back probe, computed the same way on both sides
Importing it also installs the vLLM-CPU workaround that must precede model load (vllm_cpu.install_cpu_guards: on the
CPU platform only).
"""
from __future__ import annotations

import base64
import functools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass

import torch

from drafttrain.engines.vllm_cpu import install_cpu_guards

TRANSFER_BACKEND = "drafttrain_inline"


def pack(weights: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({n: t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous()
                 for n, t in weights.items()})


def unpack(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(bytes(blob))


_STACKED = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
            ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def vllm_name(name: str, draft: bool) -> tuple[str, int | None]:
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


@functools.lru_cache(maxsize=64)
def _probe_x(n: int) -> torch.Tensor:
    """A fixed probe vector (no RNG, so both processes build the same one)."""
    return torch.sin(torch.arange(n, dtype=torch.float64) * 0.7 + 0.3).float()


@functools.lru_cache(maxsize=64)
def _probe_x_int(n: int, asym: bool) -> torch.Tensor:
    """Integers with max 127 and min -127 (symmetric) or -128 (asym): dynamic per-token int8 quantization of
    activations, symmetric (scale max|x| / 127) or asymmetric (scale (max - min) / 255, zero point 0 here), maps
    this probe onto itself, so a quantized layer's output is exact integer arithmetic times the weight scales."""
    x = torch.round(127 * _probe_x(n))
    x[0], x[1] = 127.0, (-128.0 if asym else -127.0)
    return x


def probe(t: torch.Tensor, scale: torch.Tensor | None = None, asym: bool = False,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(W @ x, ||W_row|| ||x||) for a matrix, (t, |t|) otherwise: a probe and the scale of its rounding error
    (|W_row . x| <= ||W_row|| ||x||), computed on t's device, of t as a model of `dtype` holds it (rounded to it).
    An int8 matrix q [N, K] with its scale [N, 1] (per row) or [N, K/G] (per group) is the quantized weight
    W = q * scale, probed with the integer x its layer is probed with."""
    if t.dtype == torch.int8 and t.dim() == 2:
        N, K = t.shape
        s = scale.detach().to(t.device).double().reshape(N, -1)
        w = (t.double().view(N, s.shape[1], -1) * s[..., None]).view(N, K)
        x = _probe_x_int(K, asym).to(t.device).double()
        return (w @ x).float(), (torch.linalg.vector_norm(w, dim=1) * torch.linalg.vector_norm(x)).float()
    t = t.detach()
    t = (t.to(dtype) if t.is_floating_point() else t).float()
    if t.dim() == 2:
        x = _probe_x(t.shape[1]).to(t.device, dtype).float()  # the worker multiplies in dtype
        return t @ x, torch.linalg.vector_norm(t, dim=1) * torch.linalg.vector_norm(x)
    return t.flatten(), t.flatten().abs()


# ---- collective_rpc methods -------------------------------------------------------------------------------------

class DrafttrainWorkerExtension:
    """Mixed into vLLM's Worker (parallel_config.worker_extension_cls); called through collective_rpc."""

    def dt_setup(self, owner_pid: int, owner_tmp: str | None = None) -> dict:
        """Once after start-up: the owner watchdog, the vLLM-CPU sampler fixes, what the drafter shares with the
        target, and whether W8A8 layers multiply in fp32 (int8_fp32_gemm: oneDNN's int8 saturates on this CPU)."""
        _watch_owner(owner_pid, owner_tmp)
        info = {"fixed_cpu_expand_kernel": install_cpu_guards(setup=True)}  # CPU platform only
        # a partial update (the drafter without the embedding it shares, rotary caches) leaves some layers
        # unloaded; vLLM restores them and logs "Failed to load weights" each time. The read-back checks instead.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        proposer = getattr(self.model_runner, "drafter", None)
        if hasattr(proposer, "bind_runner"):  # drafttrain's custom_class proposer (vllm_suffix.py) reads the batch
            proposer.bind_runner(self.model_runner)
        draft, target = self.get_draft_model(), self.get_model()
        info["int8_fp32_gemm"] = any(hasattr(getattr(getattr(m, "scheme", None), "kernel", None), "dt_weight_fp32")
                                     for model in (draft, target) if model is not None for m in model.modules())
        info.update(has_drafter=draft is not None, drafter_shared=[], drafter_has_d2t=False,
                    dtype=str(self.vllm_config.model_config.dtype).removeprefix("torch."),
                    supports_draft_weight_updates=bool(self.supports_draft_weight_updates()))
        if draft is not None:
            info.update(_shared_with_target(draft, target))
        return info

    @torch.no_grad()
    def dt_probe(self, names: list[str], draft: bool) -> bytes:
        """{vLLM parameter name: probe} where probe = W @ x computed by the layer's own kernel for linear layers
        (vLLM-CPU repacks their weights and leaves an empty parameter; a quantized layer gets the integer probe),
        W @ x for other matrices, the values of vectors; each on the weights' device, in the model's dtype. Missing
        names are left out."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        model = self.get_draft_model() if draft else self.get_model()
        device, dtype = self.model_runner.device, self.vllm_config.model_config.dtype
        out = {}
        for name in names:
            mod_name, _, pname = name.rpartition(".")
            try:
                mod = model.get_submodule(mod_name)
            except AttributeError:
                continue
            if pname == "weight" and isinstance(mod, LinearBase):  # int8 kernels may drop the parameter itself
                if isinstance(mod.quant_method, UnquantizedLinearMethod):
                    x = _probe_x(mod.input_size)
                else:  # Dynamic4bitLinearKernel (W4A8) quantizes activations asymmetrically on x86
                    kernel = type(getattr(getattr(mod, "scheme", None), "kernel", None)).__name__
                    x = _probe_x_int(mod.input_size, kernel == "Dynamic4bitLinearKernel")
                x = x.to(device, dtype).unsqueeze(0)  # [1, K]
                out[name] = mod.quant_method.apply(mod, x, None)[0].float().cpu()
                continue
            t = getattr(mod, pname, None)
            if isinstance(t, torch.Tensor):
                out[name] = probe(t, dtype=t.dtype if t.is_floating_point() else torch.float32)[0].cpu()
        return pack(out)

    # ---- string in, JSON out: what a handle on a server or a user's vllm.LLM calls (collective_rpc over HTTP takes
    # only string arguments and returns JSON)
    def dt_info(self) -> dict:
        """The served model as a handle checks it: the policy's vocabulary and hidden size, the speculative method,
        the drafter's parameters {vLLM name: shape}, what the drafter shares with the target, the dtype, whether a
        weight transfer engine is set up, and the drafter version drafttrain last pushed (None: never, e.g. since a
        restart)."""
        hf = self.vllm_config.model_config.hf_config
        spec = self.vllm_config.speculative_config
        draft, target = self.get_draft_model(), self.get_model()
        info = {"vocab_size": int(hf.vocab_size), "hidden_size": int(hf.hidden_size),
                "method": getattr(spec, "method", None), "k": getattr(spec, "num_speculative_tokens", None),
                "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
                "drafter_params": _param_shapes(draft) if draft is not None else {},
                "drafter_shared": [], "drafter_has_d2t": False,
                "transfer": type(getattr(self, "weight_transfer_engine", None)).__name__,
                "drafter_version": getattr(self, "_dt_drafter_version", None)}
        if draft is not None:
            info.update(_shared_with_target(draft, target))
        return info

    def dt_enable_transfer(self) -> dict:
        """Set up drafttrain's weight transfer engine where the engine was started without one (no
        --weight-transfer-config); {"backend": the class in use}. Another backend already there is left alone."""
        if getattr(self, "weight_transfer_engine", None) is None:
            from vllm.config import WeightTransferConfig
            from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend=TRANSFER_BACKEND), self.vllm_config, self.model_runner.device,
                self.model_runner.get_model())
        return {"backend": type(self.weight_transfer_engine).__name__}

    def dt_probe_b64(self, names: str, draft: str) -> dict:
        """dt_probe with its arguments as JSON strings, its result base64-encoded."""
        return {"b64": base64.b64encode(self.dt_probe(json.loads(names), json.loads(draft))).decode()}

    def dt_drafter_version(self, version: str = "") -> dict:  # kept in the worker: a restart forgets it
        if version != "":
            self._dt_drafter_version = int(version)
        return {"version": getattr(self, "_dt_drafter_version", None)}

    @torch.no_grad()
    def dt_drafter_call(self, method: str, *args):
        """Call a method of drafttrain's own custom_class proposer (vllm_suffix.SuffixProposer) in this worker."""
        return getattr(self.model_runner.drafter, method)(*args)

    def dt_zero_kv_cache(self) -> None:
        """Zero every KV-cache block: NaN/inf values left by a broken policy would otherwise leak into later
        requests that reuse the blocks (masked-out slots still meet 0 * NaN)."""
        for t in self.model_runner.kv_caches:
            if isinstance(t, torch.Tensor):
                t.zero_()

    def dt_set_drafting(self, on) -> None:
        """off: zero draft tokens per request, every step a plain decode step. on: bool, or "True"/"False" (HTTP)."""
        runner, on = self.model_runner, on if isinstance(on, bool) else {"True": True, "False": False}[on]
        if on:
            runner.__dict__.pop("propose_draft_token_ids", None)
            return

        def no_drafts(*args, **kwargs):
            return torch.zeros(len(runner.input_batch.req_ids), 0, dtype=torch.int32, device=runner.device)

        runner.propose_draft_token_ids = no_drafts


def _shared_with_target(draft, target) -> dict:
    """{"drafter_shared": the drafter tensors (our names) that are the target's own, "drafter_has_d2t": whether the
    drafter holds a draft-to-target vocabulary map}."""
    tp = {p.data_ptr() for p in target.parameters() if p.numel()}
    params = dict(draft.named_parameters(remove_duplicate=False))
    shared = [ours for ours in ("embed_tokens.weight", "lm_head.weight")
              if (p := params.get(vllm_name(ours, True)[0])) is not None and p.numel() and p.data_ptr() in tp]
    return {"drafter_shared": shared, "drafter_has_d2t": getattr(draft, "draft_id_to_target_id", None) is not None}


def _param_shapes(model) -> dict[str, list[int]]:
    """{parameter name: shape as loaded}: a linear layer's weight by the layer's sizes (vLLM-CPU repacks it into its
    kernel and leaves an empty parameter)."""
    from vllm.model_executor.layers.linear import LinearBase

    out = {n: list(p.shape) for n, p in model.named_parameters()}
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase) and f"{name}.weight" in out:
            out[f"{name}.weight"] = [sum(getattr(mod, "output_partition_sizes", [mod.output_size])),
                                     getattr(mod, "input_size_per_partition", mod.input_size)]
    return out


def add_worker_methods() -> None:
    """Every DrafttrainWorkerExtension method on vLLM's WorkerBase (idempotent). vLLM's worker_extension_cls
    takes one class, and stacks set their own (TRL's weight sync); methods on the base class reach every worker."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in vars(DrafttrainWorkerExtension).items():
        if name.startswith("dt_") and not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)


def _watch_owner(owner_pid: int, owner_tmp: str | None = None, interval_s: float = 1.0) -> None:
    """If the process that owns the engine dies without closing it (SIGKILL, say: no atexit, no finalizer), the
    engine core would live on as an orphan, and the owner's temporary folder (a full policy copy) would stay on
    disk. A thread in the worker notices within interval_s, removes that folder (only one the engine made: named
    drafttrain-vllm-*) and takes the engine core (its parent, identity checked) and itself down."""
    import signal

    import psutil

    owner, core = psutil.Process(owner_pid), psutil.Process(os.getppid())

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while alive(owner):
            time.sleep(interval_s)
        if owner_tmp and os.path.basename(os.path.normpath(owner_tmp)).startswith("drafttrain-vllm-"):
            shutil.rmtree(owner_tmp, ignore_errors=True)
        if alive(core):  # is_running() also checks the start time: never a recycled pid
            core.send_signal(signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="drafttrain-owner-watch", daemon=True).start()


@dataclass
class _InitInfo:
    pass


@dataclass
class _UpdateInfo:
    blob: bytes | None = None  # the safetensors bytes themselves, or
    path: str | None = None  # a safetensors file on this host, or
    b64: str | None = None  # the safetensors bytes base64-encoded (an update over HTTP, as JSON)


@torch.no_grad()
def _rebuild_quantized(model, tensors: dict[str, torch.Tensor]) -> None:
    """Load int8-stored quantized layers (compressed-tensors W8A8 / W4A8: int8 `<proj>.weight` + fp32
    `<proj>.weight_scale`, policy names) by rebuilding them: the raw weight and scale are registered as at checkpoint
    load and the layer's own post-load processing runs again. vLLM-CPU 0.32's layerwise reload gets the W8A8 layers
    wrong: the oneDNN handle it builds keeps a pointer to a scale tensor the reload frees (a reload of the very
    same weights reads back as garbage)."""
    groups: dict[str, list] = {}
    for name, q in tensors.items():
        if q.dtype == torch.int8:
            theirs, shard = vllm_name(name, False)
            groups.setdefault(theirs.rpartition(".")[0], []).append((shard or 0, q, tensors[name + "_scale"]))
    for mod_name, parts in groups.items():
        layer = model.get_submodule(mod_name)
        parts.sort(key=lambda p: p[0])
        q = torch.cat([p[1] for p in parts]).contiguous()  # [N, K]
        s = torch.cat([p[2].reshape(len(p[1]), -1) for p in parts]).float().contiguous()  # [N, 1 or K/G]
        if tuple(q.shape) != (sum(layer.output_partition_sizes), layer.input_size_per_partition):
            raise ValueError(f"int8 update of {mod_name}: shape {list(q.shape)} does not fit the layer")
        w = torch.nn.Parameter(q, requires_grad=False)
        for name in ("weight", "weight_packed"):  # W4A8 registers its weight under both names
            if name == "weight" or name in layer._parameters:
                layer.register_parameter(name, w)
        layer.register_parameter("weight_scale", torch.nn.Parameter(s, requires_grad=False))
        layer.quant_method.process_weights_after_loading(layer)


def _repack_tied_head(model, model_config) -> None:
    """A tied output head shares its weight with the input embedding, so the reload (which re-processes only the
    modules that received weights) updated the embedding's weight but not the head's own packed copy that vLLM-CPU
    multiplies with (built at load): the head kept computing with the old weights. Re-run its post-load step."""
    hf = getattr(model_config, "hf_config", None)
    head = getattr(model, "lm_head", None)
    if getattr(hf, "tie_word_embeddings", False) and head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _transfer_engine_cls():
    """vLLM's WeightTransferEngine for weights in safetensors format, inline or in a file on the worker's host.
    Like vLLM's IPC engine it reloads layerwise, so layers whose weights the platform repacks after loading (oneDNN
    on CPU, quantized kernels) are re-processed; int8-stored quantized layers (a self-drafter's) are rebuilt
    instead (_rebuild_quantized), and a tied output head is re-processed (_repack_tied_head)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class InlineWeightTransferEngine(WeightTransferEngine):
        init_info_cls = _InitInfo
        update_info_cls = _UpdateInfo
        supports_draft_weight_update = True

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            self._quantized: dict[str, torch.Tensor] = {}
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            # quantized layers got no weights through the reload: it puts their served tensors back, then they are
            # rebuilt
            finalize_layerwise_reload(self.model, self.model_config)
            quant, self._quantized = self._quantized, {}
            if quant:
                _rebuild_quantized(self.model, quant)
            _repack_tied_head(self.model, self.model_config)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info: _UpdateInfo) -> None:
            if update_info.path is not None:
                from safetensors.torch import load_file

                weights = load_file(update_info.path)
            elif update_info.b64 is not None:
                weights = unpack(base64.b64decode(update_info.b64))
            else:
                weights = unpack(update_info.blob)
            quant = {n for n, t in weights.items() if t.dtype == torch.int8}
            quant |= {n + "_scale" for n in quant}
            self._quantized.update((n, weights[n]) for n in quant)
            self.model.load_weights([(n, t) for n, t in weights.items() if n not in quant])

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
install_cpu_guards()  # before vLLM loads the model: this module is imported when the worker is built
