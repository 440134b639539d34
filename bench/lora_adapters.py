"""Random PEFT LoRA adapters for a base model's shapes, and the workloads the multi-LoRA benchmarks share.

    from bench.lora_adapters import base_config, write_random_adapters
    paths = write_random_adapters(tmp_dir, base_config(model_path), n=8, rank=16)

The directory layout is what PEFT's `save_pretrained` writes: `adapter_config.json` written by
PEFT's own `LoraConfig.save_pretrained`, and `adapter_model.safetensors` with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` (A [r, in],
B [out, r]). Writing the tensors directly (instead of wrapping a 135M model in PEFT) keeps a
thousand adapters cheap. Every adapter gets its own seed, so every content hash (adapter id)
differs. `check_loads_in_peft` proves the layout by loading one into PEFT on a meta-device base.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.lora.validation import module_shapes  # noqa: E402
from inference.models.config import LlamaConfig  # noqa: E402
from inference.models.loader import open_checkpoint  # noqa: E402
from protocol.adapter_format import SUPPORTED_MODULES, module_path  # noqa: E402

# What PEFT records when an adapter was trained on the default model.
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALL_MODULES = tuple(SUPPORTED_MODULES)  # q, k, v, o, gate, up, down


def base_config(model_path: str | Path) -> LlamaConfig:
    """The base's LlamaConfig read from the checkpoint's header (no weights loaded)."""
    return open_checkpoint(model_path).config


def adapter_nbytes(config: LlamaConfig, rank: int, targets=ALL_MODULES, dtype=torch.bfloat16) -> int:
    shapes = module_shapes(config)
    per_layer = sum(rank * (shapes[m][0] + shapes[m][1]) for m in targets)
    return per_layer * config.num_hidden_layers * dtype.itemsize


def write_random_adapter(
    out: Path,
    config: LlamaConfig,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    targets=ALL_MODULES,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    base_model_name_or_path: str = BASE_MODEL_ID,
) -> Path:
    """One adapter directory with random A (kaiming-like scale) and small random B (a trained
    adapter's delta is small against the base, so generation stays a language model's)."""
    from peft import LoraConfig

    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    ).save_pretrained(str(out))
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            prefix = f"base_model.model.{module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in**0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * 0.01).to(dtype)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


def write_random_adapters(root: Path, config: LlamaConfig, n: int, *, prefix: str = "adapter",
                          seed: int = 0, **kwargs) -> list[Path]:
    """n adapters root/{prefix}-{i:04d}, each with its own content."""
    return [
        write_random_adapter(root / f"{prefix}-{i:04d}", config, seed=seed * 100_003 + i, **kwargs)
        for i in range(n)
    ]


def check_loads_in_peft(adapter_dir: Path, config: LlamaConfig) -> None:
    """Load `adapter_dir` into PEFT on an HF Llama of the same shapes (meta device, no weights):
    PEFT must find a LoRA A/B pair for every module the config targets."""
    import transformers
    from peft import PeftModel

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings,
    )
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(hf_config)
    model = PeftModel.from_pretrained(base, str(adapter_dir), low_cpu_mem_usage=True)
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    if not wrapped:
        raise AssertionError(f"PEFT found no LoRA modules in {adapter_dir}")


# --- workloads -------------------------------------------------------------------------------


def zipf_choices(n_items: int, n_draws: int, s: float = 1.0, seed: int = 0) -> list[int]:
    """n_draws indices in [0, n_items), P(k) ∝ 1 / (k + 1)^s (index 0 the most popular)."""
    weights = [1.0 / (k + 1) ** s for k in range(n_items)]
    return random.Random(seed).choices(range(n_items), weights=weights, k=n_draws)


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
