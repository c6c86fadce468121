"""Reward functions the "your own model" tests name with reward.fn (module:function). SEEN records each call's
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
