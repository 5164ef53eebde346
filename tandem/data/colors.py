"""The built-in visual task `colors`: name the colour of the one shape in a small picture rendered here (PIL).

Each row is one 64x64 RGB picture (PNG bytes): a filled circle, square or triangle of random size and place, in one of
six colours (each shade jittered), on a light or dark background, with pixel noise over the whole frame. The question
is the same text in every row, `<image>Colour:`, so the answer depends on the image alone: a model that does not see
it answers every row alike and scores 1/6 on the balanced held-out split. The answer is the colour's name (`red`),
then EOS.
"""
from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image, ImageDraw

from tandem.data.images import IMAGE_TOKEN
from tandem.rewards.base import register_reward

COLOURS = {  # name -> RGB, far enough apart that a jitter of +-JITTER keeps each nearest to its own
    "red": (215, 40, 40),
    "green": (40, 170, 60),
    "blue": (45, 80, 220),
    "yellow": (230, 215, 40),
    "purple": (140, 55, 180),
    "orange": (240, 135, 30),
}
SHAPES = ("circle", "square", "triangle")
SIZE = 64  # pixels a side: the demo model's vision tower reads 64x64 (4x4 patches of 16)
JITTER = 20  # each channel of the shape's colour moves by up to this
NOISE = 12.0  # standard deviation of the per-pixel noise (0-255 scale)
TRAIN_SIZE, TEST_SIZE = 3000, 300  # multiples of 6: every colour is drawn equally often in each split
QUESTION = f"{IMAGE_TOKEN}Colour:"


def picture(colour: str, rng: random.Random, noise: np.random.Generator) -> bytes:
    """A SIZE x SIZE picture of one shape in `colour` (jittered), of random kind, size and place, on a light or dark
    background, with noise; PNG bytes."""
    light = rng.random() < 0.5
    level = rng.randint(195, 240) if light else rng.randint(15, 60)
    background = tuple(level + rng.randint(-12, 12) for _ in range(3))  # a grey, slightly tinted
    fill = tuple(min(255, max(0, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[colour])
    side = rng.randint(SIZE // 4, SIZE * 5 // 8)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    image = Image.new("RGB", (SIZE, SIZE), background)
    draw = ImageDraw.Draw(image)
    shape = rng.choice(SHAPES)
    if shape == "circle":
        draw.ellipse((x, y, x + side - 1, y + side - 1), fill=fill)
    elif shape == "square":
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=fill)
    else:
        draw.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    pixels = np.asarray(image, dtype=np.float32) + noise.normal(0.0, NOISE, (SIZE, SIZE, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def rows(split: str, seed: int = 1234, holdout: int = TEST_SIZE) -> list[dict]:
    """The fixed train (TRAIN_SIZE) or held-out `test` (`holdout`) rows, each colour equally often (up to one row)
    in a shuffled order: {"question": "<image>Colour:", "answer": "red", "images": [png_bytes]}. Picture i of a
    split is drawn from its own seed, so a split's rows do not depend on the other's size."""
    if split not in ("train", "test"):
        raise ValueError(f"colors.rows: unknown split {split!r}; use 'train' or 'test'")
    count = holdout if split == "test" else TRAIN_SIZE
    names = list(COLOURS)
    colours = [names[i % len(names)] for i in range(count)]
    random.Random(f"{seed}-{split}-order").shuffle(colours)
    out = []
    for i, colour in enumerate(colours):
        rng = random.Random(f"{seed}-{split}-{i}")
        noise = np.random.default_rng([seed, split == "test", i])
        out.append({"question": QUESTION, "answer": colour, "images": [picture(colour, rng, noise)]})
    return out


def corpus() -> list[str]:
    """Text the demo tokenizer is trained on: the question without its placeholder, and each answer."""
    return [QUESTION.replace(IMAGE_TOKEN, "") + name for name in COLOURS] * 20 + list(COLOURS) * 20


@register_reward("colors_exact", inline=True)
def exact(completion: str, prompt: str, row, **_) -> float:
    """1 if the completion is exactly the colour's name (surrounding whitespace ignored), else 0."""
    return float(completion.strip() == str(row["answer"]).strip())
