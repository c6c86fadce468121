"""Supervised data and sampling eval for the tiny policy (used by scripts/make_policy.py).

`sft_batches` yields length-bucketed, right-padded batches of
`BOS prompt solution EOS` with the loss masked to the response (solution + EOS).
Bucketing by length keeps padding small without packing documents together.
`sample_eval` draws responses at a given temperature with HF `generate` and
reports exact-match accuracy and response lengths in tokens (EOS included).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
from transformers import GenerationConfig

from drafttrain.policy.task import Problem, reward, sample_problem, sample_solution
from drafttrain.policy.tokenizer import decode, encode_prompt

IGNORE = -100


def encode_example(tok, p: Problem, solution: str | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for `solution` (default p.solution); labels are IGNORE on BOS + prompt."""
    prompt = encode_prompt(tok, p.prompt)
    response = tok.encode(p.solution if solution is None else solution, add_special_tokens=False) + [tok.eos_token_id]
    return prompt + response, [IGNORE] * len(prompt) + response


def sft_batches(tok, seed: int, tokens_per_batch: int, pool: int = 512,
                check_p: float | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of about `tokens_per_batch` tokens (padded), deterministic in `seed`; `check_p` is the share of
    responses that check after the answer (None: the task's CHECK_P)."""
    rng = random.Random(seed)
    while True:
        problems = (sample_problem(rng) for _ in range(pool))  # each written in a random mix of the step styles
        examples = sorted((encode_example(tok, p, sample_solution(p, rng, check_p=check_p)) for p in problems),
                          key=lambda e: len(e[0]))
        batches, cur = [], []
        for ex in examples:
            if cur and (len(cur) + 1) * len(ex[0]) > tokens_per_batch:  # sorted: ex is the longest so far
                batches.append(cur)
                cur = []
            cur.append(ex)
        batches.append(cur)  # the tail batch is kept: long examples are rare and matter
        rng.shuffle(batches)
        for b in batches:
            T = max(len(ids) for ids, _ in b)
            ids = torch.full((len(b), T), tok.pad_token_id, dtype=torch.long, device="cpu")  # [B, T], host batches
            labels = torch.full((len(b), T), IGNORE, dtype=torch.long, device="cpu")  # [B, T]
            for i, (x, y) in enumerate(b):
                ids[i, : len(x)] = torch.tensor(x, device="cpu")
                labels[i, : len(y)] = torch.tensor(y, device="cpu")
            yield {"input_ids": ids, "labels": labels}


@torch.inference_mode()
def sample_eval(
    model, tok, problems: list[Problem], temperature: float = 1.0, max_new_tokens: int = 256,
    batch_size: int = 64, seed: int = 0, texts: list[str] | None = None,
) -> dict:
    """Exact-match accuracy and response-length stats (tokens, EOS included) from sampling; `texts`, if given, gets
    the decoded responses (in the sampling order, sorted by prompt length)."""
    torch.manual_seed(seed)
    model.eval()
    rewards, lengths = [], []
    gen = GenerationConfig(  # explicit: plain temperature sampling, no top-k/top-p from model defaults
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    order = sorted(range(len(problems)), key=lambda i: len(problems[i].prompt))  # similar lengths together
    for s in range(0, len(order), batch_size):
        chunk = [problems[i] for i in order[s : s + batch_size]]
        enc = [encode_prompt(tok, p.prompt) for p in chunk]
        T = max(map(len, enc))
        dev = model.device
        ids = torch.tensor([[tok.pad_token_id] * (T - len(e)) + e for e in enc], device=dev)  # [B, T] left-padded
        mask = (torch.arange(T, device=dev) >= torch.tensor([T - len(e) for e in enc], device=dev)[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)[:, T:]  # [B, <=new]
        for p, row in zip(chunk, out.tolist()):
            n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            lengths.append(n)
            text = decode(tok, row)
            rewards.append(reward(p, text))
            if texts is not None:
                texts.append(text)
    L = np.array(lengths)
    return {
        "n": len(problems), "temperature": temperature, "accuracy": float(np.mean(rewards)),
        "response_tokens_mean": float(L.mean()), "response_tokens_p50": float(np.percentile(L, 50)),
        "response_tokens_p90": float(np.percentile(L, 90)), "response_tokens_max": int(L.max()),
    }
