"""Which files of an uploaded PEFT adapter directory are the adapter, which are harmless
companions (accepted, never stored, never sent to a worker), and which are refused.

The training tools write more than the two adapter files, and a tenant uploads the directory as
they wrote it (checked against PEFT 0.21 and transformers 5 in the venv):

    PeftModel.save_pretrained   adapter_config.json, adapter_model.safetensors, README.md (model card)
    tokenizer.save_pretrained   tokenizer.json, tokenizer_config.json, special_tokens_map.json,
                                added_tokens.json, chat_template.jinja / .json,
                                additional_chat_templates/*.jinja, vocab.json, vocab.txt, merges.txt,
                                and the SentencePiece models tokenizer.model, spiece.model,
                                sentencepiece.bpe.model (protobuf, not pickle)
    Trainer.save_model          the above plus training_args.bin (torch.save: a pickle)
    Trainer checkpoints         trainer_state.json, optimizer.pt, scheduler.pt, rng_state.pth (pickles)
    save_metrics, hub, OS       all_results.json, train_results.json, .gitattributes, .DS_Store, __MACOSX/

Rules, first match wins (`rel` is the path inside the directory, "/"-separated):
    a pickle suffix anywhere (.bin .pt .pth .pkl .pickle .ckpt)   refused: never opened, never stored
    a hidden file or folder, __MACOSX/, Thumbs.db, desktop.ini     ignored (OS and tool metadata)
    adapter_config.json / adapter_model.safetensors at the top     the adapter
    the same names in a subfolder                                  refused (one adapter per version)
    a SentencePiece tokenizer model by its exact name              ignored
    a text file (.md .txt .json .jinja .yaml .yml, LICENSE,        ignored when its first bytes hold no
        NOTICE)                                                    NUL (a binary named like text is refused)
    any other file                                                 refused, naming it and why

Ignored files are never stored, so their content is never trusted; refusing unknown binaries
catches the wrong upload early (full model weights, an optimizer dump) with a clear reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TEXT_SUFFIXES = (".md", ".txt", ".json", ".jinja", ".yaml", ".yml")
TEXT_NAMES = ("LICENSE", "NOTICE")
SENTENCEPIECE_MODELS = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
OS_METADATA = ("__MACOSX", "Thumbs.db", "desktop.ini")
SNIFF_BYTES = 8192  # enough to tell text from binary: binaries hold NUL bytes early

EXPECTED = (
    f"upload the two PEFT files ({CONFIG_FILE} and {WEIGHTS_FILE}) or one .zip/.tar.gz of the directory; "
    "the README.md model card, tokenizer, chat-template and other text files that save_pretrained or the "
    "Trainer write beside them are accepted and ignored"
)


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
        return FileRole("refused", _pickle_reason(rel, name, suffix))
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
            return FileRole("refused", f"{rel} is named like a text file but holds binary data; leave it out")
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


def _pickle_reason(rel: str, name: str, suffix: str) -> str:
    if name.startswith("adapter_model"):
        hint = f"save the adapter with save_pretrained(safe_serialization=True) and upload {WEIGHTS_FILE}"
    elif name == "training_args.bin":
        hint = "it holds the HF Trainer's TrainingArguments, which serving does not need: leave it out"
    else:
        hint = "it is not part of the adapter (optimizer, scheduler or other training state?): leave it out"
    return f"{rel} is a pickle file ({suffix}); pickles are never opened, only safetensors are accepted: {hint}"
