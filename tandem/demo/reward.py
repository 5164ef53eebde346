"""The demo's reward model (`examples/reward_model.yaml`): a tiny sequence classifier that scores arithmetic answers,
trained to rank each right answer above a wrong one."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data import arithmetic
from tandem.demo.common import DemoShape, build_tokenizer, cached_model, log


@dataclass(frozen=True)
class RewardModelSpec(DemoShape):
    """The demo's reward model (`examples/reward_model.yaml`, `rewards: [{name: model, path: demo:reward_model}]`):
    the demo's tiny Qwen2 shape with a one-output sequence-classification head (Qwen2ForSequenceClassification, the
    embedding tied to an LM head it is also trained with), and a tokenizer built as the demo's. It reads
    `question + answer + EOS` (no chat template: tandem.train.reward_model) and is trained (`reward_model_loss`) on
    train questions, each right answer against one wrong answer (`wrong_answer`, drawn by WRONG_KINDS: mostly the
    carry-less sum, as the warm-started policy errs, then one digit changed, a digit more or less, any number), with
    the pairwise Bradley-Terry loss -log sigmoid(r(right) - r(wrong)) plus the next-token loss of the right answers'
    digits (a dense signal: one score per text alone learns slowly). It stops once it ranks the held-out questions'
    (right, wrong) pairs right `target_accuracy` of the time, checked every `eval_every` steps.
    Ranking one wrong answer is not ranking every near miss (`ranks_first`): GRPO on its score alone finds the units
    digits it overrates, which examples/reward_model.yaml's KL to the warm start holds."""

    lr: float = 1e-3
    batch: int = 64
    target_accuracy: float = 0.96
    eval_every: int = 100
    max_steps: int = 3000
    version: int = 1  # bump when the builder's code changes what it produces

    def build(self, tokenizer):
        """The untrained classifier of this shape for `tokenizer`: one output, read at the last token."""
        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        cfg = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=128, num_labels=1,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        )
        torch.manual_seed(self.seed)
        return Qwen2ForSequenceClassification(cfg)


# The wrong answers the reward model learns to rank below the right one, and how often each kind is drawn: as a policy
# warm-started on the carry-less teacher errs, mostly by not carrying, then by a digit, a length or anything.
WRONG_KINDS = {"carryless": 0.5, "one_digit": 0.2, "length": 0.15, "other": 0.15}


def wrong_answer(a: int, b: int, rng: random.Random, kind: str | None = None) -> str | None:
    """A wrong answer to a+b of `kind` (drawn by WRONG_KINDS' weights when None); None where that kind has none
    (the carry-less answer of a sum without a carry is right)."""
    right = arithmetic.answer(a, b)
    for _ in range(100):
        k = kind or rng.choices(list(WRONG_KINDS), weights=list(WRONG_KINDS.values()))[0]
        if k == "carryless":
            guess = arithmetic.carryless(a, b)
        elif k == "one_digit":
            i = rng.randrange(len(right))
            guess = right[:i] + str(rng.randrange(10)) + right[i + 1:]
        elif k == "length":
            guess = right + str(rng.randrange(10)) if rng.random() < 0.5 else right[:-1]
        else:
            guess = str(rng.randrange(1000))[::-1] if rng.random() < 0.5 else str(rng.randrange(10, 200))
        if guess and guess != right:
            return guess
    return None


def encode_scored(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of texts (`question + answer`) as the reward model reads them: EOS appended (its
    tokenizer has no chat template: tandem.train.reward_model), padded on the right."""
    seqs = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


def reward_scores(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """The classifier's one output for each text."""
    ids, mask = encode_scored(tokenizer, texts)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def pairwise_accuracy(model, tokenizer, rows: list[dict], seed: int, kind: str | None = None) -> float:
    """The share of held-out (correct, wrong) pairs, one per row (where `kind` has a wrong answer), that the model
    scores correct above wrong."""
    rng = random.Random(seed)
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in rows]
    wrong = {(a, b): w for a, b in pairs if (w := wrong_answer(a, b, rng, kind)) is not None}
    with torch.no_grad():
        right_scores = reward_scores(model, tokenizer, [arithmetic.question(a, b) + arithmetic.answer(a, b)
                                                        for a, b in wrong])
        wrong_scores = reward_scores(model, tokenizer, [arithmetic.question(a, b) + w for (a, b), w in wrong.items()])
    return float((right_scores > wrong_scores).float().mean())


def near_misses(a: int, b: int) -> list[str]:
    """Every wrong answer one edit from the right one (a digit changed, a digit more, the last dropped) and the
    carry-less one: where a policy maximizing the score looks first."""
    right = arithmetic.answer(a, b)
    out = {right[:i] + str(d) + right[i + 1:] for i in range(len(right)) for d in range(10)}
    out |= {right + str(d) for d in range(10)} | {right[:-1], arithmetic.carryless(a, b)}
    return sorted(w for w in out if w and w != right)


def ranks_first(model, tokenizer, rows: list[dict]) -> float:
    """The share of questions whose right answer the model scores above every one of its near misses."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in rows]
    texts = [[arithmetic.answer(a, b)] + near_misses(a, b) for a, b in pairs]
    with torch.no_grad():
        scores = reward_scores(model, tokenizer, [arithmetic.question(a, b) + t
                                                  for (a, b), ts in zip(pairs, texts) for t in ts]).tolist()
    first, at = 0, 0
    for ts in texts:
        mine = scores[at:at + len(ts)]
        first += mine[0] > max(mine[1:])
        at += len(ts)
    return first / len(rows)


def reward_model_loss(model, tokenizer, batch: list[tuple[int, int]], rng: random.Random) -> torch.Tensor:
    """The pairwise loss -log sigmoid(r(correct) - r(wrong)) of each question's correct answer against a wrong one
    (`wrong_answer`), plus the next-token loss of the correct answers' digits and EOS read from the same forward
    through the tied embedding: one score per text is a sparse signal, and the digit-by-digit sum is what the score
    must check."""
    right = [arithmetic.question(a, b) + arithmetic.answer(a, b) for a, b in batch]
    wrong = [arithmetic.question(a, b) + wrong_answer(a, b, rng) for a, b in batch]
    ids, mask = encode_scored(tokenizer, right + wrong)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(1) - 1  # EOS, where the classifier reads (the last token that is not padding)
    scores = model.score(hidden[torch.arange(len(ids)), last])[:, 0].float()
    n = len(batch)
    pairwise = -torch.nn.functional.logsigmoid(scores[:n] - scores[n:]).mean()
    logits = hidden[:n, :-1] @ model.model.embed_tokens.weight.T
    q = len(tokenizer.encode(right[0][:right[0].index("=") + 1]))  # every question is as long: a+b= of two digits
    answer = mask[:n, 1:].clone()
    answer[:, :q - 1] = 0  # predict the answer's tokens and EOS, not the question's
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), ids[:n, 1:], reduction="none")
    return pairwise + (nll * answer).sum() / answer.sum()


def train_reward_model(model, tokenizer, spec: RewardModelSpec) -> tuple[float, int]:
    """Steps on train questions (`reward_model_loss`) until held-out pairs rank right `spec.target_accuracy` of the
    time; returns (held-out pairwise accuracy, steps)."""
    pairs = [tuple(map(int, r["question"][:-1].split("+"))) for r in arithmetic.rows("train")]
    held = arithmetic.rows("test")
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    acc, step = 0.0, 0
    while step < spec.max_steps:
        model.train()
        loss = reward_model_loss(model, tokenizer, rng.sample(pairs, spec.batch), rng)
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:  # decaying to 10%: at a constant rate the accuracy swings by a few points
            group["lr"] = spec.lr * max(0.1, 1 - step / spec.max_steps)
        opt.step()
        step += 1
        if step % spec.eval_every == 0:
            model.eval()
            acc = pairwise_accuracy(model, tokenizer, held, spec.seed + 1)
            log.info("reward model step %d: loss %.3f, held-out pairwise accuracy %.1f%%", step, loss.item(), 100 * acc)
            if acc >= spec.target_accuracy:
                break
    model.eval()
    return acc, step


def reward_model(spec: RewardModelSpec = RewardModelSpec(), root: Path | None = None) -> Path:
    """Path of the demo's reward model folder (see RewardModelSpec), built on first use and cached."""
    def build():
        tokenizer = build_tokenizer(arithmetic.corpus(), spec.vocab_size)
        model = spec.build(tokenizer)
        acc, steps = train_reward_model(model, tokenizer, spec)
        held = arithmetic.rows("test")
        by_kind = {k: pairwise_accuracy(model, tokenizer, held, spec.seed + 2, k) for k in WRONG_KINDS}
        return model, tokenizer, {"pairwise_accuracy": acc, "pairwise_accuracy_by_kind": by_kind,
                                  "right_above_every_near_miss": ranks_first(model, tokenizer, held), "steps": steps}

    return cached_model("reward-model", spec, build, root, lambda f: (
        f"held-out pairwise accuracy {100 * f['pairwise_accuracy']:.1f}% in {f['steps']} steps, right above every "
        f"near miss {100 * f['right_above_every_near_miss']:.1f}%; by kind of wrong "
        "answer: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in f["pairwise_accuracy_by_kind"].items())))
