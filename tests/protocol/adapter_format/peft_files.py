"""Test helper: PEFT LoRA adapter directories laid out as PeftModel.save_pretrained writes them,
made with numpy alone (milliseconds, no torch), for a tiny base. Import as
`tests.protocol.adapter_format.peft_files`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from protocol.adapter_format import BaseShapes, module_path

# Small enough to write adapters in microseconds; named like the default model, so the base
# name rule compares names as in production. Projections (in, out): q/o 16x16, k/v 16x8,
# gate/up 16x32, down 32x16.
TINY = BaseShapes(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    num_hidden_layers=2,
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_lora_rank=8,
)


class BF16:
    """Tensor values stored as bfloat16 (numpy has none): float32 values cut to their top
    16 bits, or bit patterns given as uint16."""

    def __init__(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        self.bits = values if values.dtype == np.uint16 else (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def lora_config(**overrides) -> dict:
    """An adapter_config.json as PEFT writes it: r=4, alpha 8 on q_proj and v_proj."""
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": TINY.name,
        "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }  # fmt: skip
    config.update(overrides)
    return config


def tensor_key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.{module_path(layer, module)}.lora_{ab}.weight"


def lora_tensors(
    base: BaseShapes = TINY, *, rank: int = 4, targets=("q_proj", "v_proj"), layers=None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random float32 A [rank, in] and B [out, rank] for `targets` in `layers` (default: all)."""
    rng = np.random.default_rng(seed)
    shapes = base.module_shapes()
    tensors = {}
    for layer in range(base.num_hidden_layers) if layers is None else layers:
        for module in targets:
            d_in, d_out = shapes[module]
            tensors[tensor_key(layer, module, "A")] = rng.standard_normal((rank, d_in)).astype(np.float32)
            tensors[tensor_key(layer, module, "B")] = rng.standard_normal((d_out, rank)).astype(np.float32)
    return tensors


def write_adapter(directory: Path, *, config: dict | None = None, tensors: dict | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors in `directory` (defaults: lora_config()
    and lora_tensors()); a tensor may be a numpy array or BF16."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(lora_config() if config is None else config))
    save_tensors(directory / "adapter_model.safetensors", lora_tensors() if tensors is None else tensors)
    return directory


def save_tensors(path: Path, tensors: dict) -> None:
    arrays = {k: v.bits if isinstance(v, BF16) else np.ascontiguousarray(v) for k, v in tensors.items()}
    specs = {
        k: TensorSpec(
            dtype="bfloat16" if isinstance(tensors[k], BF16) else a.dtype.name,
            shape=list(a.shape),
            data_ptr=a.ctypes.data,
            data_len=a.nbytes,
        )
        for k, a in arrays.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})
