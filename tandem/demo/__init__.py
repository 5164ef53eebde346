"""Builds the demos' own models (no downloads): tiny tokenizers and models warm-started on the demos' tasks, cached.

One module per demo, highest first (pyproject.toml's contract on `tandem.demo`): `catalog` (the models by the names
presets give them, and `demo_model`); `teacher` (the GRPO-trained model); `families` (the arithmetic model as a
Qwen3-MoE and a Qwen3.5), `tools`, `long_tail` (the long-tail demo's), `reward` (the reward model), `vision`,
`qwen_vision`; `arithmetic` (the dense model, warm-started on sums); `common` (the shape, tokenizer, loss and cache
they share). What callers use is here."""
from tandem.demo.arithmetic import (DEMO_DEFAULTS, DemoModelSpec, arithmetic_model, greedy_answers,  # noqa: F401
                                    sampled_agreement, sampled_answers, teacher_answer, warm_start)
from tandem.demo.catalog import DEMO_MODELS, DEMO_REWARD_MODELS, demo_model  # noqa: F401
from tandem.demo.common import (EOS, PAD, DemoShape, build_tokenizer, cache_root,  # noqa: F401
                                cached_model, masked_nll)
from tandem.demo.families import HybridDemoSpec, MoEDemoSpec  # noqa: F401
from tandem.demo.qwen_vision import QWEN_VISION_TEMPLATE, QWEN_VISION_TOKENS, build_qwen_vision  # noqa: F401
from tandem.demo.long_tail import LongTailSpec, long_tail_model  # noqa: F401
from tandem.demo.reward import (WRONG_KINDS, RewardModelSpec, encode_scored, near_misses,  # noqa: F401
                                pairwise_accuracy, ranks_first, reward_model, reward_model_loss, reward_scores,
                                train_reward_model, wrong_answer)
from tandem.demo.teacher import GRPO_TEACHER, GRPODemoSpec, grpo_demo_model  # noqa: F401
from tandem.demo.tools import (ToolDemoSpec, add_tool_tokens, head_answer, tool_demo_model,  # noqa: F401
                               tool_figures, tool_rollouts, tool_teacher, tool_transcript, tool_warm_start)
from tandem.demo.vision import (SLIPS, VISION_BOS, VISION_TOKENS, VisionDemoSpec, answer_step,  # noqa: F401
                                blank_image_accuracy, build_vision_model, build_vision_processor,
                                build_vision_tokenizer, colour_teacher, image_tokens, share_right, teacher_answers,
                                vision_demo_model, vision_greedy_answers, vision_inputs, vision_sampled_answers,
                                vision_warm_start)
