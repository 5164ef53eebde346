"""Images in data rows: each read as its encoded file and checked (found, readable, within data.max_pixels), counted
against the prompt's image placeholders; and the refusal of rows with images while tandem trains text-only models."""
from __future__ import annotations

import io
import math
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image as PILImage

from tandem.data.rows import DataError, row_at

IMAGE_TOKEN = "<image>"  # a text prompt's placeholder (ms-swift; geometry3k's `problem`), chat text parts' too
PART_TYPES = ("text", "image")  # the chat content parts tandem reads (TRL's and HF's)
ITEM_KINDS = ("a path (relative to the data file's folder, or absolute), bytes, a {'bytes', 'path'} dict (a "
              "`datasets` Image feature) or a PIL image")


@dataclass(frozen=True)
class Image:
    """One image of a row as its encoded file (PNG, JPEG, ...); `name`: the path as the row gave it, or
    `row <i> image <k>` for inline data."""
    name: str
    data: bytes = field(repr=False)

    def load(self) -> PILImage.Image:
        """The decoded image, in RGB."""
        with PILImage.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), from the file's header: PIL decodes no pixels for it."""
        with PILImage.open(io.BytesIO(self.data)) as image:
            return image.size


def attach_images(rows: list[dict], image_field: str, folder: Path | None, max_pixels: int, source: str) -> None:
    """Each row's images (its `image_field`) read, checked and kept as `row["_images"]` (rows without images get
    none), their number checked against the prompt's placeholders; `folder`: what relative paths are relative to
    (None: a Hub dataset, which has none). Chat messages of a row without images get their text parts joined, so
    that a chat template sees text as it always has."""
    for i, row in enumerate(rows, 1):
        at = row_at(source, row, i)
        images = _row_images(row, image_field, folder, at, i)
        for k, image in enumerate(images):
            _check_image(image, k, at, max_pixels)
        _check_placeholders(row, len(images), image_field, at)
        if images:
            row["_images"] = images
        elif "_messages" in row:
            row["_messages"] = [dict(m, content=content_text(m["content"])) for m in row["_messages"]]


def _row_images(row: dict, image_field: str, folder: Path | None, at: str, i: int) -> list[Image]:
    """The row's images under `image_field` (a list of them, or one), each read (`attach_images` checks them);
    none where the field is absent."""
    items = row.get(image_field)
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        items = [items]
    label = f"row {row.get('_row', i)}"
    return [_read_item(item, k, folder, at, label) for k, item in enumerate(items)]


def _read_item(item, k: int, folder: Path | None, at: str, label: str) -> Image:
    if isinstance(item, dict) and ("bytes" in item or "path" in item):  # a `datasets` Image feature, undecoded
        item = item.get("bytes") or item.get("path")
        if not item:
            raise DataError(f"{at}: image {k} is a {{'bytes', 'path'}} dict with neither; give the image's bytes "
                            "or its path")
    if isinstance(item, PILImage.Image):
        return Image(f"{label} image {k}", _png(item))
    if isinstance(item, (bytes, bytearray, memoryview)):
        return Image(f"{label} image {k}", bytes(item))
    if isinstance(item, str):
        return Image(item, _read_file(item, k, folder, at))
    raise DataError(f"{at}: image {k} is a {type(item).__name__}; an image is {ITEM_KINDS} (a field that holds "
                    "something else: set data.image_field to the field holding the images)")


def _png(image: PILImage.Image) -> bytes:
    """A decoded image encoded once, as PNG (lossless); modes PNG cannot hold (CMYK, ...) as RGB."""
    out = io.BytesIO()
    try:
        image.save(out, format="PNG")
    except (OSError, ValueError):
        out = io.BytesIO()
        image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def _read_file(path: str, k: int, folder: Path | None, at: str) -> bytes:
    if "://" in path:
        raise DataError(f"{at}: image {k} ({path}) is a URL; tandem downloads nothing while it runs: download the "
                        "images and give their paths")
    file = Path(path).expanduser()
    if not file.is_absolute():
        if folder is None:
            raise DataError(f"{at}: image {k} ({path}) is a relative path, but the data is a Hugging Face dataset "
                            "id, with no folder here to resolve it against; give absolute paths or the images' bytes, "
                            "or point the data setting at a local copy")
        file = folder / file
    if not file.is_file():
        raise DataError(f"{at}: image {k} ({path}): no such file ({file}); a relative path is relative to the data "
                        "file's folder (a dataset folder's own), not the working directory: fix the path or add "
                        "the file")
    return file.read_bytes()


def _check_image(image: Image, k: int, at: str, max_pixels: int) -> None:
    """An image PIL identifies (from its header), within `max_pixels`."""
    try:
        width, height = image.size
    except (OSError, PILImage.DecompressionBombError) as exc:
        raise DataError(f"{at}: image {k} ({image.name}) is no image PIL can read ({exc}); give a whole PNG, JPEG, "
                        "... file (a repository cloned without git-lfs holds pointers instead of its images)") from None
    if width * height > max_pixels:
        raise DataError(f"{at}: image {k} ({image.name}) is {width}x{height} = {width * height} pixels, over "
                        f"data.max_pixels={max_pixels}; resize the images, or raise data.max_pixels")


def _placeholders(prompt: str | list[dict]) -> int:
    """How many images a prompt refers to: `<image>` markers in text (a text prompt, chat text parts, chat text
    contents) and `{"type": "image"}` chat content parts."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_TOKEN)
    return sum(_content_placeholders(m["content"]) for m in prompt)


def _content_placeholders(content: str | list[dict]) -> int:
    if isinstance(content, str):
        return content.count(IMAGE_TOKEN)
    return sum(1 if p["type"] == "image" else p["text"].count(IMAGE_TOKEN) for p in content)


def content_text(content: str | list[dict]) -> str:
    """A chat message's text: its content, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def parts_problem(content: list) -> str:
    """What keeps a chat message's `content` list from being content parts (text parts with a string `text`,
    image parts), said as the error's `got ...`; empty if it is."""
    for j, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            what = f"content part {j} {part!r}" if kind is None else f"content part {j} of type {kind!r}"
            return f"{what} (tandem reads parts of type {' and '.join(PART_TYPES)})"
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"text part {j} with no string 'text'"
    return ""


def _check_placeholders(row: dict, count: int, image_field: str, at: str) -> None:
    wanted = _placeholders(row.get("_messages") or row["question"])
    if wanted == count:
        return
    how = f"one `{IMAGE_TOKEN}` in the text, or one {{'type': 'image'}} chat content part, per image, in order"
    if not wanted:
        raise DataError(f"{at}: the row has {count} image(s) in field {image_field!r} but its prompt has no image "
                        f"placeholder; put {how}")
    if not count:
        raise DataError(f"{at}: the prompt has {wanted} image placeholder(s) but the row has no images in field "
                        f"{image_field!r}; set data.image_field to the field holding them, or remove the "
                        "placeholders")
    raise DataError(f"{at}: the prompt has {wanted} image placeholder(s) but field {image_field!r} holds {count} "
                    f"image(s); they must agree in number: {how}")


def refuse_image_rows(rows: list[dict], source: str, image_field: str, model_path: str = "") -> None:
    """Refuse rows with images (the first one named): tandem trains text-only models, which would see only the
    placeholder text; `model_path` (a model folder) says whether the model is one."""
    for i, row in enumerate(rows, 1):
        if row.get("_images"):
            raise DataError(f"{row_at(source, row, i)}: the row carries {len(row['_images'])} image(s) (field "
                            f"{image_field!r}), but tandem's vision-language support is not built yet (issue 47): "
                            f"a text-only model would see only the placeholder text ({IMAGE_TOKEN!r}), never the "
                            f"images{_model_kind(model_path)}. Train on rows without images and placeholders")


def _model_kind(model_path: str) -> str:
    """`; model.path ... is a text-only model` where its config.json has no vision_config; empty where unknown."""
    if not model_path:
        return ""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if "vision_config" in config:
        return (f"; model.path {model_path!r} is a vision-language model (its config.json has a vision_config), "
                "which tandem would train as a text-only one")
    return f"; model.path {model_path!r} is such a text-only model (its config.json has no vision_config)"


# How an image processor (its `image_processor_type`) takes a pixel bound (`image_resize`): Qwen2-VL's
# family as pixel counts, Idefics3's as a longest edge in pixels
PIXEL_BOUNDS = ("Qwen2VLImageProcessor",)
LONGEST_EDGE = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")


def image_resize(max_pixels: int, min_pixels: int, image_processor: dict[str, Any]) -> dict[str, Any]:
    """What the image processor whose settings are `image_processor` (its `to_dict()`) is called with, and vLLM
    built with (`mm_processor_kwargs`), to hold its resize within `min_pixels`..`max_pixels` (data.min_pixels,
    data.max_pixels): one setting for both, so that both resize an image the same way; empty where its own resize
    is within them already, or where it takes no pixel bound."""
    kind = str(image_processor.get("image_processor_type", "")).removesuffix("Fast")
    size = image_processor.get("size") or {}
    if kind in PIXEL_BOUNDS:  # Qwen's `size` counts pixels: shortest_edge is min_pixels, longest_edge max_pixels
        high = min(size["longest_edge"], max_pixels)
        low = min(max(size["shortest_edge"], min_pixels), high)
        wanted = {"shortest_edge": low, "longest_edge": high}
    elif kind in LONGEST_EDGE:  # Idefics3's resizes the longest edge to size.longest_edge, up or down
        edge = max(size["longest_edge"], math.ceil(math.sqrt(min_pixels)))
        cap = math.isqrt(max_pixels)
        if image_processor.get("do_image_splitting"):  # tiles of max_image_size: the edge rounds up to whole ones
            tile = image_processor["max_image_size"]["longest_edge"]
            cap = max(tile, cap // tile * tile)
        wanted = {"longest_edge": min(edge, cap)}
    else:
        return {}
    return {} if wanted == {k: size.get(k) for k in wanted} else {"size": wanted}
