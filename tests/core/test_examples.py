"""Every preset in examples/ is a valid config on the demo's settings, and `tandem demo` picks the model it names."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import _demo_model, _demo_teacher
from tandem.demo import DEMO_DEFAULTS
from tandem.config import ConfigError, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("preset", EXAMPLES, ids=lambda p: p.name)
def test_each_preset_loads_over_the_demo_settings(preset):
    load_config(preset, [], DEMO_DEFAULTS)


def test_the_demo_builds_the_model_a_preset_names(monkeypatch):
    import tandem.demo as demo

    built = []
    monkeypatch.setattr(demo, "demo_model", lambda spec=None: built.append(spec or demo.DemoModelSpec()) or Path("m"))
    monkeypatch.setattr(demo, "tool_demo_model", lambda: built.append("tools") or Path("t"))
    monkeypatch.setattr(demo, "long_tail_model", lambda: built.append("long tail") or Path("l"))
    examples = Path(__file__).resolve().parents[2] / "examples"
    _demo_model(load_config(examples / "moe.yaml", [], DEMO_DEFAULTS))
    _demo_model(load_config(examples / "qwen3_5.yaml", [], DEMO_DEFAULTS))
    _demo_model(load_config(None, [], DEMO_DEFAULTS))
    _demo_model(load_config(None, ["data.task=multiply"], DEMO_DEFAULTS))
    _demo_model(load_config(examples / "long_tail.yaml", [], DEMO_DEFAULTS))
    assert built == [demo.MoEDemoSpec(), demo.HybridDemoSpec(), demo.DemoModelSpec(), "tools", "long tail"]
    with pytest.raises(ConfigError, match="'demo:gpt_oss' names no demo model; the demo builds demo:qwen3_moe, "
                                          "demo:qwen3_5"):
        _demo_model(load_config(None, ["model.path=demo:gpt_oss"], DEMO_DEFAULTS))


def test_the_demo_builds_the_teacher_a_preset_names(monkeypatch):
    """examples/distill.yaml's `demo:grpo` becomes the demo's GRPO-trained model's folder; a teacher given as a
    folder is left as it is; another demo name is refused, naming the one there is."""
    import tandem.demo as demo

    monkeypatch.setattr(demo, "grpo_demo_model", lambda: Path("grpo"))
    examples = Path(__file__).resolve().parents[2] / "examples"
    assert _demo_teacher(load_config(examples / "distill.yaml", [], DEMO_DEFAULTS)) == ["algo.distill.teacher=grpo"]
    assert _demo_teacher(load_config(None, ["algo.distill.teacher=/models/t"], DEMO_DEFAULTS)) == []
    with pytest.raises(ConfigError, match="'demo:qwen3_5' names no demo model; the demo's teacher is 'demo:grpo'"):
        _demo_teacher(load_config(None, ["algo.distill.teacher=demo:qwen3_5"], DEMO_DEFAULTS))


def test_the_warm_start_stops_on_its_samples_not_on_one_greedy_check(monkeypatch):
    """A greedy check past warm_target_agreement does not stop the demo's warm start while its samples at
    temperature 1 are not the teacher's answers: greedy agreement flips from check to check (an argmax over a near
    tie), so float rounding moved the first check past it (the MoE model's from step 675 with PyTorch's AVX2 kernels
    to 375 with its AVX-512 ones, where GRPO then ended at 0.83 instead of ~1)."""
    from dataclasses import replace

    import tandem.demo as demo
    from tandem.data import arithmetic
    from tandem.demo import arithmetic as warm  # where the warm start finds its samplers

    spec = demo.DemoModelSpec(hidden_size=32, layers=1, intermediate_size=64, warm_batch=4, warm_max_steps=200)
    tokenizer = demo.build_tokenizer(arithmetic.corpus(), spec.vocab_size)
    monkeypatch.setattr(warm, "greedy_answers", lambda model, tok, rows: [r["answer"] for r in rows])  # always agrees
    checks = []

    def sampled(model, tok, rows, n, temperature=1.0, seed=0):  # noise at the first two checks, then the teacher's
        checks.append((n, temperature))
        return [[r["answer"] if len(checks) > 2 else "x"] * n for r in rows]

    monkeypatch.setattr(warm, "sampled_answers", sampled)
    assert demo.warm_start(spec.build(tokenizer), tokenizer, spec) == (1.0, 1.0, 1.0, 75)
    assert checks == [(4, 1.0)] * 3
    checks.clear()
    alone = replace(spec, warm_target_sampled_agreement=0.0)  # greedy agreement alone: its first check stops it
    assert demo.warm_start(alone.build(tokenizer), tokenizer, alone) == (1.0, 1.0, None, 25)
    assert checks == []
