"""What crosses between VllmEngine and the running vLLM engine: weight pushes (load_drafter, update_policy), their
read-back, requests (checked prompts, vLLM's sampling parameters) and vLLM's spec-decode metrics read out as SpecStats.

Weight updates use vLLM's native update session, start_[draft_]weight_update -> update_weights ->
finish_weight_update, with a transport this module registers (backend "drafttrain_inline": a safetensors file
in /dev/shm, or inline bytes; vLLM's NCCL and IPC backends need CUDA). It reloads layerwise, as vLLM's IPC
backend does, because vLLM-CPU repacks linear weights into oneDNN kernels after loading. Every update is read
back: each tensor is probed in the worker through the layer's own kernel (W @ x for a fixed x) and compared
with the same probe of what was sent; a drafter swap that does not land is refused and the served weights are
pushed back. A self-drafter swap takes what the embedded engine takes (the policy's state dict, requantized
here, or the drafter's own); its quantized weights and scales are pushed as they are, loaded by rebuilding the
layers (vLLM-CPU's layerwise reload breaks its int8 kernel), and probed through vLLM's quantized kernels with an
integer probe that their activation quantization keeps exact (vllm_worker.probe).
vLLM shares the target's embed_tokens with an EAGLE head whose embed_tokens equal the target's (ours are a
frozen copy). A shared tensor is never written by a drafter swap (that would overwrite the policy); it follows
the policy instead. A drafter lm_head shared that way is refused at swap time if it changed.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from drafttrain.engines.vllm_worker import probe, unpack, vllm_name
from drafttrain.spec import SpecStats


def push_weights(engine, weights: dict, draft: bool) -> None:
    """vLLM's native update session over this module's transport (off CUDA; vllm_gpu.push picks). The worker runs on
    this host, so the tensors go through a safetensors file in shared memory: one copy each way instead of the four
    that collective_rpc's serialization and relays make of an inline blob."""
    from safetensors.torch import save_file

    path = engine.shm / f"drafttrain-update-{os.getpid()}-{id(engine)}.safetensors"
    save_file({n: t.detach().to("cpu").contiguous() for n, t in weights.items()}, str(path))
    try:
        engine.rpc("start_draft_weight_update" if draft else "start_weight_update")
        try:
            engine.rpc("update_weights", {"path": str(path)})
        finally:
            engine.rpc("finish_weight_update")
    finally:
        path.unlink(missing_ok=True)


def swap_drafter(side, weights: dict, version: int) -> None:
    """A drafter swap into a running vLLM engine, for every way drafttrain reaches one (its own engine, a handle on a
    server or a user's vllm.LLM): validated in the form's terms (one-line ValueError), pushed without what the
    drafter shares with the policy, read back; on a read-back that differs the served weights go back and it raises.
    `side` offers form, template, worker_info, _fixed (shared tensors' values at start), _served, _push and rpc;
    its _served becomes a copy of what was pushed."""
    weights = side.form.accept(side.template, weights)  # validated (one-line error), in the worker's form
    if "lm_head.weight" in side._fixed and not torch.equal(weights["lm_head.weight"], side._fixed["lm_head.weight"]):
        raise ValueError("load_drafter: lm_head.weight is shared with the policy in this vLLM engine (they were "
                         "identical at start-up), so it cannot change; start the engine with a distinct lm_head")
    if not side.worker_info["drafter_has_d2t"] and weights.get("d2t", torch.zeros(1)).any():
        raise ValueError("load_drafter: d2t is non-zero but the served drafter covers the whole vocabulary")
    push = side._drafter_tensors(weights)
    if push:  # a drafter with no weights (the suffix drafter) swaps its version only
        side._push(push, draft=True)
        try:
            read_back(side, push, draft=True, what="load_drafter")
        except ValueError:  # the worker may hold a mix now: put the served weights back
            side._push(side._served, draft=True)
            raise
    # a copy: the caller may keep training its tensors in place, and a failed swap restores these
    side._served = {n: t.detach().to("cpu", copy=True) for n, t in push.items()}


def policy_state(owner, policy) -> dict:
    """update_policy's argument as a state dict: an HF module (kept as owner._module, the one a later
    update_policy() re-reads), a state dict, or None (owner._module; one-line ValueError where there is none)."""
    if policy is None:
        if owner._module is None:
            raise ValueError("update_policy: this engine was built from a checkpoint folder; pass the policy "
                             "module or its state dict")
        policy = owner._module
    elif hasattr(policy, "state_dict"):
        owner._module = policy
    return policy.state_dict() if hasattr(policy, "state_dict") else dict(policy)


def policy_weights(sd: dict, shapes: dict, tied: bool) -> dict:
    """The tensors of a policy state dict to push, checked against the served checkpoint's names and shapes
    (one-line ValueError); tied weights once, under the name the checkpoint stores."""
    seen, weights = set(), {}
    for name, t in sd.items():
        if (t.data_ptr(), t.dtype) in seen or (tied and name == "lm_head.weight"):
            continue
        if name not in shapes:
            raise ValueError(f"update_policy: unexpected tensor {name!r}")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"update_policy: {name} has shape {list(t.shape)}, expected {list(shapes[name])}")
        seen.add((t.data_ptr(), t.dtype))
        weights[name] = t
    missing = sorted(set(shapes) - set(sd))
    if missing:
        raise ValueError(f"update_policy: missing tensor {missing[0]!r} ({len(missing)} missing)")
    return weights


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
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


# ---- read-back: what the worker's kernels hold, compared with what was sent ------------------------------------

# of a probe's scale: fp32 kernels differ by ~1e-6 of it (an optimizer step moves a probe by far more); a 16-bit
# kernel rounds its output to the dtype (unit roundoff 2^-8 bf16, 2^-11 fp16) and accumulates in another order
_TOL = {torch.float32: 3e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def tolerance(dtype: torch.dtype) -> float:
    """The read-back tolerance, relative to a probe's scale, for a model served in `dtype`."""
    return _TOL.get(dtype, _TOL[torch.bfloat16])


def read_back(engine, weights: dict, draft: bool, what: str) -> None:
    """Probe every sent tensor in the worker (through the layer's own kernel where weights are repacked, as on
    CPU) and compare with the same probe of the sent tensor as the worker's dtype holds it, within that dtype's
    tolerance; ValueError naming the first tensor that differs."""
    dtype = getattr(torch, engine.worker_info.get("dtype", "float32"))
    tol = tolerance(dtype)
    groups: dict[str, list[tuple[int, str]]] = {}
    eagle = draft and engine.form.eagle_names  # a draft_model uses the policy's own names
    asym = draft and engine.form.asym_int4(engine.template)
    for name in weights:
        base = weights.get(name[:-len("_scale")]) if name.endswith(".weight_scale") else None
        if base is not None and base.dtype == torch.int8:
            continue  # read back through its weight's probe (quantized kernels may drop the parameter)
        theirs, shard = vllm_name(name, eagle)
        groups.setdefault(theirs, []).append((shard or 0, name))
    got = unpack(engine.rpc("dt_probe", sorted(groups), draft))
    for theirs, members in groups.items():
        if theirs not in got:
            raise ValueError(f"{what}: read-back found no tensor {members[0][1]!r} in the worker's model")
        members = [n for _, n in sorted(members)]
        wants, scales = zip(*(probe(weights[n], weights.get(n + "_scale"), asym, dtype) for n in members))
        want, scale = torch.cat(wants).cpu(), torch.cat(scales).cpu()
        y = got[theirs].float()
        if theirs.endswith(("embed_tokens.weight", "lm_head.weight")) and len(y) > len(want):
            y = y[: len(want)]  # vLLM pads vocabulary rows to a multiple of 64
        if y.shape != want.shape:
            raise ValueError(f"{what}: read-back of {members[0]} has {len(y)} values, sent {len(want)}")
        ok = ((y - want).abs() <= tol * scale + 1e-6) | (y.isnan() & want.isnan())  # NaN sent, NaN held
        if not bool(ok.all()):
            first = int((~ok).nonzero()[0])
            name = members[int((torch.tensor([len(w) for w in wants]).cumsum(0) <= first).sum())]
            raise ValueError(f"{what}: read-back of {name} does not match what was sent (off by "
                             f"{float((y - want).abs()[~ok].max()):.3g}): the update did not land")


def vllm_sampling(params, row: int, vocab_size: int):
    """vLLM's SamplingParams for one row of a generate call (a per-row seed from params.seed)."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    seed = None if params.seed is None else (params.seed * 1_000_003 + row) % (2 ** 62)
    return VSP(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
               max_tokens=params.max_new_tokens, ignore_eos=True,
               stop_token_ids=[t for t in params.stop_token_ids if 0 <= t < vocab_size],  # others never occur
               seed=seed, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)


def spec_stats(toks, metrics, spec: bool, forwards: int) -> SpecStats:
    """SpecStats from vLLM's per-row metrics: per_step_accepted / per_step_drafted of each verify step, counted
    as the torch engine counts them (SpecStats.from_steps): a step emits accepted + 1 tokens, the last one only up to
    the row's end (drafts vLLM accepted past a stop token are not counted); the decode steps the response has left
    after them drafted nothing (AR, or vLLM skipped drafting) and emitted one token each."""
    per_row = []
    for m in metrics:
        a, d = (list(m.per_step_accepted), list(m.per_step_drafted)) if (spec and m is not None) else ([], [])
        per_row.append((a[:len(d)], d[:len(a)]))
    # every row's verify steps one after another: [N]
    acc = torch.tensor([x for a, _ in per_row for x in a], dtype=torch.long, device="cpu")
    drafted = torch.tensor([x for _, d in per_row for x in d], dtype=torch.long, device="cpu")
    steps = torch.tensor([len(a) for a, _ in per_row], dtype=torch.long, device="cpu")  # [R]
    # [R] each row's response tokens after its first (the prefill emitted that one)
    left = torch.tensor([max(len(r) - 1, 0) for r in toks], dtype=torch.long, device="cpu")
    row = torch.repeat_interleave(torch.arange(len(steps), device="cpu"), steps)  # [N] each step's row
    inc = acc + 1  # [N] what a step emits where the row's end does not cut it
    total = torch.zeros(len(steps), dtype=torch.long, device="cpu").index_add_(0, row, inc)  # [R]
    # c: what a row's steps emit up to and including this one, uncut; the row keeps min(c, left) of it, so a step
    # keeps min(c, left) - min(c - inc, left): the step that reaches the row's end is cut there, later ones keep none
    c = inc.cumsum(0) - (total.cumsum(0) - total)[row]  # [N]
    kept = torch.minimum(c, left[row]) - torch.minimum(c - inc, left[row])  # [N]
    n_ar = int((left - torch.minimum(total, left)).sum())  # the decode steps left after the verify steps
    zeros = torch.zeros(n_ar, dtype=torch.long, device="cpu")
    return SpecStats.from_steps(torch.cat([acc, zeros]), torch.cat([drafted, zeros]), torch.cat([kept, zeros + 1]),
                                target_forwards=forwards)
