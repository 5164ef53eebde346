"""A tiny random Qwen2.5-VL (the second vision-language family: 3-D rotary positions, mRoPE), saved as a Hub
checkpoint is: what tests load as they load a real one."""
from __future__ import annotations

from pathlib import Path

import torch

from tandem.data import colors
from tandem.demo.common import build_tokenizer

QWEN_VISION_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                      "<|video_pad|>")
# Qwen2.5-VL's chat template cut to what tandem's prompts hold: turns of text parts and image parts
QWEN_VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_qwen_vision(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL saved in `folder` as a Hub checkpoint has it (weights; a tokenizer with Qwen's special
    tokens and chat template; the image processor's preprocessor_config.json naming the processor), to be loaded back
    by tandem.modeling as real checkpoints are. Its language model: 2 layers, hidden 64, heads of 32 dimensions whose
    16 rotary frequencies are split [4, 6, 6] over time, height and width (mrope_section). Its vision tower: 2 blocks
    of 32 (a windowed one, a full one), 14-pixel patches merged 2x2, so a 64x64 picture (resized to 56x56) is a
    [1, 4, 4] grid of 16 patches and 4 `<|image_pad|>` tokens. Its weights are drawn wider than transformers' default
    (0.05, not 0.02): attention far from uniform, so that positions move its logprobs well above the tests' tolerances
    (tests/train/test_vision_mrope.py: flattened positions move them by over 1e-3)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer(colors.corpus(), 300)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    tokenizer.chat_template = QWEN_VISION_TEMPLATE
    token = tokenizer.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=0.05),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], initializer_range=0.05),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        initializer_range=0.05)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    images.processor_class = "Qwen2_5_VLProcessor"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)
    return folder
