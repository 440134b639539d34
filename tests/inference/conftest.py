"""Shared fixtures for the inference tests: the default SmolLM2 GGUF, fetched by the test command."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.config import DEFAULT_MODEL, ROOT


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = ROOT / DEFAULT_MODEL
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m inference.models fetch` (make test does)")
    return path
