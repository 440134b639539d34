"""What may sit beside a PEFT adapter in an uploaded directory (portal/adapters/adapter_files.py),
judged through validate_adapter_dir as an archive's contents are: the companions the tools and
operating systems write are accepted, everything that could be mistaken for weights is refused
with the file's path and the reason."""

from __future__ import annotations

import pytest

from portal.adapters.validation import validate_adapter_dir
from tests.portal.adapters.peft_files import TINY, write_peft

COMPANIONS = {
    "README.md": b"---\nlibrary_name: peft\n---\n# Model card\n",
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "added_tokens.json": b"",  # empty: harmless
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "additional_chat_templates/tool_use.jinja": b"{{ tools }}",
    "vocab.json": b"{}",
    "merges.txt": b"#version: 0.2\n",
    "tokenizer.model": b"\x0a\x05\x00binary sentencepiece protobuf",
    "trainer_state.json": b'{"global_step": 10}',
    "all_results.json": b"{}",
    "LICENSE": b"Apache-2.0\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
    ".DS_Store": b"\x00\x00\x00\x01Bud1",
    ".ipynb_checkpoints/README-checkpoint.md": b"# old",
    "__MACOSX/._adapter_model.safetensors": b"\x00\x05\x16\x07AppleDouble",
}


def test_the_companions_of_an_adapter_are_accepted(tmp_path) -> None:
    directory = write_peft(tmp_path / "a")
    for rel, data in COMPANIONS.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    result = validate_adapter_dir(directory, TINY)
    assert result.ok, result.reasons
    assert set(result.file_sha256) == {"adapter_config.json", "adapter_model.safetensors"}


REFUSED = [
    ("training_args.bin", b"\x80\x04\x95pickle", "training_args.bin is a pickle file (.bin)"),
    ("checkpoint-10/optimizer.pt", b"PK\x03\x04", "checkpoint-10/optimizer.pt is a pickle file (.pt)"),
    (".hidden/rng_state.pth", b"\x80\x02", ".hidden/rng_state.pth is a pickle file (.pth)"),
    ("checkpoint-10/adapter_model.safetensors", b"\x00" * 16, "is an adapter file in a subfolder"),
    ("model.safetensors", b"\x00" * 16, "model.safetensors is a safetensors file other than adapter_model"),
    ("model.gguf", b"GGUF\x03\x00\x00\x00", "model.gguf is not a file PEFT or the HF Trainer writes"),
    ("README.md", b"# card\x00\x80\x04binary", "README.md is named like a text file but holds binary data"),
]


@pytest.mark.parametrize(("rel", "data", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_pickles_and_unknown_binaries_are_refused_by_path(tmp_path, rel, data, reason) -> None:
    directory = write_peft(tmp_path / "a")
    (directory / rel).parent.mkdir(parents=True, exist_ok=True)
    (directory / rel).write_bytes(data)
    result = validate_adapter_dir(directory, TINY)
    assert not result.ok
    assert any(r.startswith(rel) and reason in r for r in result.reasons), result.reasons
