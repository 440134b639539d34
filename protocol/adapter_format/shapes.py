"""The served base model as the adapter rules see it: the seven projections LoRA may adapt, their
HF module names, and each one's (in_features, out_features).

The engine builds a BaseShapes from the checkpoint it loaded; the portal from what a worker
reports at GET /v1/base_model (`BaseShapes.from_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
SUPPORTED_TEXT = ", ".join(SUPPORTED_MODULES)  # as reasons name them


@dataclass(frozen=True)
class BaseShapes:
    """The served base's dimensions, as far as LoRA shapes go, and the largest rank it serves."""

    name: str  # what base_model_name_or_path is compared with (the checkpoint's own name)
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_lora_rank: int = 16

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None, *, default_max_rank: int = 16
    ) -> BaseShapes | None:
        """From a worker's base-model description (HF config.json keys); None when incomplete."""
        if not isinstance(config, Mapping):
            return None
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                name=str(
                    config.get("checkpoint_name")
                    or config.get("name")
                    or config.get("_name_or_path")
                    or ""
                ),
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
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }


def module_parent(module: str) -> str:
    """The decoder-layer block a projection lives in: "self_attn" or "mlp"."""
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


def module_path(layer: int, module: str) -> str:
    """HF module name, e.g. (3, "down_proj") -> "model.layers.3.mlp.down_proj"."""
    return f"model.layers.{layer}.{module_parent(module)}.{module}"
