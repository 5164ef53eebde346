"""Format rewards: a whole-completion regex pattern, and partial credit for each expected tag appearing once."""
from __future__ import annotations

import functools
import re
from typing import Mapping, Sequence

from tandem.rewards.base import register_reward

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str, flags: int) -> re.Pattern:
    return re.compile(pattern, flags)


@register_reward("format", inline=True)
def format_reward(completion: str, prompt: str, row: Mapping, pattern: str = THINK_ANSWER,
                  dotall: bool = True) -> float:
    """1.0 if the whole completion (surrounding whitespace ignored) matches `pattern`, else 0.0. The default is
    `<think>…</think>` then `<answer>…</answer>`; `dotall` lets `.` cross lines. Runs inline: keep patterns free
    of nested quantifiers such as `(a+)+` (Python's `re` has no time limit)."""
    flags = re.DOTALL if dotall else 0
    return 1.0 if _compiled(pattern, flags).fullmatch(completion.strip()) else 0.0


def tag_counts(text: str, tags: Sequence[str]) -> dict[str, int]:
    """How many times each `<tag>` and `</tag>` occurs."""
    return {t: text.count(t) for tag in tags for t in (f"<{tag}>", f"</{tag}>")}


@register_reward("tag_count", inline=True)
def tag_count(completion: str, prompt: str, row: Mapping, tags: Sequence[str] = ("think", "answer")) -> float:
    """Partial credit for the format: each of `<tag>` and `</tag>` present exactly once earns an equal share of 1.0
    (so 0.25 each for think/answer). A smoother signal than `format` early in training."""
    counts = tag_counts(completion, tuple(tags))
    return sum(1 for c in counts.values() if c == 1) / len(counts) if counts else 0.0
