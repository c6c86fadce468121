"""Reward functions tests name with reward.fn (module:function). SEEN records each has_digit call's
prompt, so a test can tell which rows the run trained and evaluated on."""
from __future__ import annotations

SEEN: list[str] = []


def has_digit(prompt: str, response: str, row: dict) -> float:
    SEEN.append(prompt)
    return float(any(c.isdigit() for c in response))


def not_finite(prompt: str, response: str, row: dict) -> float:
    return float("nan")


def raises(prompt: str, response: str, row: dict) -> float:
    raise KeyError("score")


def length_parity(prompt: str, response: str, row: dict) -> float:
    """A random policy earns no exact-match reward: this one gives every step a gradient."""
    return float(len(response) % 2)


CALLS = [0]
LIMIT = [40]


def fails_after_limit(prompt: str, response: str, row: dict) -> float:
    """has_digit for the first LIMIT calls, then a verifier that is down."""
    CALLS[0] += 1
    if CALLS[0] > LIMIT[0]:
        raise RuntimeError("verifier unreachable")
    return float(any(c.isdigit() for c in response))
