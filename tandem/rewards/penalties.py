"""Length and repetition penalties: optional terms in [-1, 0] to add to a reward sum with a weight."""
from __future__ import annotations

from typing import Mapping

from tandem.rewards.base import register_reward


def _length(text: str, unit: str) -> int:
    if unit == "chars":
        return len(text)
    if unit == "words":
        return len(text.split())
    raise ValueError(f"unit must be 'chars' or 'words', got {unit!r}")


@register_reward("length_penalty", inline=True)
def length_penalty(completion: str, prompt: str, row: Mapping, max_len: int = 4096, buffer: int = 1024,
                   unit: str = "chars") -> float:
    """DAPO's soft overlong penalty: 0 up to `max_len - buffer`, falling linearly to -1 at `max_len`, -1 beyond.
    Lengths are in characters or whitespace-separated words (this layer has no tokenizer)."""
    if max_len <= 0 or not 0 <= buffer <= max_len:
        raise ValueError(f"need max_len > 0 and 0 <= buffer <= max_len, got {max_len}, {buffer}")
    n = _length(completion, unit)
    if n <= max_len - buffer:
        return 0.0
    if n > max_len or buffer == 0:
        return -1.0
    return -(n - (max_len - buffer)) / buffer


def repeated_fraction(text: str, n: int = 3) -> float:
    """The fraction of word n-grams that repeat an earlier one: 0 for varied text, near 1 for a loop."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@register_reward("repetition_penalty", inline=True)
def repetition_penalty(completion: str, prompt: str, row: Mapping, ngram: int = 3) -> float:
    """Minus the fraction of repeated word `ngram`s, in [-1, 0]: degenerate loops score near -1."""
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    return -repeated_fraction(completion, ngram)
