"""The long-tail demo's task: the arithmetic task's sums, each answer followed by a countdown of long-tailed length.

A completion is the answer (the reversed sum, as the arithmetic task's), `;`, then a countdown from some n to 1:
`47+38=` is answered `58;3 2 1`. The n is the writer's choice, long-tailed in the demo's teacher (most count down
from a few, a few from dozens), so one step's completions run from a handful to about two hundred tokens: the
workload packing (`batch.padding_free`) and context parallelism are for. Only the answer before the `;` is judged;
the countdown is free, and ends where it reaches 1 (EOS), so greedy decoding stops too.
"""
from __future__ import annotations

from tandem.data import arithmetic
from tandem.rewards.base import register_reward

SEPARATOR = ";"  # between the answer and the countdown


def countdown(n: int) -> str:
    """`n n-1 ... 1`, space-separated."""
    return " ".join(str(k) for k in range(n, 0, -1))


def completion(answer: str, n: int) -> str:
    """A whole completion: `answer`, the separator, then the countdown from `n`."""
    return answer + SEPARATOR + countdown(n)


def given_answer(completion_text: str) -> str | None:
    """What precedes the first separator, stripped; None when the completion has no separator."""
    head, sep, _ = completion_text.partition(SEPARATOR)
    return head.strip() if sep else None


def rows(split: str) -> list[dict]:
    """The arithmetic task's rows (the same train / held-out split): the questions and answers are its own."""
    return arithmetic.rows(split)


@register_reward("long_tail_exact", inline=True)
def exact(completion: str, prompt: str, row, **_) -> float:
    """1 if what precedes the completion's first `;` is exactly the reversed sum, else 0."""
    return float(given_answer(completion) == str(row["answer"]).strip())
