"""Weight-only quantised projections for CPU decode: int8 per output row, int4 per group of 32.

A decode step at batch 1 reads every weight once for a handful of multiply-adds, so it is
bound by memory traffic (or, on CPUs without wide integer units, by unpacking): int8 weights
halve bf16's bytes, int4 quarter them.

    Int8Weight  w[n, k] = q[n, k] · scale[n]                         q int8 in -127..127
    Int4Weight  w[n, k] = q[n, k] · scale[n, g] + min[n, g]          q 0..15, g = k // 32

GGUF's 4-bit blocks (32 weights each) are this form as they are: Q4_1 is w = d·q + m, Q4_0 is
w = d·(q - 8), min -8·d; inference/models/gguf_quants.py reads them.

Two kernels multiply by them; which one serves is the engine's measured choice
(inference/layers/quant_plan.py), set on each weight by `use_kernel`:

    fused  kernels/csrc/quant_cpu.cpp (q4_linear / q8_linear): the activations quantised to
           int8 per group of 32 (llama.cpp's Q8 activations), then integer dot products;
           int4 scales and mins in fp16, as a GGUF file gives them
    torch  aten._weight_int4pack_mm_for_cpu / _weight_int8pack_mm (what gpt-fast and torchao
           use): each weight widened to float; bf16 activations, scales and zeros

An Int4Weight holds one packing: the fused kernel's (GGUF's nibble order, built at once) until
torch's is chosen, which then replaces it (torch's is not row-separable and cannot be undone).

`linear` takes any float dtype and returns that dtype. A Linear holding one of these as
`packed` computes `packed.linear(x)` (+ bias) instead of x·Wᵀ; its `weight` is then freed.
CPU only: the CUDA int4 kernel wants a different packing.
"""

from __future__ import annotations

import torch

from kernels import cpu_fused

FUSED_KERNEL, TORCH_KERNEL = "fused", "torch"
QUANT_KERNELS = (FUSED_KERNEL, TORCH_KERNEL)
COMPUTE_DTYPE = torch.bfloat16  # torch's kernels' activations, scales and zeros
INT4_GROUP = 32  # GGUF's block size; every Llama width we serve is a multiple of it


def _compute(x: torch.Tensor) -> torch.Tensor:
    # a Python dtype check is cheaper than a no-op .to() through the dispatcher (8 a layer)
    return x if x.dtype == COMPUTE_DTYPE else x.to(COMPUTE_DTYPE)


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    """Whether both int4 kernels take this shape (torch's packs 16 output rows at a time)."""
    return out_features % 16 == 0 and in_features % group == 0


def default_kernel() -> str:
    """A new weight's kernel until the engine's plan sets one: the fused kernel where its library
    loads here (fused_op() builds it on first use), else torch's."""
    return FUSED_KERNEL if cpu_fused.fused_op() is not None else TORCH_KERNEL


def _check_kernel(kernel: str) -> None:
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"quantised kernel must be one of {', '.join(QUANT_KERNELS)}, got {kernel!r}")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] 0..15 -> [out, in / 2] uint8 in GGUF's Q4 order: per group of 32, byte j
    holds q[32g + j] in its low nibble and q[32g + 16 + j] in its high one."""
    out_features, in_features = q.shape
    halves = q.to(torch.uint8).reshape(out_features, in_features // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """pack_nibbles undone: [out, in / 2] uint8 -> [out, in] uint8 0..15."""
    out_features = qs.shape[0]
    groups = qs.reshape(out_features, -1, 1, 16)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(out_features, -1)


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
        self.scales = scales.to(COMPUTE_DTYPE).contiguous()  # torch's kernel's
        self.scales32 = scales.float().contiguous()  # the fused kernel's
        self.out_features, self.in_features = qweight.shape
        self.kernel = default_kernel()

    def can_use(self, kernel: str) -> bool:
        return kernel in QUANT_KERNELS

    def use_kernel(self, kernel: str) -> None:
        """FUSED_KERNEL or TORCH_KERNEL from now on (both share the int8 weight)."""
        _check_kernel(kernel)
        self.kernel = kernel

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """weight [out, in], any float dtype."""
        w = weight.float()
        # rounded to the kernel's bf16 first, so q is the best choice for the scale it will use
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(COMPUTE_DTYPE).float()  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales)

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out], x's dtype
        if self.kernel == FUSED_KERNEL:
            return cpu_fused.layer_ops().q8_linear(x, self.qweight, self.scales32)
        y = torch.ops.aten._weight_int8pack_mm(_compute(x), self.qweight, self.scales)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernels multiply by (tests, references)."""
        return self.qweight.float() * self.scales32[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.scales32.nbytes

    def __repr__(self) -> str:
        return f"Int8Weight(out={self.out_features}, in={self.in_features})"


class Int4Weight:
    """Asymmetric int4 per group of `group` inputs of each output row."""

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int = INT4_GROUP
    ) -> None:
        # torch's form: q [out, in] integers 0..15; scales, zeros [out, in / group];
        # w = (q - 8) · scale + zero
        out_features, in_features = q.shape
        if group != INT4_GROUP or not int4_fits(out_features, in_features, group) or scales.shape != (
            out_features,
            in_features // group,
        ):
            raise ValueError(
                f"Int4Weight: needs groups of {INT4_GROUP}, out_features a multiple of 16, in_features of "
                f"the group and scales [out, in/group]; got group {group}, q {tuple(q.shape)}, "
                f"scales {tuple(scales.shape)}"
            )
        if zeros.shape != scales.shape:
            raise ValueError(f"Int4Weight: zeros {tuple(zeros.shape)} != scales {tuple(scales.shape)}")
        self.out_features, self.in_features, self.group = out_features, in_features, group
        self.kernel = FUSED_KERNEL
        # the fused kernel's packing: qs [out, in / 2] uint8 (pack_nibbles), w = q · scale + min
        self.qs: torch.Tensor | None = pack_nibbles(q)
        self.scales16: torch.Tensor | None = scales.to(torch.float16).contiguous()  # [out, in / group]
        self.mins16: torch.Tensor | None = (zeros.float() - 8 * scales.float()).to(torch.float16).contiguous()
        if not (self.scales16.isfinite().all() and self.mins16.isfinite().all()):
            raise ValueError("Int4Weight: a group's scale or minimum is beyond fp16's range (65504)")
        # torch's, built by use_kernel(TORCH_KERNEL): packed [out, in / 2] uint8 in its tiled order,
        # scale_and_zero [in / group, out, 2] bf16
        self.packed: torch.Tensor | None = None
        self.scale_and_zero: torch.Tensor | None = None
        if default_kernel() == TORCH_KERNEL:
            self.use_kernel(TORCH_KERNEL)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
        """weight [out, in], any float dtype: min/max of each group mapped onto 0..15."""
        out_features, in_features = weight.shape
        w = weight.float().reshape(out_features, in_features // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, in / group]
        # scale and min rounded to the fused kernel's fp16 first (GGUF's own choice), q chosen for
        # the rounded pair; torch's kernel, if chosen, rounds them once more to its bf16
        scales = ((hi - lo) / 15).clamp_min(2**-24).to(torch.float16).float()
        mins = lo.to(torch.float16).float()
        q = torch.round((w - mins[..., None]) / scales[..., None]).clamp_(0, 15)
        zeros = mins + 8 * scales  # torch's form: w = (q - 8) · scale + zero
        return cls(q.reshape(out_features, in_features).to(torch.uint8), scales, zeros, group)

    def can_use(self, kernel: str) -> bool:
        """Whether use_kernel(kernel) can serve (not once the weight is repacked for torch's)."""
        return kernel == TORCH_KERNEL or (kernel == FUSED_KERNEL and self.qs is not None)

    def use_kernel(self, kernel: str) -> None:
        """FUSED_KERNEL or TORCH_KERNEL from now on. Choosing torch's repacks the weight for it
        and frees the fused kernel's packing, so it is for good: ValueError to go back."""
        _check_kernel(kernel)
        if kernel == self.kernel:
            return
        if kernel == FUSED_KERNEL:
            raise ValueError("Int4Weight: repacked for torch's kernel; the fused kernel's packing is gone")
        assert self.qs is not None and self.scales16 is not None and self.mins16 is not None
        q = unpack_nibbles(self.qs)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scales = self.scales16.float()
        zeros = self.mins16.float() + 8 * scales
        self.scale_and_zero = torch.stack([scales.t(), zeros.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
        self.qs = self.scales16 = self.mins16 = None
        self.kernel = TORCH_KERNEL

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out], x's dtype
        if self.kernel == FUSED_KERNEL:
            return cpu_fused.layer_ops().q4_linear(x, self.qs, self.scales16, self.mins16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _compute(x), self.packed, self.group, self.scale_and_zero
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernel in use multiplies by (tests, references)."""
        if self.kernel == FUSED_KERNEL:
            q = unpack_nibbles(self.qs).float().reshape(self.out_features, -1, self.group)
            w = q * self.scales16.float()[..., None] + self.mins16.float()[..., None]
            return w.reshape(self.out_features, self.in_features)
        # torch's packing is its own: recovered by multiplying the identity
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return self.linear(eye).float().t().contiguous()

    @property
    def nbytes(self) -> int:
        held = (self.qs, self.scales16, self.mins16, self.packed, self.scale_and_zero)
        return sum(t.nbytes for t in held if t is not None)

    def __repr__(self) -> str:
        return f"Int4Weight(out={self.out_features}, in={self.in_features}, group={self.group}, kernel={self.kernel})"


PackedWeight = Int8Weight | Int4Weight


def packed_weights(model: torch.nn.Module) -> list[PackedWeight]:
    """Every quantised weight of `model`: its Linears' (`packed`) and the LM head's
    (`lm_head_packed`); not parameters, so `model.parameters()` misses them."""
    packs = [getattr(m, "packed", None) for m in model.modules()]
    packs.append(getattr(model, "lm_head_packed", None))
    return [p for p in packs if p is not None]
