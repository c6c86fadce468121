"""A user's plain vLLM on an export folder (python -m tests.vllm.plain_llm OUT RESULT.json ROWS): serve.json read as
the README shows, vllm.LLM with nothing of drafttrain's engine. Writes greedy outputs of contract.RAGGED_PROMPTS, ROWS
samples at temperature 1 of 3 tokens after [1, 2, 3], and the spec-decode counters."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.contract import RAGGED_PROMPTS


def main(out: Path, result: Path, rows: int) -> None:
    import vllm

    s = json.loads((out / "serve.json").read_text())
    spec = {**s["speculative_config"], "model": str(out / s["speculative_config"]["model"])}
    llm = vllm.LLM(model=str(out / s["model"]), speculative_config=spec, skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, max_model_len=64, seed=0, disable_log_stats=False)
    try:
        greedy = vllm.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
        g = llm.generate([{"prompt_token_ids": p} for p in RAGGED_PROMPTS], greedy, use_tqdm=False)
        sampled = vllm.SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, detokenize=False)
        t = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * rows, sampled, use_tqdm=False)
        metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
                   and hasattr(m, "value")}
        result.write_text(json.dumps({"greedy": [list(o.outputs[0].token_ids) for o in g],
                                      "sampled": [list(o.outputs[0].token_ids) for o in t], "metrics": metrics}))
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
