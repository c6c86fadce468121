"""Synthetic verifiable task: iterate a map, writing each step in one of two styles.

    prompt    Q:37*4=                          apply f(x) = (3x + 7) mod 100 four times to 37
    response  18;c:61;90;a:77;A:77             (then EOS); the same steps, all plain: 18;61;90;77;A:77

Each step is the next value, written plain (`61`) or after a countdown label (`c:61`: the label is the letter of
the number of steps left, `a` on the last one). The answer is exact match of the final `A:` value. The SFT corpus
writes each step in either style at random (COUNTDOWN_P each), so the SFT policy spreads over both. The number of
steps is long-tailed (1 + a geometric draw, capped at 16): most responses are short, a few are long, as in
reasoning RL where a handful of long rollouts dominate a batch.

Why this world (bench/NOTES.md, issue 18): a policy whose text moves while it gets better, through mechanisms that
real RL shows, so that a drafter fitted to the step-0 policy goes stale:
- sharpening at a choice point (entropy collapse): every step is a choice of style; the two styles are not equally
  reliable for this policy (f is right 0.97 of the time after a countdown label, 0.76 after a plain step; a wrong
  label ends the count early or late), so GRPO concentrates the policy on some ways of writing and the per-style
  mix of the text shifts;
- a length change: the mix shift and fewer over- or under-long chains shorten the responses;
- competence gain: stopping after exactly n steps and f itself get more reliable, which changes the text too.
Measured (bench/NOTES.md): 60 GRPO steps at the default recipe take held-out sampled accuracy from 0.35-0.37 to
0.51-0.55; on the later policy's text the step-0 policy itself, as an ideal frozen drafter, loses 15% of its mean
accepted length (k=5), the shipped step-0 EAGLE-3 drafter 7%.

Kept small on purpose: the 5M-parameter policy learns local small-table operations (f of the previous value) but
not non-local ones (fetching a term from the prompt, counting, two-digit addition), measured over six candidate
worlds. f has short cycles (99 -> 04 -> 19 -> 64 -> 99); that only makes some chains periodic.
Everything is deterministic given a seed (`random.Random`), never the global RNG.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MIN_STEPS = 1
MAX_STEPS = 16
EXTRA_STEP_P = 0.7  # P(one more step): extra steps ~ Geometric, mean 0.7/0.3 ~ 2.3
LABELS = "abcdefghijklmnop"  # LABELS[j]: j steps left after this one
COUNTDOWN_P = 0.5  # the SFT corpus's share of steps written with a countdown label
MUL, ADD = 3, 7  # f(x) = (MUL x + ADD) mod 100

_NUMBER_RE = re.compile(r"-?\d+")
_COUNTDOWN_RE = re.compile(r"(?:^|;)[a-p]:")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:37*4="
    answer: str  # "77"
    solution: str  # every step with its countdown label: "d:18;c:61;b:90;a:77;A:77" (no EOS)
    start: int  # 37
    n: int  # 4: how many times f is applied


def f(x: int) -> int:
    return (MUL * x + ADD) % 100


def sample_num_steps(rng: random.Random) -> int:
    n = MIN_STEPS
    while n < MAX_STEPS and rng.random() < EXTRA_STEP_P:
        n += 1
    return n


def solve(start: int, n: int, countdown: list[bool]) -> str:
    """The response for `start` iterated n times, step i written with its countdown label where countdown[i]."""
    x, steps = start, []
    for i in range(1, n + 1):
        x = f(x)
        steps.append((f"{LABELS[n - i]}:" if countdown[i - 1] else "") + f"{x:02d}")
    return ";".join(steps) + f";A:{x:02d}"


def sample_solution(p: Problem, rng: random.Random, countdown_p: float = COUNTDOWN_P) -> str:
    """One SFT response for `p`: each step labelled with probability countdown_p."""
    return solve(p.start, p.n, [rng.random() < countdown_p for _ in range(p.n)])


def make_problem(start: int, n: int) -> Problem:
    if not (0 <= start < 100 and MIN_STEPS <= n <= MAX_STEPS):
        raise ValueError(f"start must be in 0..99 and n in {MIN_STEPS}..{MAX_STEPS}, got {start}, {n}")
    solution = solve(start, n, [True] * n)
    return Problem(prompt=f"Q:{start:02d}*{n}=", answer=solution.rsplit(":", 1)[1], solution=solution, start=start,
                   n=n)


def sample_problem(rng: random.Random) -> Problem:
    n = sample_num_steps(rng)
    return make_problem(rng.randrange(100), n)


def longest_problem() -> Problem:
    """A problem with the longest prompt (and, all labels written, response) the task draws: what sizes the engine."""
    return make_problem(99, MAX_STEPS)


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def make_prompts(n: int, seed: int) -> list[Problem]:
    """`n` problems (prompt + reference answer), deterministic in `seed`."""
    return make_problems(n, seed)


def extract_answer(text: str) -> str | None:
    """What follows the last `A:` in `text` if it is exactly a number, else None (no `A:`, or a malformed answer:
    `A:77;A:`, `A:7<pad>7`, `A:77=78` score nothing; an earlier well-formed `A:` does not rescue a later one)."""
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


def countdown_share(texts: list[str]) -> float:
    """The share of written steps that carry a countdown label: the style mix that RL moves."""
    steps = sum(t.count(";") for t in texts)
    return sum(len(_COUNTDOWN_RE.findall(t)) for t in texts) / max(steps, 1)
