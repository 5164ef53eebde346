"""The long-tail demo's model (`tandem demo --config examples/long_tail.yaml`): the dense demo's warm-started model,
warm-started further on the same imperfect teacher's sums each followed by a countdown of long-tailed length
(tandem.data.long_tail), so its samples run from a handful to about two hundred tokens while GRPO reinforces their
right answers. Starting from the dense demo's model spares relearning the sums: the countdown's tokens, most of each
completion, would otherwise dilute the answer's share of the warm start's loss."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch

from tandem.data import arithmetic, long_tail
from tandem.modeling import load_causal_lm, load_tokenizer
from tandem.demo.arithmetic import DemoModelSpec, arithmetic_model, supervised_step, teacher_answer
from tandem.demo.common import DemoShape, cached_model, log


@dataclass(frozen=True)
class LongTailSpec(DemoModelSpec):
    """The dense demo's model (of this shape and seed) warm-started further, the teacher counting down
    after each answer from n: lognormal around `count_median` (sigma `count_sigma` of its log), clipped to
    [1, `count_max`]."""

    folder: ClassVar[str] = "long_tail"
    max_positions: ClassVar[int] = 256  # the prompt, the answer and the longest countdown (~175 tokens), with room
    count_median: float = 4.0
    count_sigma: float = 1.1
    count_max: int = 60
    new_tokens: int = 224  # what the warm start's checks sample (examples/long_tail.yaml's rollout.max_new_tokens)
    # its samples settle near 80% the teacher's after a few hundred steps, short of the dense demo's 0.9: still the
    # teacher's four times in five, which GRPO lifts
    warm_target_sampled_agreement: float = 0.8
    version: int = 1  # of this builder (the dense model it starts from has its own)

    def count(self, rng: random.Random) -> int:
        """The n a teacher's countdown starts from."""
        return min(self.count_max, max(1, round(rng.lognormvariate(math.log(self.count_median), self.count_sigma))))


def answers(model, tokenizer, rows: list[dict], spec: LongTailSpec, n: int, temperature: float) -> list[list[str]]:
    """`n` completions' answers (`long_tail.given_answer`, "" where none) to each row's question, seeded."""
    from tandem.rollout.base import Sampling
    from tandem.rollout.hf import HFEngine

    engine = HFEngine("", model=model, tokenizer=tokenizer, seed=spec.seed)
    outs = engine.generate([tokenizer.encode(r["question"]) for r in rows],
                           Sampling(n=n, temperature=temperature, max_new_tokens=spec.new_tokens, seed=spec.seed))
    model.train()
    model.requires_grad_(True)
    return [[long_tail.given_answer(c.text) or "" for c in outs[i * n:(i + 1) * n]] for i in range(len(rows))]


def agreement(got: list[list[str]], held: list[dict]) -> float:
    """The share of answers `got` (`answers`' to the rows `held`) that are the teacher's (right, or carry-less)."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in held]
    return sum(g in (arithmetic.answer(a, b), arithmetic.carryless(a, b))
               for row, (a, b) in zip(got, pairs) for g in row) / sum(map(len, got))


def warm_start(model, tokenizer, spec: LongTailSpec) -> tuple[float, float, int]:
    """Supervised steps on the teacher's completions until the model's greedy answers to held-out questions are the
    teacher's and so are its samples at temperature 1 (the arithmetic demo's two targets); returns (greedy accuracy,
    sampled agreement, steps)."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in arithmetic.rows("train")]
    held = arithmetic.rows("test")[:200]
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_lr)
    acc = sampled = 0.0
    step = 0
    model.train()
    while step < spec.warm_max_steps:
        loss = supervised_step(model, tokenizer, opt, rng.sample(pairs, spec.warm_batch), lambda a, b: (
            long_tail.completion(teacher_answer(a, b, rng, spec.teacher_carry_error), spec.count(rng))))
        step += 1
        if step % 25 == 0:
            got = answers(model, tokenizer, held, spec, 1, 0.0)
            acc = sum(g[0] == r["answer"] for g, r in zip(got, held)) / len(held)
            agree = agreement(got, held)
            log.info("long-tail warm start step %d: loss %.3f, held-out greedy accuracy %.1f%%, teacher agreement "
                     "%.1f%%", step, loss.item(), 100 * acc, 100 * agree)
            if agree >= spec.warm_target_agreement:
                sampled = agreement(answers(model, tokenizer, held, spec, 4, 1.0), held)
                log.info("long-tail warm start: sampled teacher agreement %.1f%%", 100 * sampled)
                if sampled >= spec.warm_target_sampled_agreement:
                    break
    return acc, sampled, step


def long_tail_model(spec: LongTailSpec = LongTailSpec(), root: Path | None = None) -> Path:
    """Path of the long-tail demo's model folder, warm-started, built on first use and cached."""
    def build():
        # the dense demo's model of this shape and seed, warm-started as the dense demo's is (its byte-level BPE
        # encodes `;` and spaces too); the warm-start fields of `spec` are this builder's own
        base = arithmetic_model(DemoModelSpec(**{f.name: getattr(spec, f.name) for f in fields(DemoShape)}))
        tokenizer, model = load_tokenizer(base), load_causal_lm(base)
        model.config.max_position_embeddings = spec.max_positions
        acc, sampled, steps = warm_start(model, tokenizer, spec)
        return model, tokenizer, {"warm_start_accuracy": acc, "sampled_teacher_agreement": sampled,
                                  "warm_start_steps": steps}

    return cached_model(spec.folder, spec, build, root, lambda f: f"warm start {100 * f['warm_start_accuracy']:.1f}% "
                                                                  f"in {f['warm_start_steps']} steps")
