"""Rotary position embedding: cos/sin per position, and the rotation applied to q and k.

The frequencies: plain RoPE with `theta`, or a checkpoint's scaling (`RopeScaling`, see
rope_scaling.py), or llama.cpp's per-frequency divisors `freq_factors` (GGUF only: the
`rope_freqs` tensor llama.cpp's converter writes for Llama 3.1 checkpoints instead of metadata).

Layout: HF's rotate_half (dimension i pairs with i + D/2), which is what HF checkpoints store;
the GGUF loader undoes GGUF's interleaved Q/K row order at load time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from inference.layers.rope_scaling import RopeScaling
from kernels import cpu_fused


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    freq_factors: Sequence[float] | None = None,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with the checkpoint's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        # llama.cpp: theta_i = position * inv_freq_i / freq_factor_i
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    elif scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(
            inv_freq,
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position_embeddings,
        )
    return inv_freq


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, old_context: int
) -> torch.Tensor:
    """Llama 3.1 frequency scaling.

    A frequency whose wavelength is longer than old_context/low is slowed by `factor`, one
    shorter than old_context/high is kept, and in between the two are blended linearly in
    old_context/wavelength (0 at the low edge, 1 at the high edge).
    """
    wavelen = 2 * math.pi / inv_freq
    blend = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_context / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position < max_positions, computed once, gathered per step."""

    def __init__(
        self,
        *,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
        freq_factors: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.freq_factors = freq_factors
        self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the caches; the loader calls this after building the model on `meta`."""
        inv_freq = rope_inv_freq(
            self.head_dim, self.theta, self.scaling, self.freq_factors
        )  # [D/2]
        inv_freq = inv_freq.to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)  # [P]
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]: rotate_half pairs i with i + D/2
        self.register_buffer("cos_cache", angles.cos(), persistent=False)  # [P, D] fp32
        self.register_buffer("sin_cache", angles.sin(), persistent=False)  # [P, D] fp32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [T] -> cos, sin [T, 1, D] in the model dtype (broadcast over heads)
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def rope_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The first `heads` heads of qkv [T, H, D] rotated, as a new [T, heads, D]: one call on the
    CPU where the fused kernels are loaded (kernels/csrc/layer_cpu.cpp), else apply_rope."""
    ops = cpu_fused.layer_ops()
    if ops is not None and qkv.is_cpu:
        return ops.rope(qkv, cos, sin, heads)
    return apply_rope(qkv[:, :heads], cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D], cos/sin [T, 1, D]; rotate_half(x) = (-x[D/2:], x[:D/2])
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
