"""Synthetic verifiable task: iterate a map, step by step, with a right rule and a tempting wrong one.

    prompt    Q:37*4=                          apply f(x) = (x + 7) mod 100 four times to 37
    response  d:44;c:51;b:58;a:65;A:65         (then EOS)

Each step is the next value after a countdown label (the letter of the number of steps left, `a` on the last one)
and a mark of the rule applied: `:` for f, the right rule, `-` for g(x) = (x + 3) mod 100, a plausible wrong one
(`d:44;c-48;...`: the chain goes on from the value written). The answer is exact match of the final `A:` value. The
SFT teacher is a mixture of a right and a buggy solver: it applies g at WRONG_P of its steps and says so, so the SFT
policy computes either rule reliably but picks the wrong one at most steps: the right rule is the minority
strategy, the one the verifier rewards. The number of steps is long-tailed (1 + a geometric draw, capped at 16):
most responses are short, a few are long, as in reasoning RL where a handful of long rollouts dominate a batch.
After its answer the teacher goes on checking in a few responses (CHECK_P of them), drawn per sample: the long tail
of reasoning RL, where a few samples of a prompt run many times longer than the others and dominate the rollout.
The check applies the rules with the chain's mixture, so RL's move away from the wrong rule reaches the tail's text.

Why this world (issue 18): a policy whose text moves while it gets better, through mechanisms that real RL shows,
so that a drafter fitted to the step-0 policy goes stale:
- a strategy shift the reward favours, by sharpening at choice points: every step opens with a choice the SFT
  policy spreads over (WRONG_P for g); the verifier rewards only chains that never take g, so GRPO moves the
  policy onto `:` at every step (a forking token whose distribution RL moves, while the text around it stays as
  easy to predict);
- a skill the SFT policy barely had, learned by RL: solving long problems, which needs n right choices in a row
  (sampled accuracy ~(1 - WRONG_P)^n at step 0).
A drafter matched to the step-0 policy proposes `-` at every step as often as the SFT policy wrote it, and hedges
between the two rules' values; once the policy never writes `-`, those proposals are rejected, while a drafter
retrained on the new text finds it easier than the old (one rule, no choice). Within the default run GRPO all but
removes the wrong rule, held-out sampled accuracy rises far, and the shipped step-0 EAGLE-3 drafter loses much of its
MAL on the later policy's text (measured: see bench/NOTES.md, World).

Kept small on purpose: the 5M-parameter policy learns local small-table operations (a rule applied to the
previous value, a countdown) but not non-local ones (fetching a term from the prompt, counting, two-digit
multiplication), measured over eight candidate worlds (bench/NOTES.md).
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
WRONG_P = 0.7  # the SFT teacher's share of steps by the wrong rule g
ADD, WRONG_ADD = 7, 3  # f(x) = (x + ADD) mod 100, the right rule; g(x) = (x + WRONG_ADD) mod 100, the wrong one
RIGHT, WRONG = ":", "-"  # a step's mark of the rule applied: "c:51" (f), "c-48" (g)
# After its answer the SFT teacher goes on checking in CHECK_P of its responses, drawn per sample: it draws how many
# steps c (1 + Geometric(CHECK_STOP), at most CHECK_MAX) and keeps applying the rules, each step labelled with the
# steps left after it in two digits and taking the chain's choice of rule (`;02:72;01-75;00:82`). The check does not
# change the answer; under STRICT scoring a wrong step in it scores nothing. The count is written once, in the first
# label: a per-step stop instead let RL drift the length (bench/NOTES.md, World, session 34).
CHECK_P = 0.12
CHECK_STOP = 0.04
CHECK_MAX = 64
CHECK_FORM = False  # a response whose check is malformed (a label off by one, a value neither rule gives) scores 0
STRICT = False

_NUMBER_RE = re.compile(r"-?\d+")
_WRONG_RE = re.compile(r"(?:^|;)(?:[a-p]|\d\d)" + WRONG)  # a chain step's letter label or a check step's count


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q:37*4="
    answer: str  # "65"
    solution: str  # every step by the right rule: "d:44;c:51;b:58;a:65;A:65" (no EOS)
    start: int  # 37
    n: int  # 4: how many times f is applied


def f(x: int) -> int:
    """The right rule."""
    return (x + ADD) % 100


def g(x: int) -> int:
    """The wrong rule the SFT teacher sometimes applies."""
    return (x + WRONG_ADD) % 100


def sample_num_steps(rng: random.Random) -> int:
    n = MIN_STEPS
    while n < MAX_STEPS and rng.random() < EXTRA_STEP_P:
        n += 1
    return n


def solve(start: int, n: int, wrong: list[bool] | None = None) -> str:
    """The response for `start` iterated n times: step i by g where wrong[i], else by f (all f by default)."""
    x, steps = start, []
    for i in range(1, n + 1):
        bad = bool(wrong and wrong[i - 1])
        x = g(x) if bad else f(x)
        steps.append(f"{LABELS[n - i]}{WRONG if bad else RIGHT}{x:02d}")
    return ";".join(steps) + f";A:{x:02d}"


def sample_solution(p: Problem, rng: random.Random, wrong_p: float = WRONG_P, check_p: float | None = None) -> str:
    """One SFT response for `p`: each step by the wrong rule with probability wrong_p, then, with probability
    check_p (default CHECK_P), a check of 1 + Geometric(CHECK_STOP) steps (at most CHECK_MAX) after the answer."""
    text = solve(p.start, p.n, [rng.random() < wrong_p for _ in range(p.n)])
    check_p = CHECK_P if check_p is None else check_p
    if check_p <= 0 or rng.random() >= check_p:  # no draw at 0: a check-free world keeps its random stream
        return text
    c = 1
    while c < CHECK_MAX and rng.random() >= CHECK_STOP:
        c += 1
    x, steps = int(text.rsplit(":", 1)[1]), []
    for left in range(c - 1, -1, -1):
        bad = rng.random() < wrong_p
        x = g(x) if bad else f(x)
        steps.append(f"{left:02d}{WRONG if bad else RIGHT}{x:02d}")
    return text + ";" + ";".join(steps)


def make_problem(start: int, n: int) -> Problem:
    if not (0 <= start < 100 and MIN_STEPS <= n <= MAX_STEPS):
        raise ValueError(f"start must be in 0..99 and n in {MIN_STEPS}..{MAX_STEPS}, got {start}, {n}")
    solution = solve(start, n)
    return Problem(prompt=f"Q:{start:02d}*{n}=", answer=solution.rsplit(":", 1)[1], solution=solution, start=start,
                   n=n)


def sample_problem(rng: random.Random) -> Problem:
    n = sample_num_steps(rng)
    return make_problem(rng.randrange(100), n)


def longest_problem() -> Problem:
    """A problem with the longest prompt and response the task draws: what sizes the engine."""
    return make_problem(99, MAX_STEPS)


def make_problems(n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def make_prompts(n: int, seed: int) -> list[Problem]:
    """`n` problems (prompt + reference answer), deterministic in `seed`."""
    return make_problems(n, seed)


def extract_answer(text: str) -> str | None:
    """What follows the last `A:` in `text`, up to a check (`;`) or the end, if it is exactly a number, else None (no
    `A:`, or a malformed answer: `A:77;A:`, `A:7<pad>7`, `A:77=78` score nothing; an earlier well-formed `A:` does
    not rescue a later one)."""
    at = text.rfind("A:")
    if at < 0:
        return None
    tail = text[at + 2:].split(";", 1)[0]
    return tail if _NUMBER_RE.fullmatch(tail) else None


def _check_steps(text: str, rules: dict) -> bool:
    """Whether what follows the answer is nothing or a whole check whose labels count down to 00 and whose every step
    is a mark in `rules` with that rule applied to the value before (a check cut short never counts down to 00)."""
    at = text.rfind("A:")
    parts = text[at + 2:].split(";") if at >= 0 else []
    if not parts or not _NUMBER_RE.fullmatch(parts[0]):
        return False
    x, steps = int(parts[0]), parts[1:]
    for i, step in enumerate(steps):
        left, mark = f"{len(steps) - 1 - i:02d}", step[2:3]
        if mark not in rules or step != f"{left}{mark}{rules[mark](x):02d}":
            return False
        x = rules[mark](x)
    return True


def check_formed(text: str) -> bool:
    """A whole check (or none) in which each value is the rule its mark names applied to the value before, either
    rule (`;01:72;00-75`)."""
    return _check_steps(text, {RIGHT: f, WRONG: g})


def check_right(text: str) -> bool:
    """A whole check (or none) of right steps only (`;01:72;00:79`: f of the value before)."""
    return _check_steps(text, {RIGHT: f})


def reward(problem_or_answer: Problem | str, response_text: str) -> float:
    """1.0 iff the response's final `A:` answer equals the reference answer (and, under CHECK_FORM, its check after the
    answer is well formed; under STRICT, it takes only right steps), else 0.0."""
    answer = problem_or_answer.answer if isinstance(problem_or_answer, Problem) else problem_or_answer
    got = extract_answer(response_text)
    ok = got is not None and got == answer
    ok = ok and (not CHECK_FORM or check_formed(response_text)) and (not STRICT or check_right(response_text))
    return 1.0 if ok else 0.0


def wrong_rule_share(texts: list[str]) -> float:
    """The share of written steps that take the wrong rule: the choice RL moves."""
    steps = sum(t.count(";") for t in texts)
    return sum(len(_WRONG_RE.findall(t)) for t in texts) / max(steps, 1)
