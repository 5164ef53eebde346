"""The vision demo's task (tandem.data.colors): its pictures, split, reward and placeholders, and the demo model it
names (`demo:vision`: a tiny Idefics3 whose processor and weights load back through the Auto classes)."""
from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tandem.data import colors
from tandem.data.images import attach_images
from tandem.data.rows import DataError
from tandem.rewards import REWARDS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def held() -> list[dict]:
    return colors.rows("test")


def test_split_is_fixed_and_each_colour_equally_often(held):
    assert held == colors.rows("test")
    assert len(held) == colors.TEST_SIZE and Counter(r["answer"] for r in held) == {c: 50 for c in colors.COLOURS}
    assert Counter(r["answer"] for r in colors.rows("test", seed=7, holdout=12)) == {c: 2 for c in colors.COLOURS}
    assert colors.rows("test", seed=7, holdout=12) != colors.rows("test", holdout=12)  # the seed draws the pictures
    with pytest.raises(ValueError, match="unknown split 'validation'"):
        colors.rows("validation")


def test_the_answer_is_in_the_picture_not_in_the_text(held):
    """Every question is the same text, so a model that does not see the picture is at 1/6; the picture holds a
    shape nearest the answer's colour (more of its pixels near that colour than near any other)."""
    from tandem.demo import VisionDemoSpec

    assert {r["question"] for r in held} == {"<image>Colour:"}
    palette = np.array(list(colors.COLOURS.values()), dtype=np.float32)
    for row in held:
        image = Image.open(io.BytesIO(row["images"][0]))
        assert image.format == "PNG" and image.mode == "RGB"
        assert image.size == (VisionDemoSpec().image_size,) * 2 == (colors.SIZE, colors.SIZE)
        pixels = np.asarray(image, dtype=np.float32).reshape(-1, 1, 3)
        near = (np.linalg.norm(pixels - palette, axis=2) < 60).sum(0)
        assert list(colors.COLOURS)[near.argmax()] == row["answer"] and near.max() >= 100, (row["answer"], near)


def test_each_picture_matches_its_placeholder(held):
    rows = [dict(r) for r in held]
    attach_images(rows, "images", None, colors.SIZE * colors.SIZE, "colors")
    assert all(len(r["_images"]) == 1 for r in rows)
    with pytest.raises(DataError, match="colors:1: the prompt has 2 image placeholder"):
        attach_images([dict(held[0], question="<image>" + held[0]["question"])], "images", None, 10 ** 6, "colors")


def test_exact_reward():
    exact = REWARDS["colors_exact"]
    row = {"answer": "red"}
    assert exact.inline and exact.fn(" red\n", "", row) == 1.0
    assert exact.fn("orange", "", row) == 0.0 and exact.fn("red.", "", row) == 0.0 and exact.fn("", "", row) == 0.0


def test_demo_vision_names_the_vision_demo_model(monkeypatch):
    import tandem.demo as demo
    from tandem.cli import _demo_model
    from tandem.config import load_config
    from tandem.demo import catalog  # where demo_model finds the vision demo's builder

    built = []
    monkeypatch.setattr(catalog, "vision_demo_model", lambda spec, root=None: built.append(spec) or Path("v"))
    assert _demo_model(load_config(EXAMPLES / "vision.yaml", [], demo.DEMO_DEFAULTS)) == Path("v")
    assert built == [demo.VisionDemoSpec()]


def test_the_demo_processor_and_model_load_back(tmp_path, held):
    """One picture is 4 `<image>` tokens between Idefics3's markers, nothing added (a 9-token prompt); the processor
    and an untrained model saved as the demo saves them load back through AutoProcessor and
    AutoModelForImageTextToText and give the same inputs and logits, and the supervised loss reads the answer."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import tandem.demo as demo

    spec = demo.VisionDemoSpec()
    tokenizer = demo.build_vision_tokenizer(spec)
    processor = demo.build_vision_processor(spec, tokenizer)
    inputs = demo.vision_inputs(processor, held[:2])
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    assert tokens[:7] == ["<fake_token_around_image>", "<global-img>"] + ["<image>"] * 4 + ["<fake_token_around_image>"]
    assert tokenizer.decode(inputs["input_ids"][0][7:]) == "Colour:"
    assert inputs["pixel_values"].shape == (2, 1, 3, colors.SIZE, colors.SIZE)
    model = demo.build_vision_model(spec, tokenizer)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, again = AutoModelForImageTextToText.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)
    reread = demo.vision_inputs(again, held[:2])
    assert all(torch.equal(inputs[k], reread[k]) for k in inputs)
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, loaded(**reread).logits)
        loss = demo.answer_step(model, processor, inputs, held[:2])
        answers = torch.tensor([tokenizer.encode(r["answer"]) + [tokenizer.eos_token_id] for r in held[:2]])
        assert answers.shape == (2, 2)  # each colour one token
        whole = torch.cat([inputs["input_ids"], answers], 1)
        logits = model(**dict(inputs, input_ids=whole, attention_mask=torch.ones_like(whole))).logits
    # the loss is the answer's and EOS's alone, each predicted from the token before it
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(logits[:, -3:-1].reshape(-1, logits.shape[-1]),
                                                                 answers.reshape(-1)))
    assert len(demo.vision_greedy_answers(model, processor, inputs)) == 2
