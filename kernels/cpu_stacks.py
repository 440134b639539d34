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

Paired stacks (`paired`, for the fused kernel's vdpbf16ps path: bf16 stacks, where the kernels'
library pairs_bf16()) keep the same rows two by two, interleaved, as that path multiplies them:

    a_t  [max_loras, in/2, 2·max_rank·S]     element 2c + p of pair row k: row 2k + p, column c
    b_t  S x [max_loras, max_rank/2, 2·n_s]  of the layout above

so the kernel loads a pair of rows as one vector (a projection's delta 4-15% faster, 2-core AMD
EPYC, Zen 4: kernels/csrc/lora_cpu.cpp). That is also the layout an AMX tile multiply takes its
second operand in (16 pair rows of 16 columns), so where the library has tiles (tiles_bf16())
the kernel bound to paired stacks multiplies runs of at least `tile_rows` tokens of one adapter
on them (0: never; the engine's matmul plan measures the threshold).

Paired stacks are no strided views of the kernels' API stacks: the per-slice views are 4-D
([max_loras, max_rank, in/2, 2], [max_loras, n_s, max_rank/2, 2]), `write_slice` fills a slot
of either layout, `slice_rows` reads one back, and the torch path multiplies an unpaired copy
(`unpaired()`: only where the fused kernel cannot serve them).

The layout is checked once, when the stacks are made; kernels.lora_ops.add_lora_cpu then
checks per call only what changes per call (the activations, the output, the metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate

import torch
import torch.nn.functional as F

from kernels import cpu_fused

__all__ = ["CpuStacks", "cpu_stacks", "pairs_rows"]


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
    paired: bool = False
    tile_rows: int = 0  # the fused kernel's AMX tile products: see the module doc

    @cached_property
    def _pair(self) -> int:  # rows per stored row
        return 2 if self.paired else 1

    @cached_property
    def num_slices(self) -> int:
        return len(self.b_t)

    @cached_property
    def max_loras(self) -> int:
        return self.a_t.shape[0]

    @cached_property
    def in_features(self) -> int:
        return self.a_t.shape[1] * self._pair

    @cached_property
    def max_rank(self) -> int:
        return self.a_t.shape[2] // (self.num_slices * self._pair)

    @cached_property
    def adapted(self) -> tuple[list[torch.Tensor], list[int]]:
        """(each indexed slice's Bᵀ, its first column of the output): what every call reads,
        derived once per index."""
        return [self.b_t[s] for s in self.index], [self.offsets[s] for s in self.index]

    @cached_property
    def out_features(self) -> int:
        return self.offsets[-1] + self.b_t[-1].shape[2] // self._pair

    @cached_property
    def fused_dtypes(self) -> frozenset[tuple[torch.dtype, torch.dtype]]:
        """(activations' dtype, these stacks' dtype) pairs the fused kernel takes on this layout."""
        return cpu_fused.PAIRED_DTYPES if self.paired else cpu_fused.DTYPES

    @cached_property
    def slice_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per slice, views of the stacks: A_s [max_loras, max_rank, in] and B_s [max_loras, n_s,
        max_rank]; paired, [max_loras, max_rank, in/2, 2] and [max_loras, n_s, max_rank/2, 2]
        (the last two dimensions: one row of A_s or B_s)."""
        s_count = self.num_slices
        if not self.paired:
            return ([self.a_t[:, :, s::s_count].transpose(1, 2) for s in range(s_count)],
                    [b.transpose(1, 2) for b in self.b_t])  # fmt: skip
        a5 = self.a_t.unflatten(2, (self.max_rank, s_count, 2))  # [L, in/2, R, S, 2]
        return ([a5[:, :, :, s].transpose(1, 2) for s in range(s_count)],
                [b.unflatten(2, (-1, 2)).transpose(1, 2) for b in self.b_t])  # fmt: skip

    def write_slice(self, s: int, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slice s of `slot` := A a [r, in], B b [n_s, r] (converted to the stacks' dtype), zero
        past rank r; None, None: all zero. Every element of the slot's slice is written once."""
        if a is None or b is None:
            for view in (views[s][slot] for views in self.slice_views):
                view.zero_()
            return
        r = a.shape[0]
        if not self.paired:
            a_view, b_view = (views[s][slot] for views in self.slice_views)
            a_view[:r].copy_(a)  # [r, in]
            b_view[:, :r].copy_(b)  # [n_s, r]
            a_view[r:].zero_()
            b_view[:, r:].zero_()
            return
        # A pair of bf16 is one int32: a paired write is a plain 2-D transposed copy, as an
        # unpaired one is (copies with a last dimension of 2 ran 2-3x slower)
        a_pairs, b_pairs = self._pair_views(s, slot)  # [in/2, R], [R/2, n_s]
        a_pairs[:, :r].copy_(_as_pairs(a).T)  # [in/2, r]
        a_pairs[:, r:].zero_()
        half = (r + 1) // 2  # B's pairs this rank touches; an odd rank's last pairs with a zero
        # copied in the source's order (n_s rows of `half` pairs): torch's copy ran ~2x faster so
        b_pairs[:half].T.copy_(_as_pairs(F.pad(b, (0, r % 2)) if r % 2 else b))  # [n_s, half]
        b_pairs[half:].zero_()

    def write_slot(self, slot: int, weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Every slice of `slot`: weights[s] = (A [r, in], B [n_s, r]) as write_slice takes them, or
        None (all zero). Paired stacks: one pass over the slot in the kernels' library
        (cpu_fused.slot_ops(); ~20 torch ops a slice otherwise); else slice by slice."""
        if len(weights) != self.num_slices:
            raise ValueError(f"weights: {len(weights)} entries for {self.num_slices} slices")
        ops = cpu_fused.slot_ops() if self.paired else None
        if ops is None:
            for s, w in enumerate(weights):
                self.write_slice(s, slot, *(w or (None, None)))
            return
        widths = [b.shape[2] // 2 for b in self.b_t]
        a = [_bf16_rows(w[0]) if w else self.a_t.new_empty(0, self.in_features) for w in weights]
        b = [_bf16_rows(w[1]) if w else self.a_t.new_empty(n, 0) for w, n in zip(weights, widths, strict=True)]
        ops.write_paired_slot(self.a_t, list(self.b_t), slot, a, b)

    def read_slot(
        self, slot: int, rank: int, empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Paired stacks' every slice of `slot` at `rank`, copied out in one pass of the kernels'
        library into memory from `empty(shape, dtype)`: per slice (A [rank, in], B [n_s, rank]),
        bf16 (A: views of one [S, rank, in] block). None where they are not paired or the library
        is not loaded."""
        ops = cpu_fused.slot_ops() if self.paired else None
        if ops is None:
            return None
        a = empty((self.num_slices, rank, self.in_features), torch.bfloat16)
        b = [empty((bt.shape[2] // 2, rank), torch.bfloat16) for bt in self.b_t]
        ops.read_paired_slot(self.a_t, list(self.b_t), slot, rank, list(a.unbind(0)), b)
        return list(zip(a.unbind(0), b, strict=True))

    def slice_rows(self, s: int, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice s's rows in `slot` up to `rank`: (A [rank, in], B [n_s, rank]), views of the
        stacks, or of paired stacks copies."""
        if not self.paired:
            return self.a_t[slot, :, s :: self.num_slices][:, :rank].T, self.b_t[s][slot, :rank].T
        a_pairs, b_pairs = self.slice_pairs(s, slot, rank + rank % 2)
        # a fresh copy: contiguous() keeps a size-1 dimension's stride, which view() refuses
        a, b = (t.clone(memory_format=torch.contiguous_format) for t in (a_pairs[:rank], b_pairs))
        return a.view(torch.bfloat16), b.view(torch.bfloat16)[:, :rank]  # [rank, in], [n_s, rank]

    def slice_pairs(self, s: int, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paired stacks' slice s in `slot` at an even `rank` as int32 views, one element per bf16
        pair: A [rank, in/2] and B [n_s, rank/2], strided; a contiguous copy of each, viewed as
        bf16, is (A [rank, in], B [n_s, rank])."""
        if not self.paired or rank % 2:
            raise ValueError(f"slice_pairs takes paired stacks at an even rank, got rank {rank}")
        a_pairs, b_pairs = self._pair_views(s, slot)
        return a_pairs[:, :rank].T, b_pairs[: rank // 2].T

    def _pair_views(self, s: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paired stacks' slice s in `slot` as int32 pairs: A's [in/2, R] (element [k, r]: A_s[r,
        2k] and A_s[r, 2k+1]) and B's [R/2, n_s] (element [r, j]: B_s[j, 2r] and B_s[j, 2r+1])."""
        a_pairs = self.a_t[slot].view(torch.int32)[:, s :: self.num_slices]  # [in/2, R]
        return a_pairs, self.b_t[s][slot].view(torch.int32)  # [R/2, n_s]

    def unpaired(self) -> CpuStacks:
        """These stacks in the unpaired layout: themselves, or of paired ones a copy (the torch
        path's, where the fused kernel cannot serve them)."""
        if not self.paired:
            return self
        a_t = self.a_t.unflatten(2, (-1, 2)).transpose(2, 3).flatten(1, 2).contiguous()  # [L, in, R·S]
        b_t = tuple(b.unflatten(2, (-1, 2)).transpose(2, 3).flatten(1, 2).contiguous() for b in self.b_t)
        return CpuStacks(a_t, b_t, self.offsets, self.index)  # tiles take paired stacks only

    def fused_kernel(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        """The fused C++ kernel bound to these stacks and slices (cpu_fused.bind_stacks:
        `kernel(out, x, token_ids, segments)`), made on first use and kept; None while the
        kernel's library is not loaded."""
        kernel = self.__dict__.get("_fused_kernel")
        if kernel is None:
            kernel = cpu_fused.bind_stacks(self.a_t, self.b_t, self.index, self.adapted[1], self.paired,
                                           self.tile_rows)
            if kernel is not None:  # the frozen dataclass's cache, as cached_property keeps one
                self.__dict__["_fused_kernel"] = kernel
        return kernel

    def with_index(self, index: Sequence[int]) -> CpuStacks:
        """The same stacks adding only the slices `index` (ascending, no repeats, at least one)."""
        index = tuple(index)
        if not index or list(index) != sorted(set(index)) or not 0 <= index[0] <= index[-1] < self.num_slices:
            raise ValueError(f"index must name 1 to {self.num_slices} distinct slices in order, got {index}")
        return replace(self, index=index)


def _bf16_rows(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous bf16 starting on a 4-byte boundary: write_paired_slot moves A's bf16 pairs
    as 32-bit words (a contiguous view at an odd element offset is copied)."""
    t = t.to(torch.bfloat16).contiguous()
    return t if t.data_ptr() % 4 == 0 else t.clone()


def _as_pairs(t: torch.Tensor) -> torch.Tensor:
    """t [..., 2m] as bf16 pairs along its last dimension, int32 [..., m] (a view where t is
    bf16 laid out for one, else of a bf16 copy)."""
    t = t.to(torch.bfloat16)
    try:
        return t.view(torch.int32)
    except RuntimeError:  # a strided last dimension, or an odd offset: a fresh copy views
        return t.clone(memory_format=torch.contiguous_format).view(torch.int32)


def pairs_rows(dtype: torch.dtype, in_features: int, max_rank: int) -> bool:
    """Whether stacks of these would be paired for the fused kernel: bf16, even sizes, and the
    kernels' library loaded with its AVX512-BF16 path."""
    return dtype == torch.bfloat16 and in_features % 2 == 0 and max_rank % 2 == 0 and cpu_fused.pairs_bf16()


def cpu_stacks(
    max_loras: int, max_rank: int, in_features: int, output_sizes: Sequence[int], dtype: torch.dtype,
    paired: bool = False, tile_rows: int = 0,
) -> tuple[CpuStacks, list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed stacks for slices of `output_sizes` columns (back to back in the output), and
    their per-slice views (CpuStacks.slice_views): A_s [max_loras, max_rank, in] and B_s
    [max_loras, n_s, max_rank], 4-D where `paired` (see the module doc; bf16, even in_features
    and max_rank; `tile_rows` > 0 takes paired ones). Writing a slot through the views
    (CpuStacks.write_slice) fills the stacks."""
    sizes = [int(n) for n in output_sizes]
    if not 1 <= len(sizes) <= 3 or min(sizes) < 1:
        raise ValueError(f"output_sizes must be 1 to 3 widths >= 1, got {list(output_sizes)}")
    if min(max_loras, max_rank, in_features) < 1:
        raise ValueError(
            f"max_loras, max_rank and in_features must be >= 1, got {max_loras}, {max_rank}, {in_features}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if paired and (dtype != torch.bfloat16 or in_features % 2 or max_rank % 2):
        raise ValueError(f"paired stacks are bf16 with even in_features and max_rank, got {dtype}, "
                         f"{in_features}, {max_rank}")  # fmt: skip
    if tile_rows < 0 or (tile_rows and not paired):
        raise ValueError(f"tile_rows must be 0, or >= 1 on paired stacks, got {tile_rows} (paired={paired})")
    num_slices, pair = len(sizes), 2 if paired else 1
    a_t = torch.zeros(max_loras, in_features // pair, max_rank * num_slices * pair, dtype=dtype)
    b_t = tuple(torch.zeros(max_loras, max_rank // pair, n * pair, dtype=dtype) for n in sizes)
    offsets = tuple([0, *accumulate(sizes)][:-1])
    stacks = CpuStacks(a_t, b_t, offsets, tuple(range(num_slices)), paired, tile_rows)
    return stacks, *stacks.slice_views
