"""The arithmetic demo's model (`tandem demo`): a tiny model warm-started on an imperfect teacher's sums, so that its
greedy accuracy is low while a right answer is often among its samples, which GRPO then reinforces."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from tandem.data import arithmetic
from tandem.demo.common import DemoShape, build_tokenizer, cached_model, log, masked_nll


@dataclass(frozen=True)
class DemoModelSpec(DemoShape):
    """What the demo builds; any change gives a new cache folder, `<folder>-<hash of the fields>` (`folder` is the
    class's own, not a field)."""

    folder: ClassVar[str] = "demo"
    warm_lr: float = 1e-3
    warm_batch: int = 64
    # The cold-start data come from an imperfect teacher that forgets to carry this often (questions without a
    # carry are always right). The warm start learns to imitate it, so it can carry but mostly does not: its
    # greedy accuracy is low while a correct answer is often among its samples, which GRPO then reinforces.
    teacher_carry_error: float = 0.6
    warm_target_agreement: float = 0.95  # stop once greedy answers are the teacher's (right or carry-less)
    # ... and its samples at temperature 1 (GRPO's) are the teacher's this often (0 = not asked). Greedy agreement
    # alone stops at the first check that crosses its target, and PyTorch's CPU kernels (AVX2 or AVX-512, chosen by
    # the processor) round differently enough to move that check by hundreds of steps, to a model whose samples are
    # noise half the time, which GRPO then cannot lift to ~1. Sampled agreement rises steadily instead (the steps
    # and figures: docs/design-notes.md, "Why the warm start reads samples too"; bench/bench_presets.py --demo).
    warm_target_sampled_agreement: float = 0.9
    warm_max_steps: int = 3000
    version: int = 3  # bump when the builder's code changes what it produces


# The demo's recipe over the config defaults (which already pick the arithmetic task): `tandem demo --config` and
# command-line overrides go on top.
DEMO_DEFAULTS = [
    "run.name=demo", "run.output_dir=runs/demo", "run.steps=120", "run.eval_every=20", "run.save_every=40",
    "batch.prompts_per_step=32", "batch.group_size=8", "rollout.max_new_tokens=6", "data.max_prompt_tokens=16",
    "batch.micro_batch_tokens=4096", "optim.lr=2e-4", "data.eval_size=500",
]


def greedy_answers(model, tokenizer, rows: list[dict]) -> list[str]:
    return [a[0] for a in sampled_answers(model, tokenizer, rows, n=1, temperature=0.0)]


def sampled_answers(model, tokenizer, rows: list[dict], n: int, temperature: float = 1.0,
                    seed: int = 0) -> list[list[str]]:
    """`n` answers to each row's question (seeded), as the embedded engine samples them."""
    from tandem.rollout.base import Sampling
    from tandem.rollout.hf import HFEngine

    engine = HFEngine("", model=model, tokenizer=tokenizer, seed=seed)
    prompts = [tokenizer.encode(r["question"]) for r in rows]
    outs = engine.generate(prompts, Sampling(n=n, temperature=temperature, max_new_tokens=6, seed=seed))
    model.train()
    model.requires_grad_(True)
    return [[c.text.strip() for c in outs[i * n:(i + 1) * n]] for i in range(len(rows))]


def teacher_answer(a: int, b: int, rng: random.Random, carry_error: float) -> str:
    return arithmetic.carryless(a, b) if rng.random() < carry_error else arithmetic.answer(a, b)


def supervised_step(model, tokenizer, opt: torch.optim.Optimizer, batch: list[tuple[int, int]],
                    completion: Callable[[int, int], str]) -> torch.Tensor:
    """One supervised step on `completion(a, b)` (then EOS) after each question of `batch`, the questions masked out
    of the loss: the warm starts' step (this demo's and those built on its task). Returns the loss."""
    eos = tokenizer.eos_token_id
    seqs, masks = [], []
    for a, b in batch:
        q = tokenizer.encode(arithmetic.question(a, b))
        out = tokenizer.encode(completion(a, b)) + [eos]
        seqs.append(q + out)
        masks.append([0] * len(q) + [1] * len(out))
    loss = masked_nll(model, seqs, masks, eos)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def warm_start(model, tokenizer, spec: DemoModelSpec) -> tuple[float, float, float | None, int]:
    """Supervised steps on the imperfect teacher's answers to train questions, until the model's greedy answers on
    held-out questions are the teacher's (correct or carry-less), and where the spec asks, its samples at temperature
    1 too (4 per question); returns (accuracy, agreement, sampled agreement or None where not asked, steps)."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in arithmetic.rows("train")]
    held = arithmetic.rows("test")[:300]
    held_pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in held]
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_lr)
    acc = agree = 0.0
    sampled = None
    step = 0
    model.train()
    while step < spec.warm_max_steps:
        loss = supervised_step(model, tokenizer, opt, rng.sample(pairs, spec.warm_batch),
                               lambda a, b: teacher_answer(a, b, rng, spec.teacher_carry_error))
        step += 1
        if step % 25 == 0:
            got = greedy_answers(model, tokenizer, held)
            acc = sum(g == r["answer"] for g, r in zip(got, held)) / len(held)
            agree = sum(g in (arithmetic.answer(a, b), arithmetic.carryless(a, b))
                        for g, (a, b) in zip(got, held_pairs)) / len(held)
            log.info("warm start step %d: loss %.3f, held-out greedy accuracy %.1f%%, teacher agreement %.1f%%",
                     step, loss.item(), 100 * acc, 100 * agree)
            if agree >= spec.warm_target_agreement and spec.warm_target_sampled_agreement:
                sampled = sampled_agreement(model, tokenizer, held, held_pairs, spec)
            if agree >= spec.warm_target_agreement and (sampled or 0.0) >= spec.warm_target_sampled_agreement:
                break
    return acc, agree, sampled, step


def sampled_agreement(model, tokenizer, held: list[dict], held_pairs: list[tuple[int, int]],
                      spec: DemoModelSpec, n: int = 4) -> float:
    """The share of the model's samples at temperature 1 (`n` per held-out question) that are the teacher's answers
    (correct or carry-less): GRPO learns from samples, so these must be the teacher's, not noise."""
    got = sampled_answers(model, tokenizer, held, n=n, seed=spec.seed)
    agree = sum(g in (arithmetic.answer(a, b), arithmetic.carryless(a, b))
                for answers, (a, b) in zip(got, held_pairs) for g in answers) / (n * len(held))
    log.info("warm start: sampled teacher agreement %.1f%%", 100 * agree)
    return agree


def arithmetic_model(spec: DemoModelSpec = DemoModelSpec(), root: Path | None = None) -> Path:
    """Path of the folder of the model `spec` describes (the dense one, or another architecture's), warm-started,
    built on first use (about a minute) and cached."""
    def build():
        tokenizer = build_tokenizer(arithmetic.corpus(), spec.vocab_size)
        model = spec.build(tokenizer)
        acc, agree, sampled, steps = warm_start(model, tokenizer, spec)
        figures = {"warm_start_accuracy": acc, "teacher_agreement": agree, "warm_start_steps": steps}
        return model, tokenizer, figures | ({} if sampled is None else {"sampled_teacher_agreement": sampled})

    return cached_model(spec.folder, spec, build, root, lambda f: f"warm start {100 * f['warm_start_accuracy']:.1f}% "
                                                                  f"in {f['warm_start_steps']} steps")
