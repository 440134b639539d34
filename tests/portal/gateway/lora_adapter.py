"""Test helper: a random PEFT LoRA adapter for the default model's shapes (SmolLM2-135M),
written the way PEFT's save_pretrained lays it out (adapter_config.json + safetensors named
base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight). The config is
written directly (importing PEFT costs seconds); its keys are the ones PEFT writes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference.lora.validation import module_shapes
from inference.models.loader import open_checkpoint
from protocol.adapter_format import module_path

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def write_adapter(out: Path, model_path: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                  b_scale: float = 0.05) -> Path:
    config = open_checkpoint(model_path).config
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }, indent=2))
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGETS:
            d_in, d_out = shapes[module]
            prefix = f"base_model.model.{module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in**0.5).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * b_scale).contiguous()
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out
