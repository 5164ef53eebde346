"""The built-in verifiable task: two-digit addition, answered with the sum's digits in reverse order.

Reverse order puts the digit that needs no carry first, so each answer digit depends only on the digits already
written and the aligned input digits: a tiny model can learn it, and GRPO visibly lifts accuracy in minutes.
`47+38=` is answered `58` (85 reversed), then EOS.
"""
from __future__ import annotations

import random
import re

from tandem.rewards.base import register_reward

LOW, HIGH = 10, 99


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)[::-1]


def carryless(a: int, b: int) -> str:
    """The answer of a student who forgets to carry: each digit is (a_i + b_i) mod 10, reversed like `answer`."""
    da, db = str(a)[::-1], str(b)[::-1]
    return "".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db))


def has_carry(a: int, b: int) -> bool:
    return answer(a, b) != carryless(a, b)


def rows(split: str, seed: int = 1234, holdout: float = 0.1) -> list[dict]:
    """All pairs of two-digit numbers, split once (fixed seed) into train and held-out `test` rows."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    cut = int(len(pairs) * holdout)
    chosen = pairs[:cut] if split == "test" else pairs[cut:]
    return [{"question": question(a, b), "answer": answer(a, b)} for a, b in chosen]


def corpus() -> list[str]:
    """Text that the demo tokenizer is trained on: every question and answer the task can produce."""
    return [question(a, b) + answer(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


_DIGITS = re.compile(r"\d{1,3}")


@register_reward("arithmetic_exact", inline=True)
def exact(completion: str, prompt: str, row, **_) -> float:
    """1 if the completion is exactly the reversed sum (surrounding whitespace ignored), else 0."""
    return float(completion.strip() == str(row["answer"]).strip())


@register_reward("arithmetic_format", inline=True)
def well_formed(completion: str, prompt: str, row, **_) -> float:
    """1 if the completion is 1-3 digits and nothing else (an answer that stops where it should)."""
    return float(_DIGITS.fullmatch(completion.strip()) is not None)


@register_reward("arithmetic_digits", inline=True)
def digits(completion: str, prompt: str, row, **_) -> float:
    """Partial credit: the share of answer positions holding the right digit (a longer completion dilutes it).

    Denser than exact match, so fewer GRPO groups have all-equal rewards and zero advantage.
    """
    got, want = completion.strip(), str(row["answer"]).strip()
    if not want:
        return 0.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
