"""The demo's GRPO-trained model: the arithmetic demo's model after `tandem demo`'s own run, on-policy distillation's
teacher in examples/distill.yaml and the judge of examples/judge.yaml."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.demo.arithmetic import DEMO_DEFAULTS, DemoModelSpec, arithmetic_model
from tandem.demo.common import cached_model

# `algo.distill.teacher: demo:grpo` (examples/distill.yaml): the demo's model after the demo's own GRPO run
GRPO_TEACHER = "demo:grpo"


@dataclass(frozen=True)
class GRPODemoSpec:
    """The demo's GRPO-trained model: its student (the warm start) trained by the demo's recipe; any change to either
    gives a new cache folder."""

    student: DemoModelSpec = DemoModelSpec()
    recipe: tuple[str, ...] = tuple(DEMO_DEFAULTS)


def grpo_demo_model(spec: GRPODemoSpec = GRPODemoSpec(), root: Path | None = None) -> Path:
    """Path of the demo's model after `tandem demo`'s own GRPO run (its last checkpoint's weights), built on first use
    by running that demo (minutes) and cached: on-policy distillation's teacher in examples/distill.yaml."""
    def build():
        import tempfile

        from tandem.config import load_config
        from tandem.modeling import load_causal_lm, load_tokenizer
        from tandem.run import checkpoint
        from tandem.trainer import train

        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(None, [f"model.path={arithmetic_model(spec.student, root)}", f"run.output_dir={out}",
                                     "run.progress=false", "run.plots=false"], list(spec.recipe))
            summary = train(cfg)
            last = checkpoint.latest(Path(out) / "checkpoints")
            model, tokenizer = load_causal_lm(str(last), "float32"), load_tokenizer(last)
        return model, tokenizer, {"initial_eval_accuracy": summary["initial_eval/accuracy"],
                                  "eval_accuracy": summary["eval/accuracy"]}

    return cached_model("demo-grpo", spec, build, root, lambda f: f"held-out accuracy "
                        f"{f['initial_eval_accuracy']:.3f} -> {f['eval_accuracy']:.3f} by the demo's GRPO run")
