"""The MLP's activation: silu(gate) * up over a fused gate_up product [T, 2I] -> [T, I].

On the CPU, where the fused kernels are loaded, one pass of kernels/csrc/layer_cpu.cpp's
silu_mul (torch makes two passes through memory: silu over the gate half, then the product):
bit for bit torch's result in bf16, to fp32 rounding in fp32. fp16 stays on torch, whose
vectorised fp16 conversions the kernel's scalar ones do not match in speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_fused

_FUSED_DTYPES = (torch.bfloat16, torch.float32)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I], in gate_up's dtype."""
    ops = cpu_fused.layer_ops()
    if ops is not None and gate_up.is_cpu and gate_up.dim() == 2 and gate_up.dtype in _FUSED_DTYPES:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
    return F.silu(gate) * up
