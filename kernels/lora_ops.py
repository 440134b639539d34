"""The one entry point for the multi-LoRA delta: Triton on CUDA, torch everywhere else.

    meta = build_lora_metadata(token_slots, slot_ranks, device=...)   # once per engine step
    out = base_linear(x)                                              # [T, out_features]
    add_lora(out, x, a_stacked, b_stacked, meta)                      # out += per-token delta
    add_lora_cpu(out, x, stacks, meta)          # the same, stacks in the CPU layout (cpu_stacks)

`lora_shrink` / `lora_expand` are the two halves, for callers that keep the shrunk
activations (on the CPU they take the plain per-segment path; add_lora is the tuned one). Semantics, shapes and argument checks
are those of kernels/triton_lora.py; kernels/reference.py spells them out as loops.

Stacked weights must be zero beyond each slot's rank (a[s][slot, r:] and b[s][slot, :, r:]),
as the adapter cache leaves them: the Triton kernels never read those entries, but the CPU
path's batched products run at the batch's largest rank and multiply them.

CPU: add_lora_cpu(..., kernel="fused") makes one call of the C++ kernel built for this CPU
(kernels/cpu_fused.py, kernels/csrc/lora_cpu.cpp) where it could be built; the engine's matmul
plan times it against the torch path below and takes the faster. The torch path, the fastest
of the torch formulations bench/lora_cpu_paths.py measures (per-segment matmuls, gathered
per-token bmm, padded stacked weights over every slot, and variants):
- `add_lora_cpu` takes the stacks in the CPU layout (kernels/cpu_stacks.py: Aᵀ of every slice in
  one rank-major tensor, each Bᵀ contiguous): one shrink per segment reads x once for every
  slice (q/k/v, gate/up) instead of once per slice, and no product takes a transposed operand;
- segments of >= meta's padded_max_len tokens (prefill chunks) are multiplied one by one at
  the adapter's own rank, x_seg @ A[slot, :r].T @ B[slot, :, :r].T; contiguous ones read x
  and add into out through views (addmm_ in place), scattered ones gather and index_add_;
- shorter segments (decode tokens) go together: rows padded to [slots, longest, in] and one
  bmm per shrink and per expanded slice, since on a CPU a small matmul costs more in call
  overhead than in FLOPs; a decode step laid out by slot with equally many tokens per adapter
  needs no padding, gather or scatter at all (its rows are the batch).
The stacks' dtype is the compute dtype (the engine's matmul plan picks the model dtype or fp32
per CPU, inference/layers/matmul_plan.py): x is converted to it once per call, and a delta in
another dtype than out joins out with one rounding.

kernels/triton_lora.py is imported on the first CUDA call only: CPU-only processes never
import Triton (0.15 s more on top of torch, measured with python -X importtime on a 2-core box),
and the CPU tests can switch Triton to its interpreter before it is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.checks import (
    check_add_lora_args,
    check_cpu_stacks_args,
    check_expand_args,
    check_shrink_args,
)
from kernels.cpu_stacks import CpuStacks, cpu_stacks
from kernels.metadata import LoRABatchMetadata, PaddedBatch, Segment

__all__ = [
    "CpuStacks", "add_lora", "add_lora_cpu", "add_lora_cpu_fused", "cpu_stacks", "lora_expand", "lora_shrink",
]


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    slice_offsets: Sequence[int] | None = None,
) -> None:
    """out[t, off_s : off_s + n_s] += x[t] @ A_s[slot, :r].T @ B_s[slot, :, :r].T for every token
    t with an adapter (slot = meta.token_slots[t], r its rank), every slice s; rows with slot -1
    are left bit for bit. Shapes: out [T, out_features], x [T, in], a_stacked[s] [max_loras,
    max_rank, in], b_stacked[s] [max_loras, n_s, max_rank], all in one dtype (fp32/bf16/fp16);
    on the CPU the weights' dtype may differ from x's and out's (a bf16 model's base linear may
    run in fp32, its LoRA stacks may be kept in fp32; the delta joins out with one rounding).
    On CUDA the shrunk activations stay float32 between the two products."""
    offsets = check_add_lora_args(out, x, a_stacked, b_stacked, meta, slice_offsets)
    if not meta.has_lora:
        return
    if meta.device.type == "cuda":
        from kernels import triton_lora  # imported on first CUDA use only (see module doc)

        max_rank = a_stacked[0].shape[1]
        y = torch.empty(len(a_stacked), x.shape[0], max_rank, dtype=torch.float32, device=x.device)
        triton_lora.launch_shrink(x, list(a_stacked), meta, y)
        triton_lora.launch_expand(y, list(b_stacked), meta, out, offsets)
        return
    b_t = [b.transpose(1, 2) for b in b_stacked]  # [max_loras, max_rank, n_s] views
    _add_lora_torch(out, x, list(a_stacked), b_t, meta, offsets, None)


def add_lora_cpu(
    out: torch.Tensor, x: torch.Tensor, stacks: CpuStacks, meta: LoRABatchMetadata, kernel: str = "torch"
) -> None:
    """add_lora for stacks kept in the CPU layout (kernels/cpu_stacks.py, what LoRALinear holds
    on the CPU): out[t, offsets[s] : offsets[s] + n_s] += the delta of slice s, for the slices
    stacks.index, with only the per-call checks (the stacks' layout was checked when they were
    made). kernel "fused": one call of the C++ kernel (kernels/cpu_fused.py) when it is loaded
    and takes these dtypes; "torch" (or no such kernel): one shrink product per segment or
    padded batch for every slice, and one expand per slice (on an unpaired copy of paired
    stacks: a fallback, they are paired for the fused kernel)."""
    check_cpu_stacks_args(out, x, stacks, meta)
    if not meta.has_lora or (kernel == "fused" and add_lora_cpu_fused(out, x, stacks, meta)):
        return
    stacks = stacks.unpaired()
    b_t, offsets = stacks.adapted
    _add_lora_torch(out, x, None, b_t, meta, offsets, stacks)


def add_lora_cpu_fused(out: torch.Tensor, x: torch.Tensor, stacks: CpuStacks, meta: LoRABatchMetadata) -> bool:
    """add_lora_cpu's fused kernel for a caller that shaped x and out itself (LoRALinear, 120
    calls a decode step): the kernel bound to the stacks once (CpuStacks.fused_kernel), which
    checks every argument it reads (a RuntimeError where one does not fit), without the Python
    checks and the dispatcher's argument parsing (~5 us of a ~20 us call). False, having done
    nothing, where that kernel cannot serve (its library not loaded, other dtypes; paired stacks
    take bf16 x alone): then add_lora_cpu does."""
    kernel = stacks.fused_kernel()
    if kernel is None or (x.dtype, stacks.a_t.dtype) not in stacks.fused_dtypes:
        return False
    if meta.has_lora:
        kernel(out, x, meta.lora_token_ids, meta.cpu_segments)
    return True


def lora_shrink(
    x: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    y: torch.Tensor,
) -> None:
    """y[s, t, :r] = fp32(x[t] @ a_stacked[s][slot, :r].T) for tokens with an adapter; the rest
    of y is untouched. See kernels.triton_lora.lora_shrink for shapes and pseudo-code."""
    if _on_cuda(meta):
        from kernels import triton_lora  # imported on first CUDA use only (see module doc)

        triton_lora.lora_shrink(x, a_stacked, meta, y)
        return
    check_shrink_args(x, a_stacked, meta, y)
    for seg in meta.segments:
        rows = _rows(x, seg).float()  # [n, in]
        for s, a in enumerate(a_stacked):
            ys = rows @ a[seg.slot, : seg.rank].float().T  # [n, r]
            if seg.token_range is not None:
                y[s, seg.token_range[0] : seg.token_range[1], : seg.rank] = ys
            else:
                y[s, seg.token_ids, : seg.rank] = ys


def lora_expand(
    y: torch.Tensor,
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    out: torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
) -> None:
    """out[t, off_s : off_s + n_s] += y[s, t, :r] @ b_stacked[s][slot, :, :r].T for tokens with an
    adapter; slot -1 rows untouched. See kernels.triton_lora.lora_expand for the pseudo-code."""
    if _on_cuda(meta):
        from kernels import triton_lora  # imported on first CUDA use only (see module doc)

        triton_lora.lora_expand(y, b_stacked, meta, out, slice_offsets)
        return
    offsets = check_expand_args(y, b_stacked, meta, out, slice_offsets)
    if not meta.has_lora:
        return
    covers_all = sum(b.shape[1] for b in b_stacked) == out.shape[1]
    delta = _delta_buffer(out, meta.num_lora_tokens, covers_all, torch.float32)  # [n_lora, out], slot order
    for seg in meta.segments:
        d = delta[seg.start : seg.start + seg.length]  # [n, out_features]
        for s, b in enumerate(b_stacked):
            ys = _rows(y[s], seg)[:, : seg.rank]  # [n, r]
            width = b.shape[1]
            torch.matmul(ys, b[seg.slot, :, : seg.rank].float().T,
                         out=d[:, offsets[s] : offsets[s] + width])  # fmt: skip
    _scatter_add(out, meta.lora_token_ids, delta)


def _add_lora_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    a_list: list[torch.Tensor] | None,
    b_t: list[torch.Tensor],
    meta: LoRABatchMetadata,
    offsets: list[int],
    stacks: CpuStacks | None,
) -> None:
    """a_list: the A stacks (None with `stacks`, the CpuStacks that hold them); b_t: each
    slice's Bᵀ [max_loras, max_rank, n_s] (contiguous in CpuStacks, else a transposed view)."""
    stack_dtype = stacks.a_t.dtype if stacks is not None else a_list[0].dtype
    # The wider of x's and the stacks' dtypes (the plan keeps them equal: then nothing converts).
    xw = x.to(torch.promote_types(x.dtype, stack_dtype))  # [T, in], converted once if at all
    covers_all = sum(b.shape[2] for b in b_t) == out.shape[1]
    for seg in meta.long_segments:
        _add_segment(out, xw, a_list, b_t, seg, offsets, covers_all, stacks)
    if meta.padded is not None:
        _add_padded(out, xw, a_list, b_t, meta.padded, offsets, covers_all, stacks)


def _split_slices(y: torch.Tensor, rank: int, stacks: CpuStacks) -> list[torch.Tensor]:
    """y [..., r·S] rank-major (column r·S + s) -> the adapted slices' [..., r], each contiguous
    (a strided one slows the expand's product)."""
    if stacks.num_slices == 1:
        return [y]
    y = y.view(*y.shape[:-1], rank, stacks.num_slices).movedim(-1, 0).contiguous()  # [S, ..., r]
    return [y[s] for s in stacks.index]


def _shrink(
    xs: torch.Tensor, a_list: list[torch.Tensor] | None, slot: int, rank: int, stacks: CpuStacks | None
) -> list[torch.Tensor]:
    """xs [n, in] -> per slice [n, r] = xs @ A_s[slot, :r].T; with CpuStacks, one product."""
    if stacks is None:
        return [xs @ a[slot, :rank].to(xs.dtype).T for a in a_list]
    a_t = stacks.a_t[slot, :, : rank * stacks.num_slices].to(xs.dtype)  # [in, r·S], a view
    return _split_slices(xs @ a_t, rank, stacks)


def _add_segment(
    out: torch.Tensor,
    xw: torch.Tensor,
    a_list: list[torch.Tensor] | None,
    b_t: list[torch.Tensor],
    seg: Segment,
    offsets: list[int],
    covers_all: bool,
    stacks: CpuStacks | None,
) -> None:
    """One adapter's tokens at its own rank; contiguous tokens (a prefill chunk) are read and
    added to in place through views, scattered ones gathered and scattered back."""
    if seg.token_range is not None:
        lo, hi = seg.token_range
        xs, rows = xw[lo:hi], out[lo:hi]  # [n, in], [n, out_features]
        # fp32 stacks under a bf16 output: accumulate the slices in an fp32 copy of the rows,
        # in place (small fp32 GEMMs are several times cheaper than bf16 ones), round once.
        acc = rows if rows.dtype == xw.dtype else rows.to(xw.dtype)
    else:
        xs, rows = xw.index_select(0, seg.token_ids), None
        delta = _delta_buffer(out, seg.length, covers_all, xw.dtype)  # [n, out_features]
    ys = _shrink(xs, a_list, seg.slot, seg.rank, stacks)
    for y, bt_all, off in zip(ys, b_t, offsets, strict=True):
        bt = bt_all[seg.slot, : seg.rank].to(xw.dtype)  # [r, n_s]
        width = bt.shape[1]
        if rows is None:
            torch.matmul(y, bt, out=delta[:, off : off + width])
        else:
            acc[:, off : off + width].addmm_(y, bt)
    if rows is None:
        _scatter_add(out, seg.token_ids, delta)
    elif acc is not rows:
        rows.copy_(acc)  # the one rounding


def _add_padded(
    out: torch.Tensor,
    xw: torch.Tensor,
    a_list: list[torch.Tensor] | None,
    b_t: list[torch.Tensor],
    batch: PaddedBatch,
    offsets: list[int],
    covers_all: bool,
    stacks: CpuStacks | None,
) -> None:
    """All short segments at once: their tokens padded to [G, m, in] (padding rows repeat a
    real row; their results are dropped), one bmm per shrink and per slice's expand at the
    batch's largest rank (weights beyond a slot's rank are zero). When the segments are one
    run of rows of equal length (a decode step the engine laid out by slot), the padded batch
    is that run itself: no gather, and each slice's product is added straight into its rows."""
    groups, m, r = batch.slots.numel(), batch.max_len, batch.max_rank
    n = batch.token_ids.numel()
    unpadded = batch.token_range is not None and groups * m == n

    def per_group(stack: torch.Tensor) -> torch.Tensor:  # [max_loras, ...] -> [G, ...]
        return stack if batch.all_slots else stack.index_select(0, batch.slots)

    if unpadded:
        x_pad = xw[batch.token_range[0] : batch.token_range[1]].view(groups, m, xw.shape[1])
    else:
        x_pad = xw.index_select(0, batch.pad_src).view(groups, m, xw.shape[1])  # [G, m, in]
    if stacks is None:
        ys = [torch.bmm(x_pad, per_group(a)[:, :r].to(xw.dtype).transpose(1, 2)) for a in a_list]  # [G, m, r]
    else:
        a_g = per_group(stacks.a_t)[:, :, : r * stacks.num_slices].to(xw.dtype)  # [G, in, r·S]
        ys = _split_slices(torch.bmm(x_pad, a_g), r, stacks)  # per slice [G, m, r]
    if unpadded:
        lo, hi = batch.token_range
        rows = out[lo:hi]  # [n, out_features]
        acc = rows if rows.dtype == xw.dtype else rows.to(xw.dtype)  # fp32 stacks: round once
        for y, bt, off in zip(ys, b_t, offsets, strict=True):
            d = torch.bmm(y, per_group(bt)[:, :r].to(xw.dtype))  # [G, m, n_s]
            acc[:, off : off + d.shape[2]].add_(d.view(n, d.shape[2]))
        if acc is not rows:
            rows.copy_(acc)
        return
    delta = _delta_buffer(out, n, covers_all, xw.dtype)  # [n, out_features]
    for y, bt, off in zip(ys, b_t, offsets, strict=True):
        d = torch.bmm(y, per_group(bt)[:, :r].to(xw.dtype))  # [G, m, n_s]
        width = d.shape[2]
        torch.index_select(d.reshape(groups * m, width), 0, batch.pad_rows,
                           out=delta[:, off : off + width])  # fmt: skip
    if batch.token_range is not None:  # one run of rows: added in place (rounded once)
        _add_rounded(out[batch.token_range[0] : batch.token_range[1]], delta)
    else:
        _scatter_add(out, batch.token_ids, delta)


def _add_rounded(rows: torch.Tensor, delta: torch.Tensor) -> None:
    """rows += delta, rounding once to rows' dtype (delta may be wider)."""
    if rows.dtype == delta.dtype:
        rows.add_(delta)
    else:
        rows.copy_(delta.add_(rows))


def _delta_buffer(out: torch.Tensor, rows: int, covers_all: bool, dtype: torch.dtype) -> torch.Tensor:
    # [rows, out_features] in the stacks' dtype; columns outside every slice must add nothing
    make = out.new_empty if covers_all else out.new_zeros
    return make(rows, out.shape[1], dtype=dtype)


def _scatter_add(out: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor) -> None:
    """out[ids] += delta, rounding once to out's dtype."""
    if out.dtype == delta.dtype:
        out.index_add_(0, ids, delta)
    else:
        out.index_copy_(0, ids, (out.index_select(0, ids).float() + delta.float()).to(out.dtype))


def _on_cuda(meta: object) -> bool:
    # Anything but metadata falls through to the CPU branch, whose checks reject it.
    return isinstance(meta, LoRABatchMetadata) and meta.device.type == "cuda"


def _rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's rows of t [T, ...]: a view when they are contiguous, else a gather."""
    if seg.token_range is not None:
        return t[seg.token_range[0] : seg.token_range[1]]
    return t.index_select(0, seg.token_ids)
