"""The tool demo's task: multiplying two 3-4 digit numbers, which a tiny model cannot do in its head but can copy.

The model may call the calculator: `123*456=` is answered `<calc>123*456</calc>`, the multi-turn loop stops at
`</calc>` and appends the observation `<result>56088</result>`, and the model then writes `56088` and EOS. A
model that answers from its head (`123*456=56088` directly) is judged the same way; it is just almost never right.
"""
from __future__ import annotations

import random
import re

from tandem.rewards.base import register_reward

LOW, HIGH = 100, 9999
TRAIN_SIZE, TEST_SIZE = 20_000, 500
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
TAGS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)


def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def answer(a: int, b: int) -> str:
    return str(a * b)


def tool_call(a: int, b: int) -> str:
    """What the model writes to use the calculator (the loop stops at its closing tag)."""
    return f"{CALL_OPEN}{a}*{b}{CALL_CLOSE}"


def observation(value: str) -> str:
    """What the loop appends after a tool call: the calculator's output between result tags."""
    return f"{RESULT_OPEN}{value}{RESULT_CLOSE}"


_EXPR = re.compile(r"\s*(\d{1,9})\s*\*\s*(\d{1,9})\s*")


def calculate(expression: str) -> str:
    """The calculator: the product of `A*B` (non-negative integers), or `error` for anything else."""
    m = _EXPR.fullmatch(expression)
    return str(int(m.group(1)) * int(m.group(2))) if m else "error"


def number(rng: random.Random) -> int:
    """A 3- or 4-digit number, either length equally likely (uniform values would make 3-digit ones rare: 9%)."""
    digits = rng.choice((3, 4))
    return rng.randint(max(LOW, 10 ** (digits - 1)), min(HIGH, 10**digits - 1))


def pairs(seed: int = 1234, holdout: int = TEST_SIZE, size: int = TRAIN_SIZE) -> tuple[list, list]:
    """`size` train and `holdout` test pairs (a, b), each a `number`, drawn once with `seed`; no unordered pair
    is in both splits (a*b and b*a are the same question to a model that has learnt one of them)."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < holdout + size:
        a, b = number(rng), number(rng)
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            out.append((a, b))
    return out[holdout:], out[:holdout]


def rows(split: str, seed: int = 1234, holdout: int = TEST_SIZE) -> list[dict]:
    """The fixed train (20k) or held-out `test` (`holdout`) rows: {"question": "123*456=", "answer": "56088"}."""
    if split not in ("train", "test"):
        raise ValueError(f"multiply.rows: unknown split {split!r}; use 'train' or 'test'")
    train, test = pairs(seed, holdout)
    return [{"question": question(a, b), "answer": answer(a, b)} for a, b in (test if split == "test" else train)]


def corpus() -> list[str]:
    """Text the tool demo's tokenizer is trained on: questions, tool calls, observations and answers."""
    return [question(a, b) + tool_call(a, b) + observation(answer(a, b)) + answer(a, b)
            for a, b in pairs()[0][:2000]]


def final_answer(completion: str) -> str:
    """The completion's answer: what follows the last `</result>` (the observation it read), else all of it."""
    return completion.rsplit(RESULT_CLOSE, 1)[-1].strip()


# Why `multiply_exact` does not ask whether the loop wrote the `<result>`: it judges only the final answer against
# the true product, so a `<result>` the model writes itself cannot make a wrong answer score; a model that writes
# `<result>56088</result>56088` with no call has multiplied correctly in its head, which is a right answer.
# `tool_format` cannot be earned with a made-up result either: the loop stops every turn at `</calc>` and appends
# the real observation, so a completion holding a call has the loop's `<result>` right after it, and a second
# `<result>` (or one without a call before it) fails the format.
_TOOL_FORMAT = re.compile(r"<calc>[^<>]+</calc><result>[^<>]*</result>\d+")


@register_reward("multiply_exact", inline=True)
def exact(completion: str, prompt: str, row, **_) -> float:
    """1 if the final answer (after the last `</result>`, else the whole completion) is the product, else 0."""
    return float(final_answer(completion) == str(row["answer"]).strip())


@register_reward("tool_format", inline=True)
def tool_format(completion: str, prompt: str, row, **_) -> float:
    """1 if the completion is `<calc>...</calc><result>...</result>ANSWER` with ANSWER digits only, else 0: a small
    shaping term for using the calculator."""
    return float(_TOOL_FORMAT.fullmatch(completion.strip()) is not None)
