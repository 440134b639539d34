"""Which files an adapter directory may hold: the companions the tools and operating systems
write beside an adapter are accepted, anything that could be mistaken for weights is refused with
its path and why, pickles are refused by name and never opened; an upload is judged on every
file, a directory the engine loads on pickles only."""

from __future__ import annotations

import os
import pickle

import pytest

from protocol.adapter_format.files import IGNORED, directory_reasons, file_role, present
from tests.protocol.adapter_format.peft_files import write_adapter

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

REFUSED = [
    ("training_args.bin", b"\x80\x04\x95pickle", "training_args.bin is a pickle file (.bin); pickles are never opened, "
     "only safetensors are accepted: it holds the HF Trainer's TrainingArguments, which serving does not need: leave it out"),
    ("adapter_model.bin", b"\x80\x04N.", "adapter_model.bin is a pickle file (.bin); pickles are never opened, only "
     "safetensors are accepted: save the adapter with save_pretrained(safe_serialization=True) and use the "
     "adapter_model.safetensors it writes"),
    ("checkpoint-10/optimizer.pt", b"PK\x03\x04", "checkpoint-10/optimizer.pt is a pickle file (.pt); pickles are never "
     "opened, only safetensors are accepted: it is not part of the adapter (optimizer, scheduler or other training "
     "state?): leave it out"),
    (".hidden/rng_state.PTH", b"\x80\x02", ".hidden/rng_state.PTH is a pickle file (.pth)"),
    ("checkpoint-10/adapter_model.safetensors", b"\x00" * 16, "checkpoint-10/adapter_model.safetensors is an adapter "
     "file in a subfolder (a second adapter or a training checkpoint?); upload one adapter directory per version, "
     "with adapter_config.json and adapter_model.safetensors at its top"),
    ("model.safetensors", b"\x00" * 16, "model.safetensors is a safetensors file other than adapter_model.safetensors "
     "(full or merged model weights?)"),
    ("model.gguf", b"GGUF\x03\x00\x00\x00", "model.gguf is not a file PEFT or the HF Trainer writes beside an adapter"),
    ("README.md", b"# card\x00\x80\x04binary", "README.md is named like a text file but holds binary data; leave it out"),
]


def place(directory, rel: str, data: bytes) -> None:
    (directory / rel).parent.mkdir(parents=True, exist_ok=True)
    (directory / rel).write_bytes(data)


@pytest.mark.parametrize("rel", COMPANIONS)
def test_a_companion_is_ignored(rel: str) -> None:
    assert file_role(rel, read_head=lambda: COMPANIONS[rel]) == IGNORED


@pytest.mark.parametrize(("rel", "data", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_file_refused_by_path(rel: str, data: bytes, reason: str) -> None:
    role = file_role(rel, read_head=lambda: data)
    assert role.refused and role.reason.startswith(reason)


def test_the_adapter_files_at_the_top() -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert file_role(name, read_head=lambda: b"").kind == "adapter"


def test_a_pickle_is_never_read_even_for_its_first_bytes() -> None:
    def read_head() -> bytes:
        raise AssertionError("a pickle's bytes were read")

    assert file_role("weights/state.pkl", read_head=read_head).refused


# --- a whole directory ------------------------------------------------------------------------------


def test_an_upload_with_every_companion_passes(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a")
    for rel, data in COMPANIONS.items():
        place(directory, rel, data)
    assert directory_reasons(directory, upload=True) == []


def test_an_upload_hears_of_every_refused_file_then_the_missing_ones(tmp_path) -> None:
    directory = tmp_path / "a"
    for rel, data, _ in REFUSED:
        place(directory, rel, data)
    reasons = directory_reasons(directory, upload=True)
    assert [r.split(" ")[0] for r in reasons] == [  # walk order: each folder's names sorted, top down
        "README.md", "adapter_model.bin", "model.gguf", "model.safetensors", "training_args.bin",
        ".hidden/rng_state.PTH", "checkpoint-10/adapter_model.safetensors", "checkpoint-10/optimizer.pt",
        "missing", "missing",
    ]
    assert reasons[-2:] == ["missing adapter_config.json", "missing adapter_model.safetensors"]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links here")
def test_an_upload_refuses_links_and_a_linked_adapter_file_is_missing(tmp_path) -> None:
    real = write_adapter(tmp_path / "real")
    directory = tmp_path / "a"
    directory.mkdir()
    (directory / "adapter_config.json").symlink_to(real / "adapter_config.json")
    (directory / "adapter_model.safetensors").write_bytes((real / "adapter_model.safetensors").read_bytes())
    (directory / "docs").symlink_to(tmp_path, target_is_directory=True)
    assert directory_reasons(directory, upload=True) == [
        "adapter_config.json is a symbolic link; links are not accepted",
        "docs is a symbolic link; links are not accepted",
        "missing adapter_config.json",
    ]
    assert not present(directory / "adapter_config.json", upload=True)
    assert present(directory / "adapter_config.json", upload=False)
    assert directory_reasons(directory, upload=False) == []  # the engine reads what a link points at


class _WouldRun:
    """Unpickling this creates `marker`: proof that nobody unpickled the file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("rel", ["adapter_model.bin", "optimizer.pt", "state.pkl", "rng_state.pth", "ckpt/training_args.bin"])
@pytest.mark.parametrize("upload", [True, False])
def test_a_pickle_anywhere_is_refused_without_being_unpickled(tmp_path, rel: str, upload: bool) -> None:
    directory = write_adapter(tmp_path / "a")
    place(directory, rel, pickle.dumps(_WouldRun(tmp_path / "unpickled")))
    [reason] = directory_reasons(directory, upload=upload)
    assert reason.startswith(f"{rel} is a pickle file (.{rel.rsplit('.', 1)[1]}); pickles are never opened")
    assert not (tmp_path / "unpickled").exists()


def test_the_engine_leaves_other_files_alone_but_refuses_a_folder_named_like_a_pickle(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a")
    for rel, data, _ in REFUSED:
        if not rel.endswith((".bin", ".pt", ".PTH")):
            place(directory, rel, data)
    assert directory_reasons(directory, upload=False) == []
    (directory / "model.pt").mkdir()
    assert directory_reasons(directory, upload=False) == [
        "model.pt is a pickle file (.pt); pickles are never opened, only safetensors are accepted: it is not part "
        "of the adapter (optimizer, scheduler or other training state?): leave it out"
    ]


@pytest.mark.parametrize("upload", [True, False])
def test_missing_adapter_files(tmp_path, upload: bool) -> None:
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").unlink()
    assert directory_reasons(directory, upload=upload) == ["missing adapter_model.safetensors"]
    (directory / "adapter_config.json").unlink()
    (directory / "adapter_config.json").mkdir()  # a folder is not the file
    assert directory_reasons(directory, upload=upload) == [
        "missing adapter_config.json", "missing adapter_model.safetensors",
    ]
