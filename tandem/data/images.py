"""Images in data rows: each read as its encoded file and checked at load (found, in an allowed format, within
data.max_pixels, decoded whole), counted against the prompt's image placeholders; and the refusal of rows with images
for a text-only model. Every consumer sees an image's pixels through one decoding, `decode`
(`tandem.util.pixels`: EXIF orientation applied, transparency on white, 16-bit greyscale scaled to 8 bits)."""
from __future__ import annotations

import base64
import binascii
import io
import math
import json
import urllib.parse
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from PIL import Image as PILImage

from tandem.data.rows import DataError, row_at
from tandem.util.pixels import FORMATS, allowed, decode, decoded_size, open_image

IMAGE_TOKEN = "<image>"  # a text prompt's placeholder (ms-swift; geometry3k's `problem`), chat text parts' too
PART_TYPES = ("text", "image")  # the chat content parts tandem reads (TRL's and HF's)
ITEM_KINDS = ("a path (relative to the data file's folder, or absolute), a data: URL, bytes, a {'bytes', 'path'} "
              "dict (a `datasets` Image feature) or a PIL image")


@dataclass(frozen=True)
class Image:
    """One image of a row as its encoded file (PNG, JPEG, ...); `name`: the path as the row gave it, or
    `row <i> image <k>` for inline data."""
    name: str
    data: bytes = field(repr=False)

    def load(self) -> PILImage.Image:
        """The decoded image, in RGB, as every consumer sees it (`decode`)."""
        return decode(self.data)

    @cached_property
    def size(self) -> tuple[int, int]:
        """(width, height) as decoded (`load`): a photo whose EXIF turns it on its side has its stored height as its
        width. The processor counts the prompt's image tokens on it; `check` keeps it from its decode."""
        return decoded_size(self.data)

    def check(self) -> None:
        """Decode the whole file once, raising what PIL raises for a broken one (checksums first: `verify` reads a
        PNG's, which decoding skips); the decoded size is kept (`size`), so it is not decoded again for it."""
        with open_image(self.data) as fresh:
            fresh.verify()
        self.__dict__["size"] = self.load().size  # cached_property's own slot (the dataclass is frozen)


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
    if isinstance(item, str) and item.startswith("data:"):
        return Image(f"{label} image {k}", _data_url(item, k, at))
    if isinstance(item, str):
        return Image(item, _read_file(item, k, folder, at))
    raise DataError(f"{at}: image {k} is a {type(item).__name__}; an image is {ITEM_KINDS} (a field that holds "
                    "something else: set data.image_field to the field holding the images)")


def _png(image: PILImage.Image) -> bytes:
    """A decoded image encoded once, as PNG (lossless), its pixels as they are (no EXIF: `datasets` has applied its
    orientation already); 32-bit greyscale as 16-bit (what a PNG holds, and a 16-bit PNG opens as), other modes PNG
    cannot hold (CMYK, ...) as RGB."""
    if image.mode == "I":
        image = image.convert("I;16")
    out = io.BytesIO()
    try:
        image.save(out, format="PNG")
    except (OSError, ValueError):
        out = io.BytesIO()
        image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def _data_url(url: str, k: int, at: str) -> bytes:
    """The file a data: URL (RFC 2397) holds: `data:image/png;base64,...` as verifiers' and OpenAI-style datasets
    write an inline image, or percent-encoded; its media type is not trusted (the check reads the file itself)."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise DataError(f"{at}: image {k} is a data: URL with no ',' before its data; write it as "
                        "data:image/png;base64,<the file in base64>")
    if not head.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except binascii.Error as exc:
        raise DataError(f"{at}: image {k} is a data: URL whose base64 does not decode ({exc}); write it as "
                        "data:image/png;base64,<the whole file in base64>") from None


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
    """An image PIL identifies from its header, in an allowed format (`FORMATS`), within `max_pixels`, then decoded
    whole: a file broken past its header is refused here, naming its row, not at a step after the models loaded."""
    width, height = _header_size(image, k, at, max_pixels)
    if width * height > max_pixels:
        raise DataError(f"{at}: image {k} ({image.name}) is {width}x{height} = {width * height} pixels, over "
                        f"data.max_pixels={max_pixels}; resize the images, or raise data.max_pixels")
    try:
        image.check()
    except Exception as exc:  # PIL raises many kinds for a broken file (OSError, SyntaxError, struct.error, ...)
        raise DataError(f"{at}: image {k} ({image.name}) is broken: {type(exc).__name__}: {exc}; give a whole PNG, "
                        "JPEG, ... file (a download cut short or a damaged copy: replace it, or re-encode it from a "
                        "good copy)") from None


def _header_size(image: Image, k: int, at: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the file's header, any format PIL knows opened to name it; refused outside `FORMATS`."""
    try:
        with PILImage.open(io.BytesIO(image.data)) as header:  # a header only: no format decodes anything here
            kind, size = header.format, header.size
    except PILImage.DecompressionBombError as exc:
        limit = 2 * (PILImage.MAX_IMAGE_PIXELS or 0)
        over = (f"over data.max_pixels={max_pixels}" if max_pixels < limit else
                f"within data.max_pixels={max_pixels} but over the {limit} pixels PIL opens at most")
        raise DataError(f"{at}: image {k} ({image.name}) is {over}: PIL refuses it as a decompression bomb ({exc}); "
                        "resize the images") from None
    except OSError as exc:
        raise DataError(f"{at}: image {k} ({image.name}) is no image PIL can read ({exc}); give a whole PNG, JPEG, "
                        "... file (a repository cloned without git-lfs holds pointers instead of its images)") from None
    if not allowed(kind):
        raise DataError(f"{at}: image {k} ({image.name}) is {kind}, which tandem does not read (decoding it would run "
                        "another program on the file, or PIL cannot decode it itself; vLLM refuses it too); allowed: "
                        f"{', '.join(FORMATS)}: convert it to PNG or JPEG")
    return size


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
    """Refuse rows with images (the first one named) where the prompts are read as text: a text-only model would see
    only the placeholder text. `model_path` (a model folder) is named, with what its config.json says it is."""
    for i, row in enumerate(rows, 1):
        if row.get("_images"):
            raise DataError(f"{row_at(source, row, i)}: the row carries {len(row['_images'])} image(s) (field "
                            f"{image_field!r}), but {_why_no_images(model_path)}")


def _why_no_images(model_path: str) -> str:
    vision = _has_vision_config(model_path)
    if vision:  # only a caller that reads a vision-language model's prompts without its processor gets here
        return (f"the prompts were read without the processor of model.path {model_path!r}, a vision-language model "
                "(its config.json has a vision_config): read them with its tandem.run.vision.VisionPrompts (pass "
                "its `ids` as load_prompts' render)")
    model = ("the model is text-only" if vision is None else
             f"model.path {model_path!r} is a text-only model (its config.json has no vision_config)")
    return (f"{model}: it would see only the placeholder text ({IMAGE_TOKEN!r}), never the images. Point model.path "
            "at a vision-language model (one whose config.json has a vision_config: Idefics3, SmolVLM, Qwen2.5-VL), "
            "or train on rows without images and placeholders")


def _has_vision_config(model_path: str) -> bool | None:
    """Whether the model folder's config.json has a vision_config; None where there is none to read."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return "vision_config" in config


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
