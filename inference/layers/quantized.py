"""Weight-only quantised projections for CPU decode: int8 per output row, int4 per group of 32.

A decode step at batch 1 reads every weight once for a handful of multiply-adds, so it is
bound by memory traffic: int8 weights halve bf16's bytes, int4 quarter them. torch's CPU
kernels for it (the ones gpt-fast and torchao use) dequantise inside the matmul:

    Int8Weight  w[n, k] = q[n, k] · scale[n]                         q int8
                aten._weight_int8pack_mm(x, q, scale)
    Int4Weight  w[n, k] = (q[n, k] - 8) · scale[n, g] + zero[n, g]    q 0..15, g = k // group
                aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zero [k/group, n, 2])

GGUF's 4-bit blocks (32 weights each) map onto the int4 form exactly: Q4_0 is w = d·(q - 8)
(zero 0), Q4_1 is w = d·q + m (zero = m + 8·d); inference/models/gguf_quants.py reads them.

Both kernels want the activations in the dtype of their scales (bf16 here: the kernels' fast
path); `linear` takes any dtype and returns that dtype. A Linear holding one of these as
`packed` computes `packed.linear(x)` (+ bias) instead of x·Wᵀ; its `weight` is then freed.
CPU only: the CUDA int4 kernel wants a different packing.
"""

from __future__ import annotations

import torch

COMPUTE_DTYPE = torch.bfloat16
INT4_GROUP = 32  # GGUF's block size; every Llama width we serve is a multiple of it


def _compute(x: torch.Tensor) -> torch.Tensor:
    # a Python dtype check is cheaper than a no-op .to() through the dispatcher (8 a layer)
    return x if x.dtype == COMPUTE_DTYPE else x.to(COMPUTE_DTYPE)


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    """Whether the int4 kernel takes this shape (it packs 16 output rows at a time)."""
    return out_features % 16 == 0 and in_features % group == 0


class Int8Weight:
    """Symmetric int8 per output row: scale[n] = max|w[n]| / 127."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        # qweight [out, in] int8, scales [out]
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != qweight.shape[:1]:
            raise ValueError(
                f"Int8Weight: expected int8 [out, in] and scales [out], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scales.shape)}"
            )
        self.qweight = qweight.contiguous()
        self.scales = scales.to(COMPUTE_DTYPE).contiguous()
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """weight [out, in], any float dtype."""
        w = weight.float()
        # rounded to the kernel's bf16 first, so q is the best choice for the scale it will use
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(COMPUTE_DTYPE).float()  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales)

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out], x's dtype
        y = torch.ops.aten._weight_int8pack_mm(_compute(x), self.qweight, self.scales)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernel multiplies by (tests, references)."""
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def __repr__(self) -> str:
        return f"Int8Weight(out={self.out_features}, in={self.in_features})"


class Int4Weight:
    """Asymmetric int4 per group of `group` inputs of each output row."""

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int = INT4_GROUP
    ) -> None:
        # q [out, in] integers 0..15; scales, zeros [out, in / group]
        out_features, in_features = q.shape
        if not int4_fits(out_features, in_features, group) or scales.shape != (
            out_features,
            in_features // group,
        ):
            raise ValueError(
                f"Int4Weight: needs out_features a multiple of 16, in_features of the group {group} "
                f"and scales [out, in/group]; got q {tuple(q.shape)}, scales {tuple(scales.shape)}"
            )
        if zeros.shape != scales.shape:
            raise ValueError(f"Int4Weight: zeros {tuple(zeros.shape)} != scales {tuple(scales.shape)}")
        self.out_features, self.in_features, self.group = out_features, in_features, group
        # [out, in / 2] uint8 in the kernel's tiled order (not row-separable: pack fused rows once)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1
        )
        self.scale_and_zero = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
        )  # [in / group, out, 2]

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
        """weight [out, in], any float dtype: min/max of each group mapped onto 0..15."""
        out_features, in_features = weight.shape
        w = weight.float().reshape(out_features, in_features // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, in / group]
        # scale and zero rounded to the kernel's bf16 first, q chosen for the rounded pair
        scales = ((hi - lo) / 15).clamp_min(1e-12).to(COMPUTE_DTYPE).float()
        zeros = (lo + 8 * scales).to(COMPUTE_DTYPE).float()  # the kernel subtracts 8 from q
        q = torch.round((w - zeros[..., None]) / scales[..., None] + 8).clamp_(0, 15)
        return cls(q.reshape(out_features, in_features).to(torch.uint8), scales, zeros, group)

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out], x's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _compute(x), self.packed, self.group, self.scale_and_zero
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, recovered by multiplying the identity (the packing is the kernel's)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return self.linear(eye).float().t().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_and_zero.nbytes

    def __repr__(self) -> str:
        return f"Int4Weight(out={self.out_features}, in={self.in_features}, group={self.group})"


PackedWeight = Int8Weight | Int4Weight
