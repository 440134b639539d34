"""Judge an extracted PEFT LoRA directory the way the inference engine will, without torch.

The engine (inference/lora/validation.py) stops at the first problem; here every independent
problem is collected as a human-readable reason, so a tenant fixes them all in one go. The
checks mirror the engine's:

    every file's role (adapter_files.py): no pickle anywhere (.bin/.pt/...: never opened), no
        unknown binary; the model card, tokenizer and other text files beside the adapter are
        ignored; both PEFT files present at the top
    adapter_config.json: a JSON object describing a plain LoRA (no DoRA, modules_to_save,
        bias, variants, PiSSA-style inits), r and rank_pattern within the fleet's max rank
    target_modules / layers_to_transform select projections of this base, and only those
    adapter_model.safetensors: the header parsed by hand (8-byte little-endian length + JSON;
        never unpickled, offsets checked against the file size, so a truncated file is caught),
        every tensor the lora_A/lora_B of a targeted projection, pairs complete, float dtype,
        shapes [r, in_features] / [out_features, r] for this base
    base_model_name_or_path does not name another model (shapes decide when it cannot be compared)
    every value finite (NaN/Inf), scanned with numpy memory maps in bounded chunks

The portal never imports torch or the inference package; this module only needs json + numpy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from portal.adapters.adapter_files import (
    ADAPTER_FILES,
    CONFIG_FILE,
    SNIFF_BYTES,
    WEIGHTS_FILE,
    file_role,
)

MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound
MAX_REASONS = 20

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_SUPPORTED_TEXT = ", ".join(SUPPORTED_MODULES)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
PEFT_LLAMA_DEFAULT_TARGETS = ("q_proj", "v_proj")
SCAN_ELEMENTS = 1 << 20  # NaN/Inf scan chunk (elements)

_UNSUPPORTED_VARIANTS = {
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
_MODIFIED_BASE_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


# --- the base model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseShapes:
    """The served base model's dimensions, as far as LoRA shapes go, and the fleet's max rank."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_lora_rank: int = 16

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, *, default_max_rank: int = 16) -> BaseShapes | None:
        """From a worker's base-model description (HF config.json keys); None when incomplete."""
        if not isinstance(config, Mapping):
            return None
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                # The checkpoint's own name is what the engine compares base_model_name_or_path with.
                name=str(config.get("checkpoint_name") or config.get("name") or config.get("_name_or_path") or ""),
                num_hidden_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                max_lora_rank=int(config.get("max_lora_rank") or default_max_rank),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection, in HF's unfused layout."""
        h, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }  # fmt: skip


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
    file_sha256: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0  # of the two adapter files


class _Reasons(list):
    def add(self, reason: str) -> None:
        if reason not in self:
            self.append(reason)


def module_path(layer: int, module: str) -> str:
    parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{parent}.{module}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def content_sha256(files: Mapping[str, str]) -> str:
    """One hash for the adapter's content: its files' hashes, by name."""
    return hashlib.sha256("".join(f"{n}:{files[n]}\n" for n in sorted(files)).encode()).hexdigest()


# --- the whole directory -----------------------------------------------------------------------


def validate_adapter_dir(path: Path, base: BaseShapes, max_lora_rank: int | None = None) -> ValidationResult:
    """Every reason the adapter in directory `path` cannot be served by `base` (empty: it can)."""
    max_rank = max_lora_rank if max_lora_rank is not None else base.max_lora_rank
    reasons = _Reasons()
    result = ValidationResult(ok=False)
    path = Path(path)
    if not path.is_dir():
        return ValidationResult(ok=False, reasons=[f"{path.name} is not a directory"])

    for root, dirs, files in os.walk(path):
        for entry in sorted(dirs + files):
            full = Path(root) / entry
            rel = full.relative_to(path).as_posix()
            if full.is_symlink():
                reasons.add(f"{rel} is a symbolic link; links are not accepted")
            elif full.is_file() and (role := file_role(rel, read_head=lambda f=full: _head(f))).refused:
                reasons.add(role.reason)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    have_config = config_path.is_file() and not config_path.is_symlink()
    have_weights = weights_path.is_file() and not weights_path.is_symlink()
    if not have_config:
        reasons.add(f"missing {CONFIG_FILE}")
    if not have_weights:
        reasons.add(f"missing {WEIGHTS_FILE}")

    settings = None
    if have_config:
        config = _read_config(config_path, reasons)
        if config is not None:
            settings = _parse_settings(config, max_rank, reasons)
    targets = _resolve_targets(settings, base, reasons) if settings is not None else None

    header = None
    if have_weights:
        header = _read_header(weights_path, reasons)
    if header is not None:
        _check_tensors(header, targets, base, reasons)
        if not any("corrupt or truncated" in r for r in reasons):
            _check_finite(weights_path, header, reasons)

    if settings is not None:
        result.alpha = settings.lora_alpha
        result.base_model = settings.base_model_name_or_path or ""
        warning = _check_base_model(settings.base_model_name_or_path, base.name, reasons)
        if warning:
            result.warnings.append(warning)
    if targets:
        result.rank = max(r for r, _ in targets.values())
        result.target_modules = sorted({m for _, m in targets}, key=SUPPORTED_MODULES.index)

    if have_config and have_weights:
        result.file_sha256 = {name: file_sha256(path / name) for name in ADAPTER_FILES}
        result.size_bytes = sum((path / name).stat().st_size for name in ADAPTER_FILES)
    result.reasons = _capped(list(reasons))
    result.ok = not reasons
    return result


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(SNIFF_BYTES)


def _capped(reasons: list[str]) -> list[str]:
    if len(reasons) <= MAX_REASONS:
        return reasons
    return reasons[:MAX_REASONS] + [f"... and {len(reasons) - MAX_REASONS} more problems of the same kinds"]


# --- adapter_config.json -------------------------------------------------------------------------


def _read_config(path: Path, reasons: _Reasons) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            reasons.add(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reasons.add(f"cannot read {CONFIG_FILE}: {e}")
        return None
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        reasons.add(f"{CONFIG_FILE} is not valid JSON: {e}")
        return None
    if not isinstance(config, dict):
        reasons.add(f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
        return None
    return config


@dataclass(frozen=True)
class _Settings:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | re.Pattern[str]
    exclude_modules: tuple[str, ...] | re.Pattern[str]
    layers_to_transform: frozenset[int] | None
    layers_pattern: tuple[re.Pattern[str], ...]
    rank_pattern: tuple[tuple[re.Pattern[str], int], ...]
    base_model_name_or_path: str | None

    def rank(self, full_name: str) -> int:
        return next((v for p, v in self.rank_pattern if p.match(full_name)), self.r)


def _parse_settings(config: Mapping[str, Any], max_rank: int, reasons: _Reasons) -> _Settings | None:
    """The config as a plain LoRA, or None (with reasons) when it is not one we can serve."""
    before = len(reasons)
    peft_type = config.get("peft_type")
    if peft_type is None:
        reasons.add(f"{CONFIG_FILE} has no peft_type; only LORA adapters are supported")
    elif peft_type != "LORA":
        reasons.add(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        reasons.add("use_dora is true; DoRA adapters are not supported")
    for key, what in _UNSUPPORTED_VARIANTS.items():
        if config.get(key):
            reasons.add(f"{key} is set; {what} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_MODIFIED_BASE_INITS):
        reasons.add(
            f"init_lora_weights {init!r}: the adapter expects a base model that PEFT modified in place; "
            "convert it with save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
    if modules_to_save := config.get("modules_to_save"):
        reasons.add(f"modules_to_save {modules_to_save!r} is not supported (it replaces whole base modules)")
    bias = config.get("bias", "none")
    if bias != "none":
        reasons.add(f"bias {bias!r} is not supported; only 'none' is")

    r = config.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int):
        reasons.add(f"r must be an integer, got {r!r}")
        r = None
    else:
        _check_rank("r", r, max_rank, reasons)
    alpha = _number("lora_alpha", config.get("lora_alpha", 8), reasons)
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        reasons.add(f"use_rslora must be true or false, got {use_rslora!r}")

    raw_targets = config.get("target_modules")
    if raw_targets is None:
        targets: Any = PEFT_LLAMA_DEFAULT_TARGETS
    elif isinstance(raw_targets, str) and raw_targets.lower() == "all-linear":
        targets = SUPPORTED_MODULES
    else:
        targets = _names_or_regex("target_modules", raw_targets, reasons)
    excludes = _names_or_regex("exclude_modules", config.get("exclude_modules") or (), reasons)

    layers = config.get("layers_to_transform")
    layers_pattern = config.get("layers_pattern") or []
    if isinstance(targets, re.Pattern) and (layers is not None or layers_pattern):
        reasons.add("layers_to_transform / layers_pattern cannot be used with a regex target_modules")
    if layers_pattern and layers is None:
        reasons.add("layers_pattern is set without layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (
        not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
    ):
        reasons.add(f"layers_to_transform must be a layer index or a list of them, got {layers!r}")
        layers = None
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    if not isinstance(layers_pattern, list) or not all(isinstance(p, str) for p in layers_pattern):
        reasons.add(f"layers_pattern must be a string or a list of strings, got {layers_pattern!r}")
        layers_pattern = []

    rank_pattern = []
    for key, value in _pattern_items("rank_pattern", config.get("rank_pattern"), reasons):
        if isinstance(value, bool) or not isinstance(value, int):
            reasons.add(f"rank_pattern[{key!r}] must be an integer, got {value!r}")
            continue
        _check_rank(f"rank_pattern[{key!r}]", value, max_rank, reasons)
        if (pattern := _compile("rank_pattern", rf"(.*\.)?({key})$", reasons)) is not None:
            rank_pattern.append((pattern, value))
    for key, value in _pattern_items("alpha_pattern", config.get("alpha_pattern"), reasons):
        _number(f"alpha_pattern[{key!r}]", value, reasons)
        _compile("alpha_pattern", rf"(.*\.)?({key})$", reasons)

    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        reasons.add(f"base_model_name_or_path must be a string, got {base!r}")
        base = None
    compiled_layers_pattern = tuple(
        p for p in (_compile("layers_pattern", rf"(?:^|.*?\.){lp}\.(?P<idx>\d+)\.", reasons) for lp in layers_pattern) if p
    )
    if len(reasons) > before or r is None or alpha is None or targets is None or excludes is None:
        return None
    return _Settings(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        exclude_modules=excludes,
        layers_to_transform=None if not layers else frozenset(layers),
        layers_pattern=compiled_layers_pattern,
        rank_pattern=tuple(rank_pattern),
        base_model_name_or_path=base or None,
    )


def _check_rank(field_name: str, r: int, max_rank: int, reasons: _Reasons) -> None:
    if r < 1:
        reasons.add(f"{field_name} must be >= 1, got {r}")
    elif r > max_rank:
        reasons.add(f"{field_name} = {r} is above the fleet's max LoRA rank of {max_rank}")


def _number(field_name: str, value: Any, reasons: _Reasons) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        reasons.add(f"{field_name} must be a finite number, got {value!r}")
        return None
    return float(value)


def _compile(field_name: str, pattern: str, reasons: _Reasons) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        reasons.add(f"{field_name}: invalid regular expression {pattern!r}: {e}")
        return None


def _names_or_regex(field_name: str, value: Any, reasons: _Reasons):
    if isinstance(value, str):
        return _compile(field_name, value, reasons)
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    reasons.add(f"{field_name} must be a list of module names or a regex string, got {value!r}")
    return None


def _pattern_items(field_name: str, value: Any, reasons: _Reasons) -> list[tuple[str, Any]]:
    if not value:
        return []
    if not isinstance(value, dict):
        reasons.add(f"{field_name} must be an object, got {value!r}")
        return []
    return list(value.items())


# --- which projections PEFT would wrap (PEFT's check_target_module_exists) ----------------------


def _hf_module_names(num_layers: int) -> list[tuple[str, int | None, str | None]]:
    names: list[tuple[str, int | None, str | None]] = [
        (n, None, None) for n in ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb")
    ]
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        names += [(prefix, None, None), (f"{prefix}.self_attn", None, None)]
        names += [(module_path(i, m), i, m) for m in ATTENTION_MODULES]
        names += [(f"{prefix}.mlp", None, None)]
        names += [(module_path(i, m), i, m) for m in MLP_MODULES]
        names += [
            (f"{prefix}.mlp.act_fn", None, None),
            (f"{prefix}.input_layernorm", None, None),
            (f"{prefix}.post_attention_layernorm", None, None),
        ]
    names.append(("lm_head", None, None))
    return names


def _name_matches(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _excluded(settings: _Settings, name: str) -> bool:
    ex = settings.exclude_modules
    if isinstance(ex, re.Pattern):
        return ex.fullmatch(name) is not None
    return any(_name_matches(e, name) for e in ex)


def _targeted(settings: _Settings, name: str) -> bool:
    targets = settings.target_modules
    if isinstance(targets, re.Pattern):
        return targets.fullmatch(name) is not None
    if name in targets:
        return True
    if not any(name.endswith("." + t) for t in targets):
        return False
    if settings.layers_to_transform is None:
        return True
    if settings.layers_pattern:
        match = next((m for p in settings.layers_pattern if (m := p.match(name))), None)
    else:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    return match is not None and int(match.group("idx")) in settings.layers_to_transform


def _unsupported_target(what: str, name: str) -> str:
    return (
        f"target_modules {what} selects {name}, which is not a supported target module "
        f"(supported: {_SUPPORTED_TEXT})"
    )


def _resolve_targets(settings: _Settings, base: BaseShapes, reasons: _Reasons) -> dict[tuple[int, str], tuple[int, str]] | None:
    """{(layer, module): (rank, full name)} PEFT would wrap, or None (with reasons)."""
    before = len(reasons)
    names = _hf_module_names(base.num_hidden_layers)
    out_of_range = sorted(i for i in settings.layers_to_transform or () if i >= base.num_hidden_layers)
    if out_of_range:
        reasons.add(
            f"layers_to_transform names layer {out_of_range[0]}; the base model has {base.num_hidden_layers} layers"
        )
    if isinstance(settings.target_modules, tuple):
        for entry in settings.target_modules:
            matched = [(n, m) for n, _, m in names if not _excluded(settings, n) and _name_matches(entry, n)]
            bad = [n for n, m in matched if m is None]
            if bad:
                reasons.add(_unsupported_target(repr(entry), bad[0]))
            elif not matched:
                reasons.add(
                    f"target_modules entry {entry!r} matches no module of the base model (supported: {_SUPPORTED_TEXT})"
                )
    targets: dict[tuple[int, str], tuple[int, str]] = {}
    for name, layer, module in names:
        if _excluded(settings, name) or not _targeted(settings, name):
            continue
        if module is None:
            if isinstance(settings.target_modules, re.Pattern):
                reasons.add(_unsupported_target(repr(settings.target_modules.pattern), name))
            continue
        targets[(layer, module)] = (settings.rank(name), name)
    if not targets and len(reasons) == before:
        reasons.add("target_modules selects no projection of the base model")
    return None if len(reasons) > before else targets


# --- adapter_model.safetensors -------------------------------------------------------------------

_TENSOR_KEY = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<module>[^.]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<infix>[^.]+))?\.weight"
)


@dataclass(frozen=True)
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the data
    end: int


def _read_header(path: Path, reasons: _Reasons) -> dict[str, _Tensor] | None:
    """The safetensors header, every offset checked against the file; None (with a reason) when
    the file is not a well-formed safetensors file."""

    def corrupt(why: str) -> None:
        reasons.add(f"{WEIGHTS_FILE} is corrupt or truncated: {why}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            corrupt(f"the file is {size} bytes, too short for a safetensors header")
            return None
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            corrupt(f"the header claims {n} bytes but the file has {size - 8} after the length")
            return None
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        corrupt(f"the header is not valid JSON ({e})")
        return None
    if not isinstance(header, dict):
        corrupt("the header is not a JSON object")
        return None
    header.pop("__metadata__", None)
    data_start, data_len = 8 + n, size - 8 - n
    tensors: dict[str, _Tensor] = {}
    spans = []
    for key, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not (isinstance(dtype, str) and isinstance(shape, list)):
                raise TypeError
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            corrupt(f"the header entry for {key!r} is malformed")
            return None
        if dtype not in DTYPE_SIZES:
            reasons.add(f"tensor {key!r} has unknown dtype {dtype}; expected one of {FLOAT_DTYPES}")
            continue
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if end < begin or end - begin != nbytes:
            corrupt(f"tensor {key!r} has {end - begin} bytes of data for shape {shape} {dtype}")
            return None
        if end > data_len:
            corrupt(f"tensor {key!r} ends at byte {end} of a {data_len}-byte data section")
            return None
        spans.append((begin, end, key))
        tensors[key] = _Tensor(dtype, tuple(shape), data_start + begin, data_start + end)
    spans.sort()
    for (_, end_a, key_a), (begin_b, _, key_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            corrupt(f"tensors {key_a!r} and {key_b!r} overlap")
            return None
    if not tensors and not header:
        reasons.add(f"{WEIGHTS_FILE} holds no tensors (empty adapter)")
        return None
    return tensors


def _check_tensors(
    header: Mapping[str, _Tensor],
    targets: Mapping[tuple[int, str], tuple[int, str]] | None,
    base: BaseShapes,
    reasons: _Reasons,
) -> None:
    """Every tensor is the A or B of a targeted projection, in pairs, float, with this base's shapes.
    Without `targets` (the config was refused) the shapes are still checked against the config-free
    facts: layer in range, a supported module, in/out features."""
    num_layers = base.num_hidden_layers
    shapes = base.module_shapes()
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(header):
        m = _TENSOR_KEY.fullmatch(key)
        if m is None:
            reasons.add(f"unexpected tensor {key!r}: not the lora_A/lora_B weight of a decoder layer's projection")
            continue
        layer, module = int(m["layer"]), m["module"]
        if layer >= num_layers:
            reasons.add(
                f"tensor {key!r} is for layer {layer}; the base model has {num_layers} layers (0-{num_layers - 1})"
            )
            continue
        expected_parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
        if module not in SUPPORTED_MODULES or m["parent"] != expected_parent:
            reasons.add(
                f"tensor {key!r} is for module {m['parent']}.{module}, which the base model does not have "
                f"as a LoRA target (supported: {_SUPPORTED_TEXT})"
            )
            continue
        if targets is not None and (layer, module) not in targets:
            reasons.add(
                f"tensor {key!r} is for {module_path(layer, module)}, which {CONFIG_FILE} does not target "
                "(target_modules / exclude_modules / layers_to_transform)"
            )
            continue
        half = halves.setdefault((layer, module), {})
        if m["ab"] in half:
            reasons.add(f"tensors {half[m['ab']]!r} and {key!r} are the same weight")
            continue
        half[m["ab"]] = key
        if header[key].dtype not in FLOAT_DTYPES:
            reasons.add(f"tensor {key!r} has dtype {header[key].dtype}; expected one of {FLOAT_DTYPES}")

    for (layer, module), half in sorted(halves.items()):
        path = module_path(layer, module)
        missing = [ab for ab in "AB" if ab not in half]
        if missing:
            other = half["B" if missing[0] == "A" else "A"]
            reasons.add(f"{path} has {other!r} but no lora_{missing[0]} weight")
            continue
        in_features, out_features = shapes[module]
        shape_a = header[half["A"]].shape
        if targets is not None:
            rank = targets[(layer, module)][0]
        elif len(shape_a) == 2:
            rank = shape_a[0]  # the config was refused: check the features, whatever the rank
        else:
            rank = None
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for ab, (rows, cols) in want.items():
            got = header[half[ab]].shape
            if rank is None or got != (rows, cols):
                layout = f"[r={rank}, in_features={in_features}]" if ab == "A" else f"[out_features={out_features}, r={rank}]"
                reasons.add(
                    f"tensor {half[ab]!r} has shape {list(got)}; {path} of the base model needs "
                    f"{[rows, cols]} {layout}"
                )


_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "BF16": np.uint16}


def _check_finite(path: Path, header: Mapping[str, _Tensor], reasons: _Reasons) -> None:
    """NaN/Inf in any float tensor, read through a memory map in bounded chunks."""
    for key in sorted(header):
        t = header[key]
        dtype = _NUMPY_DTYPES.get(t.dtype)
        count = (t.end - t.start) // DTYPE_SIZES[t.dtype]
        if dtype is None or count == 0:
            continue
        data = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=t.start, shape=(count,))
        try:
            for i in range(0, count, SCAN_ELEMENTS):
                chunk = data[i : i + SCAN_ELEMENTS]
                if t.dtype == "BF16":  # exponent all ones: NaN (mantissa != 0) or Inf
                    special = (chunk & 0x7F80) == 0x7F80
                    if special.any():
                        nan = ((chunk & 0x007F) != 0) & special
                        reasons.add(f"tensor {key!r} contains {'NaN' if nan.any() else 'Inf'} values")
                        break
                elif not np.isfinite(chunk).all():
                    reasons.add(f"tensor {key!r} contains {'NaN' if np.isnan(chunk).any() else 'Inf'} values")
                    break
        finally:
            del data


# --- base_model_name_or_path ------------------------------------------------------------------

_SIZE_TOKEN = re.compile(r"(?:(?P<experts>\d+)x)?(?P<num>\d+(?:\.\d+)?)(?P<unit>[mbt])")
_UNITS = {"m": 1e6, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class ModelName:
    family: str
    params: float

    def same_model(self, other: ModelName) -> bool:
        same_size = abs(self.params - other.params) <= 0.01 * max(self.params, other.params)
        return same_size and (self.family in other.family or other.family in self.family)


def parse_model_name(name: str) -> ModelName | None:
    """"HuggingFaceTB/SmolLM2-135M-Instruct" -> ModelName("smollm2", 135e6); None when the last
    path component has no family followed by a size token (as the engine parses it)."""
    last = re.split(r"[\\/]", name.strip().rstrip("/\\"))[-1].lower()
    tokens = [t for t in re.split(r"[-_\s]+", last) if t]
    for i, token in enumerate(tokens):
        m = _SIZE_TOKEN.fullmatch(token)
        if m is None:
            continue
        family = re.sub(r"[^a-z0-9]", "", "".join(tokens[:i]))
        if not re.search(r"[a-z]", family):
            return None
        return ModelName(family, float(m["num"]) * _UNITS[m["unit"]] * int(m["experts"] or 1))
    return None


def _check_base_model(claimed: str | None, base_name: str, reasons: _Reasons) -> str | None:
    """A reason when the recorded base clearly names another model; a warning when it cannot be
    compared (the shapes decided); None when it names the served base."""
    served = parse_model_name(base_name) if base_name else None
    named = parse_model_name(claimed) if claimed else None
    if named is not None and served is not None:
        if not named.same_model(served):
            reasons.add(
                f"base_model_name_or_path {claimed!r} names a different model than the served base {base_name!r}"
            )
        return None
    why = "is missing" if not claimed else f"{claimed!r} cannot be compared with the served base {base_name!r}"
    return f"base_model_name_or_path {why}; accepted because every tensor shape matches the served base"
