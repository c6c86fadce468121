"""A drafter with a draft vocabulary in a user's plain vLLM: the shipped EAGLE-3 drafter (the shipped policy's whole
48-token vocabulary) cut to the 24 tokens most frequent in the policy's rollouts (vocab.draft_vocab,
restrict_draft_vocab), exported in the speculators format with its d2t/t2d, served by vllm.LLM next to the shipped
policy: greedy SD equals greedy decoding, and its drafts are accepted about as often as the whole-vocabulary
drafter's (a map vLLM misread would draft the wrong tokens: acceptance would collapse)."""
from __future__ import annotations

import pytest

from drafttrain.config import PROJECT_ROOT
from drafttrain.drafters.eagle3 import restrict_draft_vocab
from drafttrain.drafters.speculators import load_drafter, save_drafter
from drafttrain.drafters.vocab import coverage, draft_vocab, token_counts
from drafttrain.engines import build_engine
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.spec import SamplingParams
from tests.conftest import engine_cfg
from tests.vllm.pool import engine_processes

pytestmark = pytest.mark.vllm
K, VD, NEW = 4, 24, 48


def test_restricted_draft_vocabulary_served_by_vllm(tmp_path):
    vllm = pytest.importorskip("vllm")
    policy_dir = PROJECT_ROOT / "checkpoints/policy"
    policy, tok = load_policy(str(policy_dir))
    full = load_drafter(PROJECT_ROOT / "checkpoints/eagle3").eval()
    stop = (tok.eos_token_id,)
    # the draft vocabulary: the most frequent tokens of sampled rollouts on other prompts than the test's
    ar = build_engine(engine_cfg(kind="torch"), policy)
    train = [encode_prompt(tok, p.prompt) for p in make_prompts(64, seed=21)]
    rollouts = ar.generate(train, SamplingParams(max_new_tokens=NEW, stop_token_ids=stop, seed=0),
                           speculative=False).tokens
    counts = token_counts(rollouts, policy.config.vocab_size)
    ids = draft_vocab(counts, VD, keep=stop)
    assert coverage(counts, ids) > 0.97  # half the vocabulary holds nearly all the mass
    drafter_dir = save_drafter(restrict_draft_vocab(full, ids), tmp_path / "eagle3", verifier=policy_dir, k=K)

    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(16, seed=22)]
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, stop_token_ids=stop)
    want = ar.generate(prompts, greedy, speculative=False).tokens
    sd = build_engine(engine_cfg(kind="torch", k=K, drafter_int8=False), policy, full).generate(prompts, greedy)
    full_rate = sd.stats.accepted / sd.stats.drafted  # the whole-vocabulary drafter, embedded, same prompts

    before = {p.pid for p in engine_processes()}
    llm = vllm.LLM(model=str(policy_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                   max_model_len=256, disable_log_stats=False, seed=0,
                   speculative_config={"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": K})
    ours = [q for q in engine_processes() if q.pid not in before]
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=list(stop), detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        m = {x.name: x.value for x in llm.get_metrics() if x.name.startswith("vllm:spec_decode_num_")
             and hasattr(x, "value")}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    import psutil

    psutil.wait_procs(ours, timeout=20)
    strip = lambda t: [x for x in t if x not in stop]  # noqa: E731  whether a stop token is kept in the output
    for p, o, w in zip(prompts, outs, want):
        assert strip(o.outputs[0].token_ids) == strip(w), f"prompt {p}"
    drafted, accepted = m["vllm:spec_decode_num_draft_tokens"], m["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0, "the EAGLE-3 drafter never ran"
    assert accepted / drafted >= 0.9 * full_rate, (accepted / drafted, full_rate, m)
