"""The engine's side of the PEFT adapter rules, which live once in protocol.adapter_format.

A bad adapter must never evict or disturb a resident one, so `load_adapter` runs every rule
first (`check_adapter`: files, config, targets, safetensors header and shapes, base name) and
checks each value as it reads the tensors (`check_finite`), returning a LoRAAdapter only when
all passed. The rules report every reason; the engine raises the first as an AdapterError whose
message is "adapter 'NAME': REASON".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from inference.lora.errors import AdapterError
from inference.models.config import LlamaConfig
from protocol.adapter_format import AdapterCheck, BaseShapes, check_adapter_dir
from protocol.adapter_format.files import WEIGHTS_FILE
from protocol.adapter_format.tensors import nonfinite, nonfinite_reason

# safetensors' names of the float dtypes an adapter's tensors may have
SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}


def base_shapes(config: LlamaConfig, *, max_lora_rank: int = 16) -> BaseShapes:
    """The served checkpoint as the adapter rules see it (its name is the checkpoint's own)."""
    return BaseShapes(
        name=config.name,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_lora_rank=max_lora_rank,
    )


def module_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA can adapt, in HF's unfused layout."""
    return base_shapes(config).module_shapes()


def check_adapter(
    adapter: str,
    directory: Path,
    config: LlamaConfig,
    *,
    max_lora_rank: int,
    strict: bool,
) -> AdapterCheck:
    """Every rule but the values' finiteness (checked as the tensors are read); raises the
    first reason as an AdapterError."""
    check = check_adapter_dir(
        directory,
        base_shapes(config, max_lora_rank=max_lora_rank),
        strict_base_match=strict,
        check_values=False,
    )
    if check.reasons:
        raise AdapterError(adapter, check.reasons[0])
    return check


@contextlib.contextmanager
def open_weights(adapter: str, path: Path) -> Iterator[Any]:
    """safe_open(path) into torch, a file that broke since it was checked reported as an
    AdapterError, whether found at open or while reading."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise AdapterError(adapter, f"{WEIGHTS_FILE} is corrupt or truncated: {e}") from None


def check_finite(adapter: str, label: str, tensor: torch.Tensor) -> None:
    """Refuse NaN/Inf in a float CPU tensor (numpy reads its memory in place; no copy)."""
    dtype = SAFETENSORS_DTYPES[tensor.dtype]
    values = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    if kind := nonfinite(values.numpy(), dtype):
        raise AdapterError(adapter, nonfinite_reason(label, kind))
