"""Triton multi-LoRA kernels: shrink (x·Aᵀ) and expand (out += y·Bᵀ) over a segmented batch.

Tokens are grouped by adapter slot (kernels/metadata.py): the batch's tiles (at most BLOCK_M
tokens of one slot each) form grid axis 0, the output slice (q/k/v, gate/up) axis 1, and a
block of the rank (shrink) or of the slice's output columns (expand) axis 2. Each program
gathers its tokens' rows through `sorted_token_ids`, so no activation is ever copied into a
sorted buffer, and reads only its slot's weights, at that adapter's own rank: a program
whose rank block starts at or past the rank exits at once, and the rank loop of expand stops
at the rank, so padding up to max_rank costs at most one partly masked block.

Products accumulate in float32. Up to MAX_SLICES output slices share one launch; their
weight tensors are separate arguments picked by the slice index (unused ones repeat slice 0).

Under TRITON_INTERPRET=1 (the CPU tests) the kernels run in Triton's numpy interpreter, which
stores bfloat16 as raw 16-bit integers and would feed those bit patterns to tl.dot; on the CPU
the launchers therefore upcast dot operands to float32 (DOT_FP32), which GPUs skip.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.checks import MAX_SLICES, check_expand_args, check_shrink_args
from kernels.metadata import LoRABatchMetadata

SHRINK_BLOCK_R = 16  # rank columns per program (tl.dot needs >= 16)
SHRINK_BLOCK_K = 128  # input features per loop step
EXPAND_BLOCK_N = 64  # output columns per program
EXPAND_BLOCK_R = 16  # rank entries per loop step

__all__ = ["MAX_SLICES", "launch_expand", "launch_shrink", "lora_expand", "lora_shrink"]


@triton.jit
def _pick(slice_id, v0, v1, v2):
    """v0, v1 or v2 for slice 0, 1 or 2 (pointers or ints of one type)."""
    if slice_id == 0:
        value = v0
    elif slice_id == 1:
        value = v1
    else:
        value = v2
    return value


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a0_ptr,  # [L, R, K] per slice
    a1_ptr,
    a2_ptr,
    y_ptr,  # [S, T, R] fp32
    sorted_ids_ptr,  # [T] int32
    tile_info_ptr,  # [num_tiles, 4] int32: start, length, slot, rank
    in_features,  # K
    stride_xt,
    stride_al,
    stride_ar,
    stride_ys,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    slice_id = tl.program_id(1)
    rank_block = tl.program_id(2) // SPLIT_K
    k_part = tl.program_id(2) % SPLIT_K

    info = tile_info_ptr + tile * 4
    rank = tl.load(info + 3)
    if rank_block * BLOCK_R >= rank:
        return  # this adapter's rank ends before this block: nothing to compute
    seg_pos = tl.load(info)
    length = tl.load(info + 1)
    slot = tl.load(info + 2).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(sorted_ids_ptr + seg_pos + offs_m, mask=mask_m, other=0).to(tl.int64)  # [M]
    offs_r = rank_block * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank

    a_ptr = _pick(slice_id, a0_ptr, a1_ptr, a2_ptr)
    a_cols = a_ptr + slot * stride_al + offs_r[None, :] * stride_ar  # [1, R]: A rows as columns
    x_rows = x_ptr + rows[:, None] * stride_xt  # [M, 1]

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_part * BLOCK_K, in_features, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_cols + offs_k[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)  # [M, K] @ [K, R], bf16/fp16 tensor cores

    y_ptrs = y_ptr + slice_id * stride_ys + rows[:, None] * stride_yt + offs_r[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["n0", "n1", "n2", "off0", "off1", "off2"])
def _lora_expand_kernel(
    y_ptr,  # [S, T, R] fp32
    b0_ptr,  # [L, n_s, R] per slice
    b1_ptr,
    b2_ptr,
    out_ptr,  # [T, out_features]
    sorted_ids_ptr,  # [T] int32
    tile_info_ptr,  # [num_tiles, 4] int32: start, length, slot, rank
    n0,  # output width of each slice
    n1,
    n2,
    off0,  # first output column of each slice
    off1,
    off2,
    max_rank,  # R: B's row stride
    stride_ys,
    stride_yt,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    slice_id = tl.program_id(1)
    n_block = tl.program_id(2)

    width = _pick(slice_id, n0, n1, n2)
    if n_block * BLOCK_N >= width:
        return  # a narrower slice (k/v next to q): no columns here
    col0 = _pick(slice_id, off0, off1, off2)
    b_ptr = _pick(slice_id, b0_ptr, b1_ptr, b2_ptr)

    info = tile_info_ptr + tile * 4
    seg_pos = tl.load(info)
    length = tl.load(info + 1)
    slot = tl.load(info + 2).to(tl.int64)
    rank = tl.load(info + 3)

    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(sorted_ids_ptr + seg_pos + offs_m, mask=mask_m, other=0).to(tl.int64)  # [M]
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < width

    b_cols = b_ptr + slot * width * max_rank + offs_n[None, :] * max_rank  # [1, N]
    y_rows = y_ptr + slice_id * stride_ys + rows[:, None] * stride_yt  # [M, 1]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # stops at this adapter's rank, not max_rank
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        y = tl.load(y_rows + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_cols + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(y, b.to(tl.float32), acc, input_precision="ieee")  # [M, R] @ [R, N]
        else:
            acc = tl.dot(y.to(b.dtype), b, acc)  # bf16/fp16 tensor cores, fp32 accumulation

    out_ptrs = out_ptr + rows[:, None] * stride_ot + (col0 + offs_n)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (current + acc).to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink(
    x: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    y: torch.Tensor,
    *,
    block_r: int = SHRINK_BLOCK_R,
    block_k: int = SHRINK_BLOCK_K,
    split_k: int = 1,
    num_warps: int = 4,
) -> None:
    """Shrink every token's activations to its adapter's rank, all slices in one launch.

    x:         [T, in_features]   fp32 / bf16 / fp16, rows contiguous (row stride free)
    a_stacked: num_slices (1..3) x [max_loras, max_rank, in_features], x's dtype
    meta:      build_lora_metadata(...) of this step, on x's device (block_m = its tile height)
    y:         [num_slices, T, max_rank] float32, written in place

        for s in range(num_slices):
            for t in range(T):
                slot = meta.token_slots[t]
                if slot == -1: continue                      # y[s, t] untouched
                r = meta.slot_ranks[slot]
                y[s, t, :r] = fp32(x[t] @ a_stacked[s][slot, :r].T)
                                                             # y[s, t, r:] untouched

    split_k > 1 splits the in_features loop over that many programs that add their partial
    sums atomically: y is then zero-filled first (every element, slot -1 rows included) and
    the sum order is not deterministic. Raises ValueError naming the argument on bad input.
    """
    check_shrink_args(x, a_stacked, meta, y)
    _check_block("block_r", block_r)
    _check_block("block_k", block_k)
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    launch_shrink(x, list(a_stacked), meta, y, block_r, block_k, split_k, num_warps)


def launch_shrink(
    x: torch.Tensor,
    a_stacked: list[torch.Tensor],
    meta: LoRABatchMetadata,
    y: torch.Tensor,
    block_r: int = SHRINK_BLOCK_R,
    block_k: int = SHRINK_BLOCK_K,
    split_k: int = 1,
    num_warps: int = 4,
) -> None:
    """lora_shrink without the argument checks (for callers that have run them)."""
    if split_k > 1:
        y.zero_()
    if meta.num_tiles == 0:
        return
    a = list(a_stacked) + [a_stacked[0]] * (MAX_SLICES - len(a_stacked))
    grid = (meta.num_tiles, len(a_stacked), triton.cdiv(meta.max_rank, block_r) * split_k)
    _lora_shrink_kernel[grid](
        x, a[0], a[1], a[2], y,
        meta.sorted_token_ids, meta.tile_info,
        x.shape[1],
        x.stride(0),
        a[0].stride(0), a[0].stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=meta.block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        DOT_FP32=_dot_fp32(x),
        num_warps=num_warps,
    )  # fmt: skip


def lora_expand(
    y: torch.Tensor,
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    out: torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
    *,
    block_n: int = EXPAND_BLOCK_N,
    block_r: int = EXPAND_BLOCK_R,
    num_warps: int = 4,
) -> None:
    """Expand the shrunk activations and add them into the base layer's output, in place.

    y:             [num_slices, T, max_rank] float32 (lora_shrink's output)
    b_stacked:     num_slices (1..3) x [max_loras, out_s, max_rank], out's dtype (scale folded in)
    meta:          build_lora_metadata(...) of this step, on out's device
    out:           [T, out_features] fp32 / bf16 / fp16, rows contiguous, added to in place
    slice_offsets: first column of each slice in out (default: the slices back to back from 0)

        for s in range(num_slices):
            off, n = slice_offsets[s], b_stacked[s].shape[1]
            for t in range(T):
                slot = meta.token_slots[t]
                if slot == -1: continue                      # out[t] untouched, bit for bit
                r = meta.slot_ranks[slot]
                delta = fp32(y[s, t, :r] @ b_stacked[s][slot, :, :r].T)      # [n]
                out[t, off : off + n] = out.dtype(fp32(out[t, off : off + n]) + delta)

    On bf16/fp16 the y block is rounded to the weights' dtype for the tensor-core dot (fp32
    accumulation); fp32 uses IEEE fp32 products. Raises ValueError naming the argument.
    """
    offsets = check_expand_args(y, b_stacked, meta, out, slice_offsets)
    _check_block("block_n", block_n)
    _check_block("block_r", block_r)
    launch_expand(y, list(b_stacked), meta, out, offsets, block_n, block_r, num_warps)


def launch_expand(
    y: torch.Tensor,
    b_stacked: list[torch.Tensor],
    meta: LoRABatchMetadata,
    out: torch.Tensor,
    offsets: list[int],
    block_n: int = EXPAND_BLOCK_N,
    block_r: int = EXPAND_BLOCK_R,
    num_warps: int = 4,
) -> None:
    """lora_expand without the argument checks; offsets as check_expand_args returns them."""
    if meta.num_tiles == 0:
        return
    b = list(b_stacked) + [b_stacked[0]] * (MAX_SLICES - len(b_stacked))
    widths = [t.shape[1] for t in b]
    offs = offsets + [offsets[0]] * (MAX_SLICES - len(offsets))
    grid = (meta.num_tiles, len(b_stacked), triton.cdiv(max(widths), block_n))
    _lora_expand_kernel[grid](
        y, b[0], b[1], b[2], out,
        meta.sorted_token_ids, meta.tile_info,
        widths[0], widths[1], widths[2],
        offs[0], offs[1], offs[2],
        y.shape[2],
        y.stride(0), y.stride(1),
        out.stride(0),
        BLOCK_M=meta.block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        DOT_FP32=_dot_fp32(out),
        num_warps=num_warps,
    )  # fmt: skip


def _dot_fp32(t: torch.Tensor) -> bool:
    # fp32 stays fp32; on the CPU only the interpreter can run these kernels (see module doc).
    return t.dtype == torch.float32 or t.device.type == "cpu"


def _check_block(name: str, value: object) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
