"""Synthetic verifiable reasoning task: running sums with a step-by-step scratchpad.

    prompt    Q:37+5+81+9=
    response  37+5=42;42+81=123;123+9=132;A:132      (then EOS)

The number of terms is long-tailed (2 + a geometric draw, capped), so most
responses are short but a few are long, as in reasoning RL where a handful of
long rollouts dominate a batch. Operands are 1-2 digits. The reward is exact
match of the final `A:` answer. Everything is deterministic given a seed
(`random.Random`), never the global RNG.

Simplifies on purpose: addition only (no subtraction), no whitespace, one
answer format. It exists to give the policy something cheap, checkable and
learnable whose scratchpad is locally predictable (good for drafters) with
a few hard spots (the sums themselves).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MIN_TERMS = 2
MAX_TERMS = 16
EXTRA_TERM_P = 0.7  # P(one more term): extra terms ~ Geometric, mean 0.7/0.3 ~ 2.3
MAX_OPERAND = 99

_ANSWER_RE = re.compile(r"A:(-?\d+)")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:37+5+81+9="
    answer: str  # "132"
    solution: str  # "37+5=42;42+81=123;123+9=132;A:132" (no EOS)


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


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def make_prompts(n: int, seed: int) -> list[Problem]:
    """`n` problems (prompt + reference answer), deterministic in `seed`."""
    return make_problems(n, seed)


def extract_answer(text: str) -> str | None:
    """The number after the last `A:` in `text`, or None if there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def reward(problem_or_answer: Problem | str, response_text: str) -> float:
    """1.0 iff the response's final `A:` answer equals the reference answer, else 0.0."""
    answer = problem_or_answer.answer if isinstance(problem_or_answer, Problem) else problem_or_answer
    got = extract_answer(response_text)
    return 1.0 if got is not None and got == answer else 0.0
