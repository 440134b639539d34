"""The one entry point for the multi-LoRA delta: Triton on CUDA, torch everywhere else.

    meta = build_lora_metadata(token_slots, slot_ranks, device=...)   # once per engine step
    out = base_linear(x)                                              # [T, out_features]
    add_lora(out, x, a_stacked, b_stacked, meta)                      # out += per-token delta

`lora_shrink` / `lora_expand` are the two halves, for callers that keep the shrunk
activations (on the CPU they take the plain per-segment path; add_lora is the tuned one). Semantics, shapes and argument checks
are those of kernels/triton_lora.py; kernels/reference.py spells them out as loops.

Stacked weights must be zero beyond each slot's rank (a[s][slot, r:] and b[s][slot, :, r:]),
as the adapter cache leaves them: the Triton kernels never read those entries, but the CPU
path's batched products run at the batch's largest rank and multiply them.

CPU path, the fastest of the candidates bench/lora_cpu_paths.py measures (per-segment
matmuls, gathered per-token bmm, padded stacked weights over every slot, and variants):
- segments of >= meta's padded_max_len tokens (prefill chunks) are multiplied one by one at
  the adapter's own rank, x_seg @ A[slot, :r].T @ B[slot, :, :r].T; contiguous ones read x
  and add into out through views (addmm_ in place), scattered ones gather and index_add_;
- shorter segments (decode tokens) go together: rows padded to [slots, longest, in] and two
  bmm's per slice, since on a CPU a small matmul costs more in call overhead than in FLOPs.
bf16/fp16 are multiplied in float32 (torch's bf16 GEMM is several times slower than fp32 on
CPUs without AVX512-BF16/AMX; the LoRA operands are small, so the upcast is cheap) and the
sum is rounded to the output dtype once.

kernels/triton_lora.py is imported on the first CUDA call only: CPU-only processes never
import Triton (0.15 s more on top of torch, measured with python -X importtime on a 2-core box),
and the CPU tests can switch Triton to its interpreter before it is imported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.checks import check_add_lora_args, check_expand_args, check_shrink_args
from kernels.metadata import LoRABatchMetadata, PaddedBatch, Segment

__all__ = ["add_lora", "lora_expand", "lora_shrink"]


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
    on the CPU, x and out may be fp32 with bf16/fp16 weights (a bf16 model's base linear runs in
    fp32 there: the delta joins its fp32 result before the one rounding to bf16).
    The shrunk activations stay float32 between the two products."""
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
    _add_lora_torch(out, x, list(a_stacked), list(b_stacked), meta, offsets)


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
    delta = _delta_buffer(out, meta.num_lora_tokens, covers_all)  # [n_lora, out], slot order
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
    a_list: list[torch.Tensor],
    b_list: list[torch.Tensor],
    meta: LoRABatchMetadata,
    offsets: list[int],
) -> None:
    covers_all = sum(b.shape[1] for b in b_list) == out.shape[1]
    for seg in meta.long_segments:
        _add_segment(out, x, a_list, b_list, seg, offsets, covers_all)
    if meta.padded is not None:
        _add_padded(out, x, a_list, b_list, meta.padded, offsets, covers_all)


def _add_segment(
    out: torch.Tensor,
    x: torch.Tensor,
    a_list: list[torch.Tensor],
    b_list: list[torch.Tensor],
    seg: Segment,
    offsets: list[int],
    covers_all: bool,
) -> None:
    """One adapter's tokens at its own rank; contiguous tokens (a prefill chunk) are read and
    added to in place through views, scattered ones gathered and scattered back."""
    if seg.token_range is not None:
        lo, hi = seg.token_range
        xs, rows = x[lo:hi].float(), out[lo:hi]  # [n, in], [n, out_features]
    else:
        xs, rows = x.index_select(0, seg.token_ids).float(), None
        delta = _delta_buffer(out, seg.length, covers_all)  # [n, out_features]
    for a, b, off in zip(a_list, b_list, offsets, strict=True):
        ys = xs @ a[seg.slot, : seg.rank].float().T  # [n, r]
        bt = b[seg.slot, :, : seg.rank].float().T  # [r, n_s]
        if rows is None:
            torch.matmul(ys, bt, out=delta[:, off : off + b.shape[1]])
        elif rows.dtype == torch.float32:
            rows[:, off : off + b.shape[1]].addmm_(ys, bt)
        else:
            rows[:, off : off + b.shape[1]].add_(ys @ bt)  # fp32 sum, rounded once
    if rows is None:
        _scatter_add(out, seg.token_ids, delta)


def _add_padded(
    out: torch.Tensor,
    x: torch.Tensor,
    a_list: list[torch.Tensor],
    b_list: list[torch.Tensor],
    batch: PaddedBatch,
    offsets: list[int],
    covers_all: bool,
) -> None:
    """All short segments at once: their tokens padded to [G, m, in] (padding rows repeat a
    real row; their results are dropped), two bmm's per slice at the batch's largest rank
    (weights beyond a slot's rank are zero)."""
    groups, m, r = batch.slots.numel(), batch.max_len, batch.max_rank
    x_pad = x.index_select(0, batch.pad_src).float().view(groups, m, x.shape[1])  # [G, m, in]
    delta = _delta_buffer(out, batch.token_ids.numel(), covers_all)  # [n, out_features]
    for a, b, off in zip(a_list, b_list, offsets, strict=True):
        a_g = a[:, :r] if batch.all_slots else a.index_select(0, batch.slots)[:, :r]
        b_g = b[:, :, :r] if batch.all_slots else b.index_select(0, batch.slots)[:, :, :r]
        y = torch.bmm(x_pad, a_g.float().transpose(1, 2))  # [G, m, r]
        d = torch.bmm(y, b_g.float().transpose(1, 2))  # [G, m, n_s]
        width = b.shape[1]
        torch.index_select(d.view(groups * m, width), 0, batch.pad_rows,
                           out=delta[:, off : off + width])  # fmt: skip
    _scatter_add(out, batch.token_ids, delta)


def _delta_buffer(out: torch.Tensor, rows: int, covers_all: bool) -> torch.Tensor:
    # float32 [rows, out_features]; columns outside every slice must add nothing
    make = out.new_empty if covers_all else out.new_zeros
    return make(rows, out.shape[1], dtype=torch.float32)


def _scatter_add(out: torch.Tensor, ids: torch.Tensor, delta: torch.Tensor) -> None:
    """out[ids] = out.dtype(fp32(out[ids]) + delta), rounding once."""
    if out.dtype == torch.float32:
        out.index_add_(0, ids, delta)
    else:
        out.index_copy_(0, ids, (out.index_select(0, ids).float() + delta).to(out.dtype))


def _on_cuda(meta: object) -> bool:
    # Anything but metadata falls through to the CPU branch, whose checks reject it.
    return isinstance(meta, LoRABatchMetadata) and meta.device.type == "cuda"


def _rows(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's rows of t [T, ...]: a view when they are contiguous, else a gather."""
    if seg.token_range is not None:
        return t[seg.token_range[0] : seg.token_range[1]]
    return t.index_select(0, seg.token_ids)
