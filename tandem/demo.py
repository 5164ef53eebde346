"""Builds the demo's own model (no downloads): a tiny tokenizer and Qwen2, warm-started on the arithmetic task, cached."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.data import arithmetic

log = logging.getLogger("tandem.demo")

EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass(frozen=True)
class DemoModelSpec:
    """What the demo builds; any change gives a new cache folder."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 300
    seed: int = 0
    warm_lr: float = 1e-3
    warm_batch: int = 64
    # The cold-start data come from an imperfect teacher that forgets to carry this often (questions without a
    # carry are always right). The warm start learns to imitate it, so it can carry but mostly does not: its
    # greedy accuracy is low while a correct answer is often among its samples, which GRPO then reinforces.
    teacher_carry_error: float = 0.6
    warm_target_agreement: float = 0.95  # stop once greedy answers are the teacher's (right or carry-less)
    warm_max_steps: int = 3000
    version: int = 2  # bump when the builder's code changes what it produces


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained on `texts`, digits always single tokens, saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def build_model(spec: DemoModelSpec, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(cfg)


def greedy_answers(model, tokenizer, rows: list[dict]) -> list[str]:
    from tandem.rollout.base import Sampling
    from tandem.rollout.hf import HFEngine

    engine = HFEngine("", model=model, tokenizer=tokenizer)
    prompts = [tokenizer.encode(r["question"]) for r in rows]
    outs = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=6))
    model.train()
    model.requires_grad_(True)
    return [c.text.strip() for c in outs]


def teacher_answer(a: int, b: int, rng: random.Random, carry_error: float) -> str:
    return arithmetic.carryless(a, b) if rng.random() < carry_error else arithmetic.answer(a, b)


def warm_start(model, tokenizer, spec: DemoModelSpec) -> tuple[float, float, int]:
    """Supervised steps on the imperfect teacher's answers to train questions, until the model's greedy answers on
    held-out questions are the teacher's (correct or carry-less); returns (accuracy, agreement, steps)."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in arithmetic.rows("train")]
    held = arithmetic.rows("test")[:300]
    held_pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in held]
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_lr)
    eos = tokenizer.eos_token_id
    acc = agree = 0.0
    step = 0
    model.train()
    while step < spec.warm_max_steps:
        seqs, masks = [], []
        for a, b in rng.sample(pairs, spec.warm_batch):
            q = tokenizer.encode(arithmetic.question(a, b))
            ans = tokenizer.encode(teacher_answer(a, b, rng, spec.teacher_carry_error)) + [eos]
            seqs.append(q + ans)
            masks.append([0] * len(q) + [1] * len(ans))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [eos] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0:
            got = greedy_answers(model, tokenizer, held)
            acc = sum(g == r["answer"] for g, r in zip(got, held)) / len(held)
            agree = sum(g in (arithmetic.answer(a, b), arithmetic.carryless(a, b))
                        for g, (a, b) in zip(got, held_pairs)) / len(held)
            log.info("warm start step %d: loss %.3f, held-out greedy accuracy %.1f%%, teacher agreement %.1f%%",
                     step, loss.item(), 100 * acc, 100 * agree)
            if agree >= spec.warm_target_agreement:
                break
    return acc, agree, step


def demo_model(spec: DemoModelSpec = DemoModelSpec(), root: Path | None = None) -> Path:
    """Path of the warm-started demo model folder, built on first use (about a minute) and cached."""
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root()
    final = root / f"demo-{key}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".demo-{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the warm start's figures depend on it; one thread is also fastest here
    try:
        tokenizer = build_tokenizer(arithmetic.corpus(), spec.vocab_size)
        model = build_model(spec, tokenizer)
        acc, agree, steps = warm_start(model, tokenizer, spec)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "tandem_demo.json").write_text(json.dumps(
        {"spec": asdict(spec), "warm_start_accuracy": acc, "teacher_agreement": agree, "warm_start_steps": steps,
         "seconds": round(time.perf_counter() - start, 1)}, indent=2))
    try:
        os.rename(tmp, final)  # atomic: a concurrent builder that finished first wins, ours is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("demo model ready at %s (warm start %.1f%% in %d steps)", final, 100 * acc, steps)
    return final
