"""The suffix drafter (drafter.kind=suffix) inside vLLM: a `custom_class` proposer that vLLM builds in its worker
(speculative_config.model = "drafttrain.engines.vllm_suffix.SuffixProposer"), holding the same index as the embedded
drafter (drafters/suffix.py: SuffixDrafter, its extend and draft).

Why custom_class (vLLM 0.32's three text proposers):
    ngram   matches within the request's own prompt and output only: no siblings, no earlier rollouts.
    suffix  arctic-inference's suffix tree (not installed here, not in this machine's package index); its global tree
            holds every request's output, prompts left out and prompts not told apart, and vLLM keeps only its
            draft token ids.
    custom_class  sees every running request's tokens at each step, so one index over the batch's sibling rows and
            the last generations' rollouts, as the embedded drafter keeps it.
vLLM takes a custom proposer's drafts without draft probabilities and verifies them as one-hot (accept with p(x),
else sample from p with x removed): lossless for any draft. So drafts here are the index's most frequent
continuations, as the embedded drafter's with engine.draft_sampling=greedy, and greedy decoding accepts exactly what
that one accepts.

The engine side (vllm_forms.SuffixForm) configures the proposer once (configure) and starts a generation per
generate() call (new_generation), through the worker extension's dt_drafter_call.
"""
from __future__ import annotations

from drafttrain.drafters.suffix import SuffixDrafter


class SuffixProposer:
    def __init__(self, vllm_config):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.index: SuffixDrafter | None = None
        self.runner = None
        self.rows: dict[str, list[int]] = {}  # request id -> its text (prompt + committed output) indexed so far
        self.gen: list[list[int]] = []

    # ---- vLLM's calls ---------------------------------------------------------------------------------------------
    def load_model(self, target) -> None:  # vLLM-CPU's runner calls it on every drafter: nothing to load
        return None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """Every running row's committed tokens enter the index first, then each row drafts k tokens; a row in
        partial prefill (no token sampled) drafts none."""
        if self.index is None or self.runner is None:
            raise RuntimeError("SuffixProposer: not configured (the drafttrain vLLM engine configures it at start)")
        req_ids = self.runner.input_batch.req_ids
        texts = []
        for i, sampled in enumerate(sampled_token_ids):
            rid, n = req_ids[i], int(num_tokens_no_spec[i])
            text = self.rows.get(rid)
            if text is None:
                text = self.rows[rid] = []
                self.gen.append(text)
                plen = int(self.runner.input_batch.num_prompt_tokens[i])
                self.index.note_prompt(text, token_ids_cpu[i, :plen].tolist())
            if len(text) < n:
                self.index.extend(text, token_ids_cpu[i, len(text):n].tolist())
            texts.append(text if len(sampled) else None)
        return [self.index.draft(t, self.k, None)[0] if t is not None else [] for t in texts]

    # ---- the engine's calls (through the worker extension) -------------------------------------------------------
    def bind_runner(self, runner) -> None:
        self.runner = runner

    def configure(self, vocab_size: int, max_ngram: int, min_ngram: int, history: int, prompt_cache: int) -> None:
        self.index = SuffixDrafter(vocab_size, max_ngram, min_ngram, history, prompt_cache)

    def new_generation(self) -> None:
        """As the embedded drafter's new_state: keep the last `history` generations' texts, index them, and collect
        this generation's rows as they come."""
        self.rows, self.gen = {}, []
        self.index.start_generation(self.gen)
