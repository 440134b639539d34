"""RMSNorm, as HF's LlamaRMSNorm computes it."""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        ops = cpu_fused.layer_ops()
        if ops is not None and x.is_cpu and x.dim() == 2:  # one call, not 8 (layer_cpu.cpp)
            return ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and scale in the model dtype, as HF's LlamaRMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): a residual add and the norm after it, [T, dim] each."""
        ops = cpu_fused.layer_ops()
        if ops is not None and x.is_cpu and x.dim() == 2:
            return ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)
