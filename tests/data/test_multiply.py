"""The tool demo's task: rows, the calculator, its rewards, and a tokenizer that encodes each segment the same."""
import functools
import random

import pytest

from tandem.data import multiply
from tandem.rewards import REWARDS


def test_question_answer_and_calculator():
    assert multiply.question(123, 456) == "123*456=" and multiply.answer(123, 456) == "56088"
    assert multiply.tool_call(123, 456) == "<calc>123*456</calc>"
    assert multiply.observation("56088") == "<result>56088</result>"
    assert multiply.calculate("123*456") == "56088" and multiply.calculate("12+3") == "error"


def test_rows_are_fixed_and_splits_disjoint():
    train, test = multiply.rows("train"), multiply.rows("test")
    assert len(train) == 20_000 and len(test) == 500
    assert test == multiply.rows("test") and train[:50] == multiply.rows("train")[:50]
    unordered = lambda rows: {frozenset(map(int, r["question"][:-1].split("*"))) for r in rows}  # noqa: E731
    assert not unordered(train) & unordered(test)
    for r in train[:500] + test:
        a, b = map(int, r["question"][:-1].split("*"))
        assert 100 <= a <= 9999 and 100 <= b <= 9999 and r["answer"] == str(a * b)
    with pytest.raises(ValueError, match="split"):
        multiply.rows("validation")


def test_exact_reward_with_and_without_the_tool():
    row = {"answer": "56088"}
    exact = REWARDS["multiply_exact"].fn
    assert exact("<calc>123*456</calc><result>56088</result>56088", "", row) == 1.0
    assert exact(" 56088 ", "", row) == 1.0  # from its head: judged the same way
    assert exact("<calc>123*456</calc><result>56088</result>56089", "", row) == 0.0
    assert exact("<calc>123*456</calc><result>56088</result>", "", row) == 0.0  # read it, never answered
    assert exact("56088<result>1</result>7", "", row) == 0.0  # the answer is what follows the last result


def test_tool_format_reward():
    fmt = REWARDS["tool_format"].fn
    assert fmt("<calc>123*456</calc><result>56088</result>56088", "", {}) == 1.0
    assert fmt("<calc>123*456</calc><result>56088</result>5608x", "", {}) == 0.0
    assert fmt("<result>56088</result>56088", "", {}) == 0.0  # a result without a call
    assert fmt("<calc>1*2</calc><result>2</result><result>9</result>9", "", {}) == 0.0  # a made-up second result
    assert fmt("56088", "", {}) == 0.0
    assert REWARDS["multiply_exact"].inline and REWARDS["tool_format"].inline


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.demo import add_tool_tokens, build_tokenizer

    tok = build_tokenizer(multiply.corpus(), 300)
    add_tool_tokens(tok)
    return tok


def test_segments_encode_the_same_alone_and_joined(tokenizer, tmp_path):
    from tandem.modeling import load_tokenizer

    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    for tok in (tokenizer, reloaded):
        enc = functools.partial(tok.encode, add_special_tokens=False)
        for tag in multiply.TAGS:
            assert len(enc(tag)) == 1, tag
        assert all(len(enc(str(d))) == 1 for d in range(10))
        for text in random.Random(0).sample(multiply.corpus(), 200):
            a, b = map(int, text.split("=")[0].split("*"))
            parts = [multiply.question(a, b), multiply.tool_call(a, b), multiply.observation(multiply.answer(a, b)),
                     multiply.answer(a, b)]
            ids = [i for p in parts for i in enc(p)]
            assert ids == enc(text)
            # decoding as the engine does (special tokens skipped) keeps the tags, so stop strings see `</calc>`
            assert tok.decode(ids, skip_special_tokens=True) == text


def test_teacher_transcript_masks_the_observation(tokenizer):
    from tandem.demo import ToolDemoSpec, head_answer, tool_teacher, tool_transcript

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids, mask = tool_transcript(tokenizer, 123, 456, None)
    q, call, obs = enc("123*456="), enc("<calc>123*456</calc>"), enc("<result>56088</result>")
    assert ids == q + call + obs + enc("56088") + [tokenizer.eos_token_id]
    assert mask == [0] * len(q) + [1] * len(call) + [0] * len(obs) + [1] * 6
    ids, mask = tool_transcript(tokenizer, 123, 456, head_answer(123, 456))
    assert ids == q + enc("123456") + [tokenizer.eos_token_id] and sum(mask) == 7
    rng = random.Random(0)
    calls = sum(tool_teacher(123, 456, rng, ToolDemoSpec()) is None for _ in range(2000))
    assert 500 < calls < 700  # tool_rate 0.3


def test_two_turn_rollout_appends_the_observation_ids(tokenizer):
    from tandem.demo import tool_rollouts
    from tandem.rollout.base import Completion

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731

    class Scripted:  # an engine that answers the first turn with a call and the second with its result
        def __init__(self):
            self.prompts = []

        def generate(self, prompts, sampling):
            self.prompts.append(prompts)
            text = "<calc>123*456</calc>" if len(self.prompts) == 1 else "56088"
            assert sampling.stop == ("</calc>",)
            return [Completion(p, enc(text), [0.0] * len(enc(text)), text, "stop", i) for i, p in enumerate(prompts)]

    engine = Scripted()
    assert tool_rollouts(engine, tokenizer, ["123*456="], 0.0) == ["<calc>123*456</calc><result>56088</result>56088"]
    assert engine.prompts[1] == [enc("123*456=") + enc("<calc>123*456</calc>") + enc("<result>56088</result>")]
