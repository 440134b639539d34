"""Per-step LoRA batch metadata: which tokens use which adapter slot, grouped for the kernels.

Built once per engine step (shared by every LoRA-wrapped layer of every decoder block) from
the per-token slot list the model runner produces:

    token_slots [T]  = 2, -1, 0, 2, 0          (-1: the token runs on the base model only)
    slot_ranks  [L]  = 8, 0, 16                (0: an empty slot)

    sorted_token_ids = 2, 4, 0, 3, 1           tokens ordered by slot (stable), slot -1 last
    segments         = (start 0, length 2, slot 0, rank 8), (start 2, length 2, slot 2, rank 16)
    tiles (block_m)  = each segment cut into pieces of at most block_m tokens (Triton grid axis 0)

The Triton kernels read the int32 device tensors. The torch path (CPU) reads host-side
Python ints and long index tensors, so it never calls `.item()`: long segments are multiplied
one by one (`long_segments`), short ones (decode tokens) together as one zero-padded batch
(`padded`), because on a CPU each small matmul costs more in call overhead than in FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

DEFAULT_BLOCK_M = 16  # tokens per Triton tile; tl.dot needs >= 16 rows
# Torch path: segments shorter than this go into the padded batch (bench/lora_cpu_paths.py).
DEFAULT_PADDED_MAX_LEN = 32
# ... and only when at least this many short segments share the step (else each alone, in place)
MIN_PADDED_SEGMENTS = 3


class Segment(NamedTuple):
    """Tokens of one adapter slot (host-side copy for the torch path)."""

    start: int  # offset into sorted_token_ids
    length: int  # number of tokens, >= 1
    slot: int  # adapter slot, 0 <= slot < max_loras
    rank: int  # that slot's rank, >= 1
    token_ids: torch.Tensor  # [length] long: its rows of x / out (a view of lora_token_ids)
    token_range: tuple[int, int] | None  # (lo, hi) when token_ids == range(lo, hi), else None


class PaddedBatch(NamedTuple):
    """Short segments laid out as G slots x m rows for two batched matmuls (torch path)."""

    slots: torch.Tensor  # [G] long: the segments' slots, ascending
    all_slots: bool  # slots == 0..max_loras-1: the stacked weights serve as they are
    max_len: int  # m: the longest of these segments
    max_rank: int  # the largest of their ranks
    token_ids: torch.Tensor  # [n] long: their tokens' rows of x / out
    pad_rows: torch.Tensor  # [n] long: each token's row in the [G * m] padded batch
    pad_src: torch.Tensor  # [G * m] long: the row of x each padded row copies; padding rows
    #                        repeat the segment's first token (computed, then never read)
    token_range: tuple[int, int] | None = None  # (lo, hi) when token_ids == range(lo, hi)


@dataclass(frozen=True, eq=False)
class LoRABatchMetadata:
    """Everything the shrink/expand kernels need about one step's batch (see module docstring).

    Shapes: T = num_tokens, L = max_loras, S = number of segments, N = number of tiles.
    Device tensors live on `device`; int32 tensors are what the Triton kernels index with.
    """

    num_tokens: int  # T
    max_loras: int  # L
    block_m: int  # tokens per tile
    device: torch.device
    token_slots: torch.Tensor  # [T] long: slot per token, -1 = no adapter
    slot_ranks: torch.Tensor  # [L] long: rank per slot, 0 = empty
    sorted_token_ids: torch.Tensor  # [T] int32: token indices by slot (stable), slot -1 last
    num_lora_tokens: int  # tokens with an adapter: the first ones of sorted_token_ids
    lora_token_ids: torch.Tensor  # [num_lora_tokens] long: those tokens, for torch index ops
    segment_starts: torch.Tensor  # [S] int32: offset of each segment into sorted_token_ids
    segment_lengths: torch.Tensor  # [S] int32
    segment_slots: torch.Tensor  # [S] int32
    segment_ranks: torch.Tensor  # [S] int32
    tile_info: torch.Tensor  # [N, 4] int32: (start, length <= block_m, slot, rank) per tile
    segments: tuple[Segment, ...]  # host copy of the segments, in slot order
    max_rank: int  # largest rank among the segments (0 when no token has an adapter)
    host_order: torch.Tensor  # [T] long on the host: sorted_token_ids, for the torch path's plan
    padded_max_len: int  # torch path: segments shorter than this may be batched (0: never)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_tiles(self) -> int:
        return self.tile_info.shape[0]

    @property
    def long_segments(self) -> tuple[Segment, ...]:
        """Torch path: the segments multiplied one by one."""
        return self._torch_path_plan[0]

    @property
    def padded(self) -> PaddedBatch | None:
        """Torch path: the other segments, batched (None: there are none)."""
        return self._torch_path_plan[1]

    @cached_property
    def _torch_path_plan(self) -> tuple[tuple[Segment, ...], PaddedBatch | None]:
        # planned on first use: the fused CPU kernel and the Triton kernels never ask, and a
        # decode step's padded batch took ~0.1 ms to build (64 tokens over 8 adapters)
        short = [seg for seg in self.segments if seg.length < self.padded_max_len]
        if len(short) < MIN_PADDED_SEGMENTS and all(seg.token_range is not None for seg in short):
            # One or two contiguous runs (a single stream's decode token, two adapters' few
            # tokens): multiplied in place through views, they cost fewer calls than gathering,
            # padding and scattering them back.
            short = []
        long = tuple(seg for seg in self.segments if not any(seg is s for s in short))
        return long, _padded_batch(short, self.host_order, self.max_loras, self.device)

    @cached_property
    def cpu_segments(self) -> torch.Tensor:
        """[S, 4] long on the host: (start, length, slot, rank) per segment, what the fused CPU
        kernel reads; built on first use (CUDA steps and the torch path never ask)."""
        rows = [(seg.start, seg.length, seg.slot, seg.rank) for seg in self.segments]
        return torch.tensor(rows, dtype=torch.long).view(len(rows), 4)

    @property
    def has_lora(self) -> bool:
        """False when no token of the step has an adapter: callers skip the LoRA delta."""
        return self.num_lora_tokens > 0


def build_lora_metadata(
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    block_m: int = DEFAULT_BLOCK_M,
    device: torch.device | str | None = None,
    padded_max_len: int = DEFAULT_PADDED_MAX_LEN,
) -> LoRABatchMetadata:
    """Group a step's tokens by adapter slot.

    token_slots: [T] integer tensor, the adapter slot of each token (-1 = none).
    slot_ranks:  [max_loras] integer tensor, the rank of the adapter in each slot (0 = empty).
    block_m:     tokens per Triton tile (a power of two >= 16); the launchers use this value.
    device:      where the tensors go (default: token_slots' device). The grouping itself
                 is computed on the host, where the scheduler's slot list comes from.
    padded_max_len: torch path only: segments shorter than this are batched with padding
                 (ignored on CUDA, where the Triton kernels need no such plan).
    Raises ValueError naming the argument on bad input, including a token whose slot is
    empty (rank 0) or out of range.
    """
    _check_args(token_slots, slot_ranks, block_m, padded_max_len)
    device = torch.device(device) if device is not None else token_slots.device
    if device.type == "cuda":
        padded_max_len = 0  # CUDA runs the Triton kernels: skip the torch path's padded batch

    slots = token_slots.detach().to("cpu", torch.long)  # [T]
    ranks = slot_ranks.detach().to("cpu", torch.long)  # [L]
    _check_slots(slots, ranks)
    max_loras = ranks.numel()
    has_adapter = slots >= 0  # [T]
    # Stable sort keeps each sequence's tokens in order inside its segment; -1 sorts last.
    order = torch.argsort(torch.where(has_adapter, slots, max_loras), stable=True)  # [T]
    counts = torch.bincount(slots[has_adapter], minlength=max_loras).tolist()  # [L]
    order_dev = order.to(device)
    device = order_dev.device  # "cuda" -> "cuda:0", so device checks compare like with like

    segments = _segments(order, order_dev, counts, ranks.tolist())
    num_lora_tokens = sum(seg.length for seg in segments)
    sorted_token_ids, seg_table, tile_info = _device_tables(order, segments, block_m, device)
    return LoRABatchMetadata(
        num_tokens=slots.numel(),
        max_loras=max_loras,
        block_m=block_m,
        device=device,
        token_slots=token_slots.to(device, torch.long),
        slot_ranks=slot_ranks.to(device, torch.long),
        sorted_token_ids=sorted_token_ids,
        num_lora_tokens=num_lora_tokens,
        lora_token_ids=order_dev[:num_lora_tokens],
        segment_starts=seg_table[0],
        segment_lengths=seg_table[1],
        segment_slots=seg_table[2],
        segment_ranks=seg_table[3],
        tile_info=tile_info,
        segments=segments,
        max_rank=max((seg.rank for seg in segments), default=0),
        host_order=order,
        padded_max_len=padded_max_len,
    )


def _check_args(token_slots: object, slot_ranks: object, block_m: object, padded_max_len: object) -> None:
    _check_int_vector("token_slots", token_slots)
    _check_int_vector("slot_ranks", slot_ranks)
    if slot_ranks.numel() == 0:
        raise ValueError("slot_ranks must have at least one slot (max_loras >= 1)")
    if not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")
    if not isinstance(padded_max_len, int) or padded_max_len < 0:
        raise ValueError(f"padded_max_len must be an int >= 0, got {padded_max_len!r}")


def _check_slots(slots: torch.Tensor, ranks: torch.Tensor) -> None:
    """Every rank >= 0; every token's slot is -1 or a filled slot (rank > 0). Host tensors."""
    max_loras = ranks.numel()
    if bool((ranks < 0).any()):
        raise ValueError(f"slot_ranks must be >= 0, got {ranks.tolist()}")
    bad = (slots < -1) | (slots >= max_loras)
    if bool(bad.any()):
        token = int(bad.nonzero()[0])
        raise ValueError(f"token_slots[{token}] = {int(slots[token])} is outside [-1, {max_loras})")
    empty = (slots >= 0) & (ranks[slots.clamp(min=0)] == 0)
    if bool(empty.any()):
        token = int(empty.nonzero()[0])
        raise ValueError(
            f"token_slots[{token}] = {int(slots[token])} names an empty slot (slot_ranks is 0)"
        )


def _segments(
    order: torch.Tensor, order_dev: torch.Tensor, counts: list[int], ranks: list[int]
) -> tuple[Segment, ...]:
    """One segment per slot that has tokens, in slot order, over the sorted token order."""
    segments: list[Segment] = []
    start = 0
    for slot, length in enumerate(counts):
        if length == 0:
            continue
        ids = order[start : start + length]
        lo, hi = int(ids[0]), int(ids[-1]) + 1
        token_range = (lo, hi) if hi - lo == length else None  # stable sort: ascending ids
        segments.append(
            Segment(start, length, slot, ranks[slot], order_dev[start : start + length], token_range)
        )
        start += length
    return tuple(segments)


def _device_tables(
    order: torch.Tensor, segments: tuple[Segment, ...], block_m: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int32 tables the Triton kernels index, in one host->device copy:
    sorted_token_ids [T], the segment table [4, S] (start, length, slot, rank) and the tiles
    [N, 4] (each segment cut into pieces of at most block_m tokens)."""
    seg_rows = [(seg.start, seg.length, seg.slot, seg.rank) for seg in segments]
    tile_rows = [
        (tile_start, min(block_m, seg.start + seg.length - tile_start), seg.slot, seg.rank)
        for seg in segments
        for tile_start in range(seg.start, seg.start + seg.length, block_m)
    ]
    num_tokens, num_segs, num_tiles = order.numel(), len(seg_rows), len(tile_rows)
    seg_columns = [v for column in zip(*seg_rows, strict=True) for v in column]  # 4 x S
    tile_values = [v for row in tile_rows for v in row]  # N x 4
    table = torch.cat(
        (order.to(torch.int32), torch.tensor(seg_columns + tile_values, dtype=torch.int32))
    ).to(device)
    sorted_token_ids = table[:num_tokens]  # [T]
    seg_table = table[num_tokens : num_tokens + num_segs * 4].view(4, num_segs)  # [4, S]
    tile_info = table[num_tokens + num_segs * 4 :].view(num_tiles, 4)  # [N, 4]
    return sorted_token_ids, seg_table, tile_info


def _padded_batch(
    short: list[Segment], order: torch.Tensor, max_loras: int, device: torch.device
) -> PaddedBatch | None:
    if not short:
        return None
    max_len = max(seg.length for seg in short)
    token_ids, pad_rows, pad_src = [], [], []
    for g, seg in enumerate(short):
        ids = order[seg.start : seg.start + seg.length]
        token_ids.append(ids)
        pad_rows.append(torch.arange(seg.length) + g * max_len)
        pad_src += [ids, ids[:1].expand(max_len - seg.length)]  # pad with its first token
    slots = [seg.slot for seg in short]
    ids = torch.cat(token_ids)  # [n] host
    lo = int(ids[0])
    # The engine lays a step out by slot, so its adapters' tokens are usually one run of rows
    contiguous = bool((ids == torch.arange(lo, lo + ids.numel())).all())
    return PaddedBatch(
        slots=torch.tensor(slots, device=device),
        all_slots=slots == list(range(max_loras)),
        max_len=max_len,
        max_rank=max(seg.rank for seg in short),
        token_ids=ids.to(device),
        pad_rows=torch.cat(pad_rows).to(device),
        pad_src=torch.cat(pad_src).to(device),
        token_range=(lo, lo + ids.numel()) if contiguous else None,
    )


def _check_int_vector(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
