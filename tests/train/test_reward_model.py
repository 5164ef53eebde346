"""The reward model (`rewards: [{name: model}]`, tandem.train.reward_model): its score is the classifier's own logit,
batching by a token budget changes no score, a bad checkpoint is refused before any model loads, a failing sample
scores 0 and is counted, and it sums with rule rewards by weight."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tandem.config import ConfigError, RewardSpec, load_config
from tandem.rewards import RewardScorer
from tandem.run.metric_names import entry_of
from tandem.train import reward_model
from tandem.train.reward_model import RewardModel

PROMPTS = ["12+34=", "47+38=", "99+99=", "10+10="]
COMPLETIONS = ["64", "58", "891", "02 and some more text 12+34=64"]  # lengths differ: padding is exercised


def save_classifier(folder: Path, outputs: int = 1, positions: int = 64) -> Path:
    """A randomly initialised one-layer Qwen2 sequence classifier with the demo's tokenizer (EOS and PAD apart)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from tandem.data import arithmetic
    from tandem.demo import build_tokenizer

    tok = build_tokenizer(arithmetic.corpus(), 300)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=positions,
                      num_labels=outputs, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():  # a wider spread than the init's, so the texts' scores differ clearly
        model.score.weight.mul_(30.0)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return save_classifier(tmp_path_factory.mktemp("reward-model"))


def own_logits(path: Path, prompts: list[str], completions: list[str]) -> list[float]:
    """What the checkpoint itself gives each text, one at a time, loaded by transformers directly."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([tok.encode(p + c) + [tok.eos_token_id]])).logits[0, 0])
                for p, c in zip(prompts, completions)]


def scorer(specs: list[RewardSpec]) -> RewardScorer:
    return RewardScorer(specs, workers=0, builders={"model": reward_model.builder("cpu", "float32", offload=True)})


def test_the_score_is_the_models_own_logit_and_its_metrics_are_registered(classifier):
    want = own_logits(classifier, PROMPTS, COMPLETIONS)
    with scorer([RewardSpec(name="model", path=str(classifier))]) as s:
        res = s.score(COMPLETIONS, PROMPTS, [{}] * 4)
    assert res.per_fn["model"] == pytest.approx(want, abs=1e-6)
    assert max(want) - min(want) > 0.1  # the texts score differently: a score that ignored them would fail above
    assert res.errors["model"] == 0
    assert res.metrics["memory/reward_model/model/idle_bytes"] == 0  # offloaded between calls
    assert res.metrics["memory/reward_model/model/resident_bytes"] > 0
    assert res.metrics["reward_model/model/raw_mean"] == pytest.approx(sum(want) / 4)
    assert [n for n in res.metrics if entry_of(n, {"reward": ["model"]}) is None] == []


def test_batching_by_a_token_budget_gives_the_scores_of_one_by_one(classifier):
    rm = RewardModel(str(classifier), batch_tokens=10_000)
    rows = [{}] * len(PROMPTS)
    together = rm(COMPLETIONS, PROMPTS, rows)
    assert rm.metrics("m")["reward_model/m/batches"] == 1
    lengths = [len(rm.encode(c, p, {})) for c, p in zip(COMPLETIONS, PROMPTS)]
    rm.batch_tokens = 2 * sorted(lengths)[2]  # two of the three short ones fit in one forward, the long one alone
    budgeted = rm(COMPLETIONS, PROMPTS, rows)
    assert rm.metrics("m")["reward_model/m/batches"] == 3
    assert rm.metrics("m")["reward_model/m/batch_tokens"] == max(lengths) > rm.batch_tokens
    alone = [rm([c], [p], [{}])[0] for c, p in zip(COMPLETIONS, PROMPTS)]
    assert together == pytest.approx(alone, abs=1e-5) and budgeted == pytest.approx(alone, abs=1e-5)


def test_bad_reward_model_configs_are_refused_before_any_model_loads(classifier, tiny_model, tmp_path, monkeypatch):
    def no_load(*_, **__):
        raise AssertionError("a model was loaded before the config was refused")

    monkeypatch.setattr(reward_model, "load_sequence_classifier", no_load)
    monkeypatch.setattr(reward_model, "load_tokenizer", no_load)
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.path: empty.*sequence-classification checkpoint"):
        load_config(None, ["rewards=[{name: arithmetic_exact}, {name: model}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]: normalize: 'sigmoid' is read only by name: model"):
        load_config(None, ["rewards=[{name: arithmetic_exact, normalize: sigmoid}]"])
    two = save_classifier(tmp_path / "two", outputs=2)
    cases = {str(tiny_model): "is not a sequence classifier .*Qwen2ForCausalLM.* model.path",
             str(two): "has 2 outputs .*num_labels=1", str(tmp_path / "nothing"): "is not a folder"}
    for path, why in cases.items():
        specs = [RewardSpec(name="arithmetic_exact"), RewardSpec(name="model", path=path)]
        with pytest.raises(ValueError, match=rf"rewards\[1\]\.path: .*{why}"):
            reward_model.check(specs)
        with pytest.raises(ValueError, match=why):
            scorer(specs)
    reward_model.check([RewardSpec(name="model", path=str(classifier))])  # a good one passes the check
    assert json.loads((classifier / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]


def test_a_sample_the_model_cannot_score_scores_0_and_is_counted(classifier):
    too_long = "1" * 100  # over the model's 64 positions
    completions = COMPLETIONS[:2] + [too_long]
    with scorer([RewardSpec(name="model", path=str(classifier))]) as s:
        res = s.score(completions, PROMPTS[:3], [{}] * 3)
    assert res.per_fn["model"][:2] == pytest.approx(own_logits(classifier, PROMPTS[:2], COMPLETIONS[:2]), abs=1e-6)
    assert res.per_fn["model"][2] == 0.0 and res.total[2] == 0.0
    assert res.errors["model"] == 1 and res.error_kinds["model"] == {"raised": 1}
    assert "over the reward model's 64 positions" in res.last_error["model"]


def test_a_forward_that_fails_is_retried_row_by_row(classifier, monkeypatch):
    rm = RewardModel(str(classifier))
    forward = rm.forward
    poison = rm.encode(COMPLETIONS[1], PROMPTS[1], {})
    monkeypatch.setattr(rm, "forward", lambda seqs: (_ for _ in ()).throw(RuntimeError("bad row"))
                        if poison in seqs else forward(seqs))
    out = rm(COMPLETIONS, PROMPTS, [{}] * 4)
    assert isinstance(out[1], RuntimeError)
    assert [out[i] for i in (0, 2, 3)] == pytest.approx([forward([rm.encode(COMPLETIONS[i], PROMPTS[i], {})])[0]
                                                         for i in (0, 2, 3)], abs=1e-5)


def test_mixed_with_a_rule_reward_it_sums_by_weight_after_its_normalization(classifier):
    rows = [{"answer": "46"}, {"answer": "58"}, {"answer": "891"}, {"answer": "0"}]
    logits = own_logits(classifier, PROMPTS, COMPLETIONS)
    specs = [RewardSpec(name="arithmetic_exact", weight=0.5), RewardSpec(name="model", path=str(classifier),
                                                                        weight=2.0, normalize="sigmoid")]
    with scorer(specs) as s:
        res = s.score(COMPLETIONS, PROMPTS, rows)
    sig = [1 / (1 + math.exp(-x)) for x in logits]
    assert res.per_fn["arithmetic_exact"] == [0.0, 1.0, 1.0, 0.0]
    assert res.per_fn["model"] == pytest.approx(sig, abs=1e-6)
    assert res.total == pytest.approx([0.5 * e + 2.0 * m for e, m in zip([0, 1, 1, 0], sig)], abs=1e-6)
    with scorer([RewardSpec(name="model", path=str(classifier), normalize="zscore")]) as s:
        z = s.score(COMPLETIONS, PROMPTS, rows).per_fn["model"]
    with scorer([RewardSpec(name="model", path=str(classifier))]) as s:
        raw = s.score(COMPLETIONS, PROMPTS, rows).per_fn["model"]
    assert raw == pytest.approx(logits, abs=1e-6)
    # against the scorer's own logits: z-scoring divides a batched forward's float32 rounding (~1e-7) by the logits'
    # spread, which took it past 1e-6 from the one-at-a-time logits on one processor
    t = torch.tensor(raw, dtype=torch.float64)
    assert z == pytest.approx(((t - t.mean()) / t.std()).tolist(), abs=1e-12)


def test_the_demo_builds_the_reward_model_a_preset_names(monkeypatch, tmp_path):
    from tandem import demo
    from tandem.cli import _demo_reward_models
    from tandem.demo import DEMO_DEFAULTS

    monkeypatch.setattr(demo, "reward_model", lambda spec: tmp_path / type(spec).__name__)
    preset = Path(__file__).resolve().parents[2] / "examples" / "reward_model.yaml"
    cfg = load_config(preset, [], DEMO_DEFAULTS)
    assert [r.name for r in cfg.rewards] == ["arithmetic_exact", "model"] and cfg.rewards[0].weight == 0
    assert _demo_reward_models(cfg) == {1: tmp_path / "RewardModelSpec"}
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.path: 'demo:nope' names no demo reward model.*"
                                          "demo:reward_model"):
        _demo_reward_models(load_config(preset, ["rewards=[{name: gsm8k, weight: 0}, {name: model, path: demo:nope}]"],
                                        DEMO_DEFAULTS))


def test_a_run_scored_by_a_reward_model_logs_its_registered_metrics(classifier, tiny_model, tmp_path):
    from tandem.demo import DEMO_DEFAULTS
    from tandem.trainer import train

    overrides = ["run.steps=2", "run.eval_every=0", "run.report_to=none", "run.plots=false", "run.progress=false",
                 "data.eval_size=4", "batch.prompts_per_step=2", "batch.group_size=2", "placement.offload=true",
                 f"model.path={tiny_model}", f"run.output_dir={tmp_path}",
                 f"rewards=[{{name: arithmetic_exact, weight: 0}}, {{name: model, path: '{classifier}'}}]"]
    train(load_config(None, overrides, DEMO_DEFAULTS))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1)
    assert step["reward_model/model/batches"] >= 1 and step["memory/reward_model/model/idle_bytes"] == 0
    assert step["reward/mean"] == pytest.approx(step["reward/model"])  # the model's weight 1, the rule's 0
    names = {k for r in rows for k in r}
    assert [n for n in names if entry_of(n, {"reward": ["arithmetic_exact", "model"]}) is None] == []


def test_the_demo_reward_models_wrong_answers_are_wrong():
    import random

    from tandem.data import arithmetic
    from tandem.demo import WRONG_KINDS, near_misses, wrong_answer

    rng = random.Random(0)
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in arithmetic.rows("test")]
    for kind in [None, *WRONG_KINDS]:
        for a, b in pairs:
            guess = wrong_answer(a, b, rng, kind)
            if guess is None:  # only a carry-less answer to a sum without a carry, which is right
                assert kind == "carryless" and not arithmetic.has_carry(a, b)
            else:
                assert guess and guess != arithmetic.answer(a, b)
    for a, b in pairs:
        misses = near_misses(a, b)
        assert arithmetic.answer(a, b) not in misses and "" not in misses
        assert arithmetic.has_carry(a, b) == (arithmetic.carryless(a, b) in misses)
        assert len(misses) >= 9 * len(arithmetic.answer(a, b))  # every digit changed every way
