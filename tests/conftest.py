"""Shared fixtures: tiny local models built through the same code that loads real checkpoints (no downloads)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never write to the home directory: the demo cache goes to a temporary folder."""
    os.environ["TANDEM_CACHE"] = str(tmp_path_factory.mktemp("tandem-cache"))
    torch.set_num_threads(1)
    yield


def free_port() -> int:
    """A free TCP port on loopback, for a torch.distributed rendezvous of the test's own processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(folder: Path, hidden: int = 32, layers: int = 1, seed: int = 0,
                    chat_template: str | None = None) -> Path:
    """A randomly initialised tiny Qwen2 with the demo's tokenizer, saved as a Hugging Face folder."""
    from tandem.data import arithmetic
    from tandem.demo import DemoModelSpec, build_tokenizer

    tok = build_tokenizer(arithmetic.corpus(), 300)
    if chat_template:
        tok.chat_template = chat_template
    spec = DemoModelSpec(hidden_size=hidden, layers=layers, heads=4, kv_heads=2, intermediate_size=2 * hidden,
                         seed=seed)
    model = spec.build(tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vlm(tmp_path_factory) -> Path:
    """The vision demo's model as built, before its warm start (random weights), with its processor: a tiny Idefics3
    whose heads are 32 wide (vLLM-CPU's attention takes no smaller)."""
    from tandem.demo import VisionDemoSpec, build_vision_model, build_vision_processor, build_vision_tokenizer

    spec = VisionDemoSpec()
    folder = tmp_path_factory.mktemp("vlm")
    tokenizer = build_vision_tokenizer(spec)
    build_vision_model(spec, tokenizer).save_pretrained(folder)
    build_vision_processor(spec, tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def qwen_vlm(tmp_path_factory) -> Path:
    """A tiny random Qwen2.5-VL (tandem.demo.build_qwen_vision): 3-D rotary positions, a tokenizer with Qwen's special
    tokens and chat template, its image processor's files as a Hub checkpoint has them."""
    from tandem.demo import build_qwen_vision

    return build_qwen_vision(tmp_path_factory.mktemp("qwen-vlm"))


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen2 models for the vLLM engine tests (tests/tiny_qwen.py), tied and untied head."""
    from tiny_qwen import build_model

    root = tmp_path_factory.mktemp("tiny_qwen2")
    return {
        "tied": build_model(root / "tied", tied=True),
        "untied": build_model(root / "untied", tied=False, seed=1),
    }


# Modules that start a vLLM engine in the test process: importing vLLM changes the process it lands in (threads,
# environment, seeds) for every test after it, so these run after all the others.
VLLM_IN_PROCESS = {"test_vllm_engine.py", "test_vllm_server.py", "test_sync_guard.py", "test_vllm_lora.py",
                   "test_vllm_moe.py", "test_vllm_vision.py"}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts a vLLM server process (~1 min); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "ray: starts Ray (the module skips itself without ray)")
    config.addinivalue_line("markers", "vllm: starts a vLLM engine (`scripts/test.sh --quick` leaves these and "
                            "the Ray ones out)")


def _uses_ray(path: Path, seen: dict[Path, bool] = {}) -> bool:  # noqa: B006  a cache over the session
    if path not in seen:
        seen[path] = 'pytest.importorskip("ray")' in path.read_text()  # every module that starts Ray says so
    return seen[path]


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _uses_ray(item.path):
            item.add_marker(pytest.mark.ray)
        if item.path.name in VLLM_IN_PROCESS or "vllm" in item.name.lower():
            item.add_marker(pytest.mark.vllm)
    items.sort(key=lambda item: item.path.name in VLLM_IN_PROCESS)  # stable: the order is kept otherwise
