"""build_lora_metadata: grouping by slot, tiles, host segments, and its bad-input errors."""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import build_lora_metadata


def test_groups_tokens_by_slot_stably_with_base_tokens_last():
    meta = build_lora_metadata(torch.tensor([2, -1, 0, 2, 0]), torch.tensor([8, 0, 16]))
    assert meta.num_tokens == 5 and meta.max_loras == 3
    assert meta.sorted_token_ids.tolist() == [2, 4, 0, 3, 1]
    assert meta.sorted_token_ids.dtype == torch.int32
    assert meta.num_lora_tokens == 4 and meta.has_lora
    assert meta.lora_token_ids.tolist() == [2, 4, 0, 3]
    assert meta.segment_starts.tolist() == [0, 2]
    assert meta.segment_lengths.tolist() == [2, 2]
    assert meta.segment_slots.tolist() == [0, 2]
    assert meta.segment_ranks.tolist() == [8, 16]
    assert meta.max_rank == 16
    assert meta.tile_info.tolist() == [[0, 2, 0, 8], [2, 2, 2, 16]]
    assert [(s.start, s.length, s.slot, s.rank) for s in meta.segments] == [
        (0, 2, 0, 8),
        (2, 2, 2, 16),
    ]
    assert [s.token_ids.tolist() for s in meta.segments] == [[2, 4], [0, 3]]
    assert [s.token_range for s in meta.segments] == [None, None]  # 2, 4 and 0, 3: gaps


def test_contiguous_segments_and_tiles_of_block_m():
    slots = torch.tensor([1] * 40 + [-1] * 3 + [0] * 5)
    meta = build_lora_metadata(slots, torch.tensor([4, 64]), block_m=16)
    assert [s.token_range for s in meta.segments] == [(43, 48), (0, 40)]
    assert meta.tile_info.tolist() == [
        [0, 5, 0, 4],
        [5, 16, 1, 64],
        [21, 16, 1, 64],
        [37, 8, 1, 64],
    ]
    assert meta.num_tiles == 4 and meta.num_segments == 2
    assert meta.sorted_token_ids[-3:].tolist() == [40, 41, 42]


def test_torch_plan_splits_long_and_short_segments():
    # slot 0: 3 scattered tokens, slot 1: 4 contiguous, slot 3: 1 token; slot 2 unused
    slots = torch.tensor([0, 1, 1, 1, 1, 0, -1, 3, 0])
    meta = build_lora_metadata(slots, torch.tensor([8, 16, 4, 2]), padded_max_len=4)
    assert [s.slot for s in meta.long_segments] == [1]
    batch = meta.padded
    assert batch.slots.tolist() == [0, 3] and not batch.all_slots
    assert batch.max_len == 3 and batch.max_rank == 8
    assert batch.token_ids.tolist() == [0, 5, 8, 7]
    assert batch.pad_rows.tolist() == [0, 1, 2, 3]  # group 0 rows 0..2, group 1 row 3
    assert batch.pad_src.tolist() == [0, 5, 8, 7, 7, 7]  # padding repeats the group's first
    assert batch.token_range is None  # scattered: gathered and scattered back

    everything_long = build_lora_metadata(slots, torch.tensor([8, 16, 4, 2]), padded_max_len=0)
    assert everything_long.padded is None and len(everything_long.long_segments) == 3
    all_short = build_lora_metadata(torch.tensor([1, 0, 1]), torch.tensor([8, 16]))
    assert all_short.long_segments == () and all_short.padded.all_slots


def test_one_or_two_contiguous_short_runs_are_multiplied_in_place_not_padded():
    ranks = torch.tensor([8, 16, 4])
    single_stream = build_lora_metadata(torch.tensor([2]), ranks)  # one decode token
    assert single_stream.padded is None and [s.token_range for s in single_stream.long_segments] == [(0, 1)]
    two = build_lora_metadata(torch.tensor([-1, 0, 0, 1]), ranks)
    assert two.padded is None and [s.slot for s in two.long_segments] == [0, 1]
    three = build_lora_metadata(torch.tensor([0, 1, 1, 2]), ranks)  # three short runs: padded
    assert three.long_segments == () and three.padded.slots.tolist() == [0, 1, 2]
    assert three.padded.token_range == (0, 4)  # one run of rows: the delta is added in place


def test_batch_without_adapters():
    meta = build_lora_metadata(torch.tensor([-1, -1]), torch.tensor([8]))
    assert not meta.has_lora
    assert meta.num_segments == 0 and meta.num_tiles == 0 and meta.max_rank == 0
    assert meta.sorted_token_ids.tolist() == [0, 1]
    empty = build_lora_metadata(torch.tensor([], dtype=torch.long), torch.tensor([8]))
    assert empty.num_tokens == 0 and not empty.has_lora


@pytest.mark.parametrize(
    ("token_slots", "slot_ranks", "block_m", "message"),
    [
        ([0, 1], [8, 8], 24, "block_m must be a power of two >= 16"),
        ([0, 1], [8, 8], 8, "block_m must be a power of two >= 16"),
        ([0, 2], [8, 8], 16, r"token_slots\[1\] = 2 is outside \[-1, 2\)"),
        ([0, -2], [8, 8], 16, r"token_slots\[1\] = -2 is outside"),
        ([1, 0], [8, 0], 16, r"token_slots\[0\] = 1 names an empty slot"),
        ([0], [8, -1], 16, "slot_ranks must be >= 0"),
        ([0], [], 16, "slot_ranks must have at least one slot"),
    ],
)
def test_bad_input_names_the_argument(token_slots, slot_ranks, block_m, message):
    with pytest.raises(ValueError, match=message):
        build_lora_metadata(
            torch.tensor(token_slots, dtype=torch.long),
            torch.tensor(slot_ranks, dtype=torch.long),
            block_m=block_m,
        )


def test_bad_padded_max_len():
    with pytest.raises(ValueError, match="padded_max_len must be an int >= 0, got -1"):
        build_lora_metadata(torch.tensor([0]), torch.tensor([8]), padded_max_len=-1)


@pytest.mark.parametrize(
    ("token_slots", "message"),
    [
        ([0, 1], "token_slots must be a torch.Tensor, got list"),
        (torch.tensor([0.0, 1.0]), "token_slots must be an integer tensor"),
        (torch.tensor([[0, 1]]), "token_slots must be 1-D"),
    ],
)
def test_bad_token_slots_type(token_slots, message):
    with pytest.raises(ValueError, match=message):
        build_lora_metadata(token_slots, torch.tensor([8, 8]))
