"""Every reason a PEFT LoRA directory is refused, checked before anything else touches it.

A bad adapter must never evict or disturb a resident one, so `load_adapter` runs all of these
first and only returns a finished `LoRAAdapter` when every check passed. Order (cheap and
dangerous first):

    directory exists, no pickle file anywhere in it (never unpickled, not even opened)
    adapter_config.json parses and describes a plain LoRA we can serve   -> LoRASettings
    target_modules / layers_to_transform resolve, with PEFT's semantics, to projections
        of this base                                                  -> {(layer, module): (r, alpha)}
    adapter_model.safetensors header parses; every tensor is the A or B of a targeted
        projection, pairs complete, shapes match the base              -> {(layer, module): (key_a, key_b)}
    base_model_name_or_path does not clearly name another model
    every value finite (checked as the data is read)

Every failure is an `AdapterError` whose message is "adapter 'NAME': REASON".
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from inference.models.config import LlamaConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_CONFIG_BYTES = 1 << 20

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_SUPPORTED_TEXT = ", ".join(SUPPORTED_MODULES)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtype names

# PEFT's default target_modules for model_type "llama" when the config leaves them out.
PEFT_LLAMA_DEFAULT_TARGETS = ("q_proj", "v_proj")

# LoraConfig fields that switch on a variant whose forward pass is not plain x·Aᵀ·Bᵀ·scale
# (or that changes the base model itself). Training-only variants (VeLoRA, MiCA) are fine.
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
# init_lora_weights values whose saved adapter only works on a base PEFT modified in place,
# unless it was converted with save_pretrained(path_initial_model_for_weight_conversion=...).
_MODIFIED_BASE_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


class AdapterError(ValueError):
    """An adapter that cannot be served; `reason` says why, `adapter` names it."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"adapter {adapter!r}: {reason}")
        self.adapter = adapter
        self.reason = reason

    def __reduce__(self):  # keep both fields across pickling (e.g. a process pool)
        return (type(self), (self.adapter, self.reason))


# --- the base model as PEFT sees it ---------------------------------------------------------


def module_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA can adapt, in HF's unfused layout."""
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, config.q_size),
        "k_proj": (h, config.kv_size),
        "v_proj": (h, config.kv_size),
        "o_proj": (config.q_size, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def module_path(layer: int, module: str) -> str:
    """HF module name, e.g. (3, "down_proj") -> "model.layers.3.mlp.down_proj"."""
    parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{parent}.{module}"


def _hf_module_names(num_layers: int) -> list[tuple[str, int | None, str | None]]:
    """Every named module of an HF LlamaForCausalLM (root excluded) -> (name, layer, projection);
    layer/projection are None for modules LoRA cannot adapt here (embeddings, norms, lm_head...)."""
    names: list[tuple[str, int | None, str | None]] = [
        (n, None, None)
        for n in ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb")
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


# --- directory and config --------------------------------------------------------------------


def check_directory(adapter: str, directory: Path) -> None:
    """A directory holding no pickle file at any depth, with both PEFT files in it."""
    if not directory.is_dir():
        raise AdapterError(adapter, f"{directory} is not a directory")
    for root, dirs, files in os.walk(directory):  # does not follow symlinked directories
        for entry in sorted(dirs + files):
            if Path(entry).suffix.lower() in PICKLE_SUFFIXES:
                rel = (Path(root) / entry).relative_to(directory).as_posix()
                raise AdapterError(
                    adapter, f"contains pickle file {rel}; only safetensors are accepted"
                )
    if not (directory / CONFIG_FILE).is_file():
        raise AdapterError(adapter, f"missing {CONFIG_FILE}")
    if not (directory / WEIGHTS_FILE).is_file():
        raise AdapterError(adapter, f"missing {WEIGHTS_FILE}")


def read_config(adapter: str, directory: Path) -> dict[str, Any]:
    """adapter_config.json as a dict (a JSON object, at most 1 MiB)."""
    path = directory / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(adapter, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AdapterError(adapter, f"missing {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise AdapterError(adapter, f"cannot read {CONFIG_FILE}: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdapterError(adapter, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(
            adapter, f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}"
        )
    return config


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
    target_modules: tuple[str, ...] | re.Pattern[str]
    exclude_modules: tuple[str, ...] | re.Pattern[str]
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


def parse_settings(adapter: str, config: Mapping[str, Any], max_lora_rank: int) -> LoRASettings:
    """Refuse anything but a plain LoRA on linear layers that fits `max_lora_rank`."""

    def fail(reason: str) -> AdapterError:
        return AdapterError(adapter, reason)

    peft_type = config.get("peft_type")
    if peft_type is None:
        raise fail(f"{CONFIG_FILE} has no peft_type; only LORA adapters are supported")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        raise fail("use_dora is true; DoRA adapters are not supported")
    for key, what in _UNSUPPORTED_VARIANTS.items():
        if config.get(key):
            raise fail(f"{key} is set; {what} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_MODIFIED_BASE_INITS):
        raise fail(
            f"init_lora_weights {init!r}: the adapter expects a base model that PEFT modified in "
            "place; convert it with save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
    modules_to_save = config.get("modules_to_save")
    if modules_to_save:
        raise fail(
            f"modules_to_save {modules_to_save!r} is not supported (it replaces whole base modules)"
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise fail(f"bias {bias!r} is not supported; only 'none' is")

    r = config.get("r", 8)  # PEFT's default
    if isinstance(r, bool) or not isinstance(r, int):
        raise fail(f"r must be an integer, got {r!r}")
    _check_rank(adapter, "r", r, max_lora_rank)
    alpha = _number(adapter, "lora_alpha", config.get("lora_alpha", 8))
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail(f"use_rslora must be true or false, got {use_rslora!r}")

    raw_targets = config.get("target_modules")
    if raw_targets is None:
        targets: tuple[str, ...] | re.Pattern[str] = PEFT_LLAMA_DEFAULT_TARGETS
    elif isinstance(raw_targets, str) and raw_targets.lower() == "all-linear":
        targets = SUPPORTED_MODULES  # PEFT: every linear layer except the output layer
    else:
        targets = _names_or_regex(adapter, "target_modules", raw_targets)
    excludes = _names_or_regex(adapter, "exclude_modules", config.get("exclude_modules") or ())

    layers = config.get("layers_to_transform")
    layers_pattern = config.get("layers_pattern") or []
    if isinstance(targets, re.Pattern) and (layers is not None or layers_pattern):
        raise fail(
            "layers_to_transform / layers_pattern cannot be used with a regex target_modules"
        )
    if layers_pattern and layers is None:
        raise fail("layers_pattern is set without layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (
        not isinstance(layers, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
    ):
        raise fail(f"layers_to_transform must be a layer index or a list of them, got {layers!r}")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    if not isinstance(layers_pattern, list) or not all(isinstance(p, str) for p in layers_pattern):
        raise fail(f"layers_pattern must be a string or a list of strings, got {layers_pattern!r}")

    rank_pattern = []
    for key, value in _pattern_items(adapter, "rank_pattern", config.get("rank_pattern")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(f"rank_pattern[{key!r}] must be an integer, got {value!r}")
        _check_rank(adapter, f"rank_pattern[{key!r}]", value, max_lora_rank)
        rank_pattern.append((_compile(adapter, "rank_pattern", rf"(.*\.)?({key})$"), value))
    alpha_pattern = []
    for key, value in _pattern_items(adapter, "alpha_pattern", config.get("alpha_pattern")):
        alpha_pattern.append(
            (
                _compile(adapter, "alpha_pattern", rf"(.*\.)?({key})$"),
                _number(adapter, f"alpha_pattern[{key!r}]", value),
            )
        )

    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise fail(f"base_model_name_or_path must be a string, got {base!r}")
    return LoRASettings(
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=targets,
        exclude_modules=excludes,
        layers_to_transform=None if not layers else frozenset(layers),  # [] means all in PEFT
        layers_pattern=tuple(
            _compile(adapter, "layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
            for p in layers_pattern
        ),
        rank_pattern=tuple(rank_pattern),
        alpha_pattern=tuple(alpha_pattern),
        base_model_name_or_path=base or None,
    )


def _check_rank(adapter: str, field: str, r: int, max_lora_rank: int) -> None:
    if r < 1:
        raise AdapterError(adapter, f"{field} must be >= 1, got {r}")
    if r > max_lora_rank:
        raise AdapterError(adapter, f"{field} = {r} is above max_lora_rank = {max_lora_rank}")


def _number(adapter: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterError(adapter, f"{field} must be a finite number, got {value!r}")
    return float(value)


def _compile(adapter: str, field: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise AdapterError(
            adapter, f"{field}: invalid regular expression {pattern!r}: {e}"
        ) from None


def _names_or_regex(adapter: str, field: str, value: Any) -> tuple[str, ...] | re.Pattern[str]:
    if isinstance(value, str):
        return _compile(adapter, field, value)
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise AdapterError(
        adapter, f"{field} must be a list of module names or a regex string, got {value!r}"
    )


def _pattern_items(adapter: str, field: str, value: Any) -> list[tuple[str, Any]]:
    if not value:
        return []
    if not isinstance(value, dict):
        raise AdapterError(adapter, f"{field} must be an object, got {value!r}")
    return list(value.items())


# --- which projections PEFT would wrap -----------------------------------------------------------


def resolve_targets(
    adapter: str, settings: LoRASettings, config: LlamaConfig
) -> dict[tuple[int, str], tuple[int, float]]:
    """{(layer, module): (rank, alpha)} for every projection PEFT would wrap in this base.

    Matching follows PEFT's check_target_module_exists: exclusions first; a regex must match
    the full module name; a list entry matches a name equal to it (then layers_to_transform is
    not consulted, as in PEFT) or ending with "." + entry (then the layer index, found by
    layers_pattern or PEFT's default, must be in layers_to_transform). Anything selected that
    is not one of the seven projections (embed_tokens, lm_head, norms, containers) is refused.
    """
    names = _hf_module_names(config.num_hidden_layers)
    out_of_range = sorted(
        i for i in settings.layers_to_transform or () if i >= config.num_hidden_layers
    )
    if out_of_range:
        raise AdapterError(
            adapter,
            f"layers_to_transform names layer {out_of_range[0]}; the base model has "
            f"{config.num_hidden_layers} layers",
        )
    if isinstance(settings.target_modules, tuple):
        for entry in settings.target_modules:  # every entry must name projections and only those
            matched = [
                (n, m)
                for n, _, m in names
                if not _excluded(settings, n) and _name_matches(entry, n)
            ]
            bad = [n for n, m in matched if m is None]
            if bad:
                raise AdapterError(adapter, _unsupported_target(repr(entry), bad[0]))
            if not matched:
                raise AdapterError(
                    adapter,
                    f"target_modules entry {entry!r} matches no module of the base model "
                    f"(supported: {_SUPPORTED_TEXT})",
                )

    targets: dict[tuple[int, str], tuple[int, float]] = {}
    for name, layer, module in names:
        if _excluded(settings, name) or not _targeted(settings, name):
            continue
        if module is None:  # only a regex gets here: list entries were checked above
            pattern = settings.target_modules
            what = repr(pattern.pattern) if isinstance(pattern, re.Pattern) else "entries"
            raise AdapterError(adapter, _unsupported_target(what, name))
        targets[(layer, module)] = settings.rank_and_alpha(name)
    if not targets:
        raise AdapterError(adapter, "target_modules selects no projection of the base model")
    return targets


def _unsupported_target(what: str, name: str) -> str:
    return (
        f"target_modules {what} selects {name}, which is not a supported target module "
        f"(supported: {_SUPPORTED_TEXT})"
    )


def _name_matches(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _excluded(settings: LoRASettings, name: str) -> bool:
    ex = settings.exclude_modules
    if isinstance(ex, re.Pattern):
        return ex.fullmatch(name) is not None
    return any(_name_matches(e, name) for e in ex)


def _targeted(settings: LoRASettings, name: str) -> bool:
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
    else:  # PEFT: the first numbered segment after a named one
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    return match is not None and int(match.group("idx")) in settings.layers_to_transform


# --- the safetensors file --------------------------------------------------------------------------

# PEFT writes "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"; some versions
# keep the adapter name ("lora_A.default.weight"); a bare LlamaModel base drops one "model.".
_TENSOR_KEY = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<module>[^.]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<infix>[^.]+))?\.weight"
)


@contextlib.contextmanager
def open_weights(adapter: str, path: Path) -> Iterator[Any]:
    """safe_open(path), with a corrupt or truncated file (bad header length, offsets beyond
    the end, ...) reported as an AdapterError, whether found at open or while reading."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise AdapterError(adapter, f"{WEIGHTS_FILE} is corrupt or truncated: {e}") from None


def read_header(adapter: str, f: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} without reading any data."""
    header = {}
    for key in f.keys():
        view = f.get_slice(key)
        header[key] = (view.get_dtype(), tuple(view.get_shape()))
    if not header:
        raise AdapterError(adapter, f"{WEIGHTS_FILE} holds no tensors (empty adapter)")
    return header


def check_tensors(
    adapter: str,
    header: Mapping[str, tuple[str, tuple[int, ...]]],
    targets: Mapping[tuple[int, str], tuple[int, float]],
    config: LlamaConfig,
) -> dict[tuple[int, str], tuple[str, str]]:
    """Map every tensor to the A or B of a targeted projection of this base -> {(layer, module):
    (key of A, key of B)}. Targeted projections with no tensors are allowed (the adapter skips
    them); a tensor the config does not target, a lone A or B, or a wrong shape is refused."""
    num_layers = config.num_hidden_layers
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(header):
        m = _TENSOR_KEY.fullmatch(key)
        if m is None:
            raise AdapterError(
                adapter,
                f"unexpected tensor {key!r}: not the lora_A/lora_B weight of a decoder layer's projection",
            )
        layer, module = int(m["layer"]), m["module"]
        if layer >= num_layers:
            raise AdapterError(
                adapter,
                f"tensor {key!r} is for layer {layer}; the base model has {num_layers} layers "
                f"(0-{num_layers - 1})",
            )
        expected_parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
        if module not in SUPPORTED_MODULES or m["parent"] != expected_parent:
            raise AdapterError(
                adapter,
                f"tensor {key!r} is for module {m['parent']}.{module}, which the base model does "
                f"not have as a LoRA target (supported: {_SUPPORTED_TEXT})",
            )
        if (layer, module) not in targets:
            raise AdapterError(
                adapter,
                f"tensor {key!r} is for {module_path(layer, module)}, which {CONFIG_FILE} does "
                "not target (target_modules / exclude_modules / layers_to_transform)",
            )
        half = halves.setdefault((layer, module), {})
        if m["ab"] in half:
            raise AdapterError(
                adapter, f"tensors {half[m['ab']]!r} and {key!r} are the same weight"
            )
        half[m["ab"]] = key
        dtype, shape = header[key]
        if dtype not in FLOAT_DTYPES:
            raise AdapterError(
                adapter, f"tensor {key!r} has dtype {dtype}; expected one of {FLOAT_DTYPES}"
            )

    shapes = module_shapes(config)
    pairs = {}
    for (layer, module), half in sorted(halves.items()):
        path = module_path(layer, module)
        for ab in "AB":
            if ab not in half:
                other = half["B" if ab == "A" else "A"]
                raise AdapterError(adapter, f"{path} has {other!r} but no lora_{ab} weight")
        rank = targets[(layer, module)][0]
        in_features, out_features = shapes[module]
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for ab, (rows, cols) in want.items():
            got = header[half[ab]][1]
            if got != (rows, cols):
                layout = (
                    f"[r={rank}, in_features={in_features}]"
                    if ab == "A"
                    else f"[out_features={out_features}, r={rank}]"
                )
                raise AdapterError(
                    adapter,
                    f"tensor {half[ab]!r} has shape {list(got)}; {path} of the base model needs "
                    f"{list((rows, cols))} {layout}",
                )
        pairs[(layer, module)] = (half["A"], half["B"])
    return pairs


def check_finite(adapter: str, key: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        bad = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise AdapterError(adapter, f"tensor {key!r} contains {bad} values")


# --- base_model_name_or_path --------------------------------------------------------------------

# A parameter-count token: "135m", "1.7b", "8b", "8x7b" (experts x size).
_SIZE_TOKEN = re.compile(r"(?:(?P<experts>\d+)x)?(?P<num>\d+(?:\.\d+)?)(?P<unit>[mbt])")
_UNITS = {"m": 1e6, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class ModelName:
    """What a model id says about the model: family ("smollm2", "llama31") and parameter count."""

    family: str
    params: float

    def same_model(self, other: ModelName) -> bool:
        same_size = abs(self.params - other.params) <= 0.01 * max(self.params, other.params)
        # Lenient on family spelling: "llama31" vs "metallama31", "smollm2" vs "smollm2".
        return same_size and (self.family in other.family or other.family in self.family)


def parse_model_name(name: str) -> ModelName | None:
    """Parse a model id: "HuggingFaceTB/SmolLM2-135M-Instruct", "Smollm2 135M 8k ..." (a GGUF
    general.name) or "/models/Llama-3.1-8B" -> ModelName; None when the last path component has no family
    followed by a size token (a bare local directory, "my-adapter-base", ...)."""
    last = re.split(r"[\\/]", name.strip().rstrip("/\\"))[-1].lower()
    tokens = [t for t in re.split(r"[-_\s]+", last) if t]
    for i, token in enumerate(tokens):
        m = _SIZE_TOKEN.fullmatch(token)
        if m is None:
            continue
        family = re.sub(r"[^a-z0-9]", "", "".join(tokens[:i]))
        if not re.search(r"[a-z]", family):
            return None
        params = float(m["num"]) * _UNITS[m["unit"]] * int(m["experts"] or 1)
        return ModelName(family, params)
    return None


def check_base_model(adapter: str, claimed: str | None, base_name: str, strict: bool) -> str | None:
    """Refuse an adapter whose base_model_name_or_path clearly names another model than the one
    served (another family or size). When the name cannot be compared (missing, a local path,
    an unrecognisable id, or a base whose own name is unrecognisable) return a warning to log —
    the tensor shapes already matched — or, with `strict`, refuse it too. None: same model."""
    served = parse_model_name(base_name)
    named = parse_model_name(claimed) if claimed else None
    if named is not None and served is not None:
        if named.same_model(served):
            return None
        raise AdapterError(
            adapter,
            f"base_model_name_or_path {claimed!r} names a different model than the served "
            f"base {base_name!r}",
        )
    why = (
        "is missing"
        if not claimed
        else f"{claimed!r} is not a recognisable model id"
        if named is None
        else f"{claimed!r} cannot be compared with the served base, whose name is not recognisable"
    )
    if strict:
        raise AdapterError(
            adapter,
            f"base_model_name_or_path {why}; strict_base_match requires it to name the served "
            f"base {base_name!r}",
        )
    return (
        f"adapter {adapter!r}: base_model_name_or_path {why}; accepted because every tensor "
        f"shape matches the served base {base_name!r}"
    )
