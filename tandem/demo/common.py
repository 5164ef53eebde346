"""What every demo's model builder shares: the tiny Qwen2 shape, the tokenizer, the supervised loss and the cache."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("tandem.demo")

EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass(frozen=True)
class DemoShape:
    """The tiny Qwen2 the demos' text models are (`build`), and the seed of its weights and warm start."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 300
    seed: int = 0

    def build(self, tokenizer):
        """The untrained model of this shape for `tokenizer`, its weights drawn from `seed`."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=128, tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True,
        )
        torch.manual_seed(self.seed)
        return Qwen2ForCausalLM(cfg)


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


def masked_nll(model, seqs, masks, pad_id: int) -> torch.Tensor:
    """The warm starts' supervised loss: mean next-token NLL over the tokens whose mask is 1, the sequences padded
    on the right with `pad_id`."""
    width = max(map(len, seqs))
    ids = torch.tensor([list(s) + [pad_id] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([list(m) + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    logits = model(input_ids=ids).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")


def cached_model(name: str, spec, build: Callable[[], tuple], root: Path | None,
                 describe: Callable[[dict], str]) -> Path:
    """The folder `root/<name>-<hash of spec>`: `build() -> (model, tokenizer, figures)` runs once per spec, on one
    thread (the warm start's figures depend on it; one thread is also fastest here), and its result is saved with
    the figures in `tandem_demo.json`, under a temporary name renamed into place (a concurrent builder that finished
    first wins, ours is dropped). The hash is of the spec's fields alone (not of its class or module), so a spec
    moved between modules keeps its folder."""
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root()
    final = root / f"{name}-{key}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}-{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer, figures = build()
    finally:
        torch.set_num_threads(threads)
    if getattr(model, "generation_config", None) is not None:  # a causal LM (the reward model is a classifier)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    seconds = round(time.perf_counter() - start, 1)
    (tmp / "tandem_demo.json").write_text(json.dumps({"spec": asdict(spec), **figures, "seconds": seconds}, indent=2))
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s model ready at %s in %.0f s (%s)", name, final, seconds, describe(figures))
    return final
