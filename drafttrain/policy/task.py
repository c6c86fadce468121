"""Synthetic verifiable reasoning task: running sums with a step-by-step scratchpad.

    prompt    Q:7+5+8+9=
    response  7+5=12;12+8=20;20+9=29;A:29      (then EOS)

The number of terms is long-tailed (2 + a geometric draw, capped at 16), so most
responses are short but a few are long, as in reasoning RL where a handful of
long rollouts dominate a batch. The reward is exact match of the final `A:`
answer. Everything is deterministic given a seed (`random.Random`), never the
global RNG.

Simplifies on purpose: addition only, no whitespace, one answer format, and
single-digit operands (1-9). Measured on this CPU (scripts/make_policy.py's
budget, ~10 min of SFT): with 1-2 digit operands the 6-layer policy did not
learn to fetch the k-th term from the prompt in budget (its loss on those digits
stayed at ln 10 after 1500 steps: 0% accuracy), and a "rewrite the remaining
expression" scratchpad learned slower still; with 1-digit operands the copy and
the sums are learned in budget. The
scratchpad is mostly locally predictable (good for drafters) with a few hard
spots: fetching the next term and the sum itself.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MIN_TERMS = 2
MAX_TERMS = 16
EXTRA_TERM_P = 0.7  # P(one more term): extra terms ~ Geometric, mean 0.7/0.3 ~ 2.3
MAX_OPERAND = 9

_NUMBER_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:7+5+8+9="
    answer: str  # "29"
    solution: str  # "7+5=12;12+8=20;20+9=29;A:29" (no EOS)


def sample_num_terms(rng: random.Random) -> int:
    n = MIN_TERMS
    while n < MAX_TERMS and rng.random() < EXTRA_TERM_P:
        n += 1
    return n


def solve(terms: list[int]) -> str:
    """The scratchpad for a list of terms: one `acc+x=sum;` step per term after the first."""
    acc, steps = terms[0], []
    for x in terms[1:]:
        steps.append(f"{acc}+{x}={acc + x}")
        acc += x
    return ";".join(steps) + f";A:{acc}"


def problem_from_terms(terms: list[int]) -> Problem:
    return Problem(
        prompt="Q:" + "+".join(str(t) for t in terms) + "=",
        answer=str(sum(terms)),
        solution=solve(terms),
    )


def sample_problem(rng: random.Random) -> Problem:
    n = sample_num_terms(rng)
    return problem_from_terms([rng.randint(1, MAX_OPERAND) for _ in range(n)])


def longest_problem() -> Problem:
    """A problem with the longest prompt the task can draw (MAX_TERMS terms of MAX_OPERAND): what sizes the engine."""
    return problem_from_terms([MAX_OPERAND] * MAX_TERMS)


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def make_prompts(n: int, seed: int) -> list[Problem]:
    """`n` problems (prompt + reference answer), deterministic in `seed`."""
    return make_problems(n, seed)


def extract_answer(text: str) -> str | None:
    """What follows the last `A:` in `text` if it is exactly a number, else None (no `A:`, or a malformed answer:
    `A:29;A:`, `A:2<pad>9`, `A:29=30` score nothing; an earlier well-formed `A:` does not rescue a later one)."""
    at = text.rfind("A:")
    if at < 0:
        return None
    tail = text[at + 2:]
    return tail if _NUMBER_RE.fullmatch(tail) else None


def reward(problem_or_answer: Problem | str, response_text: str) -> float:
    """1.0 iff the response's final `A:` answer equals the reference answer, else 0.0."""
    answer = problem_or_answer.answer if isinstance(problem_or_answer, Problem) else problem_or_answer
    got = extract_answer(response_text)
    return 1.0 if got is not None and got == answer else 0.0
