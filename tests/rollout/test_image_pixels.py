"""Every engine samples on the pixels the trainer trains on: vLLM in process is handed the images decoded as the
trainer's processor takes them (EXIF orientation applied, transparency on white, 16-bit greyscale in its top 8
bits), and a vLLM server is sent those pixels (a lossless PNG of them), never the original file to decode its own
way. No engine runs here: the inputs each engine is given are checked."""
from __future__ import annotations

import base64
import io
import sys
import types

from PIL import Image as PILImage

from data.test_images import grey16, sideways, transparent, upright
from tandem.data.images import Image
from tandem.rollout.base import Sampling
from tandem.samples import Images, ModelPrompt

FILES = {"sideways.jpg": sideways("JPEG"), "sideways.png": sideways("PNG"), "transparent.png": transparent(),
         "grey16.png": grey16()}


def _images() -> Images:
    return Images("key", tuple(FILES), {}, tuple(FILES.values()), engine_ids=(7, 1, 1, 1, 1))


def _expected() -> list[PILImage.Image]:
    """The pixels every consumer must see, made here without tandem: the photos as `datasets` shows them (EXIF
    orientation applied), the transparent pixel white, the 16-bit shade (40000 of 65535) as its top 8 bits."""
    shown = PILImage.new("RGB", (2, 1), (255, 255, 255))
    shown.putpixel((1, 0), (0, 0, 255))
    return [upright(FILES["sideways.jpg"]), upright(FILES["sideways.png"]), shown,
            PILImage.new("RGB", (3, 2), (156, 156, 156))]


def _trainers() -> list[PILImage.Image]:
    """The pixels the trainer's processor is given (`VisionPrompts.encode`)."""
    return [Image(name, data).load() for name, data in FILES.items()]


def _same(ours: list[PILImage.Image], theirs: list[PILImage.Image]) -> None:
    assert [(im.mode, im.size) for im in ours] == [(im.mode, im.size) for im in theirs]
    assert [im.tobytes() for im in ours] == [im.tobytes() for im in theirs]


def test_the_trainer_sees_each_file_upright_on_white_and_16_bit_scaled():
    _same(_trainers(), _expected())


def test_a_server_engine_is_sent_the_trainers_pixels_not_the_file():
    from tandem.rollout.vllm.server import VLLMServerEngine

    engine = object.__new__(VLLMServerEngine)  # no server: the request body alone
    engine.model_name = "m"
    body = engine.generate_body(ModelPrompt([7, 9, 9], _images()), Sampling(), 2, 0, 8)
    assert body["token_ids"] == [7, 1, 1, 1, 1]
    sent = []
    for part in body["content_parts"]:
        head, _, payload = part["url"].partition(",")
        assert head == "data:image/png;base64"  # lossless: every decoder reads these pixels alike
        image = PILImage.open(io.BytesIO(base64.b64decode(payload)))
        assert image.mode == "RGB" and image.getexif().get(274) is None and "transparency" not in image.info
        sent.append(image.convert("RGB"))
    _same(sent, _expected())


def test_the_in_process_engine_is_given_the_trainers_pixels(monkeypatch):
    from tandem.rollout.vllm.engine import vllm_input

    inputs = types.ModuleType("vllm.inputs")  # vLLM's TokensPrompt is a dict; importing vLLM here would alter us
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    prompt = vllm_input(ModelPrompt([7, 9, 9], _images()))
    assert prompt["prompt_token_ids"] == [7, 1, 1, 1, 1]
    _same(prompt["multi_modal_data"]["image"], _expected())
