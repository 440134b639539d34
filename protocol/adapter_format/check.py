"""Every reason a PEFT LoRA directory cannot be served by a base, in one pass, cheap and
dangerous checks first:

    files       no pickle anywhere (never opened); for an upload, no link or unknown binary
                either; both adapter files at the top                       files.py
    config      adapter_config.json describes a plain LoRA within max_lora_rank   settings.py
    targets     target_modules / layers_to_transform select projections of this base,
                and only those, each with its rank and alpha                 targets.py
    tensors     adapter_model.safetensors well-formed; every tensor the A or B of a targeted
                projection, pairs complete, float, shapes of this base       tensors.py
    base name   base_model_name_or_path does not name another model         base_model.py
    values      every value finite (unless the caller checks the values it reads itself)

A step whose input was refused is skipped (no settings: no targets); the tensors are still
checked without targets, so an upload with a bad config also hears about its tensors. Reasons
keep this order, so the first is the one a stop-at-first check would give: the engine raises
it, the portal shows them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.adapter_format import files, tensors
from protocol.adapter_format.base_model import check_base_name
from protocol.adapter_format.settings import LoRASettings, parse_settings, read_config
from protocol.adapter_format.shapes import BaseShapes
from protocol.adapter_format.targets import Targets, resolve_targets
from protocol.adapter_format.tensors import Pairs, TensorInfo


@dataclass
class AdapterCheck:
    """What check_adapter_dir found: every reason (none: the adapter can be served), warnings
    for an accepted adapter, and what each step parsed (None where it failed or did not run)."""

    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None
    settings: LoRASettings | None = None
    targets: Targets | None = None  # (layer, module) -> (rank, alpha)
    header: dict[str, TensorInfo] | None = None
    pairs: Pairs | None = None  # (layer, module) -> (key of A, key of B)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def add(self, reasons: list[str]) -> None:
        self.reasons += [r for r in reasons if r not in self.reasons]


def check_adapter_dir(
    directory: Path | str,
    base: BaseShapes,
    *,
    upload: bool = False,
    strict_base_match: bool = False,
    check_values: bool = True,
) -> AdapterCheck:
    """Judge the adapter in `directory` against `base` (whose max_lora_rank bounds every rank).

    upload: apply the upload policy to the files beside the adapter (files.py), else the
        engine's (pickles only).
    strict_base_match: refuse a base_model_name_or_path that cannot be compared with base.name.
    check_values: scan every value for NaN/Inf; a caller that reads the tensors anyway passes
        False and checks them as it reads (tensors.nonfinite), so nothing is read twice.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return AdapterCheck(reasons=[f"{directory} is not a directory"])
    check = AdapterCheck()
    check.add(files.directory_reasons(directory, upload=upload))

    if files.present(directory / files.CONFIG_FILE, upload=upload):
        check.config, found = read_config(directory / files.CONFIG_FILE)
        check.add(found)
    if check.config is not None:
        check.settings, found = parse_settings(check.config, max_lora_rank=base.max_lora_rank)
        check.add(found)
    if check.settings is not None:
        check.targets, found = resolve_targets(check.settings, base)
        check.add(found)

    weights = directory / files.WEIGHTS_FILE
    if files.present(weights, upload=upload):
        check.header, found = tensors.read_header(weights)
        check.add(found)
    if check.header is not None:
        check.pairs, found = tensors.check_tensors(check.header, check.targets, base)
        check.add(found)

    if check.settings is not None:
        found, warning = check_base_name(
            check.settings.base_model_name_or_path, base.name, strict=strict_base_match
        )
        check.add(found)
        check.warnings += [warning] if warning else []
    if check_values and check.header is not None:
        check.add(tensors.scan_values(weights, check.header))
    return check
