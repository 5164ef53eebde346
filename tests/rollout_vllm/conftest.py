"""Fixtures for the vLLM engine tests: tiny local Qwen2 models, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_qwen import build_model


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts a vLLM server process (~1 min); deselect with -m 'not slow'")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_qwen2")
    return {
        "tied": build_model(root / "tied", tied=True),
        "untied": build_model(root / "untied", tied=False, seed=1),
    }

