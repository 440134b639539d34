"""Argument checks shared by the Triton launchers and the torch CPU path.

Every failure is a ValueError whose message starts with the argument's name. The checks
read only shapes, dtypes, strides and devices (never tensor values), so they cost no
device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cpu_stacks import CpuStacks
from kernels.metadata import LoRABatchMetadata

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_SLICES = 3  # q/k/v; gate/up uses 2, o/down 1


def check_shrink_args(
    x: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    y: torch.Tensor,
) -> None:
    """x [T, in] · a_stacked[s] [max_loras, max_rank, in] -> y [num_slices, T, max_rank] fp32."""
    _check_meta(meta)
    num_slices, max_rank = _check_x_and_a(x, a_stacked, meta)
    _check_y(y, num_slices, max_rank, meta)


def check_expand_args(
    y: torch.Tensor,
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    out: torch.Tensor,
    slice_offsets: Sequence[int] | None,
) -> list[int]:
    """y [num_slices, T, max_rank] fp32 · b_stacked[s] [max_loras, out_s, max_rank] added into
    out [T, out_features] at column slice_offsets[s]. Returns the offsets (default: back to back)."""
    _check_meta(meta)
    num_slices, max_rank, offsets = _check_b_and_out(b_stacked, meta, out, slice_offsets)
    _check_y(y, num_slices, max_rank, meta)
    return offsets


def check_add_lora_args(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stacked: Sequence[torch.Tensor],
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    slice_offsets: Sequence[int] | None,
) -> list[int]:
    """Shrink's and expand's checks, with the intermediate y implied. Returns the offsets."""
    _check_meta(meta)
    # On the CPU activations and weights may differ in dtype: the plan may run a bf16 model's
    # base linear in fp32, or keep its LoRA stacks in fp32 (the delta joins out, rounded once).
    mixed = meta.device.type == "cpu"
    # ... and the A stacks may be views into a wider buffer (each row contiguous)
    num_slices, max_rank = _check_x_and_a(x, a_stacked, meta, mixed_dtypes=mixed, strided_a=mixed)
    b_slices, b_rank, offsets = _check_b_and_out(b_stacked, meta, out, slice_offsets, mixed_dtypes=mixed)
    if b_slices != num_slices:
        raise ValueError(f"b_stacked has {b_slices} slices but a_stacked has {num_slices}")
    if b_rank != max_rank:
        raise ValueError(f"b_stacked max_rank {b_rank} differs from a_stacked max_rank {max_rank}")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
    if a_stacked[0].dtype != b_stacked[0].dtype:
        raise ValueError(
            f"b_stacked[0] dtype {b_stacked[0].dtype} differs from a_stacked[0] dtype {a_stacked[0].dtype}"
        )
    return offsets


def check_cpu_stacks_args(
    out: torch.Tensor, x: torch.Tensor, stacks: object, meta: LoRABatchMetadata
) -> None:
    """add_lora_cpu's per-call checks: x [T, in] and out [T, out_features] against the stacks
    (whose own layout kernels.cpu_stacks checked when it made them) and the metadata."""
    _check_meta(meta)
    if not isinstance(stacks, CpuStacks) or meta.device.type != "cpu":
        raise ValueError(f"stacks must be CpuStacks with CPU metadata, got {type(stacks).__name__}")
    for name, t, columns in (("x", x, stacks.in_features), ("out", out, stacks.out_features)):
        _check_tensor(name, t, dims=2, device=meta.device, strided_rows=True)
        if t.shape != (meta.num_tokens, columns):
            raise ValueError(
                f"{name} shape {tuple(t.shape)} should be ({meta.num_tokens}, {columns}): "
                "the step's tokens by the stacks' features"
            )
    _check_dtype("x", x, ACTIVATION_DTYPES)
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
    _check_slot_dims("stacks", stacks.max_loras, stacks.max_rank, meta)


def _check_x_and_a(
    x: torch.Tensor, a_stacked: Sequence[torch.Tensor], meta: LoRABatchMetadata, mixed_dtypes: bool = False,
    strided_a: bool = False,
) -> tuple[int, int]:
    _check_tensor("x", x, dims=2, device=meta.device, strided_rows=True)
    _check_dtype("x", x, ACTIVATION_DTYPES)
    if x.shape[0] != meta.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows but meta has {meta.num_tokens} tokens")
    a_list = _check_slices("a_stacked", a_stacked)
    for s, a in enumerate(a_list):
        _check_tensor(f"a_stacked[{s}]", a, dims=3, device=meta.device, strided_rows=strided_a)
        if a.dtype != x.dtype and not (mixed_dtypes and a.dtype in ACTIVATION_DTYPES):
            raise ValueError(f"a_stacked[{s}] dtype {a.dtype} differs from x dtype {x.dtype}")
        if a.shape != a_list[0].shape:
            raise ValueError(
                f"a_stacked[{s}] shape {tuple(a.shape)} differs from a_stacked[0] "
                f"{tuple(a_list[0].shape)}"
            )
    max_loras, max_rank, in_features = a_list[0].shape
    if in_features != x.shape[1]:
        raise ValueError(f"a_stacked[0] has {in_features} input features, x has {x.shape[1]}")
    _check_slot_dims("a_stacked[0]", max_loras, max_rank, meta)
    return len(a_list), max_rank


def _check_b_and_out(
    b_stacked: Sequence[torch.Tensor],
    meta: LoRABatchMetadata,
    out: torch.Tensor,
    slice_offsets: Sequence[int] | None,
    mixed_dtypes: bool = False,
) -> tuple[int, int, list[int]]:
    _check_tensor("out", out, dims=2, device=meta.device, strided_rows=True)
    _check_dtype("out", out, ACTIVATION_DTYPES)
    if out.shape[0] != meta.num_tokens:
        raise ValueError(f"out has {out.shape[0]} rows but meta has {meta.num_tokens} tokens")
    b_list = _check_slices("b_stacked", b_stacked)
    for s, b in enumerate(b_list):
        _check_tensor(f"b_stacked[{s}]", b, dims=3, device=meta.device)
        if b.dtype != out.dtype and not (mixed_dtypes and b.dtype in ACTIVATION_DTYPES):
            raise ValueError(f"b_stacked[{s}] dtype {b.dtype} differs from out dtype {out.dtype}")
    max_loras, _, max_rank = b_list[0].shape
    for s, b in enumerate(b_list):
        if (b.shape[0], b.shape[2]) != (max_loras, max_rank):
            raise ValueError(
                f"b_stacked[{s}] shape {tuple(b.shape)}: max_loras and max_rank differ from "
                f"b_stacked[0] {tuple(b_list[0].shape)}"
            )
    _check_slot_dims("b_stacked[0]", max_loras, max_rank, meta)

    widths = [b.shape[1] for b in b_list]
    if slice_offsets is None:
        offsets = [sum(widths[:s]) for s in range(len(widths))]
    else:
        offsets = list(slice_offsets)
        if len(offsets) != len(widths) or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets
        ):
            raise ValueError(
                f"slice_offsets must be {len(widths)} ints (one per slice), got {slice_offsets!r}"
            )
    spans = sorted(zip(offsets, widths, strict=True))
    for (lo, width), (next_lo, _) in zip(spans, spans[1:] + [(out.shape[1], 0)], strict=True):
        if lo < 0 or lo + width > next_lo:
            raise ValueError(
                f"slice_offsets {offsets} with slice widths {widths} overlap or fall outside "
                f"out's {out.shape[1]} columns"
            )
    return len(b_list), max_rank, offsets


def _check_y(y: torch.Tensor, num_slices: int, max_rank: int, meta: LoRABatchMetadata) -> None:
    _check_tensor("y", y, dims=3, device=meta.device)
    _check_dtype("y", y, (torch.float32,))
    expected = (num_slices, meta.num_tokens, max_rank)
    if tuple(y.shape) != expected:
        raise ValueError(f"y shape {tuple(y.shape)} should be {expected} [num_slices, T, max_rank]")


def _check_meta(meta: object) -> None:
    if not isinstance(meta, LoRABatchMetadata):
        raise ValueError(f"meta must be a LoRABatchMetadata, got {type(meta).__name__}")


def _check_tensor(
    name: str, t: object, dims: int, device: torch.device, strided_rows: bool = False
) -> None:
    """strided_rows: rows may sit apart (a view into a wider buffer); each row is contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but meta is on {device}")
    if strided_rows:
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} rows must be contiguous (strides {t.stride()})")
    elif not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} dtype must be one of {names}, got {t.dtype}")


def _check_slices(name: str, stacked: object) -> list[torch.Tensor]:
    if not isinstance(stacked, list | tuple) or not 1 <= len(stacked) <= MAX_SLICES:
        raise ValueError(
            f"{name} must be a list of 1 to {MAX_SLICES} tensors (one per output slice), "
            f"got {type(stacked).__name__}"
            + (f" of length {len(stacked)}" if isinstance(stacked, list | tuple) else "")
        )
    return list(stacked)


def _check_slot_dims(name: str, max_loras: int, max_rank: int, meta: LoRABatchMetadata) -> None:
    if max_loras != meta.max_loras:
        raise ValueError(f"{name} has {max_loras} slots but meta.slot_ranks has {meta.max_loras}")
    if max_rank < meta.max_rank:
        raise ValueError(
            f"{name} max_rank {max_rank} is below the batch's largest rank {meta.max_rank}"
        )
