"""A vision-language model's prompts: each row's text and images through the model's processor, once at load (the ids,
with the image tokens expanded, checked against the length limit) and for each step's prompts (the images' tensors)."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from tandem.data.rows import DataError
from tandem.samples import Images

if TYPE_CHECKING:
    from tandem.data.sources import Prompt


class VisionPrompts:
    """Renders a row as its processor does: the prompt as text (the raw question, or the chat template's with the
    generation prompt opened; an image part or a `<image>` marker where each image goes), then the processor, which
    expands each image into its tokens and makes its tensors. Token ids are the truth downstream, as for text: the
    engine and the trainer both see these ids, with the same tensors."""

    def __init__(self, processor, chat_template: bool, system_prompt: str):
        self.processor, self.chat_template, self.system_prompt = processor, chat_template, system_prompt
        # a prompt's ids depend on its text and its images' sizes, not their pixels: rows alike are processed once
        # (`images` checks each step's prompts against the processor's ids again)
        self._ids: dict[tuple[str, tuple[tuple[int, int], ...]], list[int]] = {}

    def text(self, question: str | list[dict]) -> str:
        """The prompt as text, before the processor expands its images."""
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
        return self.processor(text=[text], images=[images], return_tensors="pt")

    def ids(self, row: dict) -> list[int]:
        """The row's prompt ids, each image expanded into its tokens."""
        text = self.text(row.get("_messages") or row["question"])
        key = (text, tuple(image.size for image in row.get("_images", ())))
        if key not in self._ids:
            self._ids[key] = self.encode(row, text)["input_ids"][0].tolist()
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
        tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        digest = hashlib.blake2b(digest_size=16)
        for image in row["_images"]:
            digest.update(image.data)
        collapsed = self.processor.tokenizer.encode(text, add_special_tokens=False)  # one placeholder per image
        return Images(digest.hexdigest(), tuple(image.name for image in row["_images"]), tensors,
                      tuple(image.data for image in row["_images"]), tuple(collapsed))
