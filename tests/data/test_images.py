"""Rows with images: the conventions users bring read and checked (paths, bytes, Image features; placeholders; the
pixel limit), and a run with them refused before any model loads while tandem trains text-only models."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image as PILImage
from PIL import ImageOps

from tandem.config import ConfigError, load_config
from tandem.data.images import Image, attach_images, refuse_image_rows
from tandem.data.sources import DataError, task_rows

# the data section of a config, a jsonl file, and (autouse) the Hub out of reach with the datasets cache in tmp_path
from data.test_datasets import data, offline, write_jsonl  # noqa: F401


def picture(path: Path | None = None, size: tuple[int, int] = (6, 4), fmt: str = "PNG") -> bytes:
    """A small picture's encoded bytes, written to `path` too where given."""
    out = io.BytesIO()
    PILImage.new("RGB", size, (200, 30, 30)).save(out, format=fmt)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(out.getvalue())
    return out.getvalue()


def chat(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "How many dots?"}
IMAGE = {"type": "image"}


def test_chat_image_parts_read_their_images_relative_to_the_data_files_folder(tmp_path, monkeypatch):
    picture(tmp_path / "data" / "img" / "a.png", (6, 4))
    path = write_jsonl(tmp_path / "data" / "t.jsonl", [
        {"question": chat(IMAGE, TEXT), "images": ["img/a.png"], "answer": "3"},
        {"question": chat(TEXT), "answer": "4"},  # no image: its text parts become the message's text
    ])
    (tmp_path / "elsewhere" / "img").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative to the data file, never to the working directory
    first, second = task_rows(data(path=path)).train
    assert first["_images"] == [Image("img/a.png", (tmp_path / "data" / "img" / "a.png").read_bytes())]
    assert first["_images"][0].size == (6, 4) and first["_images"][0].load().mode == "RGB"
    assert first["question"] == "How many dots?"  # what a reward sees: the last user turn's text
    assert "_images" not in second and second["_messages"] == [{"role": "user", "content": "How many dots?"}]


def test_image_markers_in_text_take_one_image_or_a_list(tmp_path):
    one = picture(tmp_path / "one.png")
    rows = task_rows(data(path=write_jsonl(tmp_path / "t.jsonl", [
        {"question": "<image>Count the dots.", "images": str(tmp_path / "one.png"), "answer": "1"},  # absolute, alone
        {"question": chat({"type": "text", "text": "<image> and <image>: same?"}),
         "images": ["one.png", "one.png"], "answer": "yes"},
    ]))).train
    assert [[i.data for i in r["_images"]] for r in rows] == [[one], [one, one]]


def test_an_image_feature_in_parquet_and_save_to_disk_keeps_the_files_bytes(tmp_path):
    import datasets

    jpeg = picture(size=(8, 5), fmt="JPEG")
    ds = datasets.Dataset.from_dict({"problem": ["<image>Find x."], "answer": ["3"],
                                     "images": [[{"bytes": jpeg, "path": None}]]})
    ds = ds.cast_column("images", datasets.Sequence(datasets.Image()))  # geometry3k's shape
    ds.to_parquet(str(tmp_path / "geo.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "geo.parquet", tmp_path / "saved"):
        (row,) = task_rows(data(path=path, prompt_field="problem")).train
        # the encoded file as the table holds it: never decoded by `datasets` and encoded again
        assert row["_images"] == [Image("row 0 image 0", jpeg)] and row["_images"][0].size == (8, 5)


def test_decoded_images_and_bytes_are_taken_as_they_come():
    pil = PILImage.new("L", (3, 2))
    rows = [{"question": "<image><image>", "images": [pil, picture(size=(2, 2))], "_row": 7}]
    attach_images(rows, "images", None, 100, "mem")
    first, second = rows[0]["_images"]
    assert (first.name, first.size, first.data[:4], first.load().mode) == ("row 7 image 0", (3, 2), b"\x89PNG", "RGB")
    assert (second.name, second.size) == ("row 7 image 1", (2, 2))


@pytest.mark.parametrize("row, message", [
    ({"question": "<image>hi", "images": ["gone.png"]},
     r"t\.jsonl:2: image 0 \(gone\.png\): no such file \(.*/data/gone\.png\); a relative path is relative to the "
     r"data file's folder"),
    ({"question": "<image><image>hi", "images": ["ok.png", "notes.png"]},
     r"t\.jsonl:2: image 1 \(notes\.png\) is no image PIL can read \(cannot identify image file"),
    ({"question": "hi", "images": ["ok.png"]},
     r"t\.jsonl:2: the row has 1 image\(s\) in field 'images' but its prompt has no image placeholder; put one "
     r"`<image>` in the text, or one \{'type': 'image'\} chat content part, per image"),
    ({"question": chat(IMAGE, TEXT)},
     r"t\.jsonl:2: the prompt has 1 image placeholder\(s\) but the row has no images in field 'images'; set "
     r"data\.image_field to the field holding them"),
    ({"question": "<image>hi <image>", "images": ["ok.png"]},
     r"t\.jsonl:2: the prompt has 2 image placeholder\(s\) but field 'images' holds 1 image\(s\); they must agree"),
    ({"question": "<image>hi", "images": ["big.png"]},
     r"t\.jsonl:2: image 0 \(big\.png\) is 20x10 = 200 pixels, over data\.max_pixels=199; resize the images, or "
     r"raise data\.max_pixels"),
    ({"question": "<image>hi", "images": [3]},
     r"t\.jsonl:2: image 0 is a int; an image is a path \(relative to the data file's folder, or absolute\), a "
     r"data: URL, bytes"),
    ({"question": "<image>hi", "images": ["https://example.com/a.png"]},
     r"t\.jsonl:2: image 0 \(https://example\.com/a\.png\) is a URL; tandem downloads nothing"),
], ids=["missing", "unreadable", "no-placeholder", "no-images", "two-for-one", "over-max-pixels", "int", "url"])
def test_a_bad_image_row_is_named_by_its_line_and_image(tmp_path, row, message):
    picture(tmp_path / "data" / "ok.png")
    picture(tmp_path / "data" / "big.png", (20, 10))
    (tmp_path / "data" / "notes.png").write_text("version https://git-lfs.github.com/spec/v1\n")
    good = {"question": "<image>fine", "images": ["ok.png"]}  # the first row passes: the error is the second's
    path = write_jsonl(tmp_path / "data" / "t.jsonl", [dict(good, answer="1"), dict(row, answer="1")])
    with pytest.raises(DataError, match=message):
        task_rows(data(path=path, max_pixels=199))


def test_held_out_images_are_checked_too(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "1+1=", "answer": "2"}])
    held = write_jsonl(tmp_path / "held" / "test.jsonl", [{"question": "<image>?", "images": ["x.png"], "answer": "1"}])
    with pytest.raises(DataError, match=r"held/test\.jsonl:1: image 0 \(x\.png\): no such file \(.*/held/x\.png\)"):
        task_rows(data(path=train, eval_path=held))


def test_min_pixels_above_max_pixels_is_refused():
    with pytest.raises(ConfigError, match=r"data\.min_pixels: 300 is above data\.max_pixels: 200"):
        data(max_pixels=200, min_pixels=300)


def test_a_run_on_rows_with_images_is_refused_before_any_model_loads(tmp_path, tiny_model, monkeypatch):
    import tandem.modeling
    import tandem.rollout.hf.engine
    import tandem.train.policy
    from tandem.trainer import start_run

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model loaded before the rows with images were refused")

    for module in (tandem.modeling, tandem.rollout.hf.engine, tandem.train.policy):
        monkeypatch.setattr(module, "load_causal_lm", no_model)
    picture(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1=", "answer": "2"},
                                              {"question": "<image>dots?", "images": ["a.png"], "answer": "1"}])
    cfg = load_config(None, ["data.task=jsonl", f"data.path={path}", f"model.path={tiny_model}",
                             f"run.output_dir={tmp_path / 'run'}", "run.progress=false"])
    with pytest.raises(DataError, match=re.escape(
            f"t.jsonl:2: the row carries 1 image(s) (field 'images'), but model.path '{tiny_model}' is a text-only "
            f"model (its config.json has no vision_config): it would see only the placeholder text ('<image>'), never "
            f"the images. Point model.path at a vision-language model (one whose config.json has a vision_config: "
            f"Idefics3, SmolVLM, Qwen2.5-VL), or train on rows without images and placeholders")):
        start_run(cfg, claim_output_dir=False)  # `tandem eval`'s start; `tandem train` and `demo` start the same


def test_a_vision_language_model_is_named_as_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    rows = [{"question": "<image>", "_images": [Image("a.png", b"")], "_line": 3}]
    with pytest.raises(DataError, match=r"d\.jsonl:3: .*, but the prompts were read without the processor of "
                                        r"model\.path '.*', a vision-language model"):
        refuse_image_rows(rows, "d.jsonl", "images", str(tmp_path))
    with pytest.raises(DataError, match=r"d\.jsonl:3: .*, but the model is text-only: .*Point model\.path at a "
                                        r"vision-language model"):
        refuse_image_rows(rows, "d.jsonl", "images")


# -- one decoding for every consumer, and whole images at load ---------------------------------------------------


def encoded(image: PILImage.Image, fmt: str = "PNG", **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


def sideways(fmt: str = "PNG") -> bytes:
    """A 4x2 photo stored as the camera saw it, with EXIF orientation 6: shown turned 90 degrees clockwise (2x4),
    as `datasets`, transformers' loaders and image viewers show it."""
    image = PILImage.new("RGB", (4, 2), (255, 0, 0))
    image.putpixel((0, 0), (0, 0, 255))
    exif = PILImage.Exif()
    exif[274] = 6
    return encoded(image, fmt, exif=exif)


def transparent() -> bytes:
    """2x1 RGBA: a fully transparent red pixel, then an opaque blue one."""
    image = PILImage.new("RGBA", (2, 1))
    image.putdata([(255, 0, 0, 0), (0, 0, 255, 255)])
    return encoded(image)


def grey16(value: int = 40000) -> bytes:
    """A 16-bit greyscale PNG (mode I;16) of one shade: 40000 of 65535, which is 156 of 255 in its top 8 bits."""
    return encoded(PILImage.new("I;16", (3, 2), value))


def upright(data: bytes) -> PILImage.Image:
    """What `datasets` shows for a file: its EXIF orientation applied."""
    return ImageOps.exif_transpose(PILImage.open(io.BytesIO(data))).convert("RGB")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_an_exif_rotated_photo_is_decoded_upright_as_datasets_shows_it(fmt):
    data = sideways(fmt)
    image = Image("photo", data)
    assert image.size == (2, 4)  # the decoded size: the prompt's image tokens are counted on it
    decoded = image.load()
    assert (decoded.mode, decoded.size) == ("RGB", (2, 4))
    assert decoded.tobytes() == upright(data).tobytes()
    # nothing left for a consumer that applies EXIF again (vLLM does) to turn it once more
    assert decoded.getexif().get(274) is None and ImageOps.exif_transpose(decoded).size == (2, 4)


def test_transparency_is_composited_on_white_not_dropped_to_black():
    assert Image("a", transparent()).load().tobytes() == bytes([255, 255, 255, 0, 0, 255])
    la = PILImage.new("LA", (1, 1), (10, 0))  # transparent grey
    palette = PILImage.new("P", (2, 1), 0)
    palette.putpalette([9, 9, 9, 200, 0, 0] + [0, 0, 0] * 254)
    palette.putpixel((1, 0), 1)
    assert Image("la", encoded(la)).load().tobytes() == bytes([255, 255, 255])
    assert Image("p", encoded(palette, transparency=0)).load().tobytes() == bytes([255, 255, 255, 200, 0, 0])


def test_16_bit_greyscale_keeps_its_top_8_bits_not_clipped_to_white():
    assert set(Image("g", grey16(40000)).load().tobytes()) == {156}
    assert set(Image("g", grey16(65535)).load().tobytes()) == {255}
    assert set(Image("g", encoded(PILImage.new("I", (2, 2), 512), "TIFF")).load().tobytes()) == {2}  # mode I
    rows = [{"question": "<image>", "images": [PILImage.new("I", (2, 2), 40000)], "_row": 1}]  # decoded already
    attach_images(rows, "images", None, 100, "mem")
    assert set(rows[0]["_images"][0].load().tobytes()) == {156}


def test_cmyk_and_bilevel_images_decode_to_rgb():
    red = Image("c", encoded(PILImage.new("CMYK", (1, 1), (0, 255, 255, 0)), "JPEG")).load()
    assert red.mode == "RGB" and red.getpixel((0, 0))[0] > 200
    assert Image("b", encoded(PILImage.new("1", (1, 1), 1))).load().tobytes() == bytes([255, 255, 255])


def truncated_png() -> bytes:
    data = encoded(PILImage.effect_noise((32, 32), 60).convert("RGB"))  # noise: the cut lands in the pixels
    return data[: len(data) * 2 // 3]


def flipped_png() -> bytes:
    """A PNG with one byte of its pixel data (IDAT) flipped: its header is whole, its checksum wrong."""
    data = bytearray(encoded(PILImage.effect_noise((32, 32), 60).convert("RGB")))
    at = data.index(b"IDAT") + 4 + 20
    data[at] ^= 0xFF
    return bytes(data)


def eps() -> bytes:
    """An EPS file as PIL writes one (no Ghostscript needed to write; decoding it runs Ghostscript)."""
    return encoded(PILImage.new("RGB", (4, 3), (1, 2, 3)), "EPS")


@pytest.mark.parametrize("make, message", [
    (truncated_png, r"image 0 \(bad\.png\) is broken: .*[Tt]runcated.*; give a whole PNG, JPEG"),
    (flipped_png, r"image 0 \(bad\.png\) is broken: .*(checksum|CRC|crc|broken).*; give a whole PNG, JPEG"),
    (eps, r"image 0 \(bad\.png\) is EPS, which tandem does not read .*; allowed: .*JPEG.*PNG.*WEBP.*: convert it"),
], ids=["truncated-png", "flipped-byte", "eps"])
@pytest.mark.parametrize("first", [True, False], ids=["first-of-its-size", "after-a-good-one"])
def test_a_broken_image_is_refused_at_load_with_its_file_and_line(tmp_path, make, message, first):
    (tmp_path / "bad.png").write_bytes(make())
    picture(tmp_path / "ok.png", (32, 32))
    rows = [{"question": "<image>fine", "images": ["ok.png"], "answer": "1"}]
    bad = {"question": "<image>hi", "images": ["bad.png"], "answer": "1"}
    rows = [bad] + rows if first else rows + [bad]
    with pytest.raises(DataError, match=rf"t\.jsonl:{1 if first else 2}: {message}"):
        task_rows(data(path=write_jsonl(tmp_path / "t.jsonl", rows)))


def bomb() -> bytes:
    """A PNG header of 30000 x 30000 pixels (900 million) and no pixels: a decompression bomb's start."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_over_max_pixels_not_called_unreadable():
    rows = [{"question": "<image>", "images": [bomb()], "_line": 4}]
    with pytest.raises(DataError, match=r"mem:4: image 0 \(row \d+ image 0\) is over data\.max_pixels=12845056: "
                                        r".*900000000 pixels.*; resize the images"):
        attach_images(rows, "images", None, 12845056, "mem")


def test_a_data_url_image_is_read_as_an_inline_image(tmp_path):
    import base64

    png = picture(size=(5, 3))
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    (row,) = task_rows(data(path=write_jsonl(tmp_path / "t.jsonl", [
        {"question": chat(IMAGE, TEXT), "images": [url], "answer": "3"}]))).train
    (image,) = row["_images"]
    assert (image.name, image.data, image.size) == ("row 1 image 0", png, (5, 3))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "<image>", "images": ["data:image/png;base64,@@"],
                                                "answer": "3"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: image 0 is a data: URL whose base64 does not decode"):
        task_rows(data(path=bad))
