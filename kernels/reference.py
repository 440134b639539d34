"""Float32 torch references for the LoRA kernels: the obvious per-token loops, for tests only.

They read only `token_slots` and `slot_ranks` from the metadata (not the sorted order or the
segments), so a wrong grouping in the metadata shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.metadata import LoRABatchMetadata


def lora_shrink_ref(
    x: torch.Tensor,  # [T, in]
    a_stacked: Sequence[torch.Tensor],  # per slice: [max_loras, max_rank, in]
    meta: LoRABatchMetadata,
    y: torch.Tensor,  # [num_slices, T, max_rank] fp32, written in place
) -> None:
    """y[s, t, :r] = x[t] @ a_stacked[s][slot, :r].T for every token t with slot >= 0
    (r = that slot's rank); every other element of y is left as it was."""
    slots = meta.token_slots.tolist()
    ranks = meta.slot_ranks.tolist()
    for s, a in enumerate(a_stacked):
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            r = ranks[slot]
            y[s, t, :r] = x[t].double() @ a[slot, :r].double().T  # [r]


def lora_expand_ref(
    y: torch.Tensor,  # [num_slices, T, max_rank] fp32
    b_stacked: Sequence[torch.Tensor],  # per slice: [max_loras, out_s, max_rank]
    meta: LoRABatchMetadata,
    out: torch.Tensor,  # [T, out_features], added to in place
    slice_offsets: Sequence[int] | None = None,
) -> None:
    """out[t, off_s : off_s + out_s] += y[s, t, :r] @ b_stacked[s][slot, :, :r].T for every token
    t with slot >= 0, summed in float64 and rounded once to out's dtype; rows with slot -1 are
    left exactly as they were. slice_offsets default: the slices back to back from column 0."""
    offsets = _offsets(b_stacked, slice_offsets)
    slots = meta.token_slots.tolist()
    ranks = meta.slot_ranks.tolist()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        r = ranks[slot]
        row = out[t].double()  # [out_features]
        for s, b in enumerate(b_stacked):
            width = b.shape[1]
            row[offsets[s] : offsets[s] + width] += y[s, t, :r].double() @ b[slot, :, :r].double().T
        out[t] = row.to(out.dtype)


def add_lora_ref(
    out: torch.Tensor,  # [T, out_features]
    x: torch.Tensor,  # [T, in]
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    slice_offsets: Sequence[int] | None = None,
) -> None:
    """Shrink then expand, with the intermediate kept in float32 as the kernels keep it."""
    max_rank = a_stacked[0].shape[1]
    y = torch.zeros(len(a_stacked), x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    lora_shrink_ref(x, a_stacked, meta, y)
    lora_expand_ref(y, b_stacked, meta, out, slice_offsets)


def _offsets(b_stacked: Sequence[torch.Tensor], slice_offsets: Sequence[int] | None) -> list[int]:
    if slice_offsets is not None:
        return list(slice_offsets)
    offsets, total = [], 0
    for b in b_stacked:
        offsets.append(total)
        total += b.shape[1]
    return offsets
