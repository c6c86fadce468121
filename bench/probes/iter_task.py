"""PROTOTYPE world 'iter': iterate f(x) = (A*x + B) mod 100 n times; terse vs careful (countdown) steps."""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

MIN_STEPS = 1
MAX_STEPS = 16
EXTRA_STEP_P = float(os.environ.get("DT_WORLD_EXTRA", "0.7"))
LABELS = "abcdefghijklmnop"
CAREFUL_P = float(os.environ.get("DT_WORLD_P", "0.3"))
MUL, ADD = 3, 7

_NUMBER_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str
    start: int = 0
    n: int = 1


def f(x: int) -> int:
    return (MUL * x + ADD) % 100


def sample_num_steps(rng: random.Random) -> int:
    n = MIN_STEPS
    while n < MAX_STEPS and rng.random() < EXTRA_STEP_P:
        n += 1
    return n


def write_solution(start, n, careful) -> str:
    x, steps = start, []
    for i in range(1, n + 1):
        x = f(x)
        steps.append((f"{LABELS[n - i]}:" if careful[i - 1] else "") + f"{x:02d}")
    return ";".join(steps) + f";A:{x:02d}"


def sample_solution(p, rng: random.Random) -> str:
    return write_solution(p.start, p.n, [rng.random() < CAREFUL_P for _ in range(p.n)])


def make_problem(start: int, n: int) -> Problem:
    x = start
    for _ in range(n):
        x = f(x)
    return Problem(prompt=f"Q:{start:02d}*{n}=", answer=f"{x:02d}",
                   solution=write_solution(start, n, [True] * n), start=start, n=n)


def sample_problem(rng: random.Random) -> Problem:
    n = sample_num_steps(rng)
    return make_problem(rng.randrange(100), n)


def longest_problem() -> Problem:
    return make_problem(99, MAX_STEPS)


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def make_prompts(n: int, seed: int) -> list[Problem]:
    return make_problems(n, seed)


def extract_answer(text: str) -> str | None:
    at = text.rfind("A:")
    if at < 0:
        return None
    tail = text[at + 2:]
    return tail if _NUMBER_RE.fullmatch(tail) else None


def reward(problem_or_answer, response_text: str) -> float:
    answer = problem_or_answer.answer if isinstance(problem_or_answer, Problem) else problem_or_answer
    got = extract_answer(response_text)
    return 1.0 if got is not None and got == answer else 0.0


_CAREFUL_RE = re.compile(r"(?:^|;)[a-p]:")


def careful_share(texts) -> float:
    steps = sum(t.count(";") for t in texts)
    return sum(len(_CAREFUL_RE.findall(t)) for t in texts) / max(steps, 1)
