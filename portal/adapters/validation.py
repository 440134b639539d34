"""The portal's side of the PEFT adapter rules, which live once in protocol.adapter_format (the
engine applies the same ones, so the portal accepts exactly what a worker will load).

An extracted upload is judged with the upload policy (links, pickles and unknown binaries
refused; the model card, tokenizer and other text files beside the adapter ignored) and every
reason is kept, so a tenant fixes them all in one go; a ready version records its facts (rank,
alpha, targets, base name) and the hashes of the two files it stores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from protocol.adapter_format import (
    ADAPTER_FILES,
    CONFIG_FILE,
    SUPPORTED_MODULES,
    WEIGHTS_FILE,
    BaseShapes,
    check_adapter_dir,
)

MAX_REASONS = 20

EXPECTED = (
    f"upload the two PEFT files ({CONFIG_FILE} and {WEIGHTS_FILE}) or one .zip/.tar.gz of the directory; "
    "the README.md model card, tokenizer, chat-template and other text files that save_pretrained or the "
    "Trainer write beside them are accepted and ignored"
)

# What uploads are validated against until a worker has described the fleet's base.
SMOLLM2_135M = BaseShapes(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    num_hidden_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_lora_rank=16,
)


@dataclass
class ValidationResult:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rank: int | None = None  # the largest rank of any targeted projection
    alpha: float | None = None
    target_modules: list[str] = field(default_factory=list)
    base_model: str = ""
    file_sha256: dict[str, str] = field(default_factory=dict)  # of an accepted adapter's two files
    size_bytes: int = 0  # of the two adapter files


def validate_adapter_dir(path: Path, base: BaseShapes) -> ValidationResult:
    """Every reason the adapter in directory `path` cannot be served by `base` (none: it can)."""
    path = Path(path)
    check = check_adapter_dir(path, base, upload=True)
    result = ValidationResult(ok=check.ok, reasons=_capped(check.reasons), warnings=check.warnings)
    if check.settings is not None:
        result.alpha = check.settings.lora_alpha
        result.base_model = check.settings.base_model_name_or_path or ""
    if check.targets:
        result.rank = max(r for r, _ in check.targets.values())
        result.target_modules = sorted({m for _, m in check.targets}, key=SUPPORTED_MODULES.index)
    if check.ok:
        result.file_sha256 = {name: file_sha256(path / name) for name in ADAPTER_FILES}
        result.size_bytes = sum((path / name).stat().st_size for name in ADAPTER_FILES)
    return result


def _capped(reasons: list[str]) -> list[str]:
    if len(reasons) <= MAX_REASONS:
        return reasons
    return reasons[:MAX_REASONS] + [f"... and {len(reasons) - MAX_REASONS} more problems of the same kinds"]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def content_sha256(files: Mapping[str, str]) -> str:
    """One hash for the adapter's content: its files' hashes, by name."""
    return hashlib.sha256("".join(f"{n}:{files[n]}\n" for n in sorted(files)).encode()).hexdigest()
