"""A vision-language model's prompts: each row's text and images through the model's processor, once at load (the ids,
with the image tokens expanded, checked against the length limit) and for each step's prompts (the images' tensors)."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from tandem.data.images import IMAGE_TOKEN
from tandem.data.rows import DataError
from tandem.samples import Images

if TYPE_CHECKING:
    from tandem.data.sources import Prompt


# what a processor gives per token of the prompt, not per image: the ids' own (Qwen-VL's mm_token_type_ids say which
# are an image's, which the ids say too)
PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class VisionPrompts:
    """Renders a row as its processor does: the prompt as text (the raw question, or the chat template's with the
    generation prompt opened; an image part or a `<image>` marker where each image goes), then the processor, which
    expands each image into its tokens and makes its tensors. Token ids are the truth downstream, as for text: the
    engine and the trainer both see these ids, with the same tensors.

    A `<image>` marker becomes the model's own text for an image (`image_text`) before the processor sees it: the
    processor expands only that (Qwen-VL's reads `<image>` as plain text and drops the picture, silently)."""

    def __init__(self, processor, chat_template: bool, system_prompt: str, resize: dict | None = None):
        """`resize`: what the image processor is called with to hold images within data.min_pixels..max_pixels
        (`tandem.data.images.image_resize`), the engine's `mm_processor_kwargs` too: both resize an image alike."""
        self.processor, self.chat_template, self.system_prompt = processor, chat_template, system_prompt
        self.resize = dict(resize or {})
        self.image_text = image_text(processor)
        # a prompt's ids depend on its text and its images' sizes, not their pixels: rows alike are processed once
        # (`images` checks each step's prompts against the processor's ids again)
        self._ids: dict[tuple[str, tuple[tuple[int, int], ...]], list[int]] = {}

    def text(self, question: str | list[dict]) -> str:
        """The prompt as text, before the processor expands its images."""
        return self._rendered(question).replace(IMAGE_TOKEN, self.image_text)

    def _rendered(self, question: str | list[dict]) -> str:
        if not self.chat_template and isinstance(question, str):
            return question
        tokenizer = self.processor.tokenizer
        if not getattr(self.processor, "chat_template", None) and not getattr(tokenizer, "chat_template", None):
            raise DataError("the prompt needs a chat template (chat messages, or data.chat_template: true), and the "
                            "model's processor and tokenizer have none; give prompts as text with <image> markers")
        messages = [{"role": "user", "content": question}] if isinstance(question, str) else list(question)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        render = self.processor if getattr(self.processor, "chat_template", None) else tokenizer
        return render.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, row: dict, text: str | None = None) -> dict:
        """The processor's output for a row (`input_ids` [1, L] and the images' tensors)."""
        text = self.text(row.get("_messages") or row["question"]) if text is None else text
        images = [image.load() for image in row.get("_images", ())]
        if not images:
            return self.processor(text=[text], return_tensors="pt")
        return self.processor(text=[text], images=[images], return_tensors="pt", **self.resize)

    def ids(self, row: dict) -> list[int]:
        """The row's prompt ids, each image expanded into its tokens."""
        text = self.text(row.get("_messages") or row["question"])
        key = (text, tuple(image.size for image in row.get("_images", ())))
        if key not in self._ids:
            ids = self.encode(row, text)["input_ids"][0].tolist()
            if row.get("_images") and self.processor.image_token_id not in ids:
                raise DataError(f"{row.get('_line', row.get('_row', '?'))}: the processor put none of the images' "
                                f"tokens ({self.processor.image_token!r}) in the prompt {text!r}: it does not read "
                                f"{self.image_text!r} as an image's place")
            self._ids[key] = ids
        return list(self._ids[key])

    def images(self, prompt: Prompt) -> Images | None:
        """A prompt's images as its model takes them (None for a row without images); its ids must be those of the
        load, or the tensors would go with other tokens."""
        row = prompt.row
        if not row.get("_images"):
            return None
        text = self.text(row.get("_messages") or row["question"])
        out = self.encode(row, text)
        if out["input_ids"][0].tolist() != prompt.ids:
            raise RuntimeError(f"the processor gave other ids for {row.get('_line', row.get('_row', '?'))} than at "
                               "load: it is not deterministic, and the images' tensors cannot be matched to the ids")
        tensors = {k: v for k, v in out.items() if k not in PER_TOKEN}
        digest = hashlib.blake2b(digest_size=16)
        for image in row["_images"]:
            digest.update(image.data)
        collapsed = self.processor.tokenizer.encode(text, add_special_tokens=False)  # one placeholder per image
        return Images(digest.hexdigest(), tuple(image.name for image in row["_images"]), tensors,
                      tuple(image.data for image in row["_images"]), tuple(collapsed))


def image_text(processor) -> str:
    """How the model's prompts write one image before its processor expands it: what its chat template renders for
    an image part (Qwen-VL: `<|vision_start|><|image_pad|><|vision_end|>`, the form it was trained on), else its
    processor's image token (Idefics3: `<image>`)."""
    if getattr(processor, "chat_template", None):
        a, b = "\x00before\x00", "\x00after\x00"
        parts = [{"type": "text", "text": a}, {"type": "image"}, {"type": "text", "text": b}]
        rendered = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
        if a in rendered and b in rendered and rendered.index(a) < rendered.index(b):
            return rendered[rendered.index(a) + len(a):rendered.index(b)] or processor.image_token
    return processor.image_token
