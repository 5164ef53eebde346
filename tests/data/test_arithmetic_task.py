"""The demo task: answers, the carry-less teacher, the split, and its rewards."""
from tandem.data import arithmetic
from tandem.rewards import REWARDS


def test_answers_are_reversed_sums():
    assert arithmetic.question(47, 38) == "47+38=" and arithmetic.answer(47, 38) == "58"
    assert arithmetic.answer(90, 94) == "481"


def test_carryless_forgets_every_carry():
    assert arithmetic.carryless(47, 38) == "57"  # 7+8=15 -> 5, 4+3 -> 7: 75 written reversed
    assert arithmetic.carryless(90, 94) == "48"  # 9+9=18 -> 8, and no hundreds
    assert arithmetic.carryless(12, 34) == arithmetic.answer(12, 34) == "64"
    assert not arithmetic.has_carry(12, 34) and arithmetic.has_carry(15, 15)


def test_split_is_fixed_and_disjoint():
    train, test = arithmetic.rows("train"), arithmetic.rows("test")
    assert len(train) + len(test) == 90 * 90 and len(test) == 810
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert test == arithmetic.rows("test")


def test_rewards():
    row = {"answer": "481"}
    assert REWARDS["arithmetic_exact"].fn(" 481", "", row) == 1.0
    assert REWARDS["arithmetic_exact"].fn("4810", "", row) == 0.0
    assert REWARDS["arithmetic_digits"].fn("48", "", row) == 2 / 3
    assert REWARDS["arithmetic_digits"].fn("4819", "", row) == 3 / 4
    assert REWARDS["arithmetic_format"].fn("48", "", row) == 1.0
    assert REWARDS["arithmetic_format"].fn("48+", "", row) == 0.0
