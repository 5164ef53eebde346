"""Format, tag-count partial credit, and the length and repetition penalties."""
from __future__ import annotations

import pytest

from tandem.rewards import REWARDS

fmt, tags = REWARDS["format"].fn, REWARDS["tag_count"].fn
length, rep = REWARDS["length_penalty"].fn, REWARDS["repetition_penalty"].fn


@pytest.mark.parametrize("text, score", [
    ("<think>a\nb</think>\n<answer>4</answer>", 1.0),
    ("  <think>a</think><answer>4</answer>\n", 1.0),
    ("<answer>4</answer>", 0.0),
    ("<think>a</think><answer>4</answer> and more", 0.0),
    ("preamble <think>a</think><answer>4</answer>", 0.0),
])
def test_format_default_pattern(text, score):
    assert fmt(text, "", {}) == score


def test_format_custom_pattern():
    assert fmt("Answer: 12", "", {}, pattern=r"Answer: \d+") == 1.0
    assert fmt("Answer: twelve", "", {}, pattern=r"Answer: \d+") == 0.0


@pytest.mark.parametrize("text, score", [
    ("<think>a</think><answer>4</answer>", 1.0),
    ("<think>a</think>", 0.5),
    ("<think>a<think></think><answer>4</answer>", 0.75),
    ("nothing", 0.0),
])
def test_tag_count(text, score):
    assert tags(text, "", {}) == score


def test_length_penalty_ramp():
    kw = dict(max_len=100, buffer=20)
    assert length("x" * 80, "", {}, **kw) == 0.0
    assert length("x" * 90, "", {}, **kw) == pytest.approx(-0.5)
    assert length("x" * 100, "", {}, **kw) == pytest.approx(-1.0)
    assert length("x" * 500, "", {}, **kw) == -1.0
    assert length("a b c d", "", {}, max_len=4, buffer=2, unit="words") == -1.0
    with pytest.raises(ValueError):
        length("x", "", {}, unit="tokens")


def test_repetition_penalty():
    assert rep("the cat sat on the mat today", "", {}) == 0.0
    loop = rep("I think so. " * 50, "", {})
    assert -1.0 <= loop < -0.9
    assert rep("short", "", {}) == 0.0
