"""The embedded engine (rollout.engine: hf): `HFEngine` samples with the trainer's own model code (`engine`), keeps a
group's prompt once in decode (`shared_prompt`), and decodes the streaming schedule's requests (`stream`)."""
from tandem.rollout.hf.engine import HFEngine, draw, filter_logits, uniforms  # noqa: F401
from tandem.rollout.hf.shared_prompt import SharedPromptDecoder, shares  # noqa: F401
from tandem.rollout.hf.stream import HFStream, SlotDecoder  # noqa: F401
