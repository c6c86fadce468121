"""Each drafter kind's vLLM form (FORMS[its DrafterKind.vllm]; form_of(kind)): how the vLLM engine serves it.

    form.method                                  vLLM's speculative method
    form.write(drafter, policy_dir, out, k, target) -> out   the folder vLLM loads the drafter from, checked
    form.template(drafter)                       the engine's own copy: the shape every later swap must have
    form.accept(template, weights) -> tensors    a swap's weights, validated, in the form the worker holds
    form.tensors(template)                       the template's weights in that form
    form.started(engine, template), form.before_generate(engine)   optional: set-up after start, before a generation
    form.needs_engine                            optional: why plain vLLM cannot serve the written form
"""
from __future__ import annotations

import copy
from pathlib import Path

from drafttrain.drafters.weights import check_finite


class Form:
    """What the vLLM engine asks of every form, with the defaults a form without the need inherits:
    method (vLLM's speculative method), write / template / accept / tensors (each form's own), and below."""
    method = ""
    eagle_names = False  # its weights go under vLLM's EAGLE head names (vllm_transfer.vllm_name), not the policy's
    needs_engine: str | None = None  # why only drafttrain's vLLM engine can serve it (plain vLLM cannot); None: any

    def asym_int4(self, template) -> bool:
        """The worker holds its weights in vLLM's asymmetric W4A8 kernel (read-back probes them that way)."""
        return False

    def started(self, engine, template) -> None:
        """The engine has started (configure what vLLM built in its worker)."""

    def before_generate(self, engine) -> None:
        """A speculative generate() is about to run."""


class Eagle3Form(Form):
    """An EAGLE-3 drafter as vLLM's `eagle3` head: the speculators export, weights under its own names."""
    method = "eagle3"
    eagle_names = True

    def write(self, drafter, policy_dir: Path, out: Path, k: int, target) -> Path:
        from drafttrain.drafters import speculators

        check_finite(drafter.state_dict())  # no corrupt drafter reaches an engine (load_drafter checks too)
        speculators.save_drafter(drafter, out, verifier=policy_dir, k=k)
        speculators.check_vllm_target(speculators.read_speculators_config(out), target, "drafter")
        return out

    def template(self, drafter):
        return copy.deepcopy(drafter).eval().requires_grad_(False)

    def accept(self, template, weights: dict) -> dict:
        from drafttrain.drafters.eagle3 import check_weights

        check_weights(template, weights)  # names, shapes, finiteness: one-line error
        return weights

    def tensors(self, template) -> dict:
        return template.state_dict()


class SelfQuantForm(Form):
    """A self-drafter as vLLM's `draft_model`: a compressed-tensors copy of the policy (vllm_selfdraft.py); a swap
    is requantized (policy form) or copied (own form) into the template, then sent in the checkpoint's form."""
    method = "draft_model"

    def write(self, drafter, policy_dir: Path, out: Path, k: int, target) -> Path:
        from drafttrain.engines import vllm_selfdraft

        return vllm_selfdraft.save_checkpoint(drafter, policy_dir, out)

    def asym_int4(self, template) -> bool:  # vLLM's W4A8 kernel: see vllm_worker.probe
        return template.quant == "int4"

    def template(self, drafter):
        return copy.deepcopy(drafter)

    def accept(self, template, weights: dict) -> dict:
        template.load_state_dict(weights)  # validates before writing: one-line error
        return self.tensors(template)

    def tensors(self, template) -> dict:
        from drafttrain.engines.vllm_selfdraft import vllm_tensors

        return vllm_tensors(template)


class _StateDictForm(Form):
    """A drafter whose state dict is what vLLM holds, under its names: a swap is that state dict, validated whole."""

    def template(self, drafter):
        return copy.deepcopy(drafter).eval().requires_grad_(False)

    def accept(self, template, weights: dict) -> dict:
        template.load_state_dict(weights)  # names, shapes, finiteness checked before writing (one-line error)
        return self.tensors(template)

    def tensors(self, template) -> dict:
        return {n: t.detach().to("cpu", copy=True).contiguous() for n, t in template.state_dict().items()}


class DraftModelForm(_StateDictForm):
    """A draft model (drafter.kind=draft_model) as vLLM's `draft_model`: its HF folder as it is (fp32, the policy's
    tokenizer; vLLM shares neither embeddings nor LM head with the target for this method), and a swap is its HF
    state dict, pushed whole."""
    method = "draft_model"

    def write(self, drafter, policy_dir: Path, out: Path, k: int, target) -> Path:
        from drafttrain.drafters import draft_model

        check_finite(drafter.state_dict())
        return draft_model.save(drafter, out, verifier=policy_dir, k=k)


class MtpForm(_StateDictForm):
    """An MTP head (drafter.kind=mtp) as vLLM's `eagle` (EAGLE-1) head for a Llama target, the form drafters/mtp.py
    computes: its folder as saved. No lm_head in it: vLLM's EAGLE-1 Llama draws with the target's, which is what the
    head shares in the embedded engine too (the policy's current one). Its own embed_tokens (the normed copy) differ
    from the target's, so vLLM keeps them. Chosen over `medusa` (no embedding input, no recurrence over steps) and
    `mlp_speculator` (no attention block): only EAGLE-1 runs the module as it is."""
    method = "eagle"
    eagle_names = True

    def write(self, drafter, policy_dir: Path, out: Path, k: int, target) -> Path:
        from drafttrain.drafters import mtp

        check_finite(drafter.state_dict())
        return mtp.save(drafter, out, verifier=policy_dir, k=k)


class SuffixForm(Form):
    """The suffix drafter as vLLM's `custom_class` proposer (vllm_suffix.py says why that method): vLLM builds it
    in its worker from its import path; this form configures it at start and starts a generation per generate() call.
    No weights: a swap carries none."""
    method = "custom_class"
    # plain vLLM (vllm serve, a user's vllm.LLM) never calls started(): the proposer stays unconfigured there
    needs_engine = "it runs only inside drafttrain's vLLM engine, which configures its index at start"
    PROPOSER = "drafttrain.engines.vllm_suffix.SuffixProposer"

    def write(self, drafter, policy_dir: Path, out: Path, k: int, target) -> str:
        return self.PROPOSER

    def template(self, drafter):
        return drafter

    def accept(self, template, weights: dict) -> dict:
        template.load_state_dict(weights)  # none: a one-line error names the first one given
        return {}

    def tensors(self, template) -> dict:
        return {}

    def started(self, engine, template) -> None:
        engine.rpc("dt_drafter_call", "configure", template.vocab_size, template.max_ngram, template.min_ngram,
                    template.history, template.prompt_cache)

    def before_generate(self, engine) -> None:
        engine.rpc("dt_drafter_call", "new_generation")


EAGLE3, SELFQUANT, DRAFT_MODEL, MTP, SUFFIX = Eagle3Form(), SelfQuantForm(), DraftModelForm(), MtpForm(), SuffixForm()
# the name a DrafterKind gives as its `vllm` -> the form (a kind added elsewhere adds its form here under that name)
FORMS = {"EAGLE3": EAGLE3, "SELFQUANT": SELFQUANT, "DRAFT_MODEL": DRAFT_MODEL, "MTP": MTP, "SUFFIX": SUFFIX}


def form_of(kind: str):
    """The vLLM form of drafter kind `kind`, from its registry entry; a kind with none is a one-line error."""
    from drafttrain.drafters.base import DRAFTERS

    entry = DRAFTERS.get(kind)
    if entry is None or entry.vllm is None:
        raise ValueError(f"drafter.kind: {kind!r} has no vLLM form: it runs in the embedded engine "
                         f"(engine.kind=torch)")
    return FORMS[entry.vllm]
