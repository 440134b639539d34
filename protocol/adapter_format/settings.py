"""adapter_config.json -> LoRASettings: the fields that decide what is computed, or every reason
the config does not describe a plain LoRA on linear layers within the served max rank.

Refused: another peft_type, DoRA, the LoRA variants whose forward pass is not x·Aᵀ·Bᵀ·scale or
that change the base (below), a PiSSA-style init saved unconverted, modules_to_save, a bias,
r / rank_pattern outside 1..max_lora_rank, a non-finite lora_alpha / alpha_pattern, malformed
target_modules / exclude_modules / layers_to_transform / layers_pattern, invalid regexes.
Defaults are PEFT's (r 8, lora_alpha 8, target_modules q_proj and v_proj for a llama).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.adapter_format.files import CONFIG_FILE
from protocol.adapter_format.shapes import SUPPORTED_MODULES

MAX_CONFIG_BYTES = 1 << 20

# PEFT's default target_modules for model_type "llama" when the config leaves them out.
PEFT_LLAMA_DEFAULT_TARGETS = ("q_proj", "v_proj")

# LoraConfig fields that switch on a variant whose forward pass is not plain x·Aᵀ·Bᵀ·scale
# (or that changes the base model itself). Training-only variants (VeLoRA, MiCA) are fine.
UNSUPPORTED_VARIANTS = {
    "lora_bias": "LoRA B bias (lora_bias)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
}
# init_lora_weights values whose saved adapter only works on a base PEFT modified in place,
# unless it was converted with save_pretrained(path_initial_model_for_weight_conversion=...).
MODIFIED_BASE_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")

Names = tuple[str, ...] | re.Pattern[str]


@dataclass(frozen=True)
class LoRASettings:
    """The adapter_config.json fields that decide what we compute, validated.

    target_modules / exclude_modules: a tuple of names (PEFT matches a module whose full name
    equals an entry or ends with "." + entry) or a compiled regex (full match on the full name).
    rank_pattern / alpha_pattern: (compiled "(.*\\.)?(KEY)$", value) in file order; PEFT takes
    the first key that matches the module's full name.
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Names
    exclude_modules: Names
    layers_to_transform: frozenset[int] | None  # None: every layer
    layers_pattern: tuple[re.Pattern[str], ...]  # empty: PEFT's default layer-index match
    rank_pattern: tuple[tuple[re.Pattern[str], int], ...]
    alpha_pattern: tuple[tuple[re.Pattern[str], float], ...]
    base_model_name_or_path: str | None

    def rank_and_alpha(self, full_name: str) -> tuple[int, float]:
        return (
            _first_match(self.rank_pattern, full_name, self.r),
            _first_match(self.alpha_pattern, full_name, self.lora_alpha),
        )

    def scale(self, rank: int, alpha: float) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _first_match(patterns, full_name: str, default):
    for pattern, value in patterns:
        if pattern.match(full_name):
            return value
    return default


def read_config(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """adapter_config.json as a dict (a JSON object, at most 1 MiB), or None and why."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None, [f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes"]
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None, [f"missing {CONFIG_FILE}"]
    except (OSError, UnicodeDecodeError) as e:
        return None, [f"cannot read {CONFIG_FILE}: {e}"]
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return None, [f"{CONFIG_FILE} is not valid JSON: {e}"]
    if not isinstance(config, dict):
        return None, [f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}"]
    return config, []


def parse_settings(
    config: Mapping[str, Any], *, max_lora_rank: int
) -> tuple[LoRASettings | None, list[str]]:
    """The config as a plain LoRA that fits `max_lora_rank`, or None and every reason it is not,
    in a fixed order (the method and its variants, r, alpha, targets, layers, patterns, base)."""
    reasons: list[str] = []
    _check_variant(config, reasons)
    r = _rank("r", config.get("r", 8), max_lora_rank, reasons)  # PEFT's defaults
    alpha = _number("lora_alpha", config.get("lora_alpha", 8), reasons)
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        reasons.append(f"use_rslora must be true or false, got {use_rslora!r}")

    raw_targets = config.get("target_modules")
    if raw_targets is None:
        targets: Names | None = PEFT_LLAMA_DEFAULT_TARGETS
    elif isinstance(raw_targets, str) and raw_targets.lower() == "all-linear":
        targets = SUPPORTED_MODULES  # PEFT: every linear layer except the output layer
    else:
        targets = _names_or_regex("target_modules", raw_targets, reasons)
    excludes = _names_or_regex("exclude_modules", config.get("exclude_modules") or (), reasons)
    layers, layers_pattern = _layers(config, targets, reasons)
    rank_pattern = _rank_pattern(config.get("rank_pattern"), max_lora_rank, reasons)
    alpha_pattern = _alpha_pattern(config.get("alpha_pattern"), reasons)

    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        reasons.append(f"base_model_name_or_path must be a string, got {base!r}")
    compiled_layers_pattern = tuple(
        _compile("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", reasons)
        for p in layers_pattern
    )
    if reasons:
        return None, reasons
    return LoRASettings(
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=targets,
        exclude_modules=excludes,
        layers_to_transform=None if not layers else frozenset(layers),  # [] means all in PEFT
        layers_pattern=compiled_layers_pattern,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        base_model_name_or_path=base or None,
    ), []


def _check_variant(config: Mapping[str, Any], reasons: list[str]) -> None:
    """Refuse anything but a plain LoRA: another PEFT method, a variant, a changed base."""
    peft_type = config.get("peft_type")
    if peft_type is None:
        reasons.append(f"{CONFIG_FILE} has no peft_type; only LORA adapters are supported")
    elif peft_type != "LORA":
        reasons.append(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        reasons.append("use_dora is true; DoRA adapters are not supported")
    for key, what in UNSUPPORTED_VARIANTS.items():
        if config.get(key):
            reasons.append(f"{key} is set; {what} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(MODIFIED_BASE_INITS):
        reasons.append(
            f"init_lora_weights {init!r}: the adapter expects a base model that PEFT modified in "
            "place; convert it with save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
    if modules_to_save := config.get("modules_to_save"):
        reasons.append(
            f"modules_to_save {modules_to_save!r} is not supported (it replaces whole base modules)"
        )
    bias = config.get("bias", "none")
    if bias != "none":
        reasons.append(f"bias {bias!r} is not supported; only 'none' is")


def _layers(
    config: Mapping[str, Any], targets: Names | None, reasons: list[str]
) -> tuple[list[int] | None, list[str]]:
    """layers_to_transform (an index or a list of them) and layers_pattern (a name or a list)."""
    layers = config.get("layers_to_transform")
    layers_pattern = config.get("layers_pattern") or []
    if isinstance(targets, re.Pattern) and (layers is not None or layers_pattern):
        reasons.append(
            "layers_to_transform / layers_pattern cannot be used with a regex target_modules"
        )
    if layers_pattern and layers is None:
        reasons.append("layers_pattern is set without layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (
        not isinstance(layers, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
    ):
        reasons.append(
            f"layers_to_transform must be a layer index or a list of them, got {layers!r}"
        )
        layers = None
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    if not isinstance(layers_pattern, list) or not all(isinstance(p, str) for p in layers_pattern):
        reasons.append(
            f"layers_pattern must be a string or a list of strings, got {layers_pattern!r}"
        )
        layers_pattern = []
    return layers, layers_pattern


def _rank_pattern(
    raw: Any, max_lora_rank: int, reasons: list[str]
) -> tuple[tuple[re.Pattern[str], int], ...]:
    pattern = []
    for key, value in _pattern_items("rank_pattern", raw, reasons):
        rank = _rank(f"rank_pattern[{key!r}]", value, max_lora_rank, reasons)
        compiled = _compile("rank_pattern", rf"(.*\.)?({key})$", reasons)
        if rank is not None and compiled is not None:
            pattern.append((compiled, rank))
    return tuple(pattern)


def _alpha_pattern(raw: Any, reasons: list[str]) -> tuple[tuple[re.Pattern[str], float], ...]:
    pattern = []
    for key, value in _pattern_items("alpha_pattern", raw, reasons):
        compiled = _compile("alpha_pattern", rf"(.*\.)?({key})$", reasons)
        alpha = _number(f"alpha_pattern[{key!r}]", value, reasons)
        if compiled is not None and alpha is not None:
            pattern.append((compiled, alpha))
    return tuple(pattern)


def _rank(field_name: str, r: Any, max_lora_rank: int, reasons: list[str]) -> int | None:
    if isinstance(r, bool) or not isinstance(r, int):
        reasons.append(f"{field_name} must be an integer, got {r!r}")
    elif r < 1:
        reasons.append(f"{field_name} must be >= 1, got {r}")
    elif r > max_lora_rank:
        reasons.append(f"{field_name} = {r} is above max_lora_rank = {max_lora_rank}")
    else:
        return r
    return None


def _number(field_name: str, value: Any, reasons: list[str]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        reasons.append(f"{field_name} must be a finite number, got {value!r}")
        return None
    return float(value)


def _compile(field_name: str, pattern: str, reasons: list[str]) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        reasons.append(f"{field_name}: invalid regular expression {pattern!r}: {e}")
        return None


def _names_or_regex(field_name: str, value: Any, reasons: list[str]) -> Names | None:
    if isinstance(value, str):
        return _compile(field_name, value, reasons)
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    reasons.append(f"{field_name} must be a list of module names or a regex string, got {value!r}")
    return None


def _pattern_items(field_name: str, value: Any, reasons: list[str]) -> list[tuple[str, Any]]:
    if not value:
        return []
    if not isinstance(value, dict):
        reasons.append(f"{field_name} must be an object, got {value!r}")
        return []
    return list(value.items())
