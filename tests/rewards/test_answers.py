"""Math verifiers: GSM8K number extraction and comparison, and math-verify LaTeX equivalence, including near misses."""
from __future__ import annotations

import pytest

from tandem.rewards import REWARDS, extract_number, math_equal, numbers_equal


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234,567", "1234567"),
    ("The answer is 42.", "42"),
    ("So the final answer is: $1,250.50", "1250.50"),
    ("the answer is 18 apples, which is 180 cents", "18"),
    ("Q: how many?\nA: 15 dollars", "15"),
    ("We get \\boxed{7} in the end, not 8", "7"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),
    ("\\boxed{1{,}000}", "1000"),
    ("\\boxed{\\$12}", "12"),
    ("The discount is 25%", "25"),
    ("It costs $3.50 and then €4", "4"),
    ("so she has 18.", "18"),
    ("the temperature fell to -3 degrees", "-3"),
    ("the temperature fell to \u22123 degrees", "-3"),
    ("half is .5", ".5"),
    ("<think>maybe 3, maybe 4</think><answer>4 cookies</answer>", "4"),
    ("x2 and y3 are names, the count is 9", "9"),
    ("no digits here", None),
    ("", None),
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize("a, b, equal", [
    ("18", "180", False), ("180", "18", False),
    ("0.5", "1/2", True), ("1/2", ".5", True),
    ("-3", "3", False), ("-3", "-3.0", True),
    ("1,000", "1000", True), ("1000.00", "1000", True),
    ("0.333333333", "1/3", True), ("0.33", "1/3", False),
    ("72", "72.5", False), ("1/0", "1", False), ("abc", "1", False), (None, "1", False),
])
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


@pytest.mark.parametrize("completion, reference, score", [
    ("... so she has 72 clips. The answer is 72.", "Natalia sold ... \n#### 72", 1.0),
    ("The answer is 18", "#### 180", 0.0),
    ("The answer is 180", "#### 18", 0.0),
    ("The answer is $1,800.", "1800", 1.0),
    ("The answer is -3", "3", 0.0),
    ("The answer is 0.5", "#### 1/2", 1.0),
    ("I don't know", "#### 5", 0.0),
    ("Total: 5 + 7 = 12 dollars", 12, 1.0),
])
def test_gsm8k_reward(completion, reference, score):
    assert REWARDS["gsm8k"].fn(completion, "", {"answer": reference}) == score


def test_gsm8k_unreadable_reference_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="reference"):
        REWARDS["gsm8k"].fn("42", "", {"answer": "no number"})


@pytest.mark.parametrize("prediction, gold, equal", [
    ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{2}{4}}", "$\\frac{1}{2}$", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{18}", "180", False),
    ("\\boxed{-3}", "3", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("The answer is \\boxed{\\pi}", "\\pi", True),
    ("no answer at all", "7", False),
])
def test_math_equal(prediction, gold, equal):
    assert math_equal(prediction, gold) is equal


def test_math_reward_is_pooled_and_gsm8k_inline():
    assert REWARDS["gsm8k"].inline and not REWARDS["math"].inline
    assert REWARDS["math"].fn("\\boxed{42}", "", {"answer": "42"}) == 1.0
