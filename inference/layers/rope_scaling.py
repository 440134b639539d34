"""RopeScaling: the RoPE variants inference/layers/rotary.py implements (no torch here, so a
checkpoint's config can be parsed and checked without it).

    None                 plain RoPE with `rope_theta`
    RopeScaling("linear", factor)                positions divided by `factor` (position interpolation)
    RopeScaling("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
                         Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth
                         ramp in between

Anything else (dynamic NTK, YaRN, ...) is rejected with a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type: unsupported {self.rope_type!r} (supported: linear, llama3)"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                value = getattr(self, name)
                if value is None or not value > 0:
                    raise ValueError(f"rope_scaling.{name} must be > 0 for llama3, got {value}")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    "rope_scaling.high_freq_factor must be > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None) -> RopeScaling | None:
        """HF `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) → ours."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling.rope_type: unsupported {rope_type!r} (supported: default, linear, llama3)"
            )
        if "factor" not in params:
            raise ValueError(f"rope_scaling.factor is required for rope_type {rope_type!r}")
        if rope_type == "linear":
            return cls("linear", float(params["factor"]))
        return cls(
            "llama3",
            float(params["factor"]),
            low_freq_factor=_opt_float(params.get("low_freq_factor")),
            high_freq_factor=_opt_float(params.get("high_freq_factor")),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
