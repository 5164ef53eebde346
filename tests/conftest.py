"""Shared fixtures: tiny local models built through the same code that loads real checkpoints (no downloads)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never write to the home directory: the demo cache goes to a temporary folder."""
    os.environ["TANDEM_CACHE"] = str(tmp_path_factory.mktemp("tandem-cache"))
    torch.set_num_threads(1)
    yield


def save_tiny_model(folder: Path, hidden: int = 32, layers: int = 1, seed: int = 0, chat_template: str | None = None) -> Path:
    """A randomly initialised tiny Qwen2 with the demo's tokenizer, saved as a Hugging Face folder."""
    from tandem.data import arithmetic
    from tandem.demo import DemoModelSpec, build_model, build_tokenizer

    tok = build_tokenizer(arithmetic.corpus(), 300)
    if chat_template:
        tok.chat_template = chat_template
    spec = DemoModelSpec(hidden_size=hidden, layers=layers, heads=4, kv_heads=2, intermediate_size=2 * hidden, seed=seed)
    model = build_model(spec, tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    """tiny_model's shape with head_dim 32: vLLM's CPU attention has no kernel for tiny_model's 8."""
    return save_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden=128)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    return save_tiny_model(tmp_path_factory.mktemp("chat-model"), chat_template=template)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The project's shared folder (GSM8K lives there), beside the repository in sessions and in CI."""
    return Path(__file__).resolve().parents[1].parent / "shared"
