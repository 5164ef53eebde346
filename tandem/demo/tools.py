"""The tool demo's model (`examples/tools.yaml`): multiplication that needs the calculator, a tiny model warm-started
on an imperfect teacher's transcripts that call it only sometimes, so that GRPO has right calls to reinforce."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data import multiply
from tandem.demo.common import DemoShape, build_tokenizer, cached_model, log, masked_nll


@dataclass(frozen=True)
class ToolDemoSpec(DemoShape):
    """What the tool demo builds; any change gives a new cache folder."""

    warm_lr: float = 3e-3
    warm_batch: int = 32  # more, smaller steps: copying is learnt in steps, not in samples
    # The cold-start data come from an imperfect teacher that calls the calculator this often (and then copies its
    # result); otherwise it answers from its head with a wrong product of about the right length: the two factors
    # written side by side (`123*456=123456`). That slip is a copy, like the call, so one skill serves both and
    # the warm start is quick; its first digit is a sure token, so greedy decoding answers from the head (accuracy
    # ~0) while sampling at temperature 1 calls the tool about `tool_rate` of the time, right, for GRPO to reinforce.
    tool_rate: float = 0.3
    warm_target_agreement: float = 0.9  # stop once greedy answers are the teacher's (a right call or its slip)
    warm_target_copy: float = 0.95  # ... and forced calls end with the right answer this often
    warm_max_steps: int = 3000  # the learning rate decays linearly to 5% over these (it settles the copying)
    warm_eval_every: int = 100
    version: int = 1  # bump when the builder's code changes what it produces


def add_tool_tokens(tokenizer) -> None:
    """Make the tool tags single, ordinary (not special) tokens: each one encodes the same wherever it stands, and
    `decode(skip_special_tokens=True)` keeps them, so stop strings and rewards see them in the text."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in multiply.TAGS])


def head_answer(a: int, b: int) -> str:
    """The imperfect teacher's answer from its head: the factors side by side (about the product's length)."""
    return f"{a}{b}"


def tool_teacher(a: int, b: int, rng: random.Random, spec: ToolDemoSpec) -> str | None:
    """The teacher's head answer to a*b, or None when it calls the calculator instead (`spec.tool_rate`)."""
    return None if rng.random() < spec.tool_rate else head_answer(a, b)


def tool_transcript(tokenizer, a: int, b: int, guess: str | None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one teacher transcript, tokenized segment by segment exactly as the multi-turn
    loop builds it: question, the model's call, the appended observation (mask 0: never predicted), the answer."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    q = enc(multiply.question(a, b))
    if guess is None:
        call, obs = enc(multiply.tool_call(a, b)), enc(multiply.observation(multiply.answer(a, b)))
        ans = enc(multiply.answer(a, b)) + eos
        return q + call + obs + ans, [0] * len(q) + [1] * len(call) + [0] * len(obs) + [1] * len(ans)
    ans = enc(guess) + eos
    return q + ans, [0] * len(q) + [1] * len(ans)


def tool_rollouts(engine, tokenizer, questions: list[str], temperature: float, seed: int = 0,
                  first: str = "") -> list[str]:
    """Two-turn transcripts (after the question) the way the multi-turn loop makes them: generate until EOS or
    `</calc>`; after a call append the calculator's observation ids (encoded once) and generate the answer.
    `first` is text forced at the start of the model's turn (e.g. `<calc>` to measure the copying)."""
    from tandem.rollout.base import Sampling

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [enc(q) + enc(first) for q in questions]
    turn = Sampling(n=1, temperature=temperature, max_new_tokens=16, stop=(multiply.CALL_CLOSE,), seed=seed)
    outs = engine.generate(prompts, turn)
    texts = [first + c.text for c in outs]
    again, where = [], []
    for i, (p, c) in enumerate(zip(prompts, outs)):
        called = texts[i].find(multiply.CALL_OPEN)
        if c.finish_reason == "stop" and texts[i].endswith(multiply.CALL_CLOSE) and called >= 0:
            expr = texts[i][called + len(multiply.CALL_OPEN): -len(multiply.CALL_CLOSE)]
            obs = multiply.observation(multiply.calculate(expr))
            texts[i] += obs
            # completion_ids end with the `</calc>` token (one token, so nothing past the stop string is kept)
            again.append(p + c.completion_ids + enc(obs))
            where.append(i)
    if again:
        turn2 = Sampling(n=1, temperature=temperature, max_new_tokens=12, stop=(multiply.CALL_CLOSE,), seed=seed + 1)
        for i, c in zip(where, engine.generate(again, turn2)):
            texts[i] += c.text
    return texts


def tool_figures(model, tokenizer, rows: list[dict], temperature: float, seed: int = 0) -> dict:
    """Held-out accuracy, tool-call rate, agreement with the teacher (a right call or its head answer), and the
    accuracy of forced calls (the model's turn starts with `<calc>`: does it copy the question and the result)."""
    from tandem.rollout.hf import HFEngine

    engine = HFEngine("", model=model, tokenizer=tokenizer, seed=seed)
    questions = [r["question"] for r in rows]
    got = tool_rollouts(engine, tokenizer, questions, temperature, seed)
    forced = tool_rollouts(engine, tokenizer, questions, temperature, seed, first=multiply.CALL_OPEN)
    model.train()
    model.requires_grad_(True)
    n = len(rows)
    right = [multiply.exact(t, "", r) for t, r in zip(got, rows)]
    called = [multiply.tool_format(t, "", r) for t, r in zip(got, rows)]
    kind = [ok or t.strip() == head_answer(*map(int, r["question"][:-1].split("*")))
            for t, ok, r in zip(got, right, rows)]
    return {"accuracy": sum(right) / n, "tool_rate": sum(called) / n, "agreement": sum(kind) / n,
            "forced_call_accuracy": sum(multiply.exact(t, "", r) for t, r in zip(forced, rows)) / n}


def tool_warm_start(model, tokenizer, spec: ToolDemoSpec) -> tuple[dict, int]:
    """Supervised steps on the imperfect teacher's transcripts of train questions, until the model's greedy
    transcripts of held-out questions are the teacher's (a right call or its head answer) and forced calls mostly
    copy right (GRPO cannot reinforce a call that comes back with the wrong answer); returns (greedy figures,
    steps). The steps are the loop's own token sequences, so what the model learns is what the loop will feed it."""
    pairs = multiply.pairs()[0]
    held = multiply.rows("test")[:300]
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_lr)
    eos = tokenizer.eos_token_id
    figures: dict = {}
    step = 0
    model.train()
    while step < spec.warm_max_steps:
        seqs, masks = zip(*(tool_transcript(tokenizer, a, b, tool_teacher(a, b, rng, spec))
                            for a, b in rng.sample(pairs, spec.warm_batch)))
        loss = masked_nll(model, seqs, masks, eos)
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = spec.warm_lr * max(0.05, 1 - step / spec.warm_max_steps)
        opt.step()
        step += 1
        if step % spec.warm_eval_every == 0:
            figures = tool_figures(model, tokenizer, held, 0.0)
            log.info("tool warm start step %d: loss %.3f, held-out greedy accuracy %.1f%%, tool calls %.1f%%, "
                     "teacher agreement %.1f%%, forced-call accuracy %.1f%%", step, loss.item(),
                     100 * figures["accuracy"], 100 * figures["tool_rate"], 100 * figures["agreement"],
                     100 * figures["forced_call_accuracy"])
            if (figures["agreement"] >= spec.warm_target_agreement
                    and figures["forced_call_accuracy"] >= spec.warm_target_copy):
                break
    return figures, step


def tool_demo_model(spec: ToolDemoSpec = ToolDemoSpec(), root: Path | None = None) -> Path:
    """Path of the warm-started tool demo model folder, built on first use (~5 minutes on one thread) and cached."""
    def build():
        tokenizer = build_tokenizer(multiply.corpus(), spec.vocab_size)
        add_tool_tokens(tokenizer)
        model = spec.build(tokenizer)
        greedy, steps = tool_warm_start(model, tokenizer, spec)
        sampled = tool_figures(model, tokenizer, multiply.rows("test")[:300], 1.0, seed=spec.seed)
        return model, tokenizer, {"greedy": greedy, "temperature_1": sampled, "warm_start_steps": steps}

    return cached_model("tooldemo", spec, build, root, lambda f: (
        f"{f['warm_start_steps']} steps: greedy accuracy {100 * f['greedy']['accuracy']:.1f}%, tool calls "
        f"{100 * f['greedy']['tool_rate']:.1f}%; "
        f"at temperature 1 accuracy {100 * f['temperature_1']['accuracy']:.1f}%, "
        f"tool calls {100 * f['temperature_1']['tool_rate']:.1f}%"))
