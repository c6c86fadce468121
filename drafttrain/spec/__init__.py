"""Pure speculative-decoding math: no engine state, no model. Engines call this; they never re-derive it."""
from drafttrain.spec.expected import expected_row_stats, expected_spec_stats, expected_tokens
from drafttrain.spec.rejection import expected_acceptance, rejection_sample
from drafttrain.spec.sampling import (SamplingParams, draft_chain, processed_logprobs, processed_probs,
                                      race_noise, sample)
from drafttrain.spec.stats import SpecStats

__all__ = ["SamplingParams", "processed_probs", "processed_logprobs", "sample", "race_noise", "draft_chain",
           "rejection_sample", "expected_acceptance", "SpecStats", "expected_row_stats", "expected_spec_stats",
           "expected_tokens"]
