"""LoRAAdapter: a PEFT LoRA directory parsed, validated and ready for the LoRA layers.

    adapter = load_adapter("adapters/support-bot", "support-bot", model.config, max_lora_rank=64)
    w = adapter.get(3, "q_proj")     # LoRAModuleWeights or None (this layer/projection not adapted)
    delta = x @ w.a.T @ w.b.T        # [T, in] -> [T, r] -> [T, out]; the scale is already in w.b

The directory is what PEFT's `save_pretrained` writes: adapter_config.json and
adapter_model.safetensors with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
(A [r, in_features], B [out_features, r], HF's unfused q/k/v and gate/up projections).
Every rule (protocol.adapter_format, through `validation`) runs before the adapter exists, and
every value is checked once read (one pass over the file's buffer), so a caller that receives
one may evict/insert it into caches; a bad one raises AdapterError and nothing else happens.

The id is the sha256 of the config and of every tensor's name, dtype, shape and bytes as
stored: different weights under the same name get a new id; the same content under two names
shares one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from inference.lora import validation as v
from inference.models.config import LlamaConfig
from protocol.adapter_format import WEIGHTS_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoRAModuleWeights:
    """One adapted projection of one layer."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], already multiplied by `scale`
    # lora_alpha / rank, or / sqrt(rank) with rsLoRA; per module when rank/alpha_pattern apply
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A validated adapter; compare adapters by `id`, never by name."""

    id: str  # sha256 hex of config + weights content
    name: str
    # the largest rank of any module: the slot width this adapter needs (= r without rank_pattern)
    rank: int
    config_rank: int  # `r` from adapter_config.json
    alpha: float  # `lora_alpha` from adapter_config.json
    # alpha / r (or alpha / sqrt(r) with use_rslora); modules that rank_pattern/alpha_pattern
    # override carry their own in weights[...].scale
    scale: float
    use_rslora: bool
    # the projections with weights in at least one layer, e.g. {"q_proj", "v_proj"}
    target_modules: frozenset[str]
    weights: Mapping[tuple[int, str], LoRAModuleWeights]  # (layer_idx, module) -> A/B; read-only
    num_layers: int  # of the base it was validated against
    dtype: torch.dtype
    nbytes: int  # bytes of every A and B in `dtype`
    base_model_name_or_path: str | None
    source: Path
    warnings: tuple[str, ...]  # accepted-with-warning notes (e.g. an unverifiable base name)

    def get(self, layer_idx: int, module: str) -> LoRAModuleWeights | None:
        return self.weights.get((layer_idx, module))

    def layers(self, module: str) -> list[int]:
        """The layers in which `module` is adapted, ascending."""
        return sorted(i for i, m in self.weights if m == module)


def load_adapter(
    path: str | Path,
    name: str,
    base_config: LlamaConfig,
    max_lora_rank: int,
    strict_base_match: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Validate and load the PEFT LoRA directory `path` for the base `base_config`.

    Raises AdapterError("adapter 'NAME': REASON") for anything we refuse, the first reason the
    rules give (see protocol.adapter_format); ValueError for bad arguments. Reads safetensors
    only (never unpickles anything), the file in one read; when `dtype` is the stored one the
    returned A/B are views of that one buffer (B scaled in place), so the adapter costs its
    file's size in memory and nothing more.
    """
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    directory = Path(path)

    v.read_ahead(directory / WEIGHTS_FILE)  # the disk reads while the rules run
    check = v.check_adapter(
        name, directory, base_config, max_lora_rank=max_lora_rank, strict=strict_base_match
    )
    settings, targets, header = check.settings, check.targets, check.header

    # One read of the file into a buffer we own; the tensors are views of it (no copy each).
    data = v.read_weights(name, directory / WEIGHTS_FILE, header)
    digest = hashlib.sha256(b"peft-lora\0")
    digest.update(json.dumps(check.config, sort_keys=True, separators=(",", ":")).encode())
    view = memoryview(data)
    for key in sorted(header):  # the bytes as stored, before any scale is folded in
        info = header[key]
        digest.update(f"\0{key}\0{info.dtype}\0{list(info.shape)}\0".encode())
        digest.update(view[info.start : info.end])

    weights: dict[tuple[int, str], LoRAModuleWeights] = {}
    in_place = []  # (key, label) of B tensors scaled where they lie in `data`
    scaled_in_place: dict[float, list[torch.Tensor]] = {}  # scale -> those B tensors (scaled below)
    for (layer, module), (key_a, key_b) in check.pairs.items():
        rank, alpha = targets[(layer, module)]
        scale = settings.scale(rank, alpha)
        a = v.tensor_view(data, header[key_a])  # [r, in] as stored
        b = v.tensor_view(data, header[key_b])  # [out, r] as stored
        b_label = f"{key_b} (scaled by {scale:g}, as {dtype})"
        # Scale folded into B in the compute dtype's own arithmetic (fp32 for bf16/fp16), in
        # place in the buffer when the dtype is kept, so B costs no second copy.
        if b.dtype == dtype:
            if scale != 1.0:
                scaled_in_place.setdefault(scale, []).append(b)
            in_place.append((key_b, b_label))
        else:
            v.check_finite(name, key_b, b)
            b = (b.float() * scale).to(dtype)
            v.check_finite(name, b_label, b)
        if a.dtype != dtype:
            v.check_finite(name, key_a, a)
            a = a.to(dtype)
            v.check_finite(name, f"{key_a} (as {dtype})", a)
        weights[(layer, module)] = LoRAModuleWeights(a=a, b=b, scale=scale)
    for scale, tensors in scaled_in_place.items():  # one call per scale, not one per module (~1 ms)
        torch._foreach_mul_(tensors, scale)
    # What is left in `data` (A and B as stored, those B scaled): all finite in one pass, or
    # the reason named as the rules name it, read again from the file as stored.
    if not v.all_finite(data, header):
        v.check_all_finite(name, v.read_weights(name, directory / WEIGHTS_FILE, header), header)
        for key_b, label in in_place:
            v.check_finite(name, label, v.tensor_view(data, header[key_b]))

    # accepted with a note (an unverifiable base name): logged and kept, named like an error
    warning = f"adapter {name!r}: {check.warnings[0]}" if check.warnings else None
    if warning is not None:
        log.warning(warning)
    return LoRAAdapter(
        id=digest.hexdigest(),
        name=name,
        rank=max(w.rank for w in weights.values()),
        config_rank=settings.r,
        alpha=settings.lora_alpha,
        scale=settings.scale(settings.r, settings.lora_alpha),
        use_rslora=settings.use_rslora,
        target_modules=frozenset(m for _, m in weights),
        weights=MappingProxyType(weights),
        num_layers=base_config.num_hidden_layers,
        dtype=dtype,
        nbytes=sum(w.nbytes for w in weights.values()),
        base_model_name_or_path=settings.base_model_name_or_path,
        source=directory,
        warnings=() if warning is None else (warning,),
    )
