"""A dense bf16/fp16 weight prepacked once into oneDNN's blocked layout (see dense_layout.py for
why and when the engine does it); here so that the matmul plan can time native products on the
layout they would run on, without importing the layout choice that reads the plan."""

from __future__ import annotations

import torch

# The batch-size hint only tunes the blocking: any row count multiplies correctly. A decode
# batch: where the per-call reorder costs most of the product.
PACK_ROWS_HINT = 32


class OneDnnWeight:
    """A dense weight [out, in] packed once into oneDNN's blocked layout; `linear` is
    F.linear's product without the per-call reorder."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out], x's dtype
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def use_kernel(self, kernel: str) -> None:  # the quantised weights' kernel choice: not ours
        pass

    def can_use(self, kernel: str) -> bool:
        return False


def packing_unavailable(dtype: torch.dtype) -> str | None:
    """Why this torch on this CPU cannot pack `dtype` weights for oneDNN; None where it can."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model is {str(dtype).removeprefix('torch.')}: only bf16/fp16 products reorder per call"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch has no oneDNN weight packing"
    mkldnn = torch.ops.mkldnn
    supported = mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported
    if not supported():
        return f"oneDNN has no {str(dtype).removeprefix('torch.')} kernels on this CPU"
    return None
