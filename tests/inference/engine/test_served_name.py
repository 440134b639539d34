"""The base model's served name: what clients put in `model` without any flag."""

from pathlib import Path

import pytest

from inference.engine.llm_engine import served_model_name


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("models/Llama-3.2-1B-Instruct.BF16.gguf", "Llama-3.2-1B-Instruct"),
        ("models/phi.IQ4_XS.gguf", "phi"),
        ("models/plain.gguf", "plain"),
        ("/checkpoints/my-llama/", "my-llama"),
    ],
)
def test_served_name_drops_the_quantisation_suffix(path: str, name: str) -> None:
    assert served_model_name(Path(path)) == name
