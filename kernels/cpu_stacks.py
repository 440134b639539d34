"""The CPU layout of one projection's LoRA stacks, built for the torch path's products.

A projection with S output slices (q/k/v: 3, gate/up: 2, o and down: 1) keeps, over its
max_loras slots:

    a_t  [max_loras, in, max_rank·S]       Aᵀ of every slice, rank-major columns: column
                                           r·S + s is row r of slice s's A
    b_t  S x [max_loras, max_rank, n_s]    each slice's Bᵀ, contiguous (the scale folded in)

so one slot's shrink at rank r is one product for every slice, x @ a_t[slot, :, :r·S] (x read
once for q/k/v or gate/up), and no product takes a transposed operand: oneDNN's small fp32
products ran 1.6-1.8x slower on a transposed view than on a contiguous one (2-core Xeon,
AVX512). The [max_loras, max_rank, in] / [max_loras, n_s, max_rank] stacks of the kernels'
API (kernels/lora_ops.add_lora, the Triton kernels, the slot manager's writes) are strided
views of the same memory.

The layout is checked once, when the stacks are made; kernels.lora_ops.add_lora_cpu then
checks per call only what changes per call (the activations, the output, the metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate

import torch

from kernels import cpu_fused

__all__ = ["CpuStacks", "cpu_stacks"]


@dataclass(frozen=True, eq=False)
class CpuStacks:
    """See the module docstring. `index`: the slices to add (those some resident adapter
    adapts: an all-q/v fleet skips k); `offsets[s]`: slice s's first column of the output.
    The sizes are derived once (the stacks never change shape): every LoRA call checks its
    activations against them, 120 calls a step for SmolLM2."""

    a_t: torch.Tensor
    b_t: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    index: tuple[int, ...]

    @cached_property
    def num_slices(self) -> int:
        return len(self.b_t)

    @cached_property
    def max_loras(self) -> int:
        return self.a_t.shape[0]

    @cached_property
    def in_features(self) -> int:
        return self.a_t.shape[1]

    @cached_property
    def max_rank(self) -> int:
        return self.a_t.shape[2] // self.num_slices

    @cached_property
    def adapted(self) -> tuple[list[torch.Tensor], list[int]]:
        """(each indexed slice's Bᵀ, its first column of the output): what every call reads,
        derived once per index."""
        return [self.b_t[s] for s in self.index], [self.offsets[s] for s in self.index]

    @cached_property
    def out_features(self) -> int:
        return self.offsets[-1] + self.b_t[-1].shape[2]

    def fused_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        """The fused C++ kernel bound to these stacks and slices (cpu_fused.bind_stacks:
        `kernel(out, x, token_ids, segments)`), made on first use and kept; None while the
        kernel's library is not loaded."""
        kernel = self.__dict__.get("_fused_kernel")
        if kernel is None:
            kernel = cpu_fused.bind_stacks(self.a_t, self.b_t, self.index, self.adapted[1])
            if kernel is not None:  # the frozen dataclass's cache, as cached_property keeps one
                self.__dict__["_fused_kernel"] = kernel
        return kernel

    def with_index(self, index: Sequence[int]) -> CpuStacks:
        """The same stacks adding only the slices `index` (ascending, no repeats, at least one)."""
        index = tuple(index)
        if not index or list(index) != sorted(set(index)) or not 0 <= index[0] <= index[-1] < self.num_slices:
            raise ValueError(f"index must name 1 to {self.num_slices} distinct slices in order, got {index}")
        return replace(self, index=index)


def cpu_stacks(
    max_loras: int, max_rank: int, in_features: int, output_sizes: Sequence[int], dtype: torch.dtype
) -> tuple[CpuStacks, list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed stacks for slices of `output_sizes` columns (back to back in the output), and
    their per-slice views: A_s [max_loras, max_rank, in] and B_s [max_loras, n_s, max_rank].
    Writing a slot through the views fills the CpuStacks."""
    sizes = [int(n) for n in output_sizes]
    if not 1 <= len(sizes) <= 3 or min(sizes) < 1:
        raise ValueError(f"output_sizes must be 1 to 3 widths >= 1, got {list(output_sizes)}")
    if min(max_loras, max_rank, in_features) < 1:
        raise ValueError(
            f"max_loras, max_rank and in_features must be >= 1, got {max_loras}, {max_rank}, {in_features}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    num_slices = len(sizes)
    a_t = torch.zeros(max_loras, in_features, max_rank * num_slices, dtype=dtype)
    b_t = tuple(torch.zeros(max_loras, max_rank, n, dtype=dtype) for n in sizes)
    offsets = tuple([0, *accumulate(sizes)][:-1])
    stacks = CpuStacks(a_t, b_t, offsets, tuple(range(num_slices)))
    a_views = [a_t[:, :, s::num_slices].transpose(1, 2) for s in range(num_slices)]
    b_views = [b.transpose(1, 2) for b in b_t]
    return stacks, a_views, b_views
