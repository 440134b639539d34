"""Fixtures for the text-side tests: HF transformers' own reading of the SmolLM2 GGUF's
tokenizer (the oracle), loaded once per session because it takes ~15 s."""

from __future__ import annotations

from pathlib import Path

import pytest


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
