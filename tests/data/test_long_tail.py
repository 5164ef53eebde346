"""The long-tail demo's task: its completions (answer, `;`, a countdown), the reward on the answer alone, its split,
and its teacher's long-tailed countdowns."""
import random

from tandem.data import arithmetic, long_tail
from tandem.data.sources import BUILT_IN_TASKS
from tandem.rewards import REWARDS


def test_a_completion_is_the_answer_then_a_countdown_to_one():
    assert long_tail.completion("58", 3) == "58;3 2 1"
    assert long_tail.completion("481", 1) == "481;1"
    assert long_tail.given_answer(" 58 ;12 11") == "58" and long_tail.given_answer("58") is None


def test_only_the_answer_before_the_separator_is_rewarded():
    reward = REWARDS["long_tail_exact"].fn
    row = {"answer": "58"}
    assert reward("58;3 2 1", "", row) == reward("58;9 8 7 6 5 4 3 2 1", "", row) == reward("58;", "", row) == 1.0
    assert reward("57;3 2 1", "", row) == reward("58", "", row) == reward("5;8", "", row) == 0.0


def test_rows_are_the_arithmetic_tasks_split():
    assert BUILT_IN_TASKS["long_tail"] is long_tail.rows
    assert long_tail.rows("test") == arithmetic.rows("test") and long_tail.rows("train") == arithmetic.rows("train")


def test_the_teachers_countdowns_are_long_tailed():
    """Most short, a few of dozens (the clip): the lengths packing is for."""
    from tandem.demo import LongTailSpec

    spec, rng = LongTailSpec(), random.Random(0)
    counts = sorted(spec.count(rng) for _ in range(2000))
    assert counts[0] == 1 and counts[-1] == spec.count_max
    assert counts[len(counts) // 2] <= 5 and counts[int(0.99 * len(counts))] >= 40
