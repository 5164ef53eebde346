"""The demo's models by the names a preset gives them (`demo:<name>`), and the one entry that builds any of them."""
from __future__ import annotations

from pathlib import Path

from tandem.demo.arithmetic import DemoModelSpec, arithmetic_model
from tandem.demo.families import HybridDemoSpec, MoEDemoSpec
from tandem.demo.reward import RewardModelSpec
from tandem.demo.vision import VisionDemoSpec, vision_demo_model

# `model.path: demo:<name>` in a preset asks `tandem demo` for one of its models other than the default dense one
DEMO_MODELS = {"qwen3_moe": MoEDemoSpec, "qwen3_5": HybridDemoSpec, "vision": VisionDemoSpec}

# `rewards: [{name: model, path: demo:<name>}]` in a preset asks `tandem demo` for one of its reward models
DEMO_REWARD_MODELS = {"reward_model": RewardModelSpec}


def demo_model(spec: DemoModelSpec | VisionDemoSpec | None = None, root: Path | None = None) -> Path:
    """Path of the folder of the demo model `spec` describes (one of DEMO_MODELS', or by default the dense one),
    warm-started, built on first use and cached."""
    if isinstance(spec, VisionDemoSpec):
        return vision_demo_model(spec, root)
    return arithmetic_model(DemoModelSpec() if spec is None else spec, root)
