"""A tiny local Qwen2 for the vLLM tests (tokenizer trained here, no downloads) and Hugging Face references."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = (
    "the a one two three four five six seven eight nine ten plus minus times equals answer question is what "
    "how many apples pears boxes each has total left right up down cat dog sat on mat ran far near big small"
).split()


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(lines):
        k = int(torch.randint(4, 16, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        nums = torch.randint(0, 1000, (2,), generator=g).tolist()
        out.append(" ".join(WORDS[i] for i in idx) + f" {nums[0]} + {nums[1]} = {nums[0] + nums[1]}.")
    return out


def build_tokenizer(folder: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE and save it as a PreTrainedTokenizerFast; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def build_model(folder: Path, *, tied: bool, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                mlp: int = 256, seed: int = 0, vocab_size: int = 384) -> Path:
    """Save a randomly initialised tiny Qwen2 with its tokenizer into `folder`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder, vocab_size)
    eos = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    cfg = Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=mlp, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=2048,
        eos_token_id=eos, bos_token_id=eos, pad_token_id=eos, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    # Random init gives near-uniform logits; a wider spread makes greedy decoding and logprob checks sharper.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token under a Hugging Face model (greedy: T = 1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
