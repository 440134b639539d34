"""Which files a PEFT adapter directory may hold: the two that are the adapter, the harmless
companions the training tools write beside them, and what is refused.

The training tools write more than the two adapter files (checked against PEFT 0.21 and
transformers 5):

    PeftModel.save_pretrained   adapter_config.json, adapter_model.safetensors, README.md (model card)
    tokenizer.save_pretrained   tokenizer.json, tokenizer_config.json, special_tokens_map.json,
                                added_tokens.json, chat_template.jinja / .json,
                                additional_chat_templates/*.jinja, vocab.json, vocab.txt, merges.txt,
                                and the SentencePiece models tokenizer.model, spiece.model,
                                sentencepiece.bpe.model (protobuf, not pickle)
    Trainer.save_model          the above plus training_args.bin (torch.save: a pickle)
    Trainer checkpoints         trainer_state.json, optimizer.pt, scheduler.pt, rng_state.pth (pickles)
    save_metrics, hub, OS       all_results.json, train_results.json, .gitattributes, .DS_Store, __MACOSX/

`file_role` judges one file, first match wins (`rel` is the path inside the directory, "/"-separated):
    a pickle suffix anywhere (.bin .pt .pth .pkl .pickle .ckpt)   refused: never opened
    a hidden file or folder, __MACOSX/, Thumbs.db, desktop.ini     ignored (OS and tool metadata)
    adapter_config.json / adapter_model.safetensors at the top     the adapter
    the same names in a subfolder                                  refused (one adapter per directory)
    a SentencePiece tokenizer model by its exact name              ignored
    a text file (.md .txt .json .jinja .yaml .yml, LICENSE,        ignored when its first bytes hold no
        NOTICE)                                                    NUL (a binary named like text is refused)
    any other file                                                 refused, naming it and why

Two policies apply it to a directory (`directory_reasons`):
    upload=True    a tenant's upload: every rule above, and links refused (the portal stores only
                   the two adapter files, so an ignored file's content is never trusted)
    upload=False   a directory the engine is asked to load: only the pickle rule, for files and
                   folders alike; anything else beside the two files is never opened, so it is
                   left alone
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TEXT_SUFFIXES = (".md", ".txt", ".json", ".jinja", ".yaml", ".yml")
TEXT_NAMES = ("LICENSE", "NOTICE")
SENTENCEPIECE_MODELS = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
OS_METADATA = ("__MACOSX", "Thumbs.db", "desktop.ini")
SNIFF_BYTES = 8192  # enough to tell text from binary: binaries hold NUL bytes early


@dataclass(frozen=True)
class FileRole:
    kind: str  # "adapter", "ignored" or "refused"
    reason: str = ""  # why it is refused

    @property
    def refused(self) -> bool:
        return self.kind == "refused"


ADAPTER = FileRole("adapter")
IGNORED = FileRole("ignored")


def file_role(rel: str, *, read_head: Callable[[], bytes]) -> FileRole:
    """The role of the file at `rel` in an adapter directory; `read_head()` returns its first
    bytes (up to SNIFF_BYTES) and is called only for files named like text."""
    parts = PurePosixPath(rel.replace("\\", "/")).parts
    name = parts[-1]
    suffix = PurePosixPath(name).suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return FileRole("refused", pickle_reason(rel))
    if any(p.startswith(".") or p in OS_METADATA for p in parts):
        return IGNORED
    if name in ADAPTER_FILES:
        if len(parts) == 1:
            return ADAPTER
        return FileRole(
            "refused",
            f"{rel} is an adapter file in a subfolder (a second adapter or a training checkpoint?); "
            f"upload one adapter directory per version, with {CONFIG_FILE} and {WEIGHTS_FILE} at its top",
        )
    if name in SENTENCEPIECE_MODELS:
        return IGNORED
    if suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
        if b"\x00" in read_head()[:SNIFF_BYTES]:
            return FileRole(
                "refused", f"{rel} is named like a text file but holds binary data; leave it out"
            )
        return IGNORED
    if suffix == ".safetensors":
        return FileRole(
            "refused",
            f"{rel} is a safetensors file other than {WEIGHTS_FILE} (full or merged model weights?); "
            f"only the adapter's own weights are accepted: upload what PeftModel.save_pretrained wrote",
        )
    return FileRole(
        "refused",
        f"{rel} is not a file PEFT or the HF Trainer writes beside an adapter (only the two adapter files "
        "and text files such as README.md or the tokenizer's are accepted); leave it out",
    )


def is_pickle(rel: str) -> bool:
    return PurePosixPath(rel.replace("\\", "/")).suffix.lower() in PICKLE_SUFFIXES


def pickle_reason(rel: str) -> str:
    name = PurePosixPath(rel.replace("\\", "/")).name
    suffix = PurePosixPath(name).suffix.lower()
    if name.startswith("adapter_model"):
        hint = (
            "save the adapter with save_pretrained(safe_serialization=True) and use the "
            f"{WEIGHTS_FILE} it writes"
        )
    elif name == "training_args.bin":
        hint = (
            "it holds the HF Trainer's TrainingArguments, which serving does not need: leave it out"
        )
    else:
        hint = "it is not part of the adapter (optimizer, scheduler or other training state?): leave it out"
    return f"{rel} is a pickle file ({suffix}); pickles are never opened, only safetensors are accepted: {hint}"


# --- a whole directory -------------------------------------------------------------------------


def directory_reasons(directory: Path, *, upload: bool) -> list[str]:
    """Every file the policy refuses (walk order: top down, names sorted), then each adapter file
    that is missing from the top of `directory` (see the module docstring for `upload`)."""
    reasons = []
    for rel, path in _entries(directory):
        if not upload:
            if is_pickle(rel):
                reasons.append(pickle_reason(rel))
        elif path.is_symlink():
            reasons.append(f"{rel} is a symbolic link; links are not accepted")
        elif path.is_file():
            role = file_role(rel, read_head=lambda p=path: _head(p))
            if role.refused:
                reasons.append(role.reason)
    reasons += [
        f"missing {name}" for name in ADAPTER_FILES if not present(directory / name, upload=upload)
    ]
    return reasons


def present(path: Path, *, upload: bool) -> bool:
    """An adapter file is there to be read (an upload's may not be a link)."""
    return path.is_file() and not (upload and path.is_symlink())


def _entries(directory: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to `directory`, path) of every file and folder below it; symlinked
    folders are listed, never followed."""
    for root, dirs, files in os.walk(directory):
        for entry in sorted(dirs + files):
            path = Path(root) / entry
            yield path.relative_to(directory).as_posix(), path


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(SNIFF_BYTES)
