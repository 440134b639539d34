"""Linear: y = x·Wᵀ (+ b), and the CPU fast path every projection and the LM head go through.

Without bf16 units (AVX2 only) torch's bf16 GEMM runs 5-8x slower than fp32. A product of a
few rows is bound by reading the weight, where bf16's half size wins; from BF16_UPCAST_MIN_ROWS
rows on, the weight is upcast to fp32 a slab at a time (the slab stays in cache for its GEMM,
so memory traffic stays that of bf16). Both paths accumulate in fp32 and round the result to
bf16 once. CPUs with AVX512-BF16 or AMX, and every GPU, take plain F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _cpu_has_bf16_matmul() -> bool:
    try:  # oneDNN's bf16 kernels need AVX512-BF16 or AMX; torch routes bf16 matmul there if present
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


CPU_HAS_BF16_MATMUL = _cpu_has_bf16_matmul()
BF16_UPCAST_MIN_ROWS = 5
UPCAST_SLAB_ROWS = 512


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except multi-row bf16 products on CPUs without bf16 matmul units (see above)."""
    if upcasts_to_fp32(x):
        return linear_fp32(x.float(), weight, bias).to(x.dtype)
    return F.linear(x, weight, bias)


def upcasts_to_fp32(x: torch.Tensor) -> bool:
    """Whether `linear` computes this bf16 input in fp32 slabs (and rounds once at the end)."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not CPU_HAS_BF16_MATMUL
        and x.shape[0] >= BF16_UPCAST_MIN_ROWS
    )


def linear_fp32(x32: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x32 [T, in] fp32 @ weight (any dtype, upcast a slab at a time).T -> [T, out] fp32, unrounded."""
    out = x32.new_empty(x32.shape[0], weight.shape[0])  # [T, out] fp32
    for i in range(0, weight.shape[0], UPCAST_SLAB_ROWS):
        slab = weight[i : i + UPCAST_SLAB_ROWS].float()  # [rows, in]
        torch.matmul(x32, slab.t(), out=out[:, i : i + UPCAST_SLAB_ROWS])
    if bias is not None:
        out += bias
    return out


class Linear(nn.Module):
    """y = x·Wᵀ (+ b), weight [out_features, in_features].

    A fused projection lists its slices in `output_sizes` (qkv_proj: [q, k, v]; gate_up_proj:
    [gate, up]); LoRALinear places one adapter matrix per slice by them.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
        )
