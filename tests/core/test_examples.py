"""Every preset in examples/ is a valid config on the demo's settings, and `tandem demo` picks the model it names."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import DEMO_DEFAULTS, _demo_model
from tandem.config import ConfigError, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("preset", EXAMPLES, ids=lambda p: p.name)
def test_each_preset_loads_over_the_demo_settings(preset):
    load_config(preset, [], DEMO_DEFAULTS)


def test_the_demo_builds_the_model_a_preset_names(monkeypatch):
    import tandem.demo as demo

    built = []
    monkeypatch.setattr(demo, "demo_model", lambda spec=demo.DemoModelSpec(): built.append(spec) or Path("m"))
    monkeypatch.setattr(demo, "tool_demo_model", lambda: built.append("tools") or Path("t"))
    moe = Path(__file__).resolve().parents[2] / "examples" / "moe.yaml"
    _demo_model(load_config(moe, [], DEMO_DEFAULTS))
    _demo_model(load_config(None, [], DEMO_DEFAULTS))
    _demo_model(load_config(None, ["data.task=multiply"], DEMO_DEFAULTS))
    assert built == [demo.MoEDemoSpec(), demo.DemoModelSpec(), "tools"]
    with pytest.raises(ConfigError, match="'demo:gpt_oss' names no demo model; the demo builds demo:qwen3_moe"):
        _demo_model(load_config(None, ["model.path=demo:gpt_oss"], DEMO_DEFAULTS))
