"""Shared fixtures for the inference tests: the default SmolLM2 GGUF, fetched by the test command."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.models.fetch import default_model_path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m inference.models fetch` (make test does)")
    return path
