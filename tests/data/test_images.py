"""Rows with images: the conventions users bring read and checked (paths, bytes, Image features; placeholders; the
pixel limit), and a run with them refused before any model loads while tandem trains text-only models."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image as PILImage

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
     r"t\.jsonl:2: image 0 is a int; an image is a path \(relative to the data file's folder, or absolute\), bytes"),
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
    import tandem.rollout.hf
    import tandem.train.policy
    from tandem.trainer import start_run

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model loaded before the rows with images were refused")

    for module in (tandem.modeling, tandem.rollout.hf, tandem.train.policy):
        monkeypatch.setattr(module, "load_causal_lm", no_model)
    picture(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1=", "answer": "2"},
                                              {"question": "<image>dots?", "images": ["a.png"], "answer": "1"}])
    cfg = load_config(None, ["data.task=jsonl", f"data.path={path}", f"model.path={tiny_model}",
                             f"run.output_dir={tmp_path / 'run'}", "run.progress=false"])
    with pytest.raises(DataError, match=re.escape(
            f"t.jsonl:2: the row carries 1 image(s) (field 'images'), but tandem's vision-language support is not "
            f"built yet (issue 47): a text-only model would see only the placeholder text ('<image>'), never the "
            f"images; model.path '{tiny_model}' is such a text-only model (its config.json has no vision_config)")):
        start_run(cfg, claim_output_dir=False)  # `tandem eval`'s start; `tandem train` and `demo` start the same


def test_a_vision_language_model_is_named_as_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    rows = [{"question": "<image>", "_images": [Image("a.png", b"")], "_line": 3}]
    with pytest.raises(DataError, match=r"d\.jsonl:3: .*issue 47.*; model\.path '.*' is a vision-language model"):
        refuse_image_rows(rows, "d.jsonl", "images", str(tmp_path))
