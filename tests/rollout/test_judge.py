"""The generative judge (`rewards: [{name: judge, ...}]`): its template, its verdict rules, unreadable verdicts scored
0 and counted, and its place among the other rewards; the engine under it is a stub here (tests/rollout/
test_vllm_engine.py and test_vllm_server.py run it on vLLM)."""
from __future__ import annotations

import pytest

from tandem.config import ConfigError, load_config
from tandem.rewards import RewardScorer
from tandem.rollout.base import Completion
from tandem.rollout.judge import Judge, UnreadableVerdict, read_verdict


class Chars:
    """A tokenizer of one id per character: what the engine was sent reads back as text."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]


class Scripted:
    """An engine whose greedy output for a prompt is `answers(prompt text)`; it records the prompts it was sent."""

    def __init__(self, answers):
        self.answers, self.sent, self.closed = answers, [], False

    def generate(self, prompts, sampling):
        assert sampling.temperature == 0.0 and sampling.n == 1 and sampling.max_new_tokens == 16
        texts = ["".join(map(chr, p)) for p in prompts]
        self.sent.append(texts)
        return [Completion(p, [], [], self.answers(t), "stop", i) for i, (p, t) in enumerate(zip(prompts, texts))]

    def close(self):
        self.closed = True


def test_the_verdict_rules_read_a_score_tag_or_compare_answers():
    assert read_verdict("score", "it adds up. <score>1</score> then <score>0</score>", "x") == 1.0
    assert read_verdict("score", "<score> 7.5 </score>", "x") == 7.5
    assert read_verdict("answer", " 58\n", "58 ") == 1.0
    assert read_verdict("answer", "58", "85") == 0.0
    for rule, output in (("score", "score: 1"), ("score", "<score>yes</score>"), ("answer", "  ")):
        with pytest.raises(UnreadableVerdict):
            read_verdict(rule, output, "58")


def test_a_judge_renders_each_sample_and_counts_what_it_cannot_read():
    """The template's fields are filled from the sample and its row ({reference} is the row's answer); a row that
    lacks a field fails alone; an output without a verdict fails alone and is counted; the others are scored."""
    engine = Scripted(lambda t: "<score>1</score>" if t.startswith("47+38=|58|") else "I am not sure")
    judge = Judge(engine, Chars(), template="{prompt}|{completion}|{reference}|{level}", max_new_tokens=16)
    rows = [{"answer": "58", "level": "easy"}, {"answer": "58", "level": "easy"}, {"answer": "58"}]
    scores = judge(["58", "85", "58"], ["47+38="] * 3, rows)
    assert scores[0] == 1.0
    assert isinstance(scores[1], UnreadableVerdict) and isinstance(scores[2], KeyError)
    assert engine.sent == [["47+38=|58|58|easy", "47+38=|85|58|easy"]]  # the row without `level` never reached it
    assert judge.metrics("judge") == {"time/judge/judge": pytest.approx(judge._last["seconds"]),
                                      "judge/judge/samples": 3.0, "judge/judge/unreadable": 1.0}


def test_a_groups_problem_is_judged_once_when_the_template_leaves_the_completion_out():
    """verdict: answer with the problem alone as the template: the judge answers each distinct problem once and
    each completion is compared with its problem's answer."""
    engine = Scripted(lambda t: {"47+38=": "58", "10+10=": "02"}[t])
    judge = Judge(engine, Chars(), template="{prompt}", verdict="answer", max_new_tokens=16)
    scores = judge(["58", "85", "02", "58"], ["47+38=", "47+38=", "10+10=", "10+10="], [{}] * 4)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert engine.sent == [["47+38=", "10+10="]]


def test_a_judge_is_one_reward_among_others_and_its_unreadable_verdicts_score_0():
    """Through the scorer, as the trainer builds it (`builders`): the judge's scores join the weighted sum; an
    unreadable verdict scores 0, counted as the judge's `raised` error; its figures come with the result; closing
    the scorer closes the judge's engine."""
    import tandem.data.arithmetic  # noqa: F401  (registers arithmetic_format)

    engine = Scripted(lambda t: "<score>1</score>" if "58" in t else "no idea")
    built = {}

    def build(spec):
        built["judge"] = Judge(engine, Chars(), template="{completion}", max_new_tokens=16)
        return built["judge"]

    scorer = RewardScorer([("arithmetic_format", 0.5, {}), ("judge", 2.0, {})], workers=0, builders={"judge": build})
    try:
        res = scorer.score(["58", "85"], ["47+38=", "47+38="], [{"answer": "58"}] * 2)
    finally:
        scorer.close()
    assert res.per_fn["judge"] == [1.0, 0.0] and res.total == [2.5, 0.5]
    assert res.errors["judge"] == 1 and res.error_kinds["judge"] == {"raised": 1}
    assert "UnreadableVerdict" in res.last_error["judge"]
    assert res.metrics["judge/judge/unreadable"] == 1.0
    assert engine.closed


def test_a_judges_settings_are_checked_before_any_model_loads(tiny_model, tmp_path, monkeypatch):
    """A judge needs its path, and a folder holding a causal LM; its fields on another reward are refused."""
    from tandem import modeling
    from tandem.modeling import ModelFolderError
    from tandem.trainer import _check_before_loading

    base = [f"model.path={tiny_model}"]
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.path: empty, but name: judge"):
        load_config(None, base, ["rewards=[{name: judge}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]: verdict: 'answer' is read only by name: judge"):
        load_config(None, base, ["rewards=[{name: arithmetic_exact, verdict: answer}]"])
    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    cfg = load_config(None, base, [f"rewards=[{{name: judge, path: {tmp_path}}}]"])
    with pytest.raises(ModelFolderError, match=r"rewards\[0\]\.path \(a judge\): .* has no config.json"):
        _check_before_loading(cfg)


def test_the_demo_builds_the_judge_a_preset_names(monkeypatch):
    """examples/judge.yaml's `path: demo:grpo` is the demo's GRPO-trained model; another demo name is refused."""
    from pathlib import Path

    from tandem import demo
    from tandem.cli import _demo_reward_models
    from tandem.demo import DEMO_DEFAULTS

    monkeypatch.setattr(demo, "grpo_demo_model", lambda: Path("grpo"))
    preset = Path(__file__).resolve().parents[2] / "examples" / "judge.yaml"
    cfg = load_config(preset, [], DEMO_DEFAULTS)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("arithmetic_exact", 0.0), ("judge", 1.0)]
    assert _demo_reward_models(cfg) == {1: Path("grpo")}
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.path: 'demo:reward_model' names no demo judge"):
        _demo_reward_models(load_config(None, [], DEMO_DEFAULTS + ["rewards=[{name: judge, path: demo:reward_model}]"]))


def test_a_run_scored_by_a_judge_logs_its_registered_metrics(tiny_model, tmp_path):
    """Two steps judged on the hf engine by the policy's own starting model (it answers each problem; a completion
    scores 1 when it says the same): the judge's scores are the step's reward, its figures are logged and
    registered."""
    import json

    from tandem.demo import DEMO_DEFAULTS
    from tandem.run.metric_names import entry_of
    from tandem.trainer import train

    overrides = ["run.steps=2", "run.eval_every=0", "run.report_to=none", "run.plots=false", "run.progress=false",
                 "data.eval_size=4", "batch.prompts_per_step=2", "batch.group_size=2", f"model.path={tiny_model}",
                 f"run.output_dir={tmp_path}", "rewards=[{name: arithmetic_exact, weight: 0}, {name: judge, path: "
                 f"'{tiny_model}', template: '{{prompt}}', verdict: answer, max_new_tokens: 6}}]"]
    train(load_config(None, overrides, DEMO_DEFAULTS))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1)
    assert step["judge/judge/samples"] == 4 and step["time/judge/judge"] > 0
    assert step["reward/mean"] == pytest.approx(step["reward/judge"])  # the judge's weight 1, the rule's 0
    names = {k for r in rows for k in r}
    assert [n for n in names if entry_of(n, {"reward": ["arithmetic_exact", "judge"]}) is None] == []
